"""pytorch/examples' FSDP2 example, run from a notebook on 2 CPU ranks with ``%torchrun``.

    python bench/examples_fsdp2.py PATH/TO/pytorch-examples [--record]

``distributed/FSDP2/example.py`` (https://github.com/pytorch/examples) is a torchrun script: it
calls ``init_process_group`` itself, so :func:`fsdp_guide.launch` cannot run it and
:func:`fsdp_guide.run` (``%torchrun``) is what runs it from a notebook. Unchanged, on a machine
without 2 accelerators, it prints ``Unable to locate sufficient 2 gpus to run this example.
Exiting.`` and exits 0 having done nothing. The two edits that make it device-generic are made
on a copy of its folder, by replacing its own lines (the script is not kept in this repository):

1. ``if not verify_min_gpu_count(...)``: checked only where there is an accelerator (on a CPU,
   the script's own ``else`` branch already picks ``cpu``);
2. ``init_process_group(backend=backend, device_id=device)``: ``device_id`` only for an
   accelerator (torch binds a group to a device with it, eagerly connecting NCCL, and gloo on
   the CPU takes none).

A notebook then runs, in a kernel, with nbclient: the unchanged script, the edited one, the edited
one again (it resumes from the checkpoint the first run saved: the example keeps them in
``checkpoints/dtensor_api/<time>``), ``--dcp-api`` (a folder of its own, so a fresh start), and
``--mixed-precision --explicit-prefetching`` (resuming from the second run's). A run that fails
shows its ``LaunchError`` in the record. The outputs are printed and, with ``--record``, kept in
``bench/results/examples_fsdp2.txt`` (paths cut to ``site-packages/``). Not a test: CI has no
checkout of pytorch/examples (this repository copies no code of it), so the record is the evidence.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "bench" / "results" / "examples_fsdp2.txt"

EDITS = [
    (
        "    if not verify_min_gpu_count(min_gpus=_min_gpu_count):",
        "    if torch.accelerator.is_available() and not verify_min_gpu_count(min_gpus=_min_gpu_count):",
    ),
    (
        "torch.distributed.init_process_group(backend=backend, device_id=device)",
        'torch.distributed.init_process_group(backend=backend, device_id=device if device.type != "cpu" else None)',
    ),
]

RUNS = [
    ("unchanged", "example_unchanged.py", ""),
    ("edited, first run", "example.py", ""),
    ("edited, resumed from its checkpoint", "example.py", ""),
    ("edited, --dcp-api", "example.py", "--dcp-api"),
    ("edited, --mixed-precision --explicit-prefetching", "example.py", "--mixed-precision --explicit-prefetching"),
]


def edited_copy(checkout: Path, into: Path) -> Path:
    folder = into / "FSDP2"
    shutil.copytree(checkout / "distributed" / "FSDP2", folder)
    source = (folder / "example.py").read_text()
    (folder / "example_unchanged.py").write_text(source)
    for old, new in EDITS:
        if source.count(old) != 1:
            raise SystemExit(f"example.py no longer has the line this edit replaces: {old!r}")
        source = source.replace(old, new)
    (folder / "example.py").write_text(source)
    return folder


def notebook(folder: Path):
    import nbformat

    cells = ["%load_ext fsdp_guide"]
    for title, script, args in RUNS:
        cells.append(f"# {title}\n%torchrun --nproc-per-node 2 {script} {args}".rstrip())
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", type=Path, help="a checkout of https://github.com/pytorch/examples")
    parser.add_argument("--commit", default="", help="the checkout's commit, where it is not a git checkout")
    parser.add_argument("--record", action="store_true", help=f"keep the printout in {RESULT.relative_to(ROOT)}")
    options = parser.parse_args()
    from nbclient import NotebookClient

    commit = subprocess.run(
        ["git", "-C", str(options.checkout), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    commit = commit or options.commit
    lines = [f"pytorch/examples {commit or '(commit unknown)'}: distributed/FSDP2/example.py from a notebook"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = edited_copy(options.checkout, Path(tmp))
        nb = notebook(folder)
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
        start = time.perf_counter()
        NotebookClient(nb, timeout=600, allow_errors=True, resources={"metadata": {"path": str(folder)}}).execute()
        lines.append(f"5 runs in {time.perf_counter() - start:.0f} s; torch {_torch_version()}, 2 CPU ranks on gloo")
        lines.append(
            f"checkpoints written: {sorted(str(p.relative_to(folder)) for p in folder.glob('checkpoints/*/*'))}"
        )
        for cell in nb.cells[1:]:
            lines.append("")
            lines.append(f"In: {cell.source}")
            for out in cell.outputs:
                if out.output_type == "stream":
                    lines.extend(out.text.rstrip("\n").splitlines())
                elif out.output_type == "error":
                    lines.append(f"{out.ename}: {out.evalue}")
    text = re.sub(r"\S*/site-packages/", "site-packages/", "\n".join(lines) + "\n")  # not this machine's paths
    print(text, end="")
    if options.record:
        RESULT.write_text(text)


def _torch_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("torch")


if __name__ == "__main__":
    sys.exit(main())
