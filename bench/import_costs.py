"""What a library a page imports costs: once per process that imports it, and per rank of a launch.

    python bench/import_costs.py [--record] [LIBRARY ...]      (default: bitsandbytes transformers peft accelerate)

For each library, in this order, each in fresh processes (one run each, 2 cores):

* ``cold``: ``import torch`` then ``import LIBRARY`` in a new interpreter, the second timed: what a
  torchrun rank, a cold rank of ``launch`` or a notebook kernel pays the first time.
* ``launch, not preloaded``: a 2-rank ``launch`` whose function imports the library, started from a
  process that has not imported it, against the same launch of a function that imports nothing
  (its own server, started first): what each rank pays when the warm server does not hold it.
* ``launch, preloaded``: the same, from a process that imported the library before its first
  launch, so that the warm server imports it once and forks ranks that have it
  (``fsdp_guide._warm.LIKELY``): what a page that imports it at the top pays per launch.

The printout is kept in bench/results/import_costs.txt with ``--record``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import recorded  # noqa: E402

COLD = "import time, torch; t = time.perf_counter(); import {lib}; print(time.perf_counter() - t)"
LAUNCHED = textwrap.dedent(
    """
    import statistics, sys, time
    if {preload}:
        import {lib}
    from fsdp_guide import launch

    def bare():
        return 0

    def importing():
        import {lib}
        return 0

    launch(bare, world_size=2, output="none")  # the warm server starts here, not in a timed call
    def timed(fn):
        t = time.perf_counter()
        launch(fn, world_size=2, output="none")
        return time.perf_counter() - t
    print(statistics.median(timed(importing) - timed(bare) for _ in range(3)))
    """
)


def run(code: str) -> float:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("libraries", nargs="*", default=["bitsandbytes", "transformers", "peft", "accelerate"])
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    command = "python bench/import_costs.py " + " ".join(args.libraries) + (" --record" if args.record else "")

    def measure() -> None:
        print(f"{'library':14} {'cold import':>12} {'per launch, not preloaded':>26} {'per launch, preloaded':>22}")
        for lib in args.libraries:
            cold = run(COLD.format(lib=lib))
            plain = run(LAUNCHED.format(lib=lib, preload=False))
            preloaded = run(LAUNCHED.format(lib=lib, preload=True))
            print(f"{lib:14} {cold:11.2f}s {plain:25.2f}s {preloaded:21.2f}s")

    if args.record:
        with recorded("import_costs", command):
            measure()
    else:
        measure()


if __name__ == "__main__":
    main()
