"""The FSDP2 map (docs/fsdp2_map.rst) knows every public FSDP2 name of the installed torch and when each came.

Runs in ``nox -s torch`` too: on the oldest supported torch and on the newest, so a new
torch release shows here what it added.
"""

from __future__ import annotations

import sys

import torch
from conftest import ROOT

sys.path.insert(0, str(ROOT / "docs" / "_ext"))
from fsdp2_map import MAP, label, public_names  # noqa: E402


def _release(version: str) -> tuple[int, int]:
    return tuple(int(part) for part in version.split("+")[0].split(".")[:2])


def test_the_map_describes_every_public_fsdp2_name_of_the_installed_torch_and_the_release_that_brought_it():
    installed, here = public_names(), _release(torch.__version__)
    assert set(installed) - set(MAP) == set(), f"torch {torch.__version__}: add these to MAP in docs/_ext/fsdp2_map.py"
    # A name the map says this release has is here; one it says came later is not.
    assert {name for name, entry in MAP.items() if _release(entry.since) <= here} == set(installed)


def test_each_name_is_executed_on_one_page_or_explained_as_gpu_only_and_labels_are_distinct():
    assert not [name for name, entry in MAP.items() if entry.page and entry.gpu]
    assert len({label(name) for name in MAP}) == len(MAP)
