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

A page that reads a counter of the whole machine, or times its ranks against each other,
runs alone (``ALONE``): the communication page counts the bytes on the loopback
interface, which a concurrent page's ranks would add to; the pipeline page times its
bubble with each stage on a core of its own, which a concurrent page's ranks would take
(its idle fractions drifted by more than 0.1 once, with another page running beside it).
"""

from __future__ import annotations

import contextlib
import itertools
import re
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

ALONE = {
    "communication",  # reads /sys/class/net/lo/statistics/tx_bytes, the whole machine's loopback bytes
    "pipeline",  # times its bubble: one core per stage
}

# A rendezvous that failed in gloo's connectFullMesh ("Connection closed by peer") with two
# processes launching at once: seen once in 350 package tests run two at a time
# (pytest-xdist, torch 2.9.1), never in 900 concurrent launches alone; not understood. A
# page that fails with it is executed once more; any other failure fails it at once.
TRANSIENT = "Gloo connectFullMesh failed"
ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


class PageFailed(Exception):
    """A page's cell raised: the message holds nbclient's report of the cell and its traceback."""


class Execution:
    """Executes pages (.py files jupytext reads) into the jupyter-cache at ``cache_path``.

    ``submit`` returns a future of the executed notebook; at most ``workers`` pages run at
    once, and a page in ``ALONE`` runs with no other. A page whose code cells are already in
    the cache is not executed again. Call ``close`` (or use it as a context manager) to wait
    for every page submitted.
    """

    def __init__(self, cache_path: str | Path, workers: int = 2, timeout: int = 180):
        from jupyter_cache import get_cache

        self.cache, self.timeout = get_cache(str(cache_path)), timeout
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="page")
        self._cache_lock = threading.Lock()  # one writer at a time for the cache's sqlite database
        self._alone = _AloneLock()
        self._futures: dict[Path, Future] = {}

    def submit(self, page: Path) -> Future:
        if page not in self._futures:
            ticket = self._alone.ticket(page.stem in ALONE)  # its place in line, taken now
            self._futures[page] = self._pool.submit(self._execute_then_release, page, ticket)
        return self._futures[page]

    def submit_all(self, pages: Iterable[Path]) -> dict[Path, Future]:
        return {page: self.submit(page) for page in pages}

    def close(self, cancel: bool = False) -> None:
        """Wait for the pages that are running; with ``cancel``, start none of those still waiting."""
        self._pool.shutdown(wait=True, cancel_futures=cancel)

    def __enter__(self) -> Execution:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _execute_then_release(self, page: Path, ticket: int):
        try:
            return self._execute(page, ticket)
        finally:  # ran, came from the cache, or failed: the pages behind it may start
            self._alone.release(ticket)

    def _execute(self, page: Path, ticket: int):
        import jupytext
        from jupyter_cache.base import CacheBundleIn
        from jupyter_cache.executors.utils import single_nb_execution
        from nbclient.exceptions import DeadKernelError

        notebook = jupytext.read(page)  # as myst-nb's nb_custom_formats reads it: the cache keys on its code cells
        with self._cache_lock:
            try:
                return self.cache.merge_match_into_notebook(notebook)[1]
            except KeyError:
                pass  # not executed yet
        for attempt in range(2):  # once more after a kernel crash or a TRANSIENT failure, and only once
            with self._alone.held(ticket, page.stem in ALONE):
                try:
                    result = single_nb_execution(jupytext.read(page), cwd=str(page.parent), timeout=self.timeout,
                                                 allow_errors=False)
                except DeadKernelError:  # the intermittent kernel crash (tests/conftest.py, KERNEL_CRASH)
                    if attempt:
                        raise
                    continue
            if result.err is None or TRANSIENT not in str(result.err):
                break
        if result.err:  # nbclient's report: the cell's source, then its traceback, without the terminal's colours
            raise PageFailed(f"{page}: {ANSI_COLOUR.sub('', str(result.err))}")
        with self._cache_lock:
            self.cache.cache_notebook_bundle(
                CacheBundleIn(result.nb, uri=str(page), data={"execution_seconds": result.time}), overwrite=True)
        return result.nb


class _AloneLock:
    """Shared by ordinary pages, exclusive for a page that must run alone: a readers-writer
    lock whose places in line are taken when the pages are submitted, so that no page
    submitted after one that must run alone starts before it has run (even when its worker
    gets there first, as the second worker does while the first starts the alone page)."""

    def __init__(self):
        self._condition = threading.Condition()
        self._running = 0
        self._alone = False
        self._tickets = itertools.count()
        self._waiting_alone: set[int] = set()  # tickets of the pages to run alone, not yet run

    def ticket(self, alone: bool) -> int:
        with self._condition:
            ticket = next(self._tickets)
            if alone:
                self._waiting_alone.add(ticket)
            return ticket

    def release(self, ticket: int) -> None:
        with self._condition:
            self._waiting_alone.discard(ticket)
            self._condition.notify_all()

    @contextlib.contextmanager
    def held(self, ticket: int, alone: bool):
        with self._condition:
            if alone:
                self._condition.wait_for(lambda: self._running == 0)
            else:
                self._condition.wait_for(lambda: not self._alone and min(self._waiting_alone, default=ticket) >= ticket)
            self._running += 1
            self._alone = alone
        try:
            yield
        finally:
            with self._condition:
                self._running -= 1
                self._alone = False
                self._condition.notify_all()


def execution_order(pages: Iterable[Path], seconds: dict[str, float]) -> list[Path]:
    """The pages that run alone first (nothing waits behind them then), then the longest first,
    so that the last page to finish is a short one; pages with no recorded time lead."""
    return sorted(pages, key=lambda page: (page.stem not in ALONE, -seconds.get(page.stem, float("inf"))))


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
    with Execution(app.config.nb_execution_cache_path, app.config.execution_workers,
                   app.config.nb_execution_timeout) as execution:
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
