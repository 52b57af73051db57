"""What each process of :func:`fsdp_guide.run` runs: a torchrun script, and the rendezvous store beside it.

A rank is ``python -c RANK_BOOTSTRAP PACKAGE_PARENT RUN_DIR RANK SCRIPT ARGS...``. Before the
script runs it installs what a rank of :func:`fsdp_guide.launch` installs (``fsdp_guide._rank``):
its stacks written on ``STACKS_SIGNAL`` (the launcher asks at a timeout), faulthandler's report of
a fatal signal, and its end when the parent goes away (end of file on stdin). Then it runs the
script as ``python SCRIPT ARGS...`` would: as ``__main__``, with ``sys.argv`` and ``sys.path[0]``
set as Python sets them for a script (this package's folder, which the bootstrap needed, is taken
off ``sys.path`` again). An exception the script does not catch is printed as Python prints it,
recorded for the launcher (``RUN_DIR/rankN.pkl``, as a launch's rank records one) and ends the
rank with exit code 1, without the interpreter's shutdown (a peer may still be blocked in a
collective with it, and tearing the group down could wait on that peer).

The store is ``python -c STORE_BOOTSTRAP PACKAGE_PARENT WORLD_SIZE PORT``: torchrun's agent hosts the
rendezvous store and its workers connect to it as clients (``TORCHELASTIC_USE_AGENT_STORE=True``,
``_create_c10d_store`` in ``torch/distributed/rendezvous.py``); here that server is a small process
of its own serving on the socket the parent bound to 127.0.0.1 (``FSDP_GUIDE_STORE_FD``), so no
rank's ``init_process_group`` opens a listening socket of its own on every interface.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import threading
import time
import traceback
from pathlib import Path

RANK_BOOTSTRAP = "import sys; sys.path.insert(0, sys.argv[1]); from fsdp_guide._script import main; main()"
STORE_BOOTSTRAP = (
    "import sys; sys.path.insert(0, sys.argv[1]); from fsdp_guide._script import serve_store; serve_store()"
)


def main() -> None:
    from fsdp_guide._rank import _dump_stacks_when_asked, _exit_when_parent_dies, _report_fatal_signals, _write_result

    _, package_parent, run_dir, rank, script, *args = sys.argv
    run_dir, rank = Path(run_dir), int(rank)
    del sys.path[0]  # the package's folder: the script sees the sys.path `python SCRIPT` gives it
    if sys.path and sys.path[0] == "":  # `python -c`'s entry, which `python SCRIPT` replaces with the script's folder
        sys.path[0] = os.path.dirname(os.path.abspath(script))
    elif not getattr(sys.flags, "safe_path", False):
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    _report_fatal_signals(run_dir, rank)
    _dump_stacks_when_asked(run_dir, rank)
    threading.Thread(target=_exit_when_parent_dies, args=(run_dir,), daemon=True).start()
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        _exit_as_python_would(exc.code)  # the script's own exit status, as Python gives it
    except BaseException as exc:  # noqa: BLE001 - what the script did not catch ends it, as in `python SCRIPT`
        tb = _from_the_script(exc.__traceback__, os.path.abspath(script))
        exc.__traceback__ = tb  # what Python's hook prints (torch's, set by init_process_group, calls it)
        sys.stdout.flush()
        sys.excepthook(type(exc), exc, tb)
        sys.stderr.flush()
        text = "".join(traceback.format_exception(type(exc), exc, tb))
        _write_result(run_dir, rank, ("error", time.time(), type(exc).__name__, text))
        os._exit(1)
    _exit_as_python_would(None)


def _exit_as_python_would(code) -> None:
    """End the rank as Python ends a script, but for the interpreter's own teardown.

    What ``python SCRIPT`` does after the script, in its order (``Py_FinalizeEx``): wait for the
    threads the script left running (not daemons), run its ``atexit`` functions, flush the
    streams, and exit with the status ``SystemExit`` carried (None: 0; a number: it; anything
    else: printed, and 1). Then ``os._exit``, without the teardown of modules and C++ objects
    that follows: there, torch 2.15 (its CUDA build, on a CPU) aborts a rank now and then with
    "terminate called without an active exception" after the script has destroyed its process
    group and returned (3 of 66 runs of the quickstart script beside two busy loops; under
    torchrun too, and with no Python frame on the stack), as launch's ranks once did
    (``fsdp_guide._rank.main`` ends the same way). Files the script left open are flushed first,
    as the teardown would have."""
    import atexit
    import gc
    import io

    threading._shutdown()  # what Python's finalization calls first: join the non-daemon threads
    atexit._run_exitfuncs()
    # Files the script left open lose nothing: the teardown would have flushed them. By type(), not
    # isinstance(), which reads __class__ from every object (torch's deprecated aliases warn on it).
    for stream in gc.get_objects():
        if issubclass(type(stream), io.IOBase):
            with contextlib.suppress(Exception):  # closed, detached (sys.stdout.detach()) or not writable
                if not stream.closed and stream.writable():
                    stream.flush()
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _from_the_script(tb, script: str):
    """The traceback from the script's first frame on: without this module's and runpy's frames."""
    first = tb
    while first is not None and os.path.abspath(first.tb_frame.f_code.co_filename) != script:
        first = first.tb_next
    return first if first is not None else tb


def serve_store() -> None:
    """Serve the rendezvous store on the parent's listening socket until the parent closes our stdin."""
    from datetime import timedelta

    import torch.distributed as dist

    world_size, port = int(sys.argv[2]), int(sys.argv[3])
    store = dist.TCPStore(  # noqa: F841 - it serves while this process lives
        "127.0.0.1",
        port,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=300),
        master_listen_fd=int(os.environ["FSDP_GUIDE_STORE_FD"]),
    )
    while os.read(0, 4096):  # end of file: the parent is done with the ranks, or gone
        pass
    os._exit(0)
