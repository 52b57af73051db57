"""Run a command in a network namespace of its own, where only loopback exists.

torchrun's rendezvous store listens on every interface (``*:PORT``), a bare
``init_process_group`` with ``env://`` does the same on rank 0, and torchft's
manager binds ``[::]``. The project binds nothing outside 127.0.0.1, so the pages,
tests and benchmarks that run those tools run them here (``unshare`` from
util-linux; root, or unprivileged user namespaces). On a cluster they run as they are.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess

__all__ = ["loopback_only"]


def loopback_only(argv: list[str]) -> list[str]:
    """``argv`` wrapped to run in a new network namespace with ``lo`` up.

    Example (on Linux with ``unshare``):

    >>> import subprocess, sys
    >>> from fsdp_guide.isolation import loopback_only
    >>> code = "import socket; print(sorted({i[1] for i in socket.if_nameindex()}))"
    >>> subprocess.run(loopback_only([sys.executable, "-c", code]), capture_output=True, text=True).stdout
    "['lo']\\n"
    """
    if shutil.which("unshare") is None:
        raise RuntimeError("`unshare` (util-linux) is needed to run torchrun on loopback only; install util-linux")
    inner = f"ip link set lo up && exec {shlex.join(argv)}"
    for flags in (["-n"], ["-rn"]):  # root first; else a user namespace
        if subprocess.run(["unshare", *flags, "true"], capture_output=True).returncode == 0:
            return ["unshare", *flags, "sh", "-c", inner]
    raise RuntimeError("cannot create a network namespace (`unshare -n` and `unshare -rn` both failed)")
