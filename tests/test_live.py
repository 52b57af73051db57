"""fsdp_guide.live.Ranks and the %%ranks magics: ranks that persist across cells (real processes, gloo)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

import fsdp_guide
from fsdp_guide import LaunchError
from fsdp_guide.live import Output, Ranks


def _children() -> set[int]:
    """This process's descendants, but the warm server and its resource tracker (kept for the next ranks)."""
    from fsdp_guide._warm import server_pids

    return {p.pid for p in psutil.Process().children(recursive=True)} - set(server_pids())


def _alive(pids) -> list[int]:
    return [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


@pytest.fixture
def ranks():
    """Two live ranks; at the end, every process they started is gone."""
    before = _children()
    session = Ranks(world_size=2)
    yield session
    session.close()
    assert not _alive(_children() - before), "a rank (or a process one started) was left running"


def test_what_a_cell_defines_is_there_in_the_next_and_each_rank_has_its_own(ranks, capsys):
    ranks.run("import torch, torch.distributed as dist\nt = torch.ones(2) * (rank + 1)")
    ranks.run("dist.all_reduce(t)")  # a collective on the tensor the first cell made
    assert [v.tolist() for v in ranks.get("t")] == [[3.0, 3.0], [3.0, 3.0]]
    assert ranks.get("rank, world_size, str(device)") == [(0, 2, "cpu"), (1, 2, "cpu")]
    ranks.put(scale=10)
    ranks.run("t = t * scale + rank")
    assert [v.tolist() for v in ranks.get("t")] == [[30.0, 30.0], [31.0, 31.0]]

    def on_each_rank(k):  # a notebook's function, run with the ranks' variables as its globals
        return float(t.sum()) * k  # noqa: F821 - t is the ranks'

    assert ranks.run(on_each_rank, 2) == [120.0, 124.0]


def test_output_is_shown_once_for_ranks_that_printed_the_same_else_per_rank(ranks, capsys):
    ranks.run("print('same on every rank')")
    assert capsys.readouterr().out == "[ranks 0, 1]\nsame on every rank\n"
    ranks.run("print('I am', rank)\nrank * 10")  # a last expression's value is shown, as in a notebook
    assert capsys.readouterr().out == "[rank 0]\nI am 0\n0\n[rank 1]\nI am 1\n10\n"
    ranks.run("if rank == 1:\n    print('only rank 1', end='')")  # no newline at the end, and silent rank 0
    out = capsys.readouterr().out
    assert out == "[rank 1]\nonly rank 1\n" and "\x00" not in out
    ranks.run("x = 1")  # nothing printed: nothing shown
    assert capsys.readouterr().out == ""


def test_a_cell_can_read_stdin_rebind_stdout_redraw_a_line_and_define_classes_that_pickle(ranks, capsys):
    ranks.run("try:\n    input()\nexcept EOFError:\n    print('end of file')")  # not the parent's commands
    assert capsys.readouterr().out == "[ranks 0, 1]\nend of file\n"
    ranks.run("import io, sys\nsys.stdout = io.StringIO()\nprint('kept aside')")  # the cell still ends
    ranks.run("sys.stdout = sys.__stdout__\nprint('back')")
    assert capsys.readouterr().out == "[ranks 0, 1]\nback\n"
    ranks.run("for i in range(3):\n    print(f'step {i}', end='\\r')\nprint('done')")  # a progress line
    assert capsys.readouterr().out == "[ranks 0, 1]\ndone\n"
    cell = (
        "import torch.distributed as dist\n"
        "class Point:\n    def __init__(self, r):\n        self.r = r\n"
        "points = [None, None]\n"
        "dist.all_gather_object(points, Point(rank))  # pickled by reference to this cell's class\n"
        "print([p.r for p in points])"
    )
    ranks.run(cell)
    assert capsys.readouterr().out == "[ranks 0, 1]\n[0, 1]\n"

    def scaled(x, *, by=3):
        return x * by

    assert ranks.run(scaled, 2) == [6, 6]


def test_a_collective_one_rank_issued_alone_is_found_after_the_cell_and_the_ranks_restart(ranks):
    ranks.run("import torch, torch.distributed as dist")
    cell = (
        "if rank == 0:\n"
        "    pending = dist.all_reduce(torch.ones(1), async_op=True)  # rank 1 never joins it\n"
        "raise ValueError('both ranks fail')"
    )
    with pytest.raises(LaunchError) as info:
        ranks.run(cell)
    message = str(info.value)
    assert "no longer agree on the collectives" in message and "restarted" in message, message
    assert re.search(r"rank 0 issued (\d+), rank 1 issued (\d+)", message), message
    counts = [int(c) for c in re.search(r"rank 0 issued (\d+), rank 1 issued (\d+)", message).groups()]
    assert counts[0] == counts[1] + 1, message  # rank 0 one ahead
    assert ranks.restarts == 1 and ranks.get("rank") == [0, 1]


def test_the_folded_output_groups_equal_ranks_and_renders_as_html():
    output = Output([[("stdout", "a")], [("stdout", "b")], [("stdout", "a")], [], [("stderr", "<w>")]])
    assert [ranks for ranks, _ in output.groups()] == [[0, 2], [1], [4]]  # silent rank 3 left out
    html = output._repr_html_()
    assert "ranks 0, 2" in html and "&lt;w&gt;" in html and "fsdp-guide-stderr" in html


def test_an_error_on_every_rank_is_reported_and_the_ranks_keep_their_state(ranks, capsys):
    ranks.run("kept = rank + 100")
    with pytest.raises(LaunchError, match=r"rank 0 raised ZeroDivisionError.*keep their state") as info:
        ranks.run("1 / 0")
    assert "ZeroDivisionError" in info.value.remote_traceback and "<cell" in info.value.remote_traceback
    assert "Traceback" in capsys.readouterr().out  # each rank's traceback, in the cell's output
    assert ranks.get("kept") == [100, 101] and ranks.restarts == 0


def test_an_error_on_one_rank_while_the_other_waits_in_a_collective_restarts_the_ranks_with_its_stack(ranks):
    ranks.run("import torch, torch.distributed as dist\nkept = 1")
    cell = "if rank == 0:\n    raise ValueError('only rank 0')\ndist.all_reduce(torch.ones(1))"
    with pytest.raises(LaunchError) as info:
        ranks.run(cell)
    message = str(info.value)
    assert "rank 0 raised ValueError: only rank 0" in message
    assert "did not end the cell" in message and "restarted" in message
    assert "[rank1]" in message and "all_reduce" in message and "line 3" in message  # where rank 1 waited
    assert ranks.restarts == 1
    with pytest.raises(LaunchError, match="NameError"):  # new ranks: nothing defined
        ranks.get("kept")
    ranks.run("import torch, torch.distributed as dist\ndist.all_reduce(torch.ones(1))")  # and usable


def test_a_cell_that_hangs_in_a_collective_ends_at_its_timeout_with_the_stack_and_new_ranks(ranks):
    ranks.run("import torch, torch.distributed as dist")
    with pytest.raises(LaunchError) as info:
        ranks.run("if rank == 0:\n    dist.all_reduce(torch.ones(1))  # rank 1 never joins", timeout=3)
    message = str(info.value)
    assert "did not finish within timeout=3 s on rank(s) 0" in message and "restarted" in message
    assert "[rank0]" in message and "all_reduce" in message and "line 2 in <module>" in message
    assert "[rank1]" not in message  # it ended its cell
    assert ranks.get("rank") == [0, 1]


def _interrupt_soon(seconds: float) -> threading.Timer:
    """Ctrl-C (SIGINT to this process, as a terminal or Jupyter's stop button sends it) after a moment."""
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    return timer


def test_an_interrupt_ends_the_cell_on_every_rank_and_keeps_the_state(ranks):
    ranks.run("import time\nkept = rank")
    _interrupt_soon(1.0)
    with pytest.raises(KeyboardInterrupt, match="interrupted on every rank; the ranks keep their state"):
        ranks.run("while True:\n    time.sleep(0.01)")
    assert ranks.get("kept") == [0, 1] and ranks.restarts == 0


def test_an_interrupt_while_a_rank_waits_in_a_collective_restarts_the_ranks(ranks, capsys):
    ranks.run("import time, torch, torch.distributed as dist")
    _interrupt_soon(1.0)
    with pytest.raises(KeyboardInterrupt, match="(?s)did not end the cell.*restarted") as info:
        ranks.run("if rank == 0:\n    while True:\n        time.sleep(0.01)\ndist.all_reduce(torch.ones(1))")
    assert "[rank1]" in str(info.value) and "all_reduce" in str(info.value)
    assert "live.py" not in capsys.readouterr().out  # rank 0's interrupted traceback: the cell's frames only
    assert ranks.restarts == 1 and ranks.get("rank") == [0, 1]


def test_an_interrupt_while_the_ranks_start_stops_them_and_says_so(tmp_path, monkeypatch):
    # Ranks that take a minute to start, whatever the machine's load: cold ones (no warm
    # server to fork from) whose interpreter sleeps as it starts (site imports sitecustomize).
    (tmp_path / "sitecustomize.py").write_text("import time\ntime.sleep(60)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("FSDP_GUIDE_WARM", "0")
    before = _children()

    def interrupt_once_both_run():  # not after a fixed time: once both ranks exist, asleep in their start
        deadline = time.monotonic() + 30
        while len(_children() - before) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_once_both_run, daemon=True).start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt, match=r"interrupted while the ranks started: 2 rank\(s\) stopped"):
        Ranks(world_size=2)
    assert time.monotonic() - started < 30  # ended by the interrupt, not by the ranks' start
    assert not _alive(_children() - before), "a starting rank was left running"


def test_live_ranks_start_cold_with_no_server_running_and_fork_from_one_a_launch_started(tmp_path):
    # In a fresh process: a server is started by launch only; live ranks use it once it runs.
    script = tmp_path / "notebook.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, psutil
            from fsdp_guide import launch
            from fsdp_guide._warm import server_pids
            from fsdp_guide.live import Ranks

            def parents(ranks):
                return {psutil.Process(pid).ppid() for pid in ranks.get("os.getpid()")}

            with Ranks(world_size=2) as ranks:
                ranks.run("import os")
                print("cold", parents(ranks) == {os.getpid()}, server_pids() == [])
            launch(os.getpid, world_size=2, output="none")
            with Ranks(world_size=2) as ranks:
                ranks.run("import os")
                print("warm", parents(ranks) == set(server_pids()[:1]), len(server_pids()) > 0)
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k not in ("FSDP_GUIDE_WARM", "FSDP_GUIDE_WARM_BROKER")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "cold True True" in done.stdout and "warm True True" in done.stdout, done.stdout + done.stderr


def test_closing_leaves_no_process_and_a_closed_session_says_so():
    before = _children()
    with Ranks(world_size=2) as ranks:
        pids = _children() - before
        assert len(pids) >= 2
        ranks.run("import torch")
    assert not _alive(pids)
    with pytest.raises(RuntimeError, match="closed.*restart"):
        ranks.run("1")
    ranks.restart()  # and they can start again
    assert ranks.get("rank") == [0, 1]
    ranks.close()


def test_the_ranks_end_when_the_process_that_started_them_is_killed(tmp_path):
    script = tmp_path / "notebook.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys, time
            from fsdp_guide.live import Ranks
            ranks = Ranks(world_size=2)
            print(" ".join(str(p.pid) for p in ranks._procs.procs), flush=True)
            time.sleep(600)
            """
        )
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    kernel = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pids = [int(p) for p in kernel.stdout.readline().split()]
        assert len(pids) == 2
        kernel.kill()  # as a kernel dies: no clean-up of its own
        kernel.wait()
        deadline = time.monotonic() + 20
        while _alive(pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pids), "a rank outlived the process that started it"
    finally:
        kernel.kill()


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: Ranks(world_size=0), "world_size must be an int >= 1"),
        (lambda: Ranks(timeout=-1), "timeout must be a finite number of seconds > 0"),
        (lambda: Ranks(backend="mpi"), "backend must be one of"),
    ],
)
def test_bad_options_are_refused_before_any_rank_starts(call, words):
    before = _children()
    with pytest.raises(ValueError, match=words):
        call()
    assert not _alive(_children() - before)


def test_bad_cells_and_calls_are_refused_on_this_side(ranks):
    with pytest.raises(SyntaxError):
        ranks.run("def broken(:")
    with pytest.raises(TypeError, match="a cell's code .* or a function"):
        ranks.run(42)
    with pytest.raises(TypeError, match="use put"):
        ranks.run("x", 1)
    with pytest.raises(ValueError, match="as keywords"):
        ranks.put()
    with pytest.raises(ValueError, match="as a string"):
        ranks.get("")
    with pytest.raises(LaunchError, match="NameError: name 'missing' is not defined"):
        ranks.get("missing")
    assert ranks.restarts == 0


def test_under_torchrun_ranks_refuses(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="already a rank"):
        Ranks(world_size=2)


NOTEBOOK = [
    "%load_ext fsdp_guide",
    "%%ranks -n 2\nimport torch, torch.distributed as dist\nt = torch.ones(2) * (rank + 1)\nprint('ready')",
    "%%ranks --return t\ndist.all_reduce(t)",
    "[v.tolist() for v in t]",
    "%%ranks\nprint('rank', rank)",
    "%%ranks -n 4\npass",
    "%%ranks\nundefined_name",
    "%ranks restart",
    "%torchrun --nproc-per-node 2 hello.py --greeting hi",
    "%ranks stop",
]
HELLO = """
import sys, torch.distributed as dist
dist.init_process_group("gloo")
print(sys.argv[1:], dist.get_rank(), dist.get_world_size())
# A collective before the group is torn down: init_process_group is no barrier, and a rank that
# destroys its group while its peer is still connecting fails that peer's init with "Gloo
# connectFullMesh failed ... Connection closed by peer" (fsdp_guide._rank.wait_for_every_rank;
# seen here once in CI). A torchrun script that makes no collective has the same race.
dist.barrier()
dist.destroy_process_group()
"""


def test_the_magics_in_a_notebook_kernel(tmp_path):
    import nbformat
    from nbclient import NotebookClient

    (tmp_path / "hello.py").write_text(HELLO)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in NOTEBOOK])
    env = {"PYTHONPATH": os.pathsep.join(sys.path)}
    client = NotebookClient(nb, timeout=120, allow_errors=True, resources={"metadata": {"path": str(tmp_path)}})
    with _kernel_env(env):
        client.execute()
    shown = [_shown(cell) for cell in nb.cells]
    assert shown[1] == ("[ranks 0, 1]\nready", None)  # the folded output, as a display
    assert shown[3] == ("[[3.0, 3.0], [3.0, 3.0]]", None)  # --return t: a list in the notebook, one per rank
    assert shown[4] == ("[rank 0]\nrank 0\n[rank 1]\nrank 1", None)
    assert "world size 2" in shown[5][1] and "%ranks restart -n 4" in shown[5][1]
    text, error = shown[6]
    assert "NameError" in text and error.startswith("LaunchError: rank 0 raised NameError")
    assert "File " not in error  # the error alone: the ranks' tracebacks are in the output
    assert "running, gloo on cpu" in shown[7][0]
    assert shown[8] == ("[rank0] ['--greeting', 'hi'] 0 2\n[rank1] ['--greeting', 'hi'] 1 2", None) or sorted(
        shown[8][0].splitlines()
    ) == ["[rank0] ['--greeting', 'hi'] 0 2", "[rank1] ['--greeting', 'hi'] 1 2"]


def _shown(cell) -> tuple[str, str | None]:
    """A cell's outputs as text (streams, displays, results), and its error as shown, if any."""
    text, error = [], None
    for out in cell.outputs:
        if out.output_type == "stream":
            text.append(out.text)
        elif out.output_type in ("display_data", "execute_result"):
            text.append(out.data["text/plain"] + "\n")
        elif out.output_type == "error":
            error = "\n".join(out.traceback)
    return "".join(text).strip(), error


@contextlib.contextmanager
def _kernel_env(env: dict):
    """The kernel nbclient starts inherits this process's environment: this package on its path."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_ranks_is_exported():
    assert fsdp_guide.Ranks is Ranks
