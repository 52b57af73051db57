"""The pages that execute, executed a few at a time into the jupyter-cache myst-nb reads.

myst-nb executes one notebook after another while Sphinx reads them. On 2 cores that
leaves half the machine idle: a page spends much of its time starting a kernel, importing,
and waiting for ranks that wait for each other (or for a timeout, on the hangs page).
Before Sphinx reads anything, this extension executes every page whose code cells the
cache does not hold yet, ``execution_workers`` pages at once (2 by default), with
jupyter-cache's own executor function and bundle, so that myst-nb's ``cache`` mode then
finds them all. The tests execute the pages the same way (``tests/conftest.py``).

Why by hand: jupyter-cache's parallel executor starts a process per CPU (there is no way
to ask for fewer, and each page starts up to 4 ranks of its own) and executes notebooks
from its project table, not the .py pages as jupytext reads them. The few lines below
bound the concurrency and reuse its execution and caching.

A cell that reads a counter of the whole machine, or times ranks against each other, is
tagged ``alone`` (``# %% tags=["alone"]``) and runs with no other page's cell running
(``_Machine``): the communication page counts the bytes on the loopback interface, which a
concurrent page's ranks would add to; the pipeline bubble page times the bubble with each stage
on a core of its own, which a concurrent page's ranks would take (its idle fractions
drifted by more than 0.1 once, with another page running beside it). The rest of such a
page (its kernel's start, its imports, its other cells) shares the machine as any page
does: only the tagged cells keep the other pages waiting. Where other processes share the
machine (the tests, run two at a time by pytest-xdist), an alone cell also waits for their
work to end, and keeps new work waiting, through a lock between processes (``MachineLock``).

An executed page's outputs name files of the machine that ran it where a warning or a
traceback does; they are cached (and shown) with those paths shortened to the part any
reader's machine shares (``without_build_paths``).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

from fsdp_guide._warm import ServerBroker

ROOT = Path(__file__).resolve().parents[2]  # the checkout: docs/_ext/ is two folders down
ALONE = "alone"  # the tag of a cell that runs with no other page's cell running

ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


class PageFailed(Exception):
    """A page's cell raised: the message holds nbclient's report of the cell and its traceback."""


class Execution:
    """Executes pages (.py files jupytext reads) into the jupyter-cache at ``cache_path``.

    ``submit`` returns a future of the executed notebook; at most ``workers`` pages run at
    once, and a cell tagged ``alone`` runs while no other page's cell does. A page whose
    code cells are already in the cache is not executed again. Call ``close`` (or use it as
    a context manager) to wait for every page submitted. ``report``, if given, is called with
    a line as each page starts and ends (the build's progress).

    The kernels talk to this process over Unix sockets in a directory of the execution's own
    (jupyter_client's ``ipc`` transport), removed when it closes: their channels listen on no
    port, and no kernel warns that it is "running over TCP without encryption", as each did on
    jupyter_client's default TCP transport, once per page, in the build's output.
    """

    def __init__(
        self,
        cache_path: str | Path,
        workers: int = 2,
        timeout: int = 180,
        report: Callable[[str], None] | None = None,
        machine_lock: Path | None = None,
    ):
        from jupyter_cache import get_cache

        self.cache, self.timeout = get_cache(str(cache_path)), timeout
        self._report, self._ended, self._report_lock = report or (lambda line: None), 0, threading.Lock()
        self._total = 0  # the pages submitted, or about to be (submit_all)
        self._sockets = Path(tempfile.mkdtemp(prefix="fsdp-guide-kernels-"))
        # One warm server per environment for every page's launches (fsdp_guide._warm.ServerBroker),
        # where each kernel would start its own and import torch again: seconds of CPU per page.
        self._broker = ServerBroker(self._sockets)
        self._environ = {**self._broker.environ(), **_deepspeed_environ()}
        self._kernels = itertools.count()  # short socket names: a Unix socket's path has ~100 bytes at most
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="page")
        self._cache_lock = threading.Lock()  # one writer at a time for the cache's sqlite database
        # an alone cell takes the machine from other processes too where they share it (MachineLock)
        self._machine = _Machine(MachineLock(machine_lock) if machine_lock else None)
        self._futures: dict[Path, Future] = {}
        self._interrupted = threading.Event()  # Ctrl-C: stop every page (close)

    def submit(self, page: Path) -> Future:
        if page not in self._futures:
            with self._report_lock:
                self._total = max(self._total, len(self._futures) + 1)
            self._futures[page] = self._pool.submit(self._execute, page)
        return self._futures[page]

    def submit_all(self, pages: Iterable[Path]) -> dict[Path, Future]:
        pages = list(pages)
        with self._report_lock:  # the count the progress lines show, before the first page can end
            self._total = len(self._futures.keys() | set(pages))
        return {page: self.submit(page) for page in pages}

    def close(self, cancel: bool = False) -> None:
        """Wait for the pages that are running; with ``cancel``, start none of those still waiting.

        Interrupted (Ctrl-C), it starts no other page, stops the running ones' kernels, and
        raises ``KeyboardInterrupt`` once their threads have ended: jupyter_client starts each
        kernel in a session of its own, so the terminal's Ctrl-C never reaches it, and the
        build would wait for every running page to end. A kernel's ranks exit with it (they
        watch their stdin: ``fsdp_guide._rank``).
        """
        try:
            self._pool.shutdown(wait=True, cancel_futures=cancel)
        except KeyboardInterrupt:
            self.stop()
            raise
        self._broker.close()
        shutil.rmtree(self._sockets, ignore_errors=True)

    def close_servers(self) -> None:
        """End the warm servers the pages' launches share (``ServerBroker``); a page executed after
        this starts a server of its own, as a kernel outside the build does."""
        self._broker.close()

    def stop(self, within: float = 60) -> None:
        """Start no other page and end the running ones now: their kernels are killed (their ranks follow)."""
        import psutil

        self._interrupted.set()  # no page starts again, or goes on to its next cell (_execute, before_cell)
        self._pool.shutdown(wait=False, cancel_futures=True)
        running = [future for future in self._futures.values() if not future.done()]
        deadline = time.monotonic() + within
        while running and time.monotonic() < deadline:
            for child in psutil.Process().children():  # the kernels nbclient started for this build's pages
                with contextlib.suppress(psutil.Error):
                    if "ipykernel_launcher" in child.cmdline():
                        child.kill()
            running = list(wait(running, timeout=0.2).not_done)
        if not running:
            self._broker.close()
            shutil.rmtree(self._sockets, ignore_errors=True)

    def __enter__(self) -> Execution:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _ended_page(self, page: Path, how: str) -> None:
        with self._report_lock:
            self._ended += 1
            self._report(f"[{self._ended:2}/{self._total}] {page.stem}: {how}")

    def _execute(self, page: Path):
        try:
            notebook, how = self._execute_or_read(page)
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # named at once, not after the pages still running
            said = [line for line in str(error).splitlines() if line.strip()]  # nbclient's report ends with the error
            self._ended_page(page, f"failed: {said[-1][:300] if said else type(error).__name__}")
            raise
        self._ended_page(page, how)
        return notebook

    def _execute_or_read(self, page: Path):
        import jupytext
        from jupyter_cache.base import CacheBundleIn
        from jupyter_cache.executors.utils import single_nb_execution
        from nbclient.exceptions import DeadKernelError

        notebook = jupytext.read(page)  # as myst-nb's nb_custom_formats reads it: the cache keys on its code cells
        with self._cache_lock:
            try:
                return self.cache.merge_match_into_notebook(notebook)[1], "from the cache"
            except KeyError:
                pass  # not executed yet

        # A page is executed once. (A failure that two launches at once showed, "Gloo
        # connectFullMesh failed ... Connection closed by peer", was retried here until its
        # cause was found: a rank tearing its group down while a peer was still setting it
        # up; fsdp_guide._rank.wait_for_every_rank. A crash of the kernel process itself,
        # libzmq aborting it with "Assertion failed: pfd.revents & POLLIN", seen on
        # 2026-11-29, was retried too, its cause not found; it is not retried now, and if it
        # comes back, the kernel's faulthandler shows where each of its threads was.)
        def interruptible(before_cell):
            def hook(**kwargs):
                if self._interrupted.is_set():
                    raise KeyboardInterrupt(f"{page}: the build was interrupted")
                return before_cell(**kwargs)

            return hook

        if self._interrupted.is_set():
            raise KeyboardInterrupt(f"{page}: the build was interrupted")
        self._report(f"        {page.stem}: executing")
        with self._machine.page() as before_cell:
            try:
                result = single_nb_execution(
                    jupytext.read(page),
                    cwd=str(page.parent),
                    timeout=self.timeout,
                    allow_errors=False,
                    on_cell_execute=interruptible(before_cell),
                    extra_arguments=[KERNEL_FAULTHANDLER],
                    kernel_manager_class=_unix_socket_kernels(self._sockets / str(next(self._kernels)), self._environ),
                )
            except DeadKernelError as error:
                if self._interrupted.is_set():  # killed by stop()
                    raise
                raise PageFailed(
                    f"{page}: its kernel process died ({error}); where each of its threads "
                    "was is in the build's error output, above (faulthandler)"
                ) from error
        if result.err:  # nbclient's report: the cell's source, then its traceback, without the terminal's colours
            raise PageFailed(f"{page}: {ANSI_COLOUR.sub('', str(result.err))}")
        without_build_paths(result.nb)
        with self._cache_lock:
            self.cache.cache_notebook_bundle(
                CacheBundleIn(result.nb, uri=str(page), data={"execution_seconds": result.time}), overwrite=True
            )
        return result.nb, f"executed in {result.time:.1f} s"


def build_paths() -> list[str]:
    """The folders of this machine that outputs name (a warning's file, a traceback's frames), longest first.

    The pages' kernels and ranks run this Python: its packages' and standard library's folders, and the checkout's.
    """
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    folders = {*site.getsitepackages(), paths["purelib"], paths["platlib"], paths["stdlib"], str(ROOT)}
    folders |= {os.path.realpath(folder) for folder in folders}  # as written, and through any symlink
    return sorted(folders, key=len, reverse=True)


def without_build_paths(notebook) -> None:
    """The outputs with each path of :func:`build_paths` shortened to the part a reader's machine shares.

    ``/.../site-packages/torch/distributed/fsdp/wrap.py:91: FutureWarning`` becomes
    ``torch/distributed/fsdp/wrap.py:91: FutureWarning``; a file of the checkout is named from its root.
    """
    # A folder where a path starts, not within another path or a URL ("https://host/app/...").
    starts = "|".join(re.escape(folder.rstrip("/") + "/") for folder in build_paths())
    folders = re.compile(rf"(?<![\w.~/-])(?:{starts})")

    def shorter(value):
        if isinstance(value, str):
            return folders.sub("", value)
        return [shorter(item) for item in value] if isinstance(value, list) else value

    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            for key in ("text", "evalue", "traceback"):
                if key in output:
                    output[key] = shorter(output[key])
            for kind, value in output.get("data", {}).items():
                if kind.startswith("text/"):
                    output["data"][kind] = shorter(value)


def _deepspeed_environ() -> dict[str, str]:
    """Where the pages run on the CPU, name it to DeepSpeed (``DS_ACCELERATOR``), unless already named.

    transformers, peft and accelerate import DeepSpeed where it is installed (the DeepSpeed page's
    extra), and DeepSpeed then logs, in every kernel and rank that finds no GPU, that it fell back to
    the CPU: a line in the output of a dozen pages that are not about DeepSpeed, and words that
    pull those pages up in the site's search. Named, it logs nothing. On GPUs its own detection
    stands (nothing is set), as it does for a reader running a page in Jupyter; the DeepSpeed page
    names the CPU itself in each rank that computes there (by ``fsdp_guide.device()``'s rule, which
    takes CUDA GPUs only: on a machine with another accelerator the ranks compute on the CPU)."""
    import torch

    from fsdp_guide.devices import DEVICE_ENV

    on_cpu = os.environ.get(DEVICE_ENV, "").strip().lower() == "cpu" or not torch.cuda.is_available()
    return {"DS_ACCELERATOR": "cpu"} if on_cpu and "DS_ACCELERATOR" not in os.environ else {}  # cpu-only: the CPU named


def _unix_socket_kernels(prefix: Path, environ: dict[str, str]) -> type:
    """nbclient's kernel manager with the ``ipc`` transport, the kernel's sockets at ``prefix``-1 to -5,
    and ``environ`` added to the kernel's environment.

    A class, not an instance: nbclient shuts down and cleans up only the kernels of managers it made.
    """
    from jupyter_client.manager import AsyncKernelManager
    from traitlets import CaselessStrEnum, Unicode

    class UnixSocketKernelManager(AsyncKernelManager):
        transport = CaselessStrEnum(["tcp", "ipc"], default_value="ipc", config=True)
        ip = Unicode(str(prefix), config=True)

        async def _async_pre_start_kernel(self, **kw):
            kw["env"] = {**kw.get("env", os.environ), **environ}
            return await super()._async_pre_start_kernel(**kw)

    return UnixSocketKernelManager


# The kernel's faulthandler, enabled as the kernel starts (ipykernel's exec_lines run before the
# first cell, without a prompt or an output), writes to the stderr the kernel was started with:
# ipykernel points file descriptor 2 at a pipe it forwards to the notebook, which a dying
# kernel no longer reads, so a native crash's stacks (a SIGSEGV, or libzmq's SIGABRT) would be
# lost there. The build's own stderr is where a reader, or CI's log, sees them.
KERNEL_FAULTHANDLER = (
    '--IPKernelApp.exec_lines=["import faulthandler, sys; faulthandler.enable('
    "getattr(sys.stderr, '_original_stdstream_copy', None) or sys.__stderr__, all_threads=True); "
    'del faulthandler, sys"]'
)


class _Machine:
    """The machine, shared by the pages that run at once, and taken whole by a cell tagged ``alone``.

    A readers-writer lock with pages for readers, given up and taken again at each cell: a
    page holds a share from before its kernel starts until its kernel has stopped, except
    at a cell's start (nbclient's ``on_cell_execute`` hook, ``before_cell``). There it waits
    while a cell tagged ``alone`` waits or runs; and a cell tagged ``alone`` waits there
    until no other page holds a share, then holds the machine until its page's next
    ordinary cell, or its end. So an alone cell starts once the other pages' running cells
    have ended (a kernel starting counts as a cell), and none starts until it has ended.
    Written by hand: neither the standard library nor nbclient has one.
    """

    def __init__(self, others: MachineLock | None = None):
        self._condition = threading.Condition()
        self._shares = 0  # pages running an ordinary cell, or starting or stopping their kernel
        self._alone_waiting = 0
        self._alone_running = False
        self._others = others  # other processes' work, which an alone cell also waits for

    def _open(self) -> bool:
        return not self._alone_running and not self._alone_waiting

    @contextlib.contextmanager
    def page(self):
        """Held while a page executes; yields the hook its kernel's client calls before each cell."""
        holds_alone = False

        def before_cell(cell, cell_index) -> None:
            nonlocal holds_alone
            alone = ALONE in cell.metadata.get("tags", [])
            with self._condition:
                if alone and holds_alone:
                    return  # the page's next cell is alone too: it keeps the machine
                self._give_up(holds_alone)
                holds_alone = False
                if alone:
                    self._alone_waiting += 1
                    self._condition.wait_for(lambda: self._shares == 0 and not self._alone_running)
                    self._alone_waiting -= 1
                    self._alone_running = holds_alone = True
                else:
                    self._condition.wait_for(self._open)
                    self._shares += 1
            if alone and self._others is not None:  # the other pages wait meanwhile: the machine is taken
                self._others.take()

        with self._condition:
            self._condition.wait_for(self._open)
            self._shares += 1
        try:
            yield before_cell
        finally:
            with self._condition:
                self._give_up(holds_alone)

    def _give_up(self, holds_alone: bool) -> None:
        """The page's share, or the whole machine (called with the condition held)."""
        if holds_alone:
            self._alone_running = False
            if self._others is not None:
                self._others.give_back()
        else:
            self._shares -= 1
        self._condition.notify_all()


class MachineLock:
    """The machine, between processes: their work holds a share, and an alone cell takes it whole.

    Two files in ``folder``, locked with flock(2): ``machine``, shared by each process's work
    (``share``, reentrant within the process) and taken whole by an alone cell (``take``), and
    ``gate``, which an alone cell holds from before it waits for the machine until it gives the
    machine back, and which work passes through before it takes a share. flock's shared and
    exclusive modes are the lock; the gate is the fairness they lack: without it, work that
    keeps coming (a test after a test) could keep the alone cell waiting for ever.
    Written by hand: neither the standard library nor pytest-xdist has a lock between processes.
    """

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self._gate, self._machine = (open(folder / name, "a") for name in ("gate", "machine"))  # noqa: SIM115
        self._shares, self._lock = 0, threading.Lock()

    @contextlib.contextmanager
    def share(self):
        """Held while this process's work runs; waits while an alone cell waits or runs."""
        with self._lock:
            if self._shares == 0:
                fcntl.flock(self._gate, fcntl.LOCK_EX)
                fcntl.flock(self._machine, fcntl.LOCK_SH)
                fcntl.flock(self._gate, fcntl.LOCK_UN)
            self._shares += 1
        try:
            yield
        finally:
            with self._lock:
                self._shares -= 1
                if self._shares == 0:
                    fcntl.flock(self._machine, fcntl.LOCK_UN)

    def take(self) -> None:
        """Wait until no process holds a share, and keep any from taking one until ``give_back``."""
        fcntl.flock(self._gate, fcntl.LOCK_EX)
        fcntl.flock(self._machine, fcntl.LOCK_EX)

    def give_back(self) -> None:
        fcntl.flock(self._machine, fcntl.LOCK_UN)
        fcntl.flock(self._gate, fcntl.LOCK_UN)


def execution_order(pages: Iterable[Path], seconds: dict[str, float]) -> list[Path]:
    """The longest first, so that the last page to finish is a short one; pages with no recorded time lead."""
    return sorted(pages, key=lambda page: -seconds.get(page.stem, float("inf")))


def recorded_seconds(root: Path) -> dict[str, float]:
    """Each page's time in the last recorded build (bench/results/page_times.json), or nothing."""
    import json

    path = root / "bench" / "results" / "page_times.json"
    return json.loads(path.read_text())["seconds"] if path.exists() else {}


def _execute_before_reading(app, env, docnames: list[str]) -> None:
    from sphinx.errors import ExtensionError
    from sphinx.util import logging

    if app.config.nb_execution_mode != "cache":
        return  # "force" executes each page as it is read; "off" and "auto" are left to myst-nb
    pages = [Path(env.doc2path(name)) for name in docnames]
    pages = execution_order([page for page in pages if page.suffix == ".py"], recorded_seconds(Path(app.srcdir)))
    logger = logging.getLogger(__name__)
    logger.info(f"executing {len(pages)} pages, {app.config.execution_workers} at a time (not those the cache holds)")
    with Execution(
        app.config.nb_execution_cache_path,
        app.config.execution_workers,
        app.config.nb_execution_timeout,
        report=logger.info,
    ) as execution:
        futures = execution.submit_all(pages)
    for page, future in futures.items():
        if future.exception() is None:
            continue
        if app.config.nb_execution_raise_on_error:
            raise ExtensionError(f"executing {page.relative_to(app.srcdir)} failed", future.exception())
        logger.warning(f"executing {page.relative_to(app.srcdir)} failed: {future.exception()}")


def setup(app):
    # Pages executed at once before Sphinx reads them; 1 executes them one after another.
    app.add_config_value("execution_workers", 2, "", types=[int])
    app.connect("env-before-read-docs", _execute_before_reading)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
