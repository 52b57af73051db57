"""``%load_ext fsdp_guide``: the magics ``%%ranks``, ``%ranks`` and ``%torchrun``.

They are :class:`fsdp_guide.live.Ranks` and :func:`fsdp_guide.run` in a notebook:


``%%ranks [-n N] [--timeout S] [--return NAME ...]``
    run the cell on every rank of the notebook's session, starting it (``N`` ranks, default 2)
    on first use; ``--return x y`` sets ``x`` and ``y`` in the notebook to their values on each
    rank, a list in rank order.
``%ranks start [-n N] [--timeout S]``, ``%ranks restart [-n N] [--timeout S]``, ``%ranks stop``
    start the session, start it again (empty namespaces), end it; ``%ranks`` alone says what runs.
``%torchrun [--nproc-per-node N | -n N] [--standalone] SCRIPT [ARGS ...]``
    run an unmodified torchrun script on ``N`` local ranks (default 2), as ``torchrun`` would.
"""

from __future__ import annotations

import argparse
import shlex

from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class

from fsdp_guide import live
from fsdp_guide.launcher import LaunchError, run
from fsdp_guide.live import Ranks


class _Usage(ValueError):
    """A magic's line that cannot be read: what was wrong and the usage, without a traceback."""

    def _render_traceback_(self) -> list[str]:
        return [f"UsageError: {self}"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise _Usage(f"{message}\nusage: {self.format_usage().removeprefix('usage: ').strip()}")


def _ranks_parser() -> _Parser:
    parser = _Parser(prog="%%ranks", add_help=False)
    parser.add_argument("action", nargs="?", choices=["start", "restart", "stop"])
    parser.add_argument("-n", "--world-size", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--return", dest="names", nargs="+", default=[], metavar="NAME")
    return parser


def _torchrun_parser() -> _Parser:
    parser = _Parser(prog="%torchrun", add_help=False)
    parser.add_argument("-n", "--nproc-per-node", "--nproc_per_node", dest="nproc", type=int, default=2)
    parser.add_argument("--standalone", action="store_true")  # what run always does: one machine, loopback
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def _briefly(exc: LaunchError) -> LaunchError:
    """Shown as its message alone: the ranks' tracebacks are in the cell's output already."""
    exc._render_traceback_ = lambda: [f"LaunchError: {exc}"]
    return exc


@magics_class
class RankMagics(Magics):
    """The session they run on is ``fsdp_guide.live.session()``: one per kernel."""

    @line_cell_magic
    def ranks(self, line: str, cell: str | None = None):
        options = _ranks_parser().parse_args(shlex.split(line))
        if cell is None:
            return self._control(options)
        if options.action:
            raise _Usage(f"%%ranks runs its cell; {options.action!r} is for the line magic: %ranks {options.action}")
        for name in options.names:
            if not name.isidentifier():
                raise _Usage(f"--return takes variable names, got {name!r}")
        ranks = self._session(options)
        try:
            ranks.run(cell, timeout=options.timeout)
            for name in options.names:
                self.shell.user_ns[name] = ranks.get(name)
        except LaunchError as exc:
            raise _briefly(exc) from None

    def _session(self, options) -> Ranks:
        session = live._session
        if session is not None and session.running:
            if options.world_size not in (None, session.world_size):
                raise _Usage(
                    f"the ranks run with world size {session.world_size}: "
                    f"`%ranks restart -n {options.world_size}` starts {options.world_size} new ones"
                )
            return session
        live._session = Ranks(world_size=options.world_size)  # --timeout is this cell's, not the session's
        return live._session

    def _control(self, options):
        session = live._session
        if options.action is None:
            print(session if session is not None else "no ranks: `%%ranks` or `%ranks start -n N` starts them")
        elif options.action == "stop":
            if session is not None:
                session.close()
            live._session = None
        elif options.action == "restart" or session is None or not session.running:
            if session is not None:
                session.close()
            keep = session is not None and options.action == "restart"  # the same ranks again, unless told
            live._session = Ranks(
                world_size=options.world_size or (session.world_size if keep else None),
                timeout=options.timeout or (session.timeout if keep else None),
            )
            print(live._session)
        else:  # start, and they run
            print(self._session(options))

    @line_magic
    def torchrun(self, line: str) -> None:
        options = _torchrun_parser().parse_args(shlex.split(line))
        try:
            run(options.script, nproc=options.nproc, args=options.args)
        except LaunchError as exc:
            raise _briefly(exc) from None


def load_ipython_extension(ipython) -> None:
    ipython.register_magics(RankMagics)
