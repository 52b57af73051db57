"""Ranks that live across notebook cells: start N ranks once, run each cell on all of them.

:func:`fsdp_guide.launch` starts fresh ranks for every call, so nothing a cell builds survives
it. A :class:`Ranks` session starts its ranks once, with the process group ready on each (the
same ranks as a launch's: loopback only, :func:`fsdp_guide.device`'s backend), and
then runs code on every rank in one namespace per rank, so a model sharded in one cell is there
in the next::

    ranks = Ranks(world_size=2)
    ranks.run("model = fully_shard(nn.Linear(8, 8))")
    ranks.run("print(model.weight.placements, model.weight.to_local().shape)")
    ranks.get("model.weight.grad.to_local()")  # one value per rank, brought back to the notebook

In a notebook, ``%load_ext fsdp_guide`` gives the same as magics: ``%%ranks`` runs its cell on
the ranks, ``%ranks restart`` starts them again, ``%torchrun -n 2 train.py ARGS`` runs a script
(:func:`fsdp_guide.run`).

How a cell reaches the ranks: each rank is a launch's rank (``fsdp_guide._rank``) whose function
is :func:`_serve`, a loop over the frames the parent writes to its stdin (``_rank.commands``). A
rank ends a cell by writing its record (``cellN.rankR.pkl``) and then a marker line, with a
token only this session knows, on both its stdout and its stderr; the parent's readers see the
markers after every line the cell printed, so the output it shows is complete.

Against ipyparallel's ``%%px``, nbdistributed and jupyter-distributed, each set up as its
documentation says (``bench/live_cells.py``; the record is ``bench/results/live_cells.txt``):
a cell here takes less time than under any of them and the ranks start no slower; ipyparallel
and jupyter-distributed leave the process group to a cell, and set up from the environment
(``env://``) or from a ``tcp://127.0.0.1`` address, torch's rendezvous store on rank 0 listens on
every interface; nbdistributed's
ZMQ router binds every interface and its first cell after ``%dist_init`` waits out a 30 s
timeout. Here nothing listens beyond 127.0.0.1.
"""

from __future__ import annotations

import ast
import builtins
import html
import os
import shutil
import signal
import sys
import tempfile
import time
import types
import uuid
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import cloudpickle

from fsdp_guide import _warm
from fsdp_guide.launcher import (
    LaunchError,
    _check_options,
    _dumps,
    _interrupts_noted,
    _Ranks,
    _record,
    _says_nothing,
    _seconds,
    _serialise,
    _where,
)

__all__ = ["Ranks", "session"]

_INTERRUPT_GRACE_S = 2.0  # how long a rank has to end its cell after SIGINT before the ranks are restarted
_CHECK_S = 30.0  # how long the ranks have to answer the check after a cell that did not end well
_LIVE_S = 0.1  # how often the parent looks at a running cell
_REDRAW_S = 0.5  # how often a notebook's display of a running cell is redrawn
_MAX_LINES = 10_000  # lines kept per rank and cell; the count of the rest is shown


_session: Ranks | None = None  # the ranks the notebook's %%ranks cells run on (fsdp_guide._magics)


def session() -> Ranks | None:
    """The ranks this kernel's ``%%ranks`` cells run on, for the same ranks from Python; ``None`` before the first."""
    return _session


class Ranks:
    """``world_size`` ranks that stay up across calls, each with the process group ready and a namespace of its own.

    Each call runs on every rank: :meth:`run` a cell's code (a string) or a function,
    :meth:`get` brings values back, :meth:`put` sends them. A rank's namespace starts with
    ``rank``, ``world_size`` and ``device`` (:func:`fsdp_guide.device`); what a cell
    defines stays for the next. What the ranks print is shown when the cell ends, once for
    ranks that printed the same, else per rank (in a notebook, also while it runs).

    When a cell fails on one rank, the other ranks' cell is ended too (SIGINT: a
    ``KeyboardInterrupt`` in their code), and the ranks keep their state if every rank
    ended its cell and they still agree (a barrier); a rank that does not end it within
    2 s (blocked in a collective its peer will never join), or ranks that no longer agree,
    mean the ranks are restarted, with empty namespaces, and the error says so. The same
    for Ctrl-C (Jupyter's stop button) and for a cell past its ``timeout``, whose error
    gives each rank's stack. The ranks end with :meth:`close`, with the ``with`` block,
    or with this process (its kernel's restart or shutdown included).

    Args:
        world_size: the number of ranks; default 2.
        backend: as :func:`fsdp_guide.launch`'s: ``"auto"`` (the rank's device decides), ``"gloo"``,
            ``"nccl"`` or ``"cpu:gloo,cuda:nccl"``.
        timeout: seconds a cell may run before the ranks are stopped and restarted; ``None``: no limit.
        collective_timeout: the process group's own timeout, as for :func:`fsdp_guide.launch`.

    Example:

    >>> with Ranks(world_size=2) as ranks:
    ...     ranks.run("import torch, torch.distributed as dist; t = torch.ones(1) * (rank + 1)")
    ...     ranks.run("dist.all_reduce(t); print(t.item())")
    ...     ranks.get("t")
    [ranks 0, 1]
    3.0
    [tensor([3.]), tensor([3.])]
    """

    def __init__(
        self,
        world_size: int | None = None,
        *,
        backend: str = "auto",
        timeout: float | None = None,
        collective_timeout: float = 300.0,
    ):
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            raise RuntimeError(
                "Ranks starts ranks of its own, and this process is already a rank (RANK and WORLD_SIZE are "
                "set, as under torchrun): run the cells' code directly in the script"
            )
        world_size = 2 if world_size is None else world_size
        _check_options(world_size, backend, timeout, collective_timeout, "all")
        self.world_size, self.backend = world_size, backend
        self.timeout, self.collective_timeout = timeout, collective_timeout
        self.restarts = 0  # how many times the ranks had to be started again
        self._cell = 0  # cells are numbered across restarts: a traceback's "<cell N>" names one cell
        self._procs: _LiveProcs | None = None
        self._start()

    # -- public ------------------------------------------------------------------------------

    def run(self, code: str | Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """Run ``code`` on every rank.

        A string runs as a notebook cell would, in each rank's namespace: what it defines
        stays, and the value of a last line that is an expression is printed. Nothing is
        returned. A function runs as ``code(*args, **kwargs)`` with the rank's namespace as
        its globals (names the namespace lacks come from the function's own); its return
        values come back, one per rank, as from :func:`fsdp_guide.launch`.

        Raises:
            SyntaxError: the string is not Python (found here, before any rank runs it).
            LaunchError: the code raised on a rank, or ran past ``timeout``; the message says
                whether the ranks kept their state or were restarted.
            KeyboardInterrupt: interrupted; the same said.
        """
        if isinstance(code, str):
            if args or kwargs:
                raise TypeError("arguments go with a function; a cell's code takes none (use put() to send values)")
            compile(code, "<cell>", "exec")  # a syntax error is the reader's, and said before anything runs
            self._call("exec", code, timeout)
            return None
        if not callable(code):
            raise TypeError(f"run() takes a cell's code (a str) or a function, got {type(code).__name__}")
        return self._call("call", _serialise(code, args, kwargs), timeout)

    def get(self, name: str, *, timeout: float | None = None) -> list:
        """The value of the expression ``name`` (a variable, ``model.weight``, ...) on each rank, in rank order."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"get() takes the name (or expression) to bring back, as a string, got {name!r}")
        compile(name, "<get>", "eval")
        return self._call("get", name, timeout)

    def put(self, **values: Any) -> None:
        """Give every rank these variables (each rank gets its own copy of the same values)."""
        if not values:
            raise ValueError("put() takes the variables to send as keywords: ranks.put(steps=10)")
        self._call("put", _dumps(values), None)

    def restart(self) -> None:
        """Stop the ranks and start new ones: empty namespaces, a new process group."""
        self.close()
        self._start()
        self.restarts += 1

    def close(self) -> None:
        """Stop every rank; idempotent. The ranks' namespaces are gone."""
        if self._procs is not None:
            procs, self._procs = self._procs, None
            procs.close()
            self._finalizer.detach()

    @property
    def running(self) -> bool:
        return self._procs is not None

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        if not self.running:
            return f"Ranks(world_size={self.world_size}): closed"
        backend, device = self._where
        return f"Ranks(world_size={self.world_size}): running, {backend} on {device}"

    # -- how -----------------------------------------------------------------------------------

    def _start(self) -> None:
        run_dir = Path(tempfile.mkdtemp(prefix="fsdp_guide-ranks-"))
        token = uuid.uuid4().hex
        config = {
            "world_size": self.world_size,
            "backend": self.backend,
            "collective_timeout": self.collective_timeout,
            "sys_path": list(sys.path),
            "output": "all",
        }
        (run_dir / "config.pkl").write_bytes(cloudpickle.dumps(config))
        (run_dir / "payload.pkl").write_bytes(_serialise(_serve, (token,), {}))
        # Forked from a warm server where one runs already (a launch started it, or a site
        # build's broker lends its own): at once. Else cold: two ranks importing torch start
        # sooner than a new server importing torch, FSDP, DTensor and DCP before it forks them
        # (a Ranks(2) start and one all-reduce, 2 cores, 2026-12-07: 0.87 s cold against 1.82 s
        # through a new server), and ranks that live for the session gain nothing from its
        # imports later.
        _warm.start_server(start_own=False)
        procs = _LiveProcs(run_dir, self.world_size, token, warm=_warm.can_start())
        self._procs = procs
        self._finalizer = weakref.finalize(self, procs.close)
        try:
            # A Ctrl-C while a warm rank is forked is noted, not raised mid-fork: WarmRank stops
            # waiting on it with its pipes closed, and the ranks started so far are stopped below.
            with _interrupts_noted() as noted_here:
                procs.interrupted = noted_here
                procs.start()
            if noted_here.is_set():
                raise KeyboardInterrupt
            outcome = procs.wait_cell(0, time.monotonic() + self.collective_timeout, None)  # each joined the group
            if outcome != "done":
                raise (
                    procs._failure()
                    if outcome == "exited"
                    else LaunchError(
                        f"the ranks did not join their process group within collective_timeout="
                        f"{self.collective_timeout:g} s" + _where(procs.stacks(procs.running(0)))
                    )
                )
        except KeyboardInterrupt:  # as launch says it: the traceback ends here, with what was stopped
            self.close()
            raise KeyboardInterrupt(
                f"interrupted while the ranks started: {len(procs.procs)} rank(s) stopped"
            ) from None
        except BaseException:
            self.close()
            raise
        where = [record[1] for record in procs.records(0)]
        self._where = (where[0]["backend"], where[0]["device"])
        _record(Ranks, self.world_size, where)  # as a launch is: where a page's ranks ran (fsdp_guide.executed_on)

    def _call(self, kind: str, payload: Any, timeout: float | None) -> Any:
        if self._procs is None:
            raise RuntimeError("these ranks were closed: start new ones with restart() (or %ranks restart)")
        _seconds("timeout", timeout, none_ok=True)
        timeout = self.timeout if timeout is None else timeout
        self._cell += 1
        n, procs = self._cell, self._procs
        view = _Live(procs, n)
        with _interrupts_noted() as noted:  # every rank gets the whole cell, or none a part of it
            procs.new_cell()
            procs.send(n, kind, payload)
        try:
            records, interrupted = self._wait(n, timeout, view, noted.is_set())
        finally:
            view.finish()
        errors = {r: rec for r, rec in enumerate(records) if rec[0] != "ok"}
        if errors or interrupted:
            with _interrupts_noted():
                self._check_agreement(errors, interrupted)
        if interrupted:
            raise KeyboardInterrupt("the cell was interrupted on every rank; the ranks keep their state")
        if errors:
            rank = min(errors, key=lambda r: (errors[r][0] != "error", r))
            status, text, summary = errors[rank]
            where = " (each rank's traceback is in the output above)" if status == "error" else f": {text}"
            raise LaunchError(
                f"rank {rank} raised {summary}{where}. The ranks keep their state.",
                rank=rank,
                ranks=sorted(errors),
                remote_traceback=text,
            )
        values = [rec[1] for rec in records]
        return None if kind in ("exec", "put") else values

    def _check_agreement(self, errors: dict, interrupted: bool) -> None:
        """After a cell that did not end well on every rank: restart the ranks unless every rank
        has issued as many collectives as the others (and still has its process group)."""
        self._cell += 1
        procs = self._procs
        procs.new_cell()
        procs.send(self._cell, "check", None)
        outcome = procs.wait_cell(self._cell, time.monotonic() + _CHECK_S, None)
        counts = [rec[1] if rec[0] == "ok" else None for rec in procs.records(self._cell)] if outcome == "done" else []
        if counts and None not in counts and len(set(counts)) == 1:
            return
        rank = min(errors, key=lambda r: (errors[r][0] != "error", r)) if errors else None
        cause = "the cell was interrupted" if interrupted else f"rank {rank} raised {errors[rank][2]}"
        found = (
            ", ".join(
                f"rank {r} {'has no process group' if c is None else f'issued {c}'}" for r, c in enumerate(counts)
            )
            if counts
            else "the ranks did not answer"
        )
        self._restart_after(
            f"{cause}; every rank ended the cell, but the ranks no longer agree on the collectives they "
            f"made ({found}): the next collective would pair with the wrong one, or wait forever.",
            interrupted=interrupted,
        )

    def _wait(self, n: int, timeout: float | None, view: _Live | None, interrupted: bool) -> tuple[list, bool]:
        """Each rank's record of cell ``n``, and whether it was interrupted; a cell that cannot end
        on every rank ends the session's ranks."""
        procs = self._procs
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            outcome = "interrupted" if interrupted else procs.wait_cell(n, deadline, view)
        except KeyboardInterrupt:
            outcome = "interrupted"
        if outcome == "done":
            return procs.records(n), False
        with _interrupts_noted():  # a second Ctrl-C cannot cut the clean-up short
            return self._end_cell(n, outcome, timeout), outcome == "interrupted"

    def _end_cell(self, n: int, outcome: str, timeout: float | None) -> list:
        procs = self._procs
        if outcome == "exited":
            self._restart_after(str(procs._failure()))
        if outcome == "timeout":
            stacks = procs.stacks(procs.running(n))
            self._restart_after(
                f"the cell did not finish within timeout={timeout:g} s on rank(s) "
                f"{', '.join(map(str, sorted(stacks) or procs.running(n)))}." + _where(stacks),
            )
        # interrupted, or a rank raised: end the cell on the ranks still in it
        running = procs.running(n)
        procs.interrupt(running)
        if procs.wait_cell(n, time.monotonic() + _INTERRUPT_GRACE_S, None) != "done":
            stuck = procs.running(n)
            stacks = procs.stacks(stuck)
            cause = "the cell was interrupted" if outcome == "interrupted" else procs.first_error(n)
            self._restart_after(
                f"{cause}; rank(s) {', '.join(map(str, stuck))} did not end the cell within "
                f"{_INTERRUPT_GRACE_S:g} s of being interrupted (blocked in a collective that a rank which "
                "stopped will never join, or in code that does not return to Python)." + _where(stacks),
                interrupted=outcome == "interrupted",
            )
        return procs.records(n)

    def _restart_after(self, why: str, interrupted: bool = False) -> None:
        self.restart()
        message = f"{why}\nThe ranks were restarted: their namespaces are empty, run the cells that set them up again."
        if interrupted:
            raise KeyboardInterrupt(message)
        raise LaunchError(message)


class _LiveProcs(_Ranks):
    """A session's rank processes: a launch's, whose output is collected cell by cell."""

    def __init__(self, run_dir: Path, world_size: int, token: str, warm: bool):
        super().__init__(run_dir, world_size, "all", warm=warm)
        self.token = token
        self.marker = f"\x00fsdp_guide {token} "
        self.ended = [{"stdout": -1, "stderr": -1} for _ in range(world_size)]  # the last cell ended, per stream
        # this cell's output, per rank: (stream, line, whether it ended in "\r": a redraw follows)
        self.lines: list[list[tuple[str, str, bool]]] = [[] for _ in range(world_size)]
        self.dropped = [0] * world_size  # lines past _MAX_LINES
        self.statuses: dict[tuple[int, int], str] = {}
        self.read: dict[tuple[int, int], tuple] = {}  # this cell's records, once read

    def _emit(self, rank: int, line: str, stream: str, show: bool) -> None:
        text, marker, rest = line.partition(self.marker)
        if text and not _says_nothing(text):
            shown = text.rstrip("\r\n")
            with self.exited:
                self.tails[rank].append(shown)  # what a failure's message shows
                lines = self.lines[rank]
                if lines and lines[-1][2] and lines[-1][0] == stream:
                    lines[-1] = (stream, shown, text.endswith("\r"))  # a progress bar's redraw: in place
                elif len(lines) < _MAX_LINES:
                    lines.append((stream, shown, text.endswith("\r")))
                else:
                    self.dropped[rank] += 1
        if marker:
            n, status = rest.split()[:2]
            with self.exited:
                self.ended[rank][stream] = int(n)
                self.statuses[rank, int(n)] = status
                self.exited.notify_all()

    def new_cell(self) -> None:
        with self.exited:
            self.lines = [[] for _ in range(self.world_size)]
            self.dropped = [0] * self.world_size
            self.read = {}

    def send(self, n: int, kind: str, payload: Any) -> None:
        frame = cloudpickle.dumps((n, kind, payload))
        for proc in self.procs:
            try:
                proc.stdin.write(len(frame).to_bytes(8, "big") + frame)
                proc.stdin.flush()
            except (BrokenPipeError, ValueError):
                pass  # that rank exited: wait_cell says so

    def _ended(self, rank: int, n: int) -> bool:
        return min(self.ended[rank].values()) >= n

    def running(self, n: int) -> list[int]:
        with self.exited:
            return [r for r in range(self.world_size) if not self._ended(r, n)]

    def wait_cell(self, n: int, deadline: float | None, view: _Live | None) -> str:
        """Until every rank ended cell ``n`` ("done"), one raised and the others did not follow within
        a moment ("error"), a rank exited ("exited") or the deadline ("timeout")."""
        first_error = None
        while True:
            with self.exited:
                if self.exits:
                    return "exited"
                ended = [r for r in range(self.world_size) if self._ended(r, n)]
                if len(ended) == self.world_size:
                    return "done"
                if first_error is None and any(self._status(r, n) != "ok" for r in ended):
                    first_error = time.monotonic()
                if first_error is not None and time.monotonic() - first_error > 0.5:
                    return "error"
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return "timeout"
                self.exited.wait(_LIVE_S if deadline is None else max(0.0, min(_LIVE_S, deadline - now)))
            if view is not None:
                view.update()

    def _status(self, rank: int, n: int) -> str:
        return self.statuses[rank, n]  # from the marker that ended the cell

    def _record(self, rank: int, n: int) -> tuple:
        if (rank, n) not in self.read:
            path = self.run_dir / f"cell{n}.rank{rank}.pkl"
            try:
                self.read[rank, n] = cloudpickle.loads(path.read_bytes())
            finally:
                path.unlink(missing_ok=True)  # read once: values brought back do not pile up on disk
        return self.read[rank, n]

    def records(self, n: int) -> list:
        records = []
        for r in range(self.world_size):
            try:
                records.append(self._record(r, n))
            except Exception as exc:  # noqa: BLE001 - whatever unpickling raises: a value this process cannot rebuild
                records.append(
                    (
                        "unreadable",
                        f"rank {r}'s value cannot be rebuilt in this process: {type(exc).__name__}: {exc}. "
                        "Bring back plain data or local tensors (a DTensor's .to_local() or .full_tensor()).",
                        f"{type(exc).__name__}: {exc}",
                    )
                )
        return records

    def first_error(self, n: int) -> str:
        for r in range(self.world_size):
            if self._ended(r, n) and self._status(r, n) == "error":
                return f"rank {r} raised {self._record(r, n)[2]}"
        return "a rank failed"

    def interrupt(self, ranks: Sequence[int]) -> None:
        for r in ranks:
            if self.procs[r].poll() is None:
                try:
                    os.kill(self.procs[r].pid, signal.SIGINT)  # the rank only, not its children
                except ProcessLookupError:
                    pass

    def stacks(self, ranks: list[int]) -> dict[int, str]:
        stacks = self._stacks(ranks)
        for rank, stack in stacks.items():  # from the cell's own frames: not this module's loop
            lines = stack.splitlines()
            serve = next((i for i, line in enumerate(lines) if "fsdp_guide/live.py" in line), len(lines))
            stacks[rank] = "\n".join(lines[:serve])
        return stacks

    def close(self) -> None:
        try:
            self.send(-1, "close", None)
            deadline = time.monotonic() + 2.0
            with self.exited:
                while len(self.exits) < len(self.procs) and time.monotonic() < deadline:
                    self.exited.wait(0.05)
        finally:
            self.stop()
            shutil.rmtree(self.run_dir, ignore_errors=True)


class _Live:
    """What a running cell printed, shown in a notebook while it runs and, once it ends, folded."""

    def __init__(self, procs: _LiveProcs, n: int):
        self.procs, self.n = procs, n
        self.handle = None
        self.shown = 0
        self.drawn = 0.0
        self.rich = _in_a_notebook()

    def _output(self) -> Output:
        with self.procs.exited:
            lines = [[(stream, text) for stream, text, _ in rank_lines] for rank_lines in self.procs.lines]
            for rank, dropped in enumerate(self.procs.dropped):
                if dropped:
                    lines[rank].append(("stderr", f"... and {dropped} more lines, not shown"))
            return Output(lines)

    def update(self) -> None:
        if not self.rich or time.monotonic() - self.drawn < _REDRAW_S:
            return
        self.drawn = time.monotonic()
        output = self._output()
        count = sum(map(len, output.lines))
        if count == self.shown:
            return
        self.shown = count
        from IPython.display import display

        if self.handle is None:
            self.handle = display(output, display_id=True)
        else:
            self.handle.update(output)

    def finish(self) -> None:
        output = self._output()
        if self.handle is not None:
            self.handle.update(output)
        elif any(output.lines):
            if self.rich:
                from IPython.display import display

                display(output)
            else:
                print(output, flush=True)


class Output:
    """What each rank printed in one cell: ranks that printed the same lines are shown once."""

    def __init__(self, lines: list[list[tuple[str, str]]]):
        self.lines = lines

    def groups(self) -> list[tuple[list[int], list[tuple[str, str]]]]:
        """(ranks, lines) for each distinct output, in the order of its first rank; silent ranks left out."""
        groups: dict[tuple, list[int]] = {}
        for rank, lines in enumerate(self.lines):
            if lines:
                groups.setdefault(tuple(lines), []).append(rank)
        return [(ranks, list(lines)) for lines, ranks in groups.items()]

    def __str__(self) -> str:
        return "\n".join(
            f"[{_label(ranks)}]\n" + "\n".join(line for _, line in lines) for ranks, lines in self.groups()
        )

    __repr__ = __str__

    def _repr_html_(self) -> str:
        blocks = []
        for ranks, lines in self.groups():
            body = "\n".join(
                f'<span class="fsdp-guide-stderr">{html.escape(line)}</span>'
                if stream == "stderr"
                else html.escape(line)
                for stream, line in lines
            )
            blocks.append(
                f'<div class="fsdp-guide-ranks"><div class="fsdp-guide-ranks-label">{_label(ranks)}</div>'
                f'<pre style="margin:0 0 0.5em 0;white-space:pre-wrap">{body}</pre></div>'
            )
        return "".join(blocks)


def _label(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def _in_a_notebook() -> bool:
    """A Jupyter kernel (display updates in place); not a terminal IPython or a script."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and getattr(shell, "kernel", None) is not None


# -- on each rank ---------------------------------------------------------------------------------------


class _Cell:
    """Whether the rank is running a cell: SIGINT interrupts a cell, and is ignored between cells."""

    running = False

    @classmethod
    def on_sigint(cls, signum, frame) -> None:
        if cls.running:
            raise KeyboardInterrupt


def _serve(token: str) -> None:
    """A rank's loop: run each cell the parent sends, then say it ended, until told to close."""
    import torch.distributed as dist

    from fsdp_guide import _rank
    from fsdp_guide.devices import device

    run_dir, rank = Path(sys.argv[1]), dist.get_rank()
    # The cells run in a module that is __main__, as a notebook's do: a class or function a cell
    # defines pickles by reference (all_gather_object, torch.save) and unpickles on every rank.
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, rank=rank, world_size=dist.get_world_size(), device=device())
    sys.modules["__main__"] = main
    # The markers go to the streams' own descriptors, whatever a cell makes of sys.stdout.
    marks = (os.dup(1), os.dup(2))
    signal.signal(signal.SIGINT, _Cell.on_sigint)
    _end(run_dir, rank, token, 0, ("ok", _rank.where_this_rank_ran(dist.get_backend())), marks)
    while True:
        n, kind, payload = cloudpickle.loads(_rank.commands.get())
        if kind == "close":
            return
        try:
            record = _run_one(n, kind, payload, main.__dict__)
        except BaseException as exc:  # noqa: BLE001 - a KeyboardInterrupt that came as the cell ended
            record = ("interrupted", "", f"{type(exc).__name__}")
        _end(run_dir, rank, token, n, record, marks)


def _run_one(n: int, kind: str, payload: Any, namespace: dict) -> tuple:
    import traceback

    filename = f"<cell {n}>"
    try:
        _Cell.running = True
        try:
            value = _do(kind, payload, namespace, filename)
        finally:
            _Cell.running = False
        return ("ok", value)
    except BaseException as exc:  # noqa: BLE001 - what a cell raises is the reader's, reported per rank
        if isinstance(exc, ValueError) and "initialize the default process group twice" in str(exc):
            exc = ValueError(
                "this cell calls init_process_group, but each rank's group is ready before the first cell: "
                "leave the call out (or guard it with `if not dist.is_initialized():`); to run a torchrun "
                "script as it is, use %torchrun -n N script.py (fsdp_guide.run)"
            ).with_traceback(exc.__traceback__)
        shown = traceback.TracebackException.from_exception(exc)
        here = os.path.abspath(__file__)  # this module's frames (the loop, the SIGINT handler): not the reader's
        shown.stack = traceback.StackSummary.from_list([f for f in shown.stack if os.path.abspath(f.filename) != here])
        text = "".join(shown.format())
        sys.stderr.write(text)
        status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "error"
        return (status, text, f"{type(exc).__name__}: {exc}".rstrip(": "))


def _do(kind: str, payload: Any, namespace: dict, filename: str) -> Any:
    import linecache

    if kind == "exec":
        linecache.cache[filename] = (len(payload), None, payload.splitlines(True), filename)
        tree = ast.parse(payload, filename)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, filename, "exec"), namespace)  # noqa: S102 - the reader's own cell
        if last is not None:
            value = eval(compile(ast.Expression(last.value), filename, "eval"), namespace)  # noqa: S307
            if value is not None:
                print(repr(value))  # as a notebook shows a cell's last value
        return None
    if kind == "call":
        import pickle

        fn, args, kwargs = pickle.loads(payload)
        if isinstance(fn, types.FunctionType):
            rebound = types.FunctionType(
                fn.__code__, {**fn.__globals__, **namespace}, fn.__name__, fn.__defaults__, fn.__closure__
            )
            rebound.__kwdefaults__, rebound.__qualname__ = fn.__kwdefaults__, fn.__qualname__
            rebound.__dict__.update(fn.__dict__)
            fn = rebound
        return fn(*args, **kwargs)
    if kind == "get":
        return eval(payload, namespace)  # noqa: S307 - the reader's own expression
    if kind == "put":
        namespace.update(cloudpickle.loads(payload))
        return None
    if kind == "check":
        import torch.distributed as dist

        if not dist.is_initialized():
            return None  # a cell destroyed the group
        # How many collectives this rank has issued: equal on every rank unless one issued a
        # collective the others never will (NCCL queues it without waiting), or missed one.
        return dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()
    raise ValueError(f"unknown command {kind!r}")


def _end(run_dir: Path, rank: int, token: str, n: int, record: tuple, marks: tuple[int, int]) -> None:
    """Record the cell's outcome, then mark its end on both streams, after all it printed.

    The marker carries the outcome ("ok", "error", "interrupted"), so the parent knows it without
    reading the record (which may hold a large value, or one it cannot rebuild)."""
    import contextlib
    import ctypes

    from fsdp_guide._rank import _write_record

    try:
        _write_record(run_dir / f"cell{n}.rank{rank}.pkl", record)
    except Exception as exc:  # noqa: BLE001 - a value that cannot be pickled: the reader's to change
        text = f"rank {rank}'s value cannot be sent back: {type(exc).__name__}: {exc}"
        sys.stderr.write(text + "\n")
        record = ("error", text, f"{type(exc).__name__}: {exc}")
        _write_record(run_dir / f"cell{n}.rank{rank}.pkl", record)
    for stream in {id(s): s for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)}.values():
        with contextlib.suppress(Exception):  # a stream a cell closed or replaced
            stream.flush()
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)  # what C code (a library's printf) still holds
    for fd in marks:
        os.write(fd, f"\x00fsdp_guide {token} {n} {record[0]}\n".encode())
