"""Run a command in a network namespace of its own, where only loopback exists.

torchrun's rendezvous store listens on every interface (``*:PORT``), and a
bare ``init_process_group`` with ``env://`` does the same on rank 0. The
project binds nothing outside 127.0.0.1, so the tests and benchmarks that
run those tools run them here (``unshare`` from util-linux; root, or
unprivileged user namespaces).
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys

import pytest

# Network namespaces (unshare) are Linux's: elsewhere the tests that need them say so and skip.
linux_only = pytest.mark.skipif(sys.platform != "linux", reason="needs Linux network namespaces (unshare -n)")


def loopback_only(argv: list[str]) -> list[str]:
    """``argv`` wrapped to run in a new network namespace with ``lo`` up."""
    if shutil.which("unshare") is None:
        raise RuntimeError("`unshare` (util-linux) is needed to run torchrun on loopback only; install util-linux")
    inner = f"ip link set lo up && exec {shlex.join(argv)}"
    for flags in (["-n"], ["-rn"]):  # root first; else a user namespace
        if subprocess.run(["unshare", *flags, "true"], capture_output=True).returncode == 0:
            return ["unshare", *flags, "sh", "-c", inner]
    raise RuntimeError("cannot create a network namespace (`unshare -n` and `unshare -rn` both failed)")
