"""The package installed on its own, without the test or docs extras, in a fresh virtual environment:
a 2-rank launch with an object collective, and the recipe saving a checkpoint and resuming from it.

The test environment has numpy, matplotlib and the rest through the extras; this is where a runtime
dependency the package forgot to declare shows up (numpy, which torch's object collectives need).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

from conftest import ROOT

WORKER = textwrap.dedent(
    """
    import torch.distributed as dist

    import fsdp_guide
    from fsdp_guide import launch


    def gather_ranks():
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, dist.get_rank())  # an object collective: torch needs numpy for it
        return ranks, str(fsdp_guide.device())


    if __name__ == "__main__":
        print(launch(gather_ranks, world_size=2, output="none"))
        print(fsdp_guide.__file__)
    """
)


def _run(argv, cwd, timeout=600):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{argv}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _install(source, venv, cwd) -> str:
    """A fresh virtual environment with ``source`` installed in it, pinned by constraints.txt; its python.

    With uv where it is (`nox` runs on it): the same resolution from the package's metadata as pip's,
    in seconds instead of pip's half a minute unpacking torch. uv reads none of pip's settings, so
    it is given the folders of wheels pip is told to look in (PIP_FIND_LINKS: the CPU torch here)."""
    python = str(venv / "bin" / "python")
    pinned = ["-c", str(ROOT / "constraints.txt"), str(source)]
    if uv := shutil.which("uv"):
        _run([uv, "venv", "-q", "--python", sys.executable, str(venv)], cwd=cwd)
        links = [f"--find-links={folder}" for folder in os.environ.get("PIP_FIND_LINKS", "").split()]
        # Bytecode now, as pip writes it: without it, each process would compile torch's modules as it imports them.
        _run(
            [uv, "pip", "install", "-q", "--python", python, "--compile-bytecode", *links, *pinned],
            cwd=cwd,
            timeout=900,
        )
    else:
        _run([sys.executable, "-m", "venv", str(venv)], cwd=cwd)
        _run([python, "-m", "pip", "install", "-q", *pinned], cwd=cwd, timeout=900)
    return python


def test_the_package_alone_launches_trains_checkpoints_and_resumes(tmp_path):
    venv = tmp_path / "venv"
    # A copy of the package's sources: pip builds in the source tree (build/), which must stay clean.
    source = tmp_path / "fsdp_guide-source"
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    python = _install(source, venv, tmp_path)  # the pinned torch (the CPU build here), and nothing from the extras
    installed = _run(
        [
            python,
            "-c",
            "import importlib.metadata as m, json; print(json.dumps([d.metadata['Name'] for d in m.distributions()]))",
        ],
        cwd=tmp_path,
    )
    names = {name.lower() for name in json.loads(installed)}
    assert "fsdp_guide" in names or "fsdp-guide" in names
    assert not names & {"matplotlib", "scikit-learn", "pytest", "torchao"}  # the extras stayed out

    (tmp_path / "worker.py").write_text(WORKER)
    out = _run([python, "worker.py"], cwd=tmp_path).splitlines()
    assert out[0] == "[([0, 1], 'cpu'), ([0, 1], 'cpu')]"
    assert str(venv) in out[1]  # the installed package, not the checkout

    recipe = [
        python,
        "-m",
        "fsdp_guide.recipes.train_llm",
        "--nproc",
        "2",
        "--n-layer",
        "2",
        "--no-progress",
        "--checkpoint-dir",
        "ckpt",
        "--checkpoint-every",
        "2",
    ]
    _run([*recipe, "--steps", "6", "--stop-at", "4", "--out", "first.json"], cwd=tmp_path)
    _run([*recipe, "--steps", "6", "--resume", "latest", "--out", "second.json"], cwd=tmp_path)
    first, second = (json.loads((tmp_path / f).read_text()) for f in ("first.json", "second.json"))
    assert len(first["losses"]) == 4 and second["first_step"] == 5 and len(second["losses"]) == 2
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-00000004", "step-00000006"]
