"""Run a command with two busy-loop processes beside it for the whole run: the check that a busy machine breaks nothing.

    python bench/beside_busy_loops.py bash .ci/run
    python bench/beside_busy_loops.py nox -s docs
    python bench/beside_busy_loops.py --loops 4 nox -s tests -- tests/test_launcher.py

Each loop is a Python process spinning on a core (``tests/load.py``). The exit status is the
command's; the loops are killed when it ends, and the time it took is printed.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from load import busy_loops  # noqa: E402


def main(argv: list[str]) -> int:
    loops = 2
    if argv[:1] == ["--loops"]:
        loops, argv = int(argv[1]), argv[2:]
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    start = time.monotonic()
    with busy_loops(loops):
        code = subprocess.call(argv)
    print(
        f"beside {loops} busy loops: {' '.join(argv)} exited {code} after {time.monotonic() - start:.0f} s", flush=True
    )
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
