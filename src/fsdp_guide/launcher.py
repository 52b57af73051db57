"""Run a function on several ranks of a real process group, from a notebook cell or a script.

:func:`launch` is what lets a tutorial define its training function in a cell
and run it, sharded, on two CPU processes (gloo), or on a GPU per rank (NCCL)
where there are enough (:func:`fsdp_guide.device` decides)::

    results = launch(train, world_size=2)   # one return value per rank

Under ``torchrun`` the same call runs ``train`` in-process on the current rank,
so a tutorial's code is also a cluster script.

Why not ``torch.multiprocessing.spawn``? It starts its processes with Python's
"spawn" method, which pickles the function by reference, by module and name
(which fails for a function defined in a notebook cell: the children cannot
import the notebook's ``__main__``), it makes the parent
import torch (a second or more before any rank starts), and its ranks
rendezvous over a TCP port that a concurrent launch may also pick. Here the
parent stays torch-free and starts plain Python processes with the standard
library's :mod:`subprocess` (see :mod:`fsdp_guide._rank`), or, after the first
launch, forks them from a server that has imported torch (:mod:`fsdp_guide._warm`),
ships the function by value with ``cloudpickle``, and hands rank 0 an
already-listening loopback socket for torch's own ``TCPStore``.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import importlib
import io
import json
import math
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import cloudpickle

from fsdp_guide import _warm
from fsdp_guide._rank import BOOTSTRAP, STACKS_SIGNAL
from fsdp_guide._script import RANK_BOOTSTRAP, STORE_BOOTSTRAP

__all__ = ["launch", "run", "LaunchError", "launches"]

_BACKENDS = ("auto", "gloo", "nccl", "cpu:gloo,cuda:nccl")
_OUTPUTS = ("all", "rank0", "none")
_TAIL_LINES = 20  # output lines of a failing rank shown with the error
_TERMINATE_GRACE_S = 2.0
_CASCADE_S = 0.5  # after a rank fails, how long the others may take to fail on their own
_SAME_GPUS_ENV = "FSDP_GUIDE_SAME_GPUS"  # fsdp_guide.devices.SAME_GPUS_ENV (that module imports torch)
_LAUNCH_LOG_ENV = "FSDP_GUIDE_LAUNCH_LOG"  # a JSON-lines file that every launch is appended to

_launches: list[dict] = []
_PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)  # where a script's rank imports this package from


class LaunchError(RuntimeError):
    """A rank raised, died, or the ranks did not finish within ``timeout``.

    Attributes:
        rank: the failing rank (``None`` for a timeout): the root cause, the rank that failed
            first. Ranks often fail only because a peer went away ("Connection reset by peer"),
            and they may exit before it, so the order is when each rank raised (its own clock
            reading as it caught the exception) or died (faulthandler's report, else when the
            launcher saw it exit), and a rank whose error says only that a peer went away
            comes after every rank that failed otherwise. The message lists the others as
            consequences, each with its own words.
        failed: every rank that failed on its own, before the launch stopped the rest, with
            its exit code (negative: killed by that signal; 1: raised); empty for a timeout.
        crashes: for each rank killed by SIGSEGV, SIGFPE, SIGABRT, SIGBUS or SIGILL, every
            thread's Python stack at that moment, as ``faulthandler`` wrote it in the rank.
        ranks: the ranks the error is about (the failing rank, or every rank still running at the timeout).
        exit_code: the failing rank's exit code (negative: killed by that signal), ``None`` for a timeout.
        remote_traceback: the traceback text the failing rank printed, if it raised.
        output: the last lines the failing ranks printed.
        stacks: for each rank still running when the launch gave up (at the timeout, or
            after another rank failed), its main thread's Python stack at that moment,
            most recent call first, as ``faulthandler`` prints it.
    """

    def __init__(
        self,
        message: str,
        *,
        rank=None,
        ranks=(),
        exit_code=None,
        remote_traceback=None,
        output=(),
        stacks=None,
        failed=None,
        crashes=None,
    ):
        super().__init__(message)
        self.rank = rank
        self.failed = dict(failed or {})
        self.crashes = dict(crashes or {})
        self.ranks = list(ranks)
        self.exit_code = exit_code
        self.remote_traceback = remote_traceback
        self.output = list(output)
        self.stacks = dict(stacks or {})


def launch(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int | None = None,
    backend: str = "auto",
    timeout: float | None = None,
    collective_timeout: float = 300.0,
    output: str = "all",
    **kwargs: Any,
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return their results in rank order.

    Each rank is a fresh process with its default process group initialised
    before ``fn`` runs and destroyed once every rank has returned from it (a rank that
    tears its group down while a peer is still setting it up breaks the peer's
    ``init_process_group``: ``fsdp_guide._rank.wait_for_every_rank``), and with ``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set as torchrun sets
    them. ``fn`` may be defined in a notebook cell or a script's ``__main__``:
    it is shipped by value. Return plain Python data (numbers, lists, dicts);
    what a rank prints is streamed to this process's output while it runs,
    each line prefixed with ``[rankN]``.

    Warm launches: ranks are forked from a server that has imported torch once (Python's
    ``multiprocessing`` forkserver), which the first launch in a process starts and waits
    for (seconds: the imports two cold ranks would make, done once); every later launch
    forks its ranks from it in a fraction of a second. They are still fresh processes
    (nothing a previous launch did is in them; each has its own random seeds: Python's,
    torch's and numpy's). The server never initialises CUDA or a process group, and ends
    with this process. A launch whose interpreter, ``torch`` on ``sys.path``, or
    environment differs from the server's (any variable but ``FSDP_GUIDE_*``: torch and
    the libraries it loads read many at import) replaces the server with one started in
    its own environment, and its ranks come from the new one. One difference cannot be
    undone in a fork: warm ranks share the server's string hash seed, so a ``set`` of
    strings iterates in the same order on every warm rank, where cold ranks and
    torchrun's (each a new interpreter, ``PYTHONHASHSEED`` unset) differ; collectives issued while iterating a set then
    work here and hang under
    torchrun. Iterate ``sorted(...)`` (:ref:`debugging-hangs-set-order`). Set
    ``FSDP_GUIDE_WARM=0`` to start every launch cold: to debug what happens at import, or
    after replacing the installed torch (the server keeps the torch it imported).

    The ranks rendezvous on a free port of 127.0.0.1 (``MASTER_PORT``) and talk
    over loopback (``GLOO_SOCKET_IFNAME=lo``), so concurrent launches never
    collide. Each rank gets ``cores // world_size`` CPU threads
    (``OMP_NUM_THREADS``, unless already set) so the ranks do not oversubscribe
    the machine. A rank imports modules from the same ``sys.path`` as this process.

    Args:
        fn: the function every rank runs.
        world_size: the number of ranks to start (each is a process); default 2. Under
            torchrun, ``WORLD_SIZE`` decides: leave it out, or give the same number.
        backend: ``"auto"``: the backend for the rank's :func:`fsdp_guide.device`,
            ``"cpu:gloo,cuda:nccl"`` when each rank has a GPU of its own, else ``"gloo"``;
            or ``"gloo"`` (CPU, even on a GPU machine), ``"nccl"`` or ``"cpu:gloo,cuda:nccl"``
            (one GPU per rank; each rank's device is made the current one).
        timeout: seconds to wait for every rank to finish before stopping them all;
            ``None`` (the default): no limit, for runs of any length.
        collective_timeout: seconds a collective (or the rendezvous) may wait for the other
            ranks before it fails: the process group's own timeout. A rank stuck in a
            collective that another rank never calls fails after this long, whatever
            ``timeout`` is.
        output: whose printed lines are streamed: ``"all"``, ``"rank0"`` or ``"none"``.

    The names ``world_size``, ``backend``, ``timeout``, ``collective_timeout`` and
    ``output`` belong to ``launch``; every other keyword argument goes to ``fn``.

    Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` already set), ``launch``
    starts nothing: it initialises the process group from the environment if
    needed, runs ``fn`` in this process and returns ``[this_rank_result]``. So
    a worker function runs unchanged as ``torchrun --nproc-per-node=N script.py``.

    Raises:
        LaunchError: a rank raised (its traceback is in the message), died without
            raising (killed by a fatal signal: every thread's Python stack at that moment,
            from ``faulthandler``), or the ranks did not finish within ``timeout``. The rank
            that failed first is the one named; the ranks that failed because of it follow.
            Every rank process is stopped before it is raised.
        KeyboardInterrupt: the wait was interrupted (Ctrl-C, Jupyter's stop button): raised
            once every rank is stopped, saying how many were.
        ValueError: ``world_size < 1`` (or, under torchrun, other than ``WORLD_SIZE``), an
            unknown ``backend`` or ``output``, a timeout that is not a finite number of
            seconds > 0 (``timeout`` may also be ``None``).
        TypeError: ``fn`` or an argument cannot be serialised.
        RuntimeError: an NCCL ``backend`` with fewer GPUs than ranks.

    Example:

    >>> import torch.distributed as dist
    >>> def rank_and_size():
    ...     return dist.get_rank(), dist.get_world_size()
    >>> launch(rank_and_size, world_size=2)
    [(0, 2), (1, 2)]
    """
    world_size = _world_size(world_size)
    _check_options(world_size, backend, timeout, collective_timeout, output)
    if _under_torchrun():
        if (hazard := _restart_hazard(os.environ)) and os.environ["RANK"] == "0":
            warnings.warn(hazard, RuntimeWarning, stacklevel=2)
        return [_run_in_this_process(fn, args, kwargs, backend, collective_timeout)]
    _check_launch_log()
    payload = _serialise(fn, args, kwargs)
    # Interrupts are noted, not raised where they land, until the ranks are stopped and the
    # run directory is gone: a second Ctrl-C (or stop button) cannot cut the cleanup short.
    with _interrupts_noted() as interrupted, tempfile.TemporaryDirectory(prefix="fsdp_guide-") as run_dir:
        run_dir = Path(run_dir)
        (run_dir / "payload.pkl").write_bytes(payload)
        config = {
            "world_size": world_size,
            "backend": backend,
            "collective_timeout": collective_timeout,
            "sys_path": list(sys.path),
            "output": output,
        }
        (run_dir / "config.pkl").write_bytes(pickle.dumps(config))
        _warm.start_server()  # a no-op once it runs for this environment; the ranks wait for its imports
        ranks = _Ranks(run_dir, world_size, output, warm=_warm.can_start(), interrupted=interrupted)
        try:
            ranks.start()
            results, where, caught = ranks.wait(timeout)
        except KeyboardInterrupt:  # from the waiting loop, or from a SIGINT handler of the caller's own
            interrupted.set()
        finally:
            ranks.stop()
    if interrupted.is_set():  # raised here, outside the waiting loop: the reader's traceback ends at launch()
        started = len(ranks.procs)  # fewer than world_size if the interrupt came while they were starting
        raise KeyboardInterrupt(f"launch interrupted: its {started} rank(s) were stopped") from None
    _record(fn, world_size, where)
    _show_warnings(caught)
    return results


def run(
    script: str | os.PathLike[str],
    nproc: int = 2,
    args: Sequence[str] = (),
    *,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
) -> int:
    """Run an unmodified torchrun script on ``nproc`` local ranks, as ``torchrun --nproc-per-node=NPROC`` would.

    Each rank is ``python SCRIPT *ARGS`` with this process's Python (``sys.executable``, a notebook
    kernel's own), in the current directory, with the environment torchrun gives its workers:
    ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``ROLE_RANK``,
    ``ROLE_WORLD_SIZE``, ``MASTER_ADDR`` (127.0.0.1), ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID`` and the
    rest of what torch's ``LocalElasticAgent`` sets, and ``OMP_NUM_THREADS=1`` unless it is set. So a
    script that calls ``dist.init_process_group()`` itself (``env://``) and reads those variables
    runs as it is: a page's script, or a ``main()`` from pytorch/examples or torchtitan, which
    :func:`fsdp_guide.launch` cannot run (it initialises the group itself, before the function). The script
    decides its own device; ``CUDA_VISIBLE_DEVICES`` is left as it is.

    Nothing listens beyond 127.0.0.1: as under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``), the
    ranks connect to a rendezvous store they do not serve; here a small process serves it on a
    loopback port this process binds first, and gloo binds loopback (``GLOO_SOCKET_IFNAME=lo``).
    Each line a rank prints is streamed while it runs, prefixed with ``[rankN]``.

    Args:
        script: the path of the script.
        nproc: the number of ranks (processes) to start.
        args: the script's command-line arguments, a list of strings (``shlex.split("--steps 10")``).
        timeout: seconds to wait for every rank to exit before stopping them all; ``None``: no limit.
        env: variables to set in the ranks' environment, beside this process's (torchrun's own
            variables are the launcher's to set).

    Returns:
        0, the exit status of every rank.

    Raises:
        LaunchError: a rank exited with another status, or was killed: its exit code, and the
            traceback it printed if it raised. The other ranks are stopped (one blocked in a
            collective with it too), and nothing is left running. Past ``timeout``: where each
            rank still running was (its Python stack), and every rank stopped.
        ValueError: a script that is not a file, ``nproc`` not an int >= 1, ``args`` not a list of
            strings, a timeout that is not a number of seconds > 0, ``env`` not a mapping of
            strings to strings or naming one of torchrun's variables; said before anything starts.
        KeyboardInterrupt: the wait was interrupted (Ctrl-C, Jupyter's stop button), once every
            rank is stopped.

    Example:

    >>> import pathlib, tempfile
    >>> script = pathlib.Path(tempfile.mkdtemp()) / "hello.py"
    >>> _ = script.write_text(
    ...     "import os, torch, torch.distributed as dist\\n"
    ...     "dist.init_process_group('gloo')\\n"
    ...     "t = torch.ones(1) * int(os.environ['RANK'])\\n"
    ...     "dist.all_reduce(t)\\n"
    ...     "if dist.get_rank() == 0:\\n"
    ...     "    print(f'sum of ranks over {dist.get_world_size()} ranks: {t.item():g}')\\n"
    ...     "dist.destroy_process_group()\\n"
    ... )
    >>> run(script, nproc=2)
    [rank0] sum of ranks over 2 ranks: 1
    0
    """
    script, args, env = _check_run(script, nproc, args, timeout, env)
    with _interrupts_noted() as interrupted, tempfile.TemporaryDirectory(prefix="fsdp_guide-run-") as run_dir:
        ranks = _ScriptRanks(Path(run_dir), script, args, nproc, env, interrupted=interrupted)
        try:
            ranks.start()
            ranks.wait(timeout)
        except KeyboardInterrupt:
            interrupted.set()
        finally:
            ranks.stop()
    if interrupted.is_set():
        raise KeyboardInterrupt(f"run interrupted: its {len(ranks.procs)} rank(s) were stopped") from None
    return 0


# What torchrun sets for its workers (fsdp_guide.launcher._ScriptRanks._env): not the caller's to change
_TORCHRUN_ENV = (
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
    "GLOO_SOCKET_IFNAME",
)  # fmt: skip


def _check_run(script, nproc, args, timeout, env) -> tuple[Path, list[str], dict]:
    """run()'s arguments checked before anything starts: the script, its arguments and the environment to use."""
    if not isinstance(script, (str, os.PathLike)):
        raise ValueError(f"script must be the path of a Python script (a str or a Path), got {script!r}")
    path = Path(script)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise ValueError(
            f"script {str(script)!r} {what} (looked for {path.absolute()}): give the path of a Python file, "
            f"absolute or relative to the current directory {os.getcwd()}"
        )
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ValueError(f"nproc must be an int >= 1 (the number of ranks to start), got {nproc!r}")
    if isinstance(args, (str, bytes)):
        raise ValueError(
            f"args must be a list of strings, one per argument, got the string {args!r}: "
            f"split it, e.g. args=shlex.split({args!r})"
        )
    if not isinstance(args, (list, tuple)) or not all(isinstance(a, str) for a in args):
        wrong = args if not isinstance(args, (list, tuple)) else next(a for a in args if not isinstance(a, str))
        raise ValueError(
            f"args must be a list of strings, e.g. ['--steps', '10'], got {args!r} ({wrong!r} is a "
            f"{type(wrong).__name__}): write each argument as it would be on the command line, str(value)"
        )
    _seconds("timeout", timeout, none_ok=True)
    env = {} if env is None else env
    if not isinstance(env, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError(f"env must be a dict of str to str (variables for the ranks), got {env!r}")
    if taken := sorted(set(env) & set(_TORCHRUN_ENV)):
        raise ValueError(
            f"env sets {', '.join(taken)}, which run sets for each rank (torchrun's variables, and gloo's "
            f"interface: loopback): leave "
            f"{'them' if len(taken) > 1 else 'it'} out (nproc decides the world size)"
        )
    return path.absolute(), list(args), dict(env)


@contextlib.contextmanager
def _interrupts_noted():
    """While a launch runs, SIGINT (Ctrl-C, Jupyter's stop button) sets the event it yields
    instead of raising ``KeyboardInterrupt`` wherever the main thread is: the waiting loop
    sees it within 0.1 s, and any number of them while the ranks are stopped change
    nothing. Only Python's own handler is replaced (in the main thread, where signals
    arrive); a handler of the caller's own stays, and what it raises is caught as before."""
    noted = threading.Event()
    takes_over = (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    )
    if takes_over:
        signal.signal(signal.SIGINT, lambda signum, frame: noted.set())
    try:
        yield noted
    finally:
        if takes_over:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def launches() -> list[dict]:
    """Every launch this process made, oldest first: where its ranks ran.

    Each entry: ``fn`` (the function's name), ``world_size``, and ``ranks``, one dict per
    rank with its ``backend``, ``device`` (such as ``"cpu"`` or ``"cuda:1"``), ``shared``
    (a GPU shared with other ranks) and ``torch`` version. Pages use it to say where they
    were executed (:func:`fsdp_guide.executed_on`). When ``FSDP_GUIDE_LAUNCH_LOG`` names a
    file, each entry is also appended to it as one line of JSON.

    Example:

    >>> before = len(launches())
    >>> _ = launch(int, world_size=2)
    >>> launches()[before]["ranks"][1]["device"]
    'cpu'
    """
    return [dict(entry) for entry in _launches]


def _record(fn, world_size: int, ranks: list[dict]) -> None:
    entry = {"fn": getattr(fn, "__qualname__", repr(fn)), "world_size": world_size, "ranks": ranks}
    _launches.append(entry)
    log = os.environ.get(_LAUNCH_LOG_ENV)
    if log:
        try:
            with open(log, "a") as f:
                f.write(json.dumps(entry) + "\n")
        except OSError as exc:  # the launch's results are not lost for a log line
            warnings.warn(
                f"{_LAUNCH_LOG_ENV}={log!r}: this launch could not be recorded there ({exc})",
                RuntimeWarning,
                stacklevel=3,
            )


def _check_launch_log() -> None:
    """A launch log that cannot be written is said before any rank starts, not after their work."""
    log = os.environ.get(_LAUNCH_LOG_ENV)
    if not log:
        return
    folder = Path(log).parent
    if Path(log).is_dir() or not folder.is_dir() or not os.access(folder if not Path(log).exists() else log, os.W_OK):
        what = (
            "is a directory"
            if Path(log).is_dir()
            else f"is in {folder}, which does not exist"
            if not folder.is_dir()
            else "cannot be written"
        )
        raise ValueError(
            f"{_LAUNCH_LOG_ENV}={log!r} {what}: name a file this process can append to "
            f"(its folder must exist), or unset {_LAUNCH_LOG_ENV}"
        )


def _show_warnings(per_rank: list[list[tuple]]) -> None:
    """Issue here, once each, the warnings that ranks whose output is hidden would have printed.

    A reader running the same code in a script would see them, so ``output="none"`` must
    not hide them; shown from this process, after the ranks finished, they come in a
    stable order with the ranks that raised them named."""
    ranks_of: dict[tuple, list[int]] = {}
    for rank, caught in enumerate(per_rank):
        for warning in caught:
            ranks_of.setdefault(warning, []).append(rank)
    for (category, message, filename, lineno), ranks in ranks_of.items():
        # The parent does not import torch, so torch's own warning classes arrive by name.
        cls = getattr(builtins, category, None)
        cls = cls if isinstance(cls, type) and issubclass(cls, Warning) else UserWarning
        prefix = "" if cls.__name__ == category else f"{category}: "
        where = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        warnings.warn_explicit(f"{prefix}{message} (on {where})", cls, filename, lineno, module="fsdp_guide.ranks")
    # Out now: a Jupyter kernel sends stderr and stdout each on its own timer, so what the cell
    # prints next could otherwise come out before these warnings, or between them.
    sys.stderr.flush()


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _restart_hazard(environ) -> str | None:
    """Why a restart by this torchrun may fail to start, or None.

    torchrun restarts its workers (``--max-restarts``) on the rendezvous store it shares
    with them by default: its server is made once (``DynamicRendezvousHandler.next_rendezvous``
    in ``torch/distributed/elastic/rendezvous/dynamic_rendezvous.py``), and the workers use it
    with no prefix per attempt (``_create_c10d_store`` in ``torch/distributed/rendezvous.py``
    assumes a new store for every retry), torch 2.9 to 2.13 at least. The keys the previous
    attempt's ranks wrote are still there, so a restarted rank can read a dead rank's address
    and fail to connect, as ``tests/test_llm.py`` saw for gloo.
    """
    restarts = int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if restarts > 0 and environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return (
            f"torchrun --max-restarts={restarts} shares its rendezvous store with the workers (torch's default), "
            "so a restarted worker can read an address a worker of the previous attempt published and fail in "
            "init_process_group ('Gloo connectFullMesh failed' on gloo; pytorch/pytorch#135712 reports NCCL "
            "failing to connect the same way). Start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its "
            "environment: each attempt then gets a store of its own."
        )
    return None


def _world_size(asked: int | None) -> int:
    """2 in a notebook or script; torchrun's ``WORLD_SIZE`` under torchrun, which an explicit value must match."""
    if not _under_torchrun():
        return 2 if asked is None else asked
    world = int(os.environ["WORLD_SIZE"])
    if asked is not None and asked != world:
        raise ValueError(
            f"launch(world_size={asked!r}) under torchrun, which started WORLD_SIZE={world} ranks: "
            f"leave world_size out under torchrun, or pass {world}"
        )
    return world


def _run_in_this_process(fn, args, kwargs, backend, timeout):
    import torch.distributed as dist

    from fsdp_guide._rank import (
        _INITIALISED_TWICE,
        _finish_saves,
        _initialised_twice,
        init_process_group,
        wait_for_every_rank,
    )

    created = not dist.is_initialized()
    if created:
        init_process_group(backend, timeout=timeout)
    global _torchrun_launches
    _torchrun_launches += 1
    try:
        try:
            result = fn(*args, **kwargs)
        except ValueError as exc:
            if created and _INITIALISED_TWICE in str(exc):
                raise ValueError(_initialised_twice(fn)) from exc
            raise
        _finish_saves()
        if created and dist.is_initialized():  # no rank tears the group down while a peer still sets it up
            from torch.distributed.distributed_c10d import _get_default_store

            wait_for_every_rank(
                _get_default_store(),
                f"fsdp_guide/returned/{_torchrun_launches}",
                dist.get_rank(),
                dist.get_world_size(),
                timeout,
            )
        return result
    finally:
        if created and dist.is_initialized():  # fn may have torn it down itself
            dist.destroy_process_group()


_torchrun_launches = 0  # launches this torchrun rank ran in-process: each waits under a key of its own


def _seconds(name: str, value, *, none_ok: bool) -> None:
    if value is None and none_ok:
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
        hint = "; for no limit, pass None" if none_ok and value == math.inf else ""
        expected = "a finite number of seconds > 0" + (" or None (no limit)" if none_ok else "")
        raise ValueError(f"{name} must be {expected}, got {value!r}{hint}")


def _check_options(world_size, backend, timeout, collective_timeout, output) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1 (the number of ranks to start), got {world_size!r}")
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if output not in _OUTPUTS:
        raise ValueError(f"output must be one of {_OUTPUTS}, got {output!r}")
    _seconds("timeout", timeout, none_ok=True)
    _seconds("collective_timeout", collective_timeout, none_ok=False)
    # A timedelta past ~10**9 days overflows (OverflowError on every rank): refuse it here.
    if collective_timeout > 10**9:
        raise ValueError(
            f"collective_timeout={collective_timeout!r} s is too long for torch's timedelta; use at most 1e9 s"
        )
    if "nccl" in backend:
        from fsdp_guide.devices import _gpu_count  # only here (it imports torch): asking for NCCL is asking for CUDA

        gpus = _gpu_count()
        if gpus < world_size:
            raise RuntimeError(
                f"backend={backend!r} needs one GPU per rank (NCCL refuses two ranks on one GPU): "
                f"world_size={world_size} but {gpus} GPU(s) are visible; "
                'use backend="gloo" (CPU) or backend="auto", or a smaller world_size'
            )


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, and a module whose type subclasses ``ModuleType`` sent by its name.

    cloudpickle sends a module by name only if its type is ``ModuleType`` itself; a function
    that reads ``torch.ops.aten.mm`` refers to ``torch.ops``, an instance of a subclass (in
    ``sys.modules`` as ``"torch.ops"``), which pickle then fails on: a checkpointing policy
    written in a notebook could not be sent. Written here because cloudpickle has no option for it."""

    def reducer_override(self, obj):
        if (
            isinstance(obj, types.ModuleType)
            and type(obj) is not types.ModuleType
            and sys.modules.get(obj.__name__) is obj
        ):
            return importlib.import_module, (obj.__name__,)
        return super().reducer_override(obj)


def _dumps(value) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer).dump(value)
    return buffer.getvalue()


def _serialise(fn, args, kwargs) -> bytes:
    # Serialise piece by piece first, so the error can name what cannot be sent.
    pieces = [("the function " + getattr(fn, "__qualname__", repr(fn)), fn)]
    pieces += [(f"positional argument {i}", a) for i, a in enumerate(args)]
    pieces += [(f"keyword argument {k!r}", v) for k, v in kwargs.items()]
    for name, value in pieces:
        try:
            _dumps(value)
        except Exception as exc:
            raise TypeError(
                f"cannot send {name} (a {type(value).__name__}) to the ranks: {exc}. "
                "Pass data the ranks can rebuild (numbers, lists, dicts, tensors, functions), "
                "or create this object inside the function."
            ) from exc
    return _dumps((fn, args, kwargs))


def _free_loopback_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


_LOOPBACK = "lo0" if sys.platform == "darwin" else "lo"  # the interface gloo binds and connects on


def _threads_per_rank(world_size: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // world_size)


# Torch 2.8 to 2.10 print this from gloo for every process group they create (2.11 no
# longer does). When the two counts agree it carries no news, and it would fill the output
# of every cell on those releases: the launcher drops it then, and shows a mismatch.
_GLOO_CONNECTED = re.compile(
    r"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. "
    r"Expected number of connected peer ranks is : (\d+)\s*$"
)


def _says_nothing(line: str) -> bool:
    """gloo's connection report with matching counts (see _GLOO_CONNECTED)."""
    match = _GLOO_CONNECTED.match(line)
    return bool(match) and match[1] == match[2]


class _Ranks:
    """The rank processes of one launch: start them, stream their output, wait, stop."""

    def __init__(
        self,
        run_dir: Path,
        world_size: int,
        output: str,
        warm: bool = False,
        interrupted: threading.Event | None = None,
    ):
        self.run_dir = run_dir
        self.interrupted = interrupted or threading.Event()  # set by SIGINT: stop waiting
        self.warm = warm  # forked from the pre-imported server (fsdp_guide._warm), or a new interpreter
        self.world_size = world_size
        self.output = output
        self.procs: list[subprocess.Popen] = []
        self.threads: list[threading.Thread] = []
        self.tails = [collections.deque(maxlen=_TAIL_LINES) for _ in range(world_size)]
        self.exits: dict[int, tuple[float, int]] = {}  # rank -> (when it exited, exit code)
        self.exit_clock: dict[int, float] = {}  # rank -> time.time() when its exit was seen (the ranks' clock)
        self.exited = threading.Condition()
        self._stopped = False

    def start(self) -> None:
        sock = _free_loopback_socket()
        try:
            for rank in range(self.world_size):
                self.procs.append(self._start_rank(rank, sock))
        finally:
            sock.close()  # rank 0 holds its own copy

    def _start_rank(self, rank: int, sock: socket.socket) -> subprocess.Popen:
        proc = self._spawn(rank, self._env(rank, sock.getsockname()[1]), sock)
        self._background(self._forward, rank, proc.stdout, "stdout")
        self._background(self._forward, rank, proc.stderr, "stderr")
        self._background(self._reap, rank, proc)
        return proc

    def _env(self, rank: int, port: int) -> dict:
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_WORLD_SIZE=str(self.world_size),
            GROUP_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            GLOO_SOCKET_IFNAME=_LOOPBACK,
            **{_SAME_GPUS_ENV: "1"},  # these ranks all see the same GPUs (fsdp_guide.devices)
            PYTHONUNBUFFERED="1",
        )
        env.setdefault("OMP_NUM_THREADS", str(_threads_per_rank(self.world_size)))
        return env

    def _spawn(self, rank: int, env: dict, sock: socket.socket):
        if self.warm:
            return _warm.WarmRank(
                [str(self.run_dir), str(rank)],
                env,
                pass_fd=sock.fileno() if rank == 0 else None,
                interrupted=self.interrupted,
            )
        return self._start_cold(rank, env, sock)

    def _start_cold(self, rank: int, env: dict, sock: socket.socket) -> subprocess.Popen:
        if rank == 0:
            env["FSDP_GUIDE_STORE_FD"] = str(sock.fileno())
        return subprocess.Popen(
            [sys.executable, "-c", BOOTSTRAP, str(self.run_dir), str(rank)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(sock.fileno(),) if rank == 0 else (),
            start_new_session=True,  # its own process group: stopping it stops its children too
        )

    def _background(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self.threads.append(thread)

    def _reap(self, rank: int, proc: subprocess.Popen) -> None:
        # One waiter per rank records when it exited (for the order of failures, and to end
        # the wait). A cold rank is left a zombie until stop(): while it is one, its pid, and
        # so its process group's id, cannot be given to another process (see _signal_group).
        code = _exit_code_leaving_a_zombie(proc) if not self.warm else proc.wait()
        with self.exited:
            self.exits[rank] = (time.monotonic(), code)
            self.exit_clock[rank] = time.time()
            self.exited.notify_all()

    def _forward(self, rank: int, pipe, stream: str) -> None:
        """Copy a rank's output to ours line by line, prefixed with its rank.

        Lines end at ``\\n`` or ``\\r`` so progress bars redraw in place."""
        show = self.output == "all" or (self.output == "rank0" and rank == 0)
        pending = b""
        for chunk in iter(lambda: os.read(pipe.fileno(), 65536), b""):
            pending += chunk
            lines = pending.splitlines(keepends=True)
            pending = lines.pop() if not lines[-1].endswith((b"\n", b"\r")) else b""
            for line in lines:
                self._emit(rank, line.decode(errors="replace"), stream, show)
        if pending:
            self._emit(rank, pending.decode(errors="replace") + "\n", stream, show)
        pipe.close()

    def _emit(self, rank: int, line: str, stream: str, show: bool) -> None:
        if _says_nothing(line):
            return
        self.tails[rank].append(line.rstrip("\r\n"))
        if show:
            out = sys.stdout if stream == "stdout" else sys.stderr
            out.write(f"{self._prefix(rank, line)}{line}")
            out.flush()

    def _prefix(self, rank: int, line: str) -> str:
        return f"[rank{rank}] "

    def wait(self, timeout: float | None) -> list:
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        while not self._wait_for_an_exit(deadline):
            if self.interrupted.is_set():
                raise KeyboardInterrupt
            if time.monotonic() >= deadline:
                raise self._timeout(timeout)
        if self._failed():
            self._let_the_others_exit(_CASCADE_S)
            raise self._failure()
        return self._results()

    def _results(self):
        records = [self._result_or_error(r) for r in range(self.world_size)]
        return [record[1] for record in records], [record[2] for record in records], [record[3] for record in records]

    def _wait_for_an_exit(self, deadline: float) -> bool:
        """True once a rank failed or all finished; waits in short slices so an interrupt is seen at once."""
        with self.exited:
            if self._failed() or len(self.exits) == self.world_size:
                return True
            self.exited.wait(max(0.0, min(0.1, deadline - time.monotonic())))
            return False

    def _let_the_others_exit(self, seconds: float) -> None:
        """Give the other ranks a moment to fail on their own: a rank whose peer failed
        usually fails a moment later, and its own error belongs in the report."""
        deadline = time.monotonic() + seconds
        with self.exited:
            while len(self.exits) < self.world_size and time.monotonic() < deadline:
                self.exited.wait(deadline - time.monotonic())

    def _failed(self) -> list[int]:
        with self.exited:  # the reaper threads add to exits: read a snapshot under their lock
            exits = list(self.exits.items())
        return [r for r, (_, code) in exits if self._rank_failed(r, code)]

    def _rank_failed(self, rank: int, code: int) -> bool:
        return code != 0 or not self._has_result(rank)  # a launch's rank that succeeded wrote its result

    def _has_result(self, rank: int) -> bool:
        return (self.run_dir / f"rank{rank}.pkl").exists()

    def _result(self, rank: int) -> tuple:
        return pickle.loads((self.run_dir / f"rank{rank}.pkl").read_bytes())

    def _result_or_error(self, rank: int) -> tuple:
        """A finished rank's record; a value this process cannot rebuild is the rank's failure."""
        try:
            return self._result(rank)
        except Exception as exc:  # noqa: BLE001 - whatever unpickling raises: the value's module, its class
            self.stop()
            raise LaunchError(
                f"rank {rank} returned a value this process cannot rebuild: {type(exc).__name__}: {exc}. "
                "Return plain data (numbers, strings, lists, dicts, tensors), or objects of modules this "
                "process imports too (a module only the rank imported cannot be unpickled here).",
                rank=rank,
                ranks=[rank],
                exit_code=0,
                output=list(self.tails[rank]),
            ) from None

    _TIMEOUT_HINT = "a rank waiting in a collective that another rank never calls waits up to collective_timeout."

    def _timeout(self, timeout: float) -> LaunchError:
        with self.exited:
            running = [r for r in range(self.world_size) if r not in self.exits]
        stacks = self._stacks(running)
        self.stop()
        return LaunchError(
            f"the ranks did not finish within timeout={timeout:g} s; still running: "
            f"rank{'s' if len(running) > 1 else ''} {', '.join(map(str, running))}. "
            "All ranks were stopped. Raise `timeout` (or pass None) if the work is just slow; "
            + self._TIMEOUT_HINT
            + _where(stacks),
            ranks=running,
            output=[f"[rank{r}] {line}" for r in running for line in self.tails[r]],
            stacks=stacks,
        )

    def _stacks(self, ranks: list[int]) -> dict[int, str]:
        """The main thread's Python stack of each of these running ranks, asked for with STACKS_SIGNAL."""
        files = {r: self.run_dir / f"rank{r}.stacks" for r in ranks}
        asked = {}
        for r, file in files.items():
            try:
                before = file.read_text()
            except FileNotFoundError:
                continue
            if not before.endswith("\n"):
                continue  # the rank has not installed its handler yet: the signal would kill it
            with self.exited:
                running = r not in self.exits and self.procs[r].returncode is None
            if not running:  # exited (a warm rank's pid may be reused): signal nothing
                continue
            try:
                os.kill(self.procs[r].pid, STACKS_SIGNAL)
            except ProcessLookupError:
                continue
            asked[r] = (len(before), -1)
        stacks, deadline = {}, time.monotonic() + 2.0
        while asked and time.monotonic() < deadline:
            time.sleep(0.05)
            for r, (start, seen) in list(asked.items()):
                dump = files[r].read_text()
                stack = _main_thread_stack(dump) if len(dump) > start else None
                if stack is not None and len(dump) == seen:  # the main thread's block, unchanged since the last look
                    stacks[r] = stack
                    del asked[r]
                else:
                    asked[r] = (start, len(dump))
        return stacks

    def _failure(self) -> LaunchError:
        with self.exited:
            failed = self._failed()
            running = [r for r in range(self.world_size) if r not in self.exits]
        stacks = self._stacks(running)  # where the others waited for it, before they are stopped
        self.stop()  # also drains the output, so the tails below are complete
        failed = self._root_cause_first(failed)
        crashes = {r: report for r in failed if (report := self._crash_report(r))}
        rank, code = failed[0], self.exits[failed[0]][1]
        message = f"rank {rank} {self._how(rank)}"
        remote_tb = self._traceback(rank)
        if remote_tb is not None:
            message += f"\n\nTraceback from rank {rank}:\n{remote_tb}"
        message += self._crash_text(rank, crashes) + self._last_output(rank)
        for other in failed[1:]:
            message += (
                f"\nThen rank {other} {self._how(other)}" + self._crash_text(other, crashes) + self._last_output(other)
            )
        stopped = [r for r in range(self.world_size) if r not in failed]
        if stopped:
            message += f"\nThe other ranks ({', '.join(map(str, stopped))}) were stopped." + _where(stacks)
        return LaunchError(
            message,
            rank=rank,
            ranks=[rank],
            exit_code=code,
            remote_traceback=remote_tb,
            output=list(self.tails[rank]),
            stacks=stacks,
            crashes=crashes,
            failed={r: self.exits[r][1] for r in failed},
        )

    def _root_cause_first(self, failed: list[int]) -> list[int]:
        """The failed ranks, the root cause first (see ``LaunchError.rank``).

        The order in which the launcher sees the ranks exit is not the order in which they
        failed: a rank that raised may take longer to exit than the peer its exit broke.
        Each rank's failure has a time on the machine's one wall clock: a raise, the rank's
        own reading as it caught the exception (taken before it exits, so before any peer
        can see it gone); a fatal signal, the modification time of faulthandler's report
        (written as it died); any other exit, when the launcher saw it (later than the
        exit, so only the peer-gone rule below keeps such a rank ahead of the peers it broke)."""

        def when(rank: int) -> float:
            try:
                record = self._result(rank) if self._has_result(rank) else None
            except Exception:  # noqa: BLE001 - an "ok" value this process cannot rebuild: no raise to date
                record = None
            if record is not None and record[0] == "error":
                return record[1]
            fault = self.run_dir / f"rank{rank}.fault"
            with contextlib.suppress(OSError):
                if fault.stat().st_size:
                    return fault.stat().st_mtime
            return self.exit_clock[rank]

        def peer_gone(rank: int) -> bool:
            tb = self._traceback(rank)
            return tb is not None and _PEER_GONE.search(tb.strip().splitlines()[-1]) is not None

        return sorted(failed, key=lambda r: (peer_gone(r), when(r), r))

    def _how(self, rank: int) -> str:
        tb = self._traceback(rank)
        return f"raised {tb.strip().splitlines()[-1]}" if tb is not None else _describe_exit(self.exits[rank][1])

    def _crash_report(self, rank: int) -> str | None:
        """faulthandler's report of a rank that died of a fatal signal, or None."""
        if self.exits[rank][1] >= 0:
            return None
        try:
            report = (self.run_dir / f"rank{rank}.fault").read_text(errors="replace").strip()
        except OSError:
            return None
        return report or None

    @staticmethod
    def _crash_text(rank: int, crashes: dict[int, str]) -> str:
        if rank not in crashes:
            return ""
        return f"\nPython stacks of rank {rank} at the signal (faulthandler, most recent call first):\n" + "\n".join(
            f"  {line}" for line in crashes[rank].splitlines()
        )

    def _traceback(self, rank: int) -> str | None:
        """The traceback this rank sent if it raised, else None."""
        try:
            record = self._result(rank) if self._has_result(rank) else None
        except Exception:  # noqa: BLE001 - an "ok" value this process cannot rebuild
            return None
        return record[3] if record is not None and record[0] == "error" else None

    def _last_output(self, rank: int) -> str:
        tail = self.tails[rank]
        return f"\nLast output of rank {rank}:\n" + "\n".join(f"  {line}" for line in tail) if tail else ""

    def stop(self) -> None:
        """Stop every rank process and anything it started; idempotent.

        Signals only process groups that are still the ranks' own: a cold rank is reaped
        here, after its group was signalled, never before (``_reap`` leaves it a zombie),
        so its group's id cannot have passed to another process; a warm rank, which the
        server reaps as it exits, only while its pid is not another process's
        (``_signal_group``)."""
        if self._stopped or not self.procs:
            return
        self._stopped = True
        for rank, proc in enumerate(self.procs):
            if not self._has_exited(rank):
                _signal_group(proc, signal.SIGTERM, exited=False)
        deadline = time.monotonic() + _TERMINATE_GRACE_S
        with self.exited:
            while len(self.exits) < len(self.procs) and time.monotonic() < deadline:
                self.exited.wait(max(0.0, deadline - time.monotonic()))
        for rank, proc in enumerate(self.procs):  # stragglers, and children a rank left behind
            _signal_group(proc, signal.SIGKILL, exited=self.warm and self._has_exited(rank))
        for thread in self.threads:  # the reapers first: a cold rank is reaped by proc.wait() below, not before
            thread.join(timeout=5)
        for proc in self.procs:
            proc.wait()
            proc.stdin.close()

    def _has_exited(self, rank: int) -> bool:
        with self.exited:
            return rank in self.exits


class _ScriptRanks(_Ranks):
    """The ranks of :func:`run`: processes of an unmodified torchrun script, and the rendezvous store they share.

    What differs from a launch's ranks: each runs the script (``fsdp_guide._script``) with
    torchrun's environment, a rank succeeds by exiting with 0 (it returns no value), and the
    store the script's ``init_process_group`` connects to is served by a process of its own on
    the loopback socket the parent bound, as torchrun's agent serves it to its workers."""

    _TIMEOUT_HINT = (
        "a rank waiting in a collective that another rank never calls waits up to its process group's "
        "timeout (init_process_group's `timeout`)."
    )

    def __init__(self, run_dir: Path, script: Path, args: list[str], nproc: int, env: dict, **kwargs):
        super().__init__(run_dir, nproc, "all", warm=False, **kwargs)
        self.script, self.args, self.extra_env = script, args, env
        self.run_id = uuid.uuid4().hex  # torchrun --standalone: a new run id each time
        self.store: subprocess.Popen | None = None

    def start(self) -> None:
        sock = _free_loopback_socket()
        try:
            self.store = self._start_store(sock)
            for rank in range(self.world_size):
                self.procs.append(self._start_rank(rank, sock))
        finally:
            sock.close()  # the store holds its own copy

    def _start_store(self, sock: socket.socket) -> subprocess.Popen:
        env = dict(os.environ, FSDP_GUIDE_STORE_FD=str(sock.fileno()))
        with open(self.run_dir / "store.err", "wb") as err:
            return subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    STORE_BOOTSTRAP,
                    _PACKAGE_PARENT,
                    str(self.world_size),
                    str(sock.getsockname()[1]),
                ],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=err,
                pass_fds=(sock.fileno(),),
                start_new_session=True,
            )

    def _env(self, rank: int, port: int) -> dict:
        """torchrun's environment for its worker ``rank`` of a single-node job: the variables its agent sets
        (``LocalElasticAgent._start_workers`` in ``torch/distributed/elastic/agent/server/local_elastic_agent.py``,
        torch 2.13), ``TORCHELASTIC_ERROR_FILE`` (``torch/distributed/elastic/multiprocessing/api.py``) and
        ``OMP_NUM_THREADS=1`` where it is unset (``torch/distributed/run.py``); then gloo kept on loopback and
        the output unbuffered, so each line reaches the cell as it is printed."""
        n = str(self.world_size)
        env = {**os.environ, **self.extra_env}
        if self.world_size > 1:
            env.setdefault("OMP_NUM_THREADS", "1")
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            GROUP_RANK="0",
            ROLE_RANK=str(rank),
            ROLE_NAME="default",
            LOCAL_WORLD_SIZE=n,
            WORLD_SIZE=n,
            GROUP_WORLD_SIZE="1",
            ROLE_WORLD_SIZE=n,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            TORCHELASTIC_RESTART_COUNT="0",
            TORCHELASTIC_MAX_RESTARTS="0",
            TORCHELASTIC_RUN_ID=self.run_id,
            # the ranks connect to the store as clients: none of them serves one (on every interface)
            TORCHELASTIC_USE_AGENT_STORE="True",
            TORCH_NCCL_ASYNC_ERROR_HANDLING=os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            TORCHELASTIC_ERROR_FILE=str(self.run_dir / f"rank{rank}.error.json"),
            GLOO_SOCKET_IFNAME=_LOOPBACK,
            PYTHONUNBUFFERED="1",
        )
        return env

    def _spawn(self, rank: int, env: dict, sock: socket.socket) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-c", RANK_BOOTSTRAP, _PACKAGE_PARENT, str(self.run_dir), str(rank), str(self.script)]
            + self.args,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group: stopping it stops its children too
        )

    def _rank_failed(self, rank: int, code: int) -> bool:
        return code != 0

    def _prefix(self, rank: int, line: str) -> str:
        # torch's own hook (set by init_process_group) already starts each line of a traceback with "[rankN]:"
        return "" if line.startswith(f"[rank{rank}]:") else f"[rank{rank}] "

    def _results(self) -> None:
        return None

    def _how(self, rank: int) -> str:
        tb = self._traceback(rank)
        code = self.exits[rank][1]
        if tb is not None:
            return f"raised {tb.strip().splitlines()[-1]} (exit code {code})"
        return _describe_exit(code)

    def _stacks(self, ranks: list[int]) -> dict[int, str]:
        """Each rank's stack down to the script's top level, without runpy's and fsdp_guide._script's frames."""
        stacks = super()._stacks(ranks)
        for rank, stack in stacks.items():
            lines = stack.splitlines()
            runpy = next((i for i, line in enumerate(lines) if "runpy" in line), len(lines))
            stacks[rank] = "\n".join(lines[:runpy])
        return stacks

    def _root_cause_first(self, failed: list[int]) -> list[int]:
        ordered = super()._root_cause_first(failed)
        self._named = ordered[0] if ordered else None  # the rank whose traceback the error shows
        return ordered

    def _last_output(self, rank: int) -> str:
        """The rank's last lines; for the rank named first, those before the traceback the error shows on its own."""
        tail = list(self.tails[rank])
        if rank == getattr(self, "_named", None) and self._traceback(rank) is not None:
            starts = [
                i
                for i, line in enumerate(tail)
                # torch's hook prefixes each line with "[rankN]: " once the group is initialised
                if line.removeprefix(f"[rank{rank}]: ").startswith("Traceback (most recent call last):")
            ]
            tail = tail[: starts[-1]] if starts else tail
        return f"\nLast output of rank {rank}:\n" + "\n".join(f"  {line}" for line in tail) if tail else ""

    def _wait_for_an_exit(self, deadline: float) -> bool:
        if self.store is not None and self.store.poll() is not None:
            with self.exited:
                done = len(self.exits) == self.world_size and not self._failed()
            if not done:
                self.stop()
                error = (self.run_dir / "store.err").read_text(errors="replace").strip()
                raise LaunchError(
                    f"the rendezvous store's process exited (code {self.store.returncode}) before the ranks "
                    f"finished; every rank was stopped.\n{error}",
                    ranks=list(range(self.world_size)),
                    exit_code=self.store.returncode,
                )
        return super()._wait_for_an_exit(deadline)

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            store, self.store = self.store, None
            if store is not None:
                store.stdin.close()  # end of file: it exits
                try:
                    store.wait(timeout=_TERMINATE_GRACE_S)
                except subprocess.TimeoutExpired:
                    _signal_group(store, signal.SIGKILL, exited=False)
                    store.wait()


def _main_thread_stack(dump: str) -> str | None:
    """From a rank's stacks file (its main thread's id, then faulthandler's dumps), the main
    thread's frames in the last dump; None while that block is not (fully) written."""
    header, _, dumps = dump.partition("\n")
    main = header.split()[-1]
    blocks = [block for block in dumps.split("\n\n") if block.strip()]
    mine = [block for block in blocks if block.lstrip().split("(")[0].split()[-1] == main]
    if not mine or not dump.endswith("\n"):
        return None
    lines = mine[-1].strip().splitlines()
    return "\n".join(line.strip() for line in lines[1:])  # the frames, without the "Thread 0x..." line


def _where(stacks: dict[int, str]) -> str:
    if not stacks:
        return ""
    return "\nWhere each rank still running was (most recent call first):\n" + "\n".join(
        f"[rank{r}]\n" + "\n".join(f"  {line}" for line in stack.splitlines()) for r, stack in sorted(stacks.items())
    )


def _exit_code_leaving_a_zombie(proc: subprocess.Popen) -> int:
    """Wait for a child's exit and return its code as ``Popen.returncode`` gives it, without
    reaping it: ``proc.wait()`` reaps it later (``_Ranks.stop``)."""
    if not hasattr(os, "waitid"):
        return proc.wait()
    while True:
        try:
            info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        except InterruptedError:
            continue
        except ChildProcessError:  # reaped already (not by this module): Popen knows its code
            return proc.wait()
        if info is None:
            continue
        killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
        return -info.si_status if killed else info.si_status


def _signal_group(proc, sig: int, *, exited: bool) -> None:
    """Signal a rank's process group: the rank and whatever it started, but nothing else.

    A process group's id is the pid of the rank that leads it (each rank starts a session of
    its own), and Linux gives that number to a new process once no process holds it, as a
    pid or as the id of its group (pid_max is 32768 on many machines, and every thread takes
    a number): a process the user started with ``setsid``, another launch's rank or a
    Jupyter kernel could then lead a group of that id, and be killed. So a group is
    signalled only while its id is known to be the rank's:

    - a cold rank: always, before ``stop`` reaps it (an unreaped zombie keeps its number);
    - a warm rank (the server reaps it): while it has not exited (``exited=False``); after,
      only while no process has its pid, that is while the group's id is held by the
      children the rank left in it, or by nothing (the signal then finds no group). What
      remains is the moment between that check and the signal, in which the number would
      have to be given to a new process that also starts a session.
    """
    if exited:
        try:
            os.kill(proc.pid, 0)
        except ProcessLookupError:
            pass  # no process has the number: the group, if any, is the rank's leftovers
        except PermissionError:
            return  # another user's process has the number: not ours
        else:
            return  # a live process has the number now: the group is not the rank's
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        if exited or proc.returncode is not None:
            return
        try:
            os.kill(proc.pid, sig)  # a warm rank before its setsid: its own pid, not yet reusable
        except (ProcessLookupError, PermissionError):
            pass


# What a rank raises when only its peer went away: the peer's exit closed the connection
# (gloo's pair.cc "Connection reset by peer" / "Connection closed by peer", a write into
# it "Broken pipe"; the TCPStore's client the same, or its recv "got 0 bytes"), or NCCL
# aborted the communicator. Such a rank is a consequence of another rank's failure.
_PEER_GONE = re.compile(
    r"Connection reset by peer|Connection closed by peer|Broken pipe|Socket closed"
    r"|failed to recv, got 0 bytes|NCCL communicator was aborted|ncclRemoteError",
    re.IGNORECASE,
)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (exit code {code}) without raising a Python exception"
    if code == 0:
        return "exited with code 0 before returning a result"
    return f"exited with code {code} without raising a Python exception"
