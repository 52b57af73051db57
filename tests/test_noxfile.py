"""The README's commands themselves: what `nox -s torch` checks before it installs."""

from __future__ import annotations

import runpy
import shutil
from collections import namedtuple
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOXFILE = runpy.run_path(str(ROOT / "noxfile.py"))
Usage = namedtuple("Usage", "total used free")


def test_a_torch_session_with_too_little_disk_fails_before_installing_and_says_how_to_free_it(tmp_path, monkeypatch):
    problem = NOXFILE["free_space_problem"]
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(100 * 10**9, 98 * 10**9, 2 * 10**9))
    message = problem([tmp_path / "uv-cache" / "not-made-yet"], 10 * 10**9, installed=False)
    assert message is not None
    assert f"{tmp_path} has 2.0 GB free" in message  # the nearest folder that exists
    assert "needs about 10 GB" in message and "uv cache prune" in message
    assert problem([tmp_path], 10 * 10**9, installed=True) is None  # the release is there already: nothing to fetch
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(100 * 10**9, 50 * 10**9, 50 * 10**9))
    assert problem([tmp_path], 10 * 10**9, installed=False) is None


def test_every_test_the_torch_sessions_leave_out_exists():
    """A renamed test would run again in the torch sessions, or a left-out name would match nothing, silently."""
    import ast

    def tests_of(file: str) -> set[str]:
        tree = ast.parse((ROOT / "tests" / file).read_text())
        return {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}

    for name in NOXFILE["SITE_TESTS"]:
        assert (ROOT / "tests" / name).is_file(), name
    assert set(NOXFILE["PROCESS_TESTS"]) <= tests_of("test_launcher.py")
    for entry in NOXFILE["LIVE_PROCESS_TESTS"]:
        file, name = entry.split("::")
        assert name in tests_of(file), entry
