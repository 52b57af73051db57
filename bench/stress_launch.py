"""Warm launches in a loop, from two processes at once, beside another page's heaviest cells: does a rank die by signal?

A stress run, not a benchmark: it looks for the rare native crash of a rank (a SIGSEGV once
in about 8,000 launches of the fsdp2_controls page's cells, two loops at once). Each loop
process executes the page's first code cells once, then the cells chosen with ``--cells``
again and again (their launches, warm, as the page makes them), until the loops together
have made ``--launches`` launches. Beside them, ``--beside`` pages run as scripts, one after
another, for the whole run (a page is a py:percent file: ``python tutorials/compile.py``).

Every ``LaunchError`` is counted by what it says; a rank killed by a signal is printed whole
(faulthandler's stacks of every thread, ``LaunchError.crashes``) and kept in
``--out/crashes.txt``. The exit status is 1 if any rank was killed by a signal or any
launch failed otherwise, else 0.

    python bench/stress_launch.py                                   # the defaults: 5,000 launches
    python bench/stress_launch.py --launches 500 --beside llm       # shorter, beside the LLM page

Run it in the pinned environment (``.nox/tests/bin/python``, or with the package installed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _code_cells(page: Path) -> list[str]:
    import jupytext

    return [cell.source for cell in jupytext.read(page).cells if cell.cell_type == "code"]


def loop(page: Path, cells: list[int], launches: int, counter: Path, out: Path, worker: int) -> int:
    """One loop process: the page's cells up to the last chosen one once, then the chosen ones until enough launches."""
    import contextlib
    import io

    from fsdp_guide import LaunchError
    from fsdp_guide.launcher import launches as made

    os.chdir(page.parent)  # as the site build executes a page
    sources = _code_cells(page)
    namespace = {"__name__": "__stress__"}  # no module of that name: cloudpickle ships the functions by value
    with contextlib.redirect_stdout(io.StringIO()):
        for source in sources[: max(cells) + 1]:
            exec(compile(source, f"{page.name}[cell]", "exec"), namespace)
    failures: dict[str, int] = {}
    crashes = 0
    while True:
        total = sum(int(f.read_text() or 0) for f in counter.glob("worker*"))
        if total >= launches:
            break
        for index in cells:
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    exec(compile(sources[index], f"{page.name}[{index}]", "exec"), namespace)
            except LaunchError as error:
                signalled = {rank: code for rank, code in error.failed.items() if code < 0}
                kind = "killed by a signal" if signalled else str(error).splitlines()[0][:200]
                failures[kind] = failures.get(kind, 0) + 1
                if signalled:
                    crashes += 1
                    with open(out / "crashes.txt", "a") as f:
                        f.write(f"=== worker {worker}, launch {len(made())}: {signalled}\n{error}\n\n")
                    print(f"worker {worker}: a rank was killed by a signal:\n{error}", flush=True)
        (counter / f"worker{worker}").write_text(str(len(made())))
    print(json.dumps({"worker": worker, "launches": len(made()), "failures": failures, "crashes": crashes}), flush=True)
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page", default="tutorials/fsdp2_controls.py", help="the page whose cells loop")
    parser.add_argument(
        "--cells",
        default="2,3",
        help="the code cells (from 0) that loop: the default is the page's profiler launches and its gradient launches",
    )
    parser.add_argument("--launches", type=int, default=5000, help="launches the loops make together")
    parser.add_argument("--loops", type=int, default=2, help="loop processes at once")
    parser.add_argument(
        "--beside",
        nargs="*",
        default=["compile", "llm"],
        help="pages run as scripts, one after another, for the whole run",
    )
    parser.add_argument("--out", type=Path, default=None, help="where crashes.txt goes (default: a new folder)")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--counter", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    page, cells = (ROOT / args.page).resolve(), [int(c) for c in args.cells.split(",")]
    if args.worker is not None:
        return loop(page, cells, args.launches, args.counter, args.out, args.worker)

    out = args.out or Path(tempfile.mkdtemp(prefix="stress-launch-"))
    out.mkdir(parents=True, exist_ok=True)
    counter = Path(tempfile.mkdtemp(prefix="counter-", dir=out))
    start = time.monotonic()
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--page",
                args.page,
                "--cells",
                args.cells,
                "--launches",
                str(args.launches),
                "--out",
                str(out),
                "--counter",
                str(counter),
                "--worker",
                str(i),
            ]
        )
        for i in range(args.loops)
    ]
    beside_runs, beside_failed = 0, 0
    beside, name, log = None, None, None  # the page running beside the loops, and its log
    while any(w.poll() is None for w in workers):
        if args.beside and (beside is None or beside.poll() is not None):
            if beside is not None:
                beside_runs += 1
                if beside.returncode != 0:  # kept whole: a failure beside the loops is looked into, not counted
                    beside_failed += 1
                    print(f"{name}.py failed (exit {beside.returncode}) beside the loops: {log.name}", flush=True)
            name = args.beside[beside_runs % len(args.beside)]
            script = ROOT / "tutorials" / f"{name}.py"
            log = out / f"beside-{beside_runs}-{name}.txt"
            with open(log, "w") as output:
                beside = subprocess.Popen(
                    [sys.executable, str(script)], cwd=script.parent, stdout=output, stderr=subprocess.STDOUT
                )
        time.sleep(0.5)
    if beside is not None:
        beside.terminate()
        beside.wait()
    codes = [w.wait() for w in workers]
    minutes = (time.monotonic() - start) / 60
    print(
        f"{args.loops} loops of {args.page} cells {args.cells}: {minutes:.1f} min, beside {beside_runs} whole "
        f"runs of {args.beside} ({beside_failed} failed); crashes, if any: {out / 'crashes.txt'}"
    )
    return 1 if any(codes) else 0


if __name__ == "__main__":
    sys.exit(main())
