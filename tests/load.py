"""A busy machine on demand: processes that spin on a core each, for checks that must hold under load."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def busy_loops(count: int = 2) -> Iterator[list[subprocess.Popen]]:
    """``count`` Python processes that spin (``while True: pass``) while the block runs; killed after it."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield loops
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
