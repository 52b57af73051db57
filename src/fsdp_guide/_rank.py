"""The program each rank of :func:`fsdp_guide.launch` runs, and the process-group set-up it shares with torchrun.

A child starts with :data:`BOOTSTRAP` (``python -c BOOTSTRAP RUN_DIR RANK``):
it takes the parent's ``sys.path`` from ``RUN_DIR/config.pkl`` before importing
anything else, so it imports this package, and the modules the function was
pickled by reference against, exactly as the parent does (a source checkout on
``sys.path`` included). :func:`main` then reads the function and its arguments
from ``RUN_DIR/payload.pkl``, joins the process group, runs the function and
writes ``("ok", value, where, warnings)`` (``where``: :func:`where_this_rank_ran`;
``warnings``: those it would have printed, when its output is not shown) or ``("error", ...)`` to
``RUN_DIR/rank{RANK}.pkl``.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import shutil
import signal
import sys
import threading
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

import cloudpickle

# The signal that asks a rank for its stacks: a real-time one, which programs (and
# libraries handling SIGUSR1, as SLURM requeue handlers do) rarely use; SIGUSR1 where
# there are none (macOS).
STACKS_SIGNAL = signal.SIGRTMIN + 5 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR1

BOOTSTRAP = (
    "import pickle, sys; "
    "sys.path[:] = pickle.load(open(sys.argv[1] + '/config.pkl', 'rb'))['sys_path']; "
    "from fsdp_guide._rank import main; main()"
)


def init_process_group(backend: str, *, store=None, timeout: float = 300.0) -> str:
    """Join the process group described by the torchrun environment variables; returns the backend used.

    ``"auto"`` is :func:`fsdp_guide.devices.backend`: NCCL (beside gloo) on a GPU of
    this rank's own, else gloo. On a GPU, :func:`fsdp_guide.device` becomes the current
    CUDA device before any collective runs: NCCL creates its communicators on it, and
    FSDP2's default mesh takes it."""
    import torch
    import torch.distributed as dist

    from fsdp_guide.devices import backend as backend_for
    from fsdp_guide.devices import device

    backend = backend_for(backend)
    dist.init_process_group(
        backend,
        store=store,
        rank=int(os.environ["RANK"]) if store is not None else -1,
        world_size=int(os.environ["WORLD_SIZE"]) if store is not None else -1,
        timeout=timedelta(seconds=timeout),
    )
    if device().type == "cuda":  # after: a gloo-only group keeps the rank on the CPU
        torch.cuda.set_device(device())
    return backend


def where_this_rank_ran(backend: str) -> dict:
    """What ``launch`` records of each rank: its backend, device, and torch's version."""
    import torch

    from fsdp_guide import _warm
    from fsdp_guide.devices import placement

    where = placement()
    return {
        "backend": backend,
        "device": str(where.device),
        "shared": where.shared,
        "torch": str(torch.__version__),  # a plain str: unpickling TorchVersion imports torch
        "warm": _warm.forked,
    }


def _store(rank: int, world_size: int, timeout: float):
    """The rendezvous store. Rank 0 serves it on the socket the parent already bound
    to 127.0.0.1 and is listening on, so there is no port race, nothing listens on
    other interfaces, and the other ranks connect at once instead of retrying."""
    import torch.distributed as dist

    listen_fd = int(os.environ["FSDP_GUIDE_STORE_FD"]) if rank == 0 else None
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=rank == 0,
        timeout=timedelta(seconds=timeout),
        master_listen_fd=listen_fd,
    )


# What the parent sent on our stdin, one frame each (an 8-byte big-endian length, then that many
# bytes): the cells of a persistent session (fsdp_guide.live). A launch's parent sends nothing.
commands: queue.Queue[bytes] = queue.Queue()


def _exit_when_parent_dies(run_dir: Path) -> None:
    # The parent holds our stdin open: end of file means it is gone (killed kernel, crashed
    # script), and a rank must not outlive it, nor anything it started (data-loader workers,
    # compile workers), nor the pickled function on disk. What it writes are commands.
    # os.read, not sys.stdin: a daemon thread holding the stdin lock aborts interpreter shutdown.
    # The pipe moves to a descriptor of its own, and /dev/null takes its place as stdin: the
    # function's input() or breakpoint() gets end of file, not the parent's commands.
    pipe = os.dup(0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    try:
        pending = bytearray()
        while chunk := os.read(pipe, 1 << 16):
            pending += chunk
            while len(pending) >= 8 and len(pending) >= 8 + (size := int.from_bytes(pending[:8], "big")):
                commands.put(bytes(pending[8 : 8 + size]))
                del pending[: 8 + size]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)  # every rank tries: whichever is first
        # This rank leads its own process group (the parent starts it in a new session),
        # which its children join: one signal ends them all, this rank included.
        os.killpg(os.getpgid(0), signal.SIGKILL)
        os._exit(70)  # only if the group could not be signalled


_stacks_file = None  # kept open: faulthandler writes to its descriptor from a signal handler
_fault_file = None  # the same, for a fatal signal


def _report_fatal_signals(run_dir: Path, rank: int) -> None:
    """On SIGSEGV, SIGFPE, SIGABRT, SIGBUS or SIGILL, write every thread's Python stack to ``RUN_DIR/rankN.fault``.

    A rank killed by such a signal raises no Python exception, so without this its
    ``LaunchError`` could say only its exit code. faulthandler writes from its C signal
    handler and then lets the signal kill the process as before (the exit code stays
    ``-SIGNAL``); the launcher puts the report in the error. Enabled before anything else
    runs, in cold and warm ranks alike (a warm rank does not inherit the server's setting:
    this replaces it). The file's modification time is when the rank died, which orders
    its death among the other ranks' failures (``launcher._Ranks._failure``).
    """
    import faulthandler

    global _fault_file
    _fault_file = open(run_dir / f"rank{rank}.fault", "w")  # noqa: SIM115
    faulthandler.enable(file=_fault_file, all_threads=True)


def _dump_stacks_when_asked(run_dir: Path, rank: int) -> None:
    """On STACKS_SIGNAL, write every thread's Python stack to ``RUN_DIR/rankN.stacks``.

    The launcher asks a rank that is still running when it times out, or when another
    rank failed, so its error can show the line each rank was stuck on. faulthandler
    writes from its C signal handler, without the interpreter: a rank blocked inside a
    collective answers too. The first line names the main thread, the one running the function.
    """
    import faulthandler

    global _stacks_file
    _stacks_file = open(run_dir / f"rank{rank}.stacks", "w")  # noqa: SIM115
    faulthandler.register(STACKS_SIGNAL, file=_stacks_file, all_threads=True)
    _stacks_file.write(f"main thread 0x{threading.main_thread().ident:016x}\n")  # after register: the launcher
    _stacks_file.flush()  # signals only a rank whose file has this line (unhandled, the signal would kill it)


def wait_for_every_rank(store, key: str, rank: int, world_size: int, timeout: float) -> None:
    """Wait, on the rendezvous store, until every rank has reached this point under ``key``.

    Called before a rank tears its process group down. ``init_process_group`` is no
    barrier (since torch 2.1 its own store barrier runs only with ``TORCH_DIST_INIT_BARRIER=1``):
    gloo's ``connectFullMesh`` returns on a rank once its side of each pair is connected,
    while a peer may still be waiting to see its side complete. A rank whose function makes
    no collective then destroys the group and closes the pairs, and the peer, still inside
    ``init_process_group`` (or inside a ``new_group`` the function made), fails with
    ``Gloo connectFullMesh failed with ... Connection closed by peer``. That was the
    intermittent failure of two launches at once: 12 of 300 trivial launches with a busy
    machine beside them (``bench/stress_launch.py``), none once every rank waits here for
    every other to have returned from the function (and so from every group's set-up) first.
    """
    store.add(key, 1)
    deadline = time.monotonic() + timeout
    while store.add(key, 0) < world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every rank reached {key!r} within {timeout:g} s")
        time.sleep(0.002)
    # Rank 0 may serve the store (torchrun's env:// rendezvous does, unless its agent's store is
    # shared): it goes on only once every rank is done asking it, or a rank still polling above
    # would lose the store as rank 0 exits ("Connection reset by peer", seen under torchrun).
    store.add(f"{key}/seen", 1)
    if rank == 0:
        while store.add(f"{key}/seen", 0) < world_size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"not every rank saw {key!r} complete within {timeout:g} s")
            time.sleep(0.002)


def _leave_together(store, rank: int, world_size: int, timeout: float) -> None:
    """Rank 0 serves the store: it leaves only after every rank has said it is done with it."""
    store.add("fsdp_guide/finished", 1)
    if rank == 0:
        deadline = time.monotonic() + timeout
        while store.add("fsdp_guide/finished", 0) < world_size and time.monotonic() < deadline:
            time.sleep(0.005)


def _shown(output: str, rank: int) -> bool:
    return output == "all" or (output == "rank0" and rank == 0)


@contextlib.contextmanager
def _warnings_kept(keep: bool):
    """Record the warnings a rank whose output is not shown would have printed, for the parent to show.

    The filters in force still decide which warnings exist (``record=True`` replaces
    only how they are shown), so the parent shows what this rank would have printed."""
    if not keep:
        yield []
        return
    with warnings.catch_warnings(record=True) as caught:
        kept = []
        yield kept
    kept.extend((w.category.__name__, str(w.message), w.filename, w.lineno) for w in caught)


def _write_result(run_dir: Path, rank: int, record: tuple) -> None:
    _write_record(run_dir / f"rank{rank}.pkl", record)


def _write_record(path: Path, record: tuple) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(cloudpickle.dumps(record))
    tmp.rename(path)  # the parent never sees half a file


def _finish_saves() -> None:
    """Publish an asynchronous checkpoint still being written, before the process group goes away."""
    checkpoint = sys.modules.get("fsdp_guide.checkpoint")  # not imported: nothing to wait for
    if checkpoint is not None:
        checkpoint._wait_in_flight()


_INITIALISED_TWICE = "trying to initialize the default process group twice"  # torch's words (distributed_c10d.py)


def _initialised_twice(fn) -> str:
    name = getattr(fn, "__qualname__", repr(fn))
    return (
        f"{name} called init_process_group, but launch initialises each rank's process group before the "
        "function runs. For a script or main() that initialises its own group (torchrun style), save it as a "
        "script and run it with fsdp_guide.run('train.py', nproc=2, args=[...]); or, to use launch, remove "
        "the call (or guard it with `if not dist.is_initialized():`)."
    )


def main(prepare=None) -> None:
    """Run this rank. ``prepare``: what a warm rank does first to look like a cold one (its
    environment, working directory, process state and seeds: ``_warm._Rank._bootstrap``), inside
    the same error handling as the function: a failure there is reported with its traceback."""
    run_dir, rank = Path(sys.argv[1]), int(sys.argv[2])
    _report_fatal_signals(run_dir, rank)
    _dump_stacks_when_asked(run_dir, rank)
    threading.Thread(target=_exit_when_parent_dies, args=(run_dir,), daemon=True).start()
    config = pickle.loads((run_dir / "config.pkl").read_bytes())
    sys.path[:] = config["sys_path"]  # a warm rank was forked with the server's (a cold one has it already)
    try:
        if prepare is not None:
            prepare()
        fn, args, kwargs = pickle.loads((run_dir / "payload.pkl").read_bytes())
        import torch.distributed as dist

        store = _store(rank, config["world_size"], config["collective_timeout"])
        backend = init_process_group(config["backend"], store=store, timeout=config["collective_timeout"])
        where = where_this_rank_ran(backend)
        with _warnings_kept(not _shown(config["output"], rank)) as caught:
            try:
                result = fn(*args, **kwargs)
            except ValueError as exc:
                if _INITIALISED_TWICE in str(exc):
                    raise ValueError(_initialised_twice(fn)) from exc
                raise
            _finish_saves()
        if dist.is_initialized():  # the function may have torn it down itself
            wait_for_every_rank(store, "fsdp_guide/returned", rank, config["world_size"], config["collective_timeout"])
            dist.destroy_process_group()
        try:
            _write_result(run_dir, rank, ("ok", result, where, caught))
        except Exception as exc:
            raise TypeError(f"the value returned by rank {rank} cannot be sent back to the parent: {exc}") from exc
        _leave_together(store, rank, config["world_size"], config["collective_timeout"])
    except BaseException as exc:  # noqa: BLE001 - everything a rank raises is reported to the parent
        sys.stdout.flush()
        _write_result(run_dir, rank, ("error", time.time(), type(exc).__name__, traceback.format_exc()))
        sys.stderr.flush()
        # Skip interpreter shutdown: other ranks may be blocked in a collective with us,
        # and tearing down the process group could wait on them.
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter shutdown here too: tearing down torch's C++ threads (the store,
    # gloo) in the interpreter's order sometimes aborts with "terminate called without an
    # active exception" after all the work is done (seen in 4 to 11 of 25 runs of an FSDP1
    # worker with param_init_fn).
    os._exit(0)
