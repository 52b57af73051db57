"""Warm launches: rank processes forked from a server that has already imported torch.

A cold rank is ``python -c BOOTSTRAP``: a new interpreter that spends seconds importing
torch before it does any work. The server here is Python's own ``multiprocessing``
forkserver (an instance of its ``ForkServer``), started once per launching process, by
its first launch, with torch preloaded (``set_forkserver_preload``): each rank is a
fresh ``fork()`` of it, so it starts with torch imported and nothing else done. The server
never initialises CUDA or a process group (it only imports), listens on a Unix socket only, and exits when the launching
process does (multiprocessing's "alive" pipe); the ranks follow through their stdin pipe,
as cold ranks do.

What the forkserver does not do, and is written here: a rank must look like a cold one.
``multiprocessing.Process`` would re-import the parent's ``__main__`` (a script's
top-level code would run again in every rank) and close stdin, so each rank is started
with ``connect_to_new_process`` directly (the forkserver module's own API) and an object
whose ``_bootstrap`` sets the rank's streams, session, environment, working directory,
arguments and ``sys.path`` before running :func:`fsdp_guide._rank.main`, which a cold rank runs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing import forkserver, reduction, spawn, util

__all__ = ["enabled", "can_start", "start_server", "WarmRank", "WARM_ENV", "ServerBroker", "BROKER_ENV"]

WARM_ENV = "FSDP_GUIDE_WARM"  # "0": every launch starts cold ranks
BROKER_ENV = "FSDP_GUIDE_WARM_BROKER"  # where a ServerBroker (the site build's) starts servers for this process
# torch._dynamo: fully_shard imports it, and so does the first op on the meta device
# (torch/_compile.py), so nearly every FSDP2 rank would import it itself (with sympy, and
# triton in CUDA builds) in each launch: bench/bench_launch.py measures what this saves.
PRELOAD = [
    "fsdp_guide._server_quiet",
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch._dynamo",
    "cloudpickle",
]
# Libraries that take seconds to import on top of torch. The server imports the modules of
# theirs that the launching process has imported by the time it starts (the functions it ships
# are likely to need them), so a Hugging Face rank starts warm too. Imported later, a rank
# imports them itself, as a cold rank would.
LIKELY = ("transformers", "accelerate", "peft", "bitsandbytes")
# This package's own variables, which the ranks read as they run (never at import). Any
# other variable may be read at import: torch alone reads TORCH_*, TORCHDYNAMO_*,
# TORCHINDUCTOR_*, PYTORCH_*, FX_*, SYMPY_*, NPY_*, OPENBLAS_*, LOGLEVEL and more, and C
# libraries read theirs with getenv; a list of prefixes would miss some.
_RUN_TIME_ENV = "FSDP_GUIDE_"
_CHANGES_BY_ITSELF = {"PYTEST_CURRENT_TEST"}  # pytest sets it for every test: no import reads it

_lock = threading.Lock()
_server: forkserver.ForkServer | None = None  # our own instance: the process's default forkserver stays the user's
_server_for: tuple | None = None
forked = False  # True in a rank forked from the server


def enabled() -> bool:
    return os.environ.get(WARM_ENV, "1") != "0" and sys.platform != "win32"


def _what_torch_would_be() -> tuple:
    """What a cold rank would import: this interpreter, the torch on sys.path now, and the environment
    it would import them in (all of it but this package's own variables): if any of it changed, the
    server's imports are not the ones a cold rank would make, and the launch starts cold."""
    spec = importlib.util.find_spec("torch")  # finds, does not import
    env = sorted(
        (k, v) for k, v in os.environ.items() if not k.startswith(_RUN_TIME_ENV) and k not in _CHANGES_BY_ITSELF
    )
    return sys.executable, spec.origin if spec else None, tuple(env)


def can_start() -> bool:
    """True if this launch's ranks may be forked from the server: it runs, and it imported the torch they would."""
    with _lock:
        return enabled() and _server is not None and _server_for == _what_torch_would_be()


def start_server(*, start_own: bool = True) -> None:
    """Start the server, if it is not running for this environment; it imports torch while the caller goes on.

    Called as a launch starts, which forks its ranks once the imports are done: the one
    process importing torch (and FSDP, DTensor, DCP, dynamo) replaces the two cold ranks that
    would, and no import is left running in the background to slow the work that follows.
    A server started for another environment is replaced. ``start_own=False``: a server
    running here, or the broker's (a site build's, which it starts once for all its pages),
    never one of this process's own (live ranks, which start once, start sooner cold than
    through a new server's imports)."""
    global _server, _server_for
    if not enabled():
        return
    with _lock:
        if _server is not None and _server_for == _what_torch_would_be():
            return
        if not start_own and not os.environ.get(BROKER_ENV):
            return
        if _server is not None:  # torch's environment changed: this launch needs a new server
            _retire(_server)
            _server = _server_for = None  # retired: never retired twice, whatever follows
        _start_resource_tracker_apart()
        borrowed = _from_broker()
        if borrowed is not None:
            _server, _server_for = borrowed, _what_torch_would_be()
            return
        if not start_own:
            return
        server = forkserver.ForkServer()
        server.set_forkserver_preload(_preload())
        python_path = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # it imports what we import
        # Started with SIGINT ignored, Python installs no KeyboardInterrupt handler in it: an
        # interrupt sent to the notebook kernel's process group cannot stop it mid-import.
        quiet = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if quiet else None
        try:
            server.ensure_running()
        finally:
            if quiet:
                signal.signal(signal.SIGINT, previous)
            if python_path is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = python_path
        _server, _server_for = server, _what_torch_would_be()
        threading.Thread(target=_reap_when_it_exits, args=(server,), daemon=True).start()


def _start_resource_tracker_apart() -> None:
    """Start multiprocessing's resource tracker, which the forkserver needs, in a process group of its own.

    At shutdown a Jupyter kernel terminates the children in its process group with SIGTERM
    and waits for them to go (``_progressively_terminate_all_children`` in ipykernel's
    ``kernelbase.py``); the tracker ignores SIGTERM and exits only when the last writer of
    its pipe closes, so the kernel waited until jupyter_client terminated it (after half of
    ``KernelManager.shutdown_wait_time``, 5 s by default) in every notebook that launched.
    Apart, it is left out, and it exits once the kernel and the server (which the kernel
    does terminate) have closed the pipe. Written by hand because
    ``resource_tracker.ensure_running`` starts it in the caller's group; the same command
    and the same attributes, so ``ensure_running`` finds it running. A tracker already
    running (started by other code) is left as it is.
    """
    from multiprocessing import resource_tracker, spawn, util

    tracker = resource_tracker._resource_tracker
    with tracker._lock:
        if tracker._fd is not None:
            return
        r, w = os.pipe()
        try:
            # SIGINT and SIGTERM blocked until it has set them to be ignored, as the stdlib does (bpo-33613)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
            try:
                process = subprocess.Popen(
                    [
                        spawn.get_executable(),
                        *util._args_from_interpreter_flags(),
                        "-c",
                        f"from multiprocessing.resource_tracker import main;main({r})",
                    ],
                    pass_fds=[r],
                    start_new_session=True,
                )
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
        except BaseException:
            os.close(w)
            raise
        finally:
            os.close(r)
        _trackers.append(process)  # kept: a Popen collected while its process runs warns (ResourceWarning)
        tracker._fd, tracker._pid = w, process.pid


_trackers: list[subprocess.Popen] = []


def _preload() -> list[str]:
    """What the server imports: torch's modules, those of LIKELY that this process has, and last
    the module that freezes them all for the garbage collector (``fsdp_guide._server_frozen``)."""
    return [
        *PRELOAD,
        *sorted(name for name in list(sys.modules) if name.partition(".")[0] in LIKELY),
        "fsdp_guide._server_frozen",
    ]


def _retire(server: forkserver.ForkServer) -> None:
    """Let an outdated server go: it exits once the ranks forked from it have (they hold its "alive" pipe too),
    and its reaper (``_reap_when_it_exits``) waits for it. A borrowed one is the broker's to end."""
    if isinstance(server, _Borrowed):
        os.close(server._forkserver_alive_fd)
        return
    _retiring.add(server._forkserver_pid)
    os.close(server._forkserver_alive_fd)
    server._forkserver_alive_fd = None


_retiring: set[int] = set()  # replaced servers on their way out


def _reap_when_it_exits(server: forkserver.ForkServer) -> None:
    """Wait for the server's exit, so that it does not stay a zombie child of this process.

    At shutdown a Jupyter kernel terminates the children in its process group and waits
    until none is left, zombies included (``_progressively_terminate_all_children`` in
    ipykernel's ``kernelbase.py``): unreaped, the server kept the kernel waiting until
    jupyter_client terminated it, in every notebook that launched. multiprocessing reaps
    its forkserver only when asked to start it again; this thread reaps it instead, and
    forgets it, so that the next launch starts a new one.
    """
    global _server, _server_for
    pid = server._forkserver_pid
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:  # reaped first by multiprocessing's own check, which found it gone
        pass
    with _lock:
        _retiring.discard(pid)
        if server._forkserver_pid == pid:
            server._forkserver_pid = None  # reaped: multiprocessing's own check (waitpid) must not look for it
        if _server is server:
            _server, _server_for = None, None


def server_pids() -> list[int]:
    """The helper processes warm launches keep: the forkserver (and replaced ones still exiting) and
    multiprocessing's resource tracker."""
    from multiprocessing import resource_tracker

    own = _server._forkserver_pid if _server and not isinstance(_server, _Borrowed) else None
    pids = [own, resource_tracker._resource_tracker._pid, *_retiring]
    return [pid for pid in pids if pid is not None]


def _broker_supported() -> bool:
    """A broker starts servers the way Python 3.10 to 3.13's ``ForkServer.ensure_running`` does; 3.14's
    forkserver authenticates its clients with a key this module does not pass (each process starts its own)."""
    import inspect

    return "authkey_r" not in inspect.signature(forkserver.main).parameters


class _Borrowed(forkserver.ForkServer):
    """A server a :class:`ServerBroker` started for this process's environment: only its address is ours.

    ``connect_to_new_process`` sends each rank an "alive" file descriptor (multiprocessing's own
    servers exit when the last holder closes it); the broker holds the real one, so a rank gets
    one that keeps nothing alive."""

    def __init__(self, address: str, pid: int):
        super().__init__()
        self._forkserver_address, self.pid = address, pid
        self._forkserver_alive_fd = os.open(os.devnull, os.O_RDONLY)

    def ensure_running(self) -> None:
        """Nothing: the broker runs it (``connect_to_new_process`` calls this first, and multiprocessing's
        own would start a server of this process's when it has no pid of one)."""


def _from_broker() -> _Borrowed | None:
    """The server the broker named in :data:`BROKER_ENV` runs for this process's environment, or None (no
    broker, or it did not answer: this process starts its own)."""
    address = os.environ.get(BROKER_ENV)
    if not address or not _broker_supported():
        return None
    executable, _, env = _what_torch_would_be()
    request = {"executable": executable, "env": dict(env), "preload": _preload(), "sys_path": sys.path}
    try:
        with socket.socket(socket.AF_UNIX) as broker:
            broker.settimeout(30)
            broker.connect(address)
            broker.sendall(json.dumps(request).encode())
            broker.shutdown(socket.SHUT_WR)
            reply = json.loads(b"".join(iter(lambda: broker.recv(65536), b"")))
    except (OSError, ValueError):
        return None
    return _Borrowed(reply["address"], reply["pid"]) if "address" in reply else None


class ServerBroker:
    """Warm servers for other processes: a site build's notebook kernels, which would each start their own.

    A kernel that has :data:`BROKER_ENV` set to :attr:`address` asks here, at its first launch, for a
    server of its environment (interpreter, variables, ``sys.path``, the modules to preload); the
    broker starts one per distinct request and keeps it until :meth:`close`, so the pages of a build
    share one import of torch instead of paying for one each. What a server is for is exactly what
    the kernel's own would be (:func:`start_server`), so a rank forked from it is the same.

    Written by hand: ``ForkServer.ensure_running`` starts a server with the calling process's
    environment only; this is its command, run with the asking kernel's environment.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as folder, ServerBroker(folder) as broker:
    ...     broker.environ() == {BROKER_ENV: broker.address}
    True
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = os.fspath(folder)
        self.address = os.path.join(self.folder, "broker")
        self._listener = _listening(self.address)
        self._lock = threading.Lock()
        self._servers: dict[str, tuple[str, int, int, subprocess.Popen]] = {}  # request: address, pid, alive, process
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="warm-server-broker").start()

    def environ(self) -> dict[str, str]:
        """The variable to set in the environment of the processes this broker serves."""
        return {BROKER_ENV: self.address}

    def servers(self) -> int:
        with self._lock:
            return len(self._servers)

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._answer, args=(connection,), daemon=True).start()

    def _answer(self, connection: socket.socket) -> None:
        with connection:
            try:
                request = json.loads(b"".join(iter(lambda: connection.recv(65536), b"")))
                reply = self._server_for(request)
            except (OSError, ValueError, KeyError, TypeError) as error:
                reply = {"error": f"{type(error).__name__}: {error}"}
            with contextlib.suppress(OSError):
                connection.sendall(json.dumps(reply).encode())

    def _server_for(self, request: dict) -> dict:
        if request["executable"] != sys.executable:  # it starts this interpreter only
            return {"error": f"this broker starts {sys.executable}, not {request['executable']}"}
        key = json.dumps(request, sort_keys=True)
        with self._lock:
            if self._closed:
                return {"error": "closed"}
            if key not in self._servers:
                self._servers[key] = self._start(request, os.path.join(self.folder, f"s{len(self._servers)}"))
            address, pid, _, _ = self._servers[key]
        return {"address": address, "pid": pid}

    @staticmethod
    def _start(request: dict, address: str) -> tuple[str, int, int, subprocess.Popen]:
        env = {**request["env"], "PYTHONPATH": os.pathsep.join(p for p in request["sys_path"] if p)}
        command = "from multiprocessing.forkserver import main; main(%d, %d, %r, **%r)"
        with _listening(address) as listener:
            alive_r, alive_w = os.pipe()
            try:
                args = command % (listener.fileno(), alive_r, request["preload"], {"sys_path": request["sys_path"]})
                process = subprocess.Popen(
                    [spawn.get_executable(), *util._args_from_interpreter_flags(), "-c", args],
                    pass_fds=(listener.fileno(), alive_r),
                    env=env,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # a terminal's Ctrl-C is the build's, not the server's mid-import
                )
            except BaseException:
                os.close(alive_w)
                raise
            finally:
                os.close(alive_r)
        return address, process.pid, alive_w, process

    def close(self) -> None:
        """Stop answering, and end every server: each exits when its "alive" pipe closes."""
        with self._lock:
            self._closed = True
            servers, self._servers = list(self._servers.values()), {}
        self._listener.close()
        for _, _, alive_w, _ in servers:
            os.close(alive_w)
        for _, _, _, process in servers:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def __enter__(self) -> ServerBroker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _listening(address: str) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    return listener


class WarmRank:
    """A rank forked by the server, with the part of ``subprocess.Popen``'s interface the launcher uses."""

    def __init__(
        self, argv: list[str], env: dict, pass_fd: int | None = None, interrupted: threading.Event | None = None
    ):
        stdin_r, stdin_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        fds = [stdin_r, out_w, err_w] + ([pass_fd] if pass_fd is not None else [])
        status_r, data_w = _server.connect_to_new_process(fds)
        with open(data_w, "wb", closefd=True) as data:
            reduction.dump({}, data)  # no preparation data: the rank sets up itself (_Rank._bootstrap)
            reduction.dump(_Rank(argv, env, os.getcwd()), data)
        for fd in (stdin_r, out_w, err_w):  # the rank has its copies
            os.close(fd)
        # The server forks it once it has imported torch: seconds, if it was started just now. An
        # interrupt (noted by the launcher, not raised) ends the wait; the rank, forked later, finds
        # its stdin closed and its run directory gone, and exits.
        while not select.select([status_r], [], [], 0.1)[0]:
            if interrupted is not None and interrupted.is_set():
                for fd in (stdin_w, out_r, err_r, status_r):
                    os.close(fd)
                raise KeyboardInterrupt
        self.pid = forkserver.read_signed(status_r)
        self.stdin, self.stdout, self.stderr = open(stdin_w, "wb"), open(out_r, "rb"), open(err_r, "rb")
        self.returncode: int | None = None
        self._exited = threading.Event()
        threading.Thread(target=self._wait_for_exit, args=(status_r,), daemon=True).start()

    def _wait_for_exit(self, status_r: int) -> None:
        try:
            self.returncode = forkserver.read_signed(status_r)  # the server writes it when the rank exits
        except EOFError:  # the server itself died
            self.returncode = -9
        finally:
            os.close(status_r)
            self._exited.set()

    def poll(self) -> int | None:
        return self.returncode if self._exited.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
        return self.returncode


class _Rank:
    """Unpickled in the forked process; ``_bootstrap`` is what ``multiprocessing.spawn._main`` calls."""

    def __init__(self, argv: list[str], env: dict, cwd: str):
        self.argv, self.env, self.cwd = argv, env, cwd
        self.state = _ProcessState.of_this_process()

    def _bootstrap(self, parent_sentinel) -> int:
        global forked
        forked = True
        stdin, out, err, *store = forkserver.get_inherited_fds()
        os.setsid()  # a process group of its own, as a cold rank's start_new_session gives it
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the server ignores it; a rank raises
        for fd, target in ((stdin, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
            os.close(fd)
        # Unbuffered, as PYTHONUNBUFFERED=1 makes a cold rank's streams.
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True, line_buffering=True)
        sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), write_through=True, line_buffering=True, errors="backslashreplace"
        )
        sys.argv = ["-c", *self.argv]

        def prepare() -> None:  # inside main's error handling: a failure here is reported as the rank's
            os.environ.clear()
            os.environ.update(self.env)
            if store:
                os.environ["FSDP_GUIDE_STORE_FD"] = str(store[0])
            os.chdir(self.cwd)
            self.state.apply()
            _fresh_state()

        from fsdp_guide._rank import main

        main(prepare=prepare)  # sets sys.path from the launch, runs the function, and always ends with os._exit
        return 1


class _ProcessState:
    """What a cold rank inherits from the launching process besides its environment and working
    directory, and a fork of the server would not: the umask (a notebook's ``os.umask(0o077)``
    must keep its checkpoints private), the resource limits, the nice value and the blocked
    signals, as they are when the launch starts."""

    def __init__(self, umask: int, limits: dict, nice: int | None, blocked: set):
        self.umask, self.limits, self.nice, self.blocked = umask, limits, nice, blocked

    @classmethod
    def of_this_process(cls) -> _ProcessState:
        import resource

        umask = os.umask(0o022)
        os.umask(umask)  # reading the umask means setting it: put it back at once
        limits = {
            name: resource.getrlimit(getattr(resource, name)) for name in dir(resource) if name.startswith("RLIMIT_")
        }
        nice = os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else None
        blocked = set(signal.pthread_sigmask(signal.SIG_BLOCK, []))
        return cls(umask, limits, nice, blocked)

    def apply(self) -> None:
        import resource

        os.umask(self.umask)
        for name, (soft, hard) in self.limits.items():
            with contextlib.suppress(ValueError, OSError):  # a hard limit the server cannot raise back stays lower
                resource.setrlimit(getattr(resource, name), (soft, hard))
        if self.nice is not None:
            with contextlib.suppress(OSError):  # a lower nice value than the server's needs privileges
                os.setpriority(os.PRIO_PROCESS, 0, self.nice)
        signal.pthread_sigmask(signal.SIG_SETMASK, self.blocked)


def _fresh_state() -> None:
    """What a new interpreter would not share with its siblings: its random seeds; torch's thread count.

    Not its string hash seed: a fork keeps its parent's (``PYTHONHASHSEED`` is read once, at
    interpreter start, and every string's hash is cached), so warm ranks iterate a set of
    strings in the same order where cold ranks, and torchrun's, may not."""
    import random

    import torch

    from fsdp_guide._server_quiet import NOISY

    for name in NOISY:  # the server's imports were quiet; the rank logs as a cold one does
        logging.getLogger(name).setLevel(logging.NOTSET)
    random.seed()  # from os.urandom, as at a cold start
    torch.seed()  # a new process's torch starts from a non-deterministic seed too (not the server's)
    if "numpy.random" in sys.modules:  # imported by the server (transformers imports it): its global state too
        sys.modules["numpy.random"].seed()  # no argument: fresh entropy, as numpy seeds itself at import
    threads = os.environ.get("OMP_NUM_THREADS")
    # 0 or junk: torch's default, as a cold rank's import takes it
    if threads and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))  # the server imported torch before this launch chose the count
