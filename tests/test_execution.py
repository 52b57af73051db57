"""docs/_ext/execution.py: pages executed a few at a time into a jupyter-cache, in real kernels."""

from __future__ import annotations

import fcntl
import json
import os
import re
import threading
import time

import execution  # docs/_ext, put on sys.path by conftest
import nbformat
import psutil
import pytest
from conftest import ROOT


def _overlap(a, b) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _cells(folder, name: str, *cells: tuple[bool, str]):
    """A page of code cells, (alone, body) each, that appends (name, cell, start, end) to cells.jsonl,
    and its kernel's start as cell -1 (from /proc: when the process began, on the same clock)."""
    source = f"""# %%
import json, os, time
ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])  # starttime, since boot
began = time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
with open("cells.jsonl", "a") as log:
    log.write(json.dumps([{name!r}, -1, began, began]) + "\\n")
"""
    for index, (alone, body) in enumerate(cells):
        source += f"""
# %%{' tags=["alone"]' if alone else ""}
start = time.time()
open("running-{name}-{index}", "w").close()
{body}
os.remove("running-{name}-{index}")
with open("cells.jsonl", "a") as log:
    log.write(json.dumps([{name!r}, {index}, start, time.time()]) + "\\n")
"""
    page = folder / f"{name}.py"
    page.write_text(source)
    return page


# A cell body that returns once a cell of another page is running (each cell marks itself
# running-<page>-<cell> while it runs), and fails after 120 s: a lock that kept the pages apart
# would never let it see one.
UNTIL_ANOTHER_PAGE_RUNS = """deadline = time.time() + 120
while not any(not p.name.startswith("running-{name}-") for p in __import__("pathlib").Path(".").glob("running-*")):
    assert time.time() < deadline, "no other page's cell ran beside this one"
    time.sleep(0.01)"""


def _cell_intervals(folder) -> dict[tuple[str, int], tuple[float, float]]:
    lines = (folder / "cells.jsonl").read_text().splitlines()
    return {(name, cell): (start, end) for name, cell, start, end in map(json.loads, lines)}


def _finished(folder) -> list[str]:
    """The pages whose first cell ran to its end, in the order they did."""
    return [name for name, cell in _cell_intervals(folder) if cell == 0]


# A deadlock in the machine's lock would leave threads that `with Execution` waits for at its end: after
# this long, pytest-timeout prints every thread's stack and ends the session instead of hanging.
HANG = pytest.mark.timeout(300, method="thread")


@HANG
def test_a_cell_tagged_alone_runs_while_no_other_page_runs_a_cell_or_starts_and_the_rest_of_its_page_does_not(tmp_path):
    waits = UNTIL_ANOTHER_PAGE_RUNS.format(name="measuring")
    measuring = _cells(tmp_path, "measuring", (False, waits), (True, "time.sleep(2)"), (False, waits))
    others = [
        _cells(tmp_path, name, (False, "time.sleep(1)"), (False, "time.sleep(1)"))
        for name in ("first", "second", "third", "fourth")
    ]
    with execution.Execution(tmp_path / "cache", workers=2) as run:
        futures = run.submit_all([measuring, *others])
    assert all(future.result().cells for future in futures.values())  # the with's end waited for them
    times = _cell_intervals(tmp_path)
    alone = times["measuring", 1]
    other_cells = {key: span for key, span in times.items() if key[0] != "measuring"}
    assert len(other_cells) == 4 * 3  # each page's kernel start and two cells
    assert not any(_overlap(alone, span) for key, span in other_cells.items() if key[1] >= 0)
    # A kernel's start is known to a clock tick (/proc's starttime): it began in [span[0], span[0] + tick). A
    # CI run had one at 1.2 ms before the alone cell's end, its first cell 0.57 s after: it began once the cell ended.
    tick = 1 / os.sysconf("SC_CLK_TCK")
    starts = [span[0] for key, span in other_cells.items() if key[1] == -1]
    assert not any(alone[0] < start and start + tick < alone[1] for start in starts)
    # the measuring page's other cells shared the machine: each ran beside another page's cell (each
    # waited until one ran: the other pages have cells left both before and after the alone cell)
    for cell in (0, 2):
        assert any(_overlap(times["measuring", cell], span) for key, span in other_cells.items() if key[1] >= 0)
    # and the ordinary pages ran two at a time
    assert any(
        _overlap(span, other)
        for (a, i), span in other_cells.items()
        for (b, j), other in other_cells.items()
        if a < b and i >= 0 and j >= 0
    )


def _until(condition, within: float = 120) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "waited 120 s"
        time.sleep(0.01)


@HANG
def test_an_alone_cell_waits_for_another_processs_work_and_that_processs_next_work_waits_for_it(tmp_path):
    # pytest-xdist's other worker, running a test (conftest.machine_share): a MachineLock with its own
    # open files, which flock(2) treats as another process's
    other = execution.MachineLock(tmp_path / "machine")
    page = _cells(tmp_path, "measuring", (False, "pass"), (True, "time.sleep(2)"))
    with execution.Execution(tmp_path / "cache", workers=1, machine_lock=tmp_path / "machine") as run:
        with other.share():
            future = run.submit(page)
            _until(lambda: (tmp_path / "cells.jsonl").exists() and ("measuring", 0) in _cell_intervals(tmp_path))
            time.sleep(1)  # an alone cell that did not wait would start now
            released = time.time()
        _until(lambda: (tmp_path / "running-measuring-1").exists())
        with other.share():  # its next test
            shared = time.time()
        future.result()
    alone = _cell_intervals(tmp_path)["measuring", 1]
    assert alone[0] >= released and shared >= alone[1]


def test_work_that_keeps_coming_cannot_keep_an_alone_cell_waiting(tmp_path):
    """flock(2) grants a shared lock while an exclusive one waits: the gate keeps later work out."""
    running, alone, later = (execution.MachineLock(tmp_path) for _ in range(3))
    order = []

    def take_alone():
        alone.take()
        order.append("alone")
        alone.give_back()

    def share_later():
        with later.share():
            order.append("later")

    with running.share():
        taker = threading.Thread(target=take_alone)
        taker.start()
        with open(tmp_path / "gate") as gate:  # held by the alone cell while it waits for the machine

            def gate_is_held() -> bool:
                try:
                    fcntl.flock(gate, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return True
                fcntl.flock(gate, fcntl.LOCK_UN)
                return False

            _until(gate_is_held)
        sharer = threading.Thread(target=share_later)
        sharer.start()
        time.sleep(0.5)  # without the gate, the later share would be granted now, beside the running one
        assert order == []
    taker.join(60), sharer.join(60)
    assert order == ["alone", "later"]


@HANG
def test_alone_cells_in_a_row_at_the_end_and_failing_neither_hang_nor_keep_the_machine(tmp_path):
    last = _cells(tmp_path, "last", (False, "pass"), (True, "time.sleep(0.5)"), (True, "time.sleep(0.5)"))
    failing = _cells(tmp_path, "failing", (True, "raise ValueError('an alone cell that fails')"))
    after = _cells(tmp_path, "after", (False, "time.sleep(0.5)"), (True, "pass"))
    for workers in (1, 2):
        with execution.Execution(tmp_path / f"cache-{workers}", workers=workers) as run:
            futures = run.submit_all([last, failing, after])
            assert futures[last].result().cells and futures[after].result().cells
            with pytest.raises(execution.PageFailed, match="an alone cell that fails"):
                futures[failing].result()
    times = _cell_intervals(tmp_path)
    assert times["last", 2][0] >= times["last", 1][1]


def test_a_page_in_the_cache_is_not_executed_again_and_a_failing_page_says_what_failed(tmp_path):
    page = _cells(tmp_path, "once", (False, "print('executed')"))
    failing = _cells(tmp_path, "failing", (False, "raise ValueError('the cell that fails')"))
    with execution.Execution(tmp_path / "cache") as run:
        assert run.submit(page).result().cells[1].outputs[0].text == "executed\n"
        with pytest.raises(execution.PageFailed, match="ValueError: the cell that fails"):
            run.submit(failing).result()
    with execution.Execution(tmp_path / "cache") as run:  # a new run over the same cache
        assert run.submit(page).result().cells[1].outputs[0].text == "executed\n"
    assert _finished(tmp_path) == ["once"]  # the second run took it from the cache


@HANG
def test_the_build_names_each_page_as_it_starts_and_ends_a_failure_at_once_and_its_kernels_talk_over_unix_sockets(
    tmp_path, capfd
):
    # The kernel's channels: Unix sockets. (ipykernel's own pipe for its subprocesses' output listens on 127.0.0.1.)
    transport = "from ipykernel.kernelapp import IPKernelApp\nprint(IPKernelApp.instance().transport)"
    ok = _cells(tmp_path, "ok", (False, transport))
    failing = _cells(tmp_path, "failing", (False, "raise ValueError('the cell that fails')"))
    lines = []
    with execution.Execution(tmp_path / "cache", workers=1, report=lines.append) as run:
        sockets = run._sockets
        futures = run.submit_all([failing, ok])
    assert futures[ok].result().cells[1].outputs[0].text == "ipc\n"
    assert not sockets.exists()  # the kernels' socket folder, removed at the end
    # the failure named before the next page ran
    assert lines[:3] == [
        "        failing: executing",
        "[ 1/2] failing: failed: ValueError: the cell that fails",
        "        ok: executing",
    ]
    assert re.fullmatch(r"\[ 2/2\] ok: executed in \d+\.\d s", lines[3]) and len(lines) == 4
    lines.clear()
    with execution.Execution(tmp_path / "cache", report=lines.append) as run:
        run.submit(ok).result()
    assert lines == ["[ 1/1] ok: from the cache"]
    assert "without encryption" not in capfd.readouterr().err  # jupyter_client's TCP transport warned once per kernel


@HANG
def test_the_pages_launches_share_one_warm_server_per_environment_and_it_ends_with_the_build(tmp_path):
    """A server per environment for the whole build (fsdp_guide._warm.ServerBroker), not one per kernel."""
    page = """# %%
import json, os, psutil
from fsdp_guide import launch

def server():  # a warm rank is a child of the server it was forked from
    return os.getppid()

servers = [launch(server, world_size=2, output="none")[0] for _ in range(2)]
os.environ["TORCH_FSDP_GUIDE_TEST"] = "other"  # another environment: another server
servers.append(launch(server, world_size=2, output="none")[0])
kernel = psutil.Process()
own = [p.pid for p in kernel.children(recursive=True) if "forkserver" in " ".join(p.cmdline())]
print(json.dumps([servers, own, kernel.pid]))
"""
    pages = [tmp_path / "a.py", tmp_path / "b.py"]
    for path in pages:
        path.write_text(page)
    with execution.Execution(tmp_path / "cache", workers=2) as run:
        broker = run._broker
        futures = run.submit_all(pages)
        results = [json.loads(futures[path].result().cells[0].outputs[0].text) for path in pages]
        assert broker.servers() == 2
    (a, a_own, a_kernel), (b, b_own, b_kernel) = results
    assert a[0] == a[1] == b[0] == b[1] and a[2] == b[2] != a[0]  # one server per environment, for both pages
    assert a_own == b_own == []  # neither kernel started a server of its own
    assert not {a[0], a[2]} & {a_kernel, b_kernel}
    for pid in (a[0], a[2]):
        assert not psutil.pid_exists(pid)  # ended, and reaped, with the build


@HANG
def test_a_warning_from_an_installed_package_shows_the_packages_path_not_the_build_machines(tmp_path):
    warns = (
        "import warnings, torch.distributed.fsdp.wrap as w\nwarnings.warn_explicit('x', FutureWarning, w.__file__, 9)"
    )
    page = _cells(tmp_path, "warns", (False, warns))
    with execution.Execution(tmp_path / "cache") as run:
        shown = "".join(output.get("text", "") for output in run.submit(page).result().cells[1].outputs)
    assert "torch/distributed/fsdp/wrap.py:9: FutureWarning: x" in shown
    assert not any(path in shown for path in execution.build_paths()), shown
    # a folder is cut where a path starts, not inside another path or a URL
    folder = execution.build_paths()[-1]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("", outputs=[
        nbformat.v4.new_output("stream", name="stdout", text=f"{folder}/a.py https://host{folder}/b.py x{folder}/c\n")
    ])])  # fmt: skip
    execution.without_build_paths(notebook)
    assert notebook.cells[0].outputs[0].text == f"a.py https://host{folder}/b.py x{folder}/c\n"


def test_the_pages_with_a_recorded_time_run_longest_first_after_those_without_one():
    pages = [ROOT / "tutorials" / f"{stem}.py" for stem in ("quickstart", "communication", "compile", "new_page")]
    order = execution.execution_order(pages, {"quickstart": 10.0, "communication": 20.0, "compile": 50.0})
    assert [page.stem for page in order] == ["new_page", "compile", "communication", "quickstart"]


def test_a_page_whose_kernel_dies_of_a_signal_fails_once_and_shows_where_each_thread_was(tmp_path, capfd):
    # The kernel process aborted as libzmq's assertion does (SIGABRT): the page is not executed
    # again, it fails naming itself, and faulthandler's stacks reach the build's stderr
    # (not the notebook's pipe, which a dead kernel no longer forwards).
    dies = _cells(
        tmp_path,
        "dies",
        (
            False,
            """open("attempts", "a").write("x")
import signal, threading
threading.Thread(target=time.sleep, args=(60,), name="a_thread_of_the_page", daemon=True).start()
def in_the_cell_that_aborts():
    os.kill(os.getpid(), signal.SIGABRT)
in_the_cell_that_aborts()""",
        ),
    )
    with execution.Execution(tmp_path / "cache") as run:
        with pytest.raises(execution.PageFailed, match=r"dies\.py: its kernel process died"):
            run.submit(dies).result()
    assert (tmp_path / "attempts").read_text() == "x"
    stderr = capfd.readouterr().err
    assert "Fatal Python error: Aborted" in stderr
    assert "in in_the_cell_that_aborts" in stderr and stderr.count("Thread 0x") >= 2  # every thread, the page's too


def test_a_page_whose_rendezvous_failed_in_gloo_fails_at_once_without_a_retry(tmp_path):
    # connectFullMesh's failure was retried until its cause was found and fixed (a rank
    # tearing its group down while a peer was still joining): a page that fails with it now
    # fails like any other, executed once.
    always = _cells(
        tmp_path,
        "always",
        (
            False,
            """open("attempts", "a").write("x")
raise RuntimeError("Gloo connectFullMesh failed with [pair.cc:553] Connection closed by peer")""",
        ),
    )
    with execution.Execution(tmp_path / "cache") as run:
        with pytest.raises(execution.PageFailed, match="connectFullMesh"):
            run.submit(always).result()
    assert (tmp_path / "attempts").read_text() == "x"


_INTERRUPTED_BUILD = """
import signal, sys, pathlib
# As in a terminal: a test run started in the background (nohup, `&`) ignores SIGINT, and its children inherit that.
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {ext!r})
import execution
pages = [pathlib.Path(p) for p in sys.argv[1:]]
try:
    with execution.Execution({cache!r}, workers=2) as run:
        futures = run.submit_all(pages)
except KeyboardInterrupt:
    print("interrupted:", sorted(p.name for p, f in futures.items() if f.cancelled()), flush=True)
    sys.exit(130)
"""

_RANKS_THAT_SLEEP = """# %%
import os
def mark(name, pid):  # written whole, then renamed: the test never reads half a pid
    open(name + ".tmp", "w").write(str(pid))
    os.replace(name + ".tmp", name)

mark("kernel-{name}", os.getpid())
from fsdp_guide import launch

def sleeper(folder):
    import os, time
    path = f"{{folder}}/rank-{name}-{{os.environ['RANK']}}"
    open(path + ".tmp", "w").write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    time.sleep(600)

launch(sleeper, os.getcwd(), world_size=2, output="none")
"""


@HANG
def test_ctrl_c_stops_the_running_pages_kernels_and_ranks_at_once_and_starts_no_other(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    import psutil

    pages = []
    for name in ("first", "second", "queued"):
        pages.append(tmp_path / f"{name}.py")
        pages[-1].write_text(_RANKS_THAT_SLEEP.format(name=name))
    script = _INTERRUPTED_BUILD.format(ext=str(ROOT / "docs" / "_ext"), cache=str(tmp_path / "cache"))
    build = subprocess.Popen(
        [sys.executable, "-c", script, *map(str, pages)], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        ranks = [tmp_path / f"rank-{name}-{rank}" for name in ("first", "second") for rank in (0, 1)]
        deadline = time.monotonic() + 180
        while not all(path.exists() for path in ranks):  # both pages' ranks are up, sleeping for 600 s
            assert time.monotonic() < deadline and build.poll() is None, build.stdout.read()
            time.sleep(0.1)
        pids = [int(path.read_text()) for path in ranks]
        pids += [int((tmp_path / f"kernel-{name}").read_text()) for name in ("first", "second")]
        build.send_signal(signal.SIGINT)  # as Ctrl-C in the terminal
        out, _ = build.communicate(timeout=120)  # not the 600 s the cells would take
    finally:
        build.kill()
    assert build.returncode == 130 and "interrupted: ['queued.py']" in out, out  # the third page never started
    assert not (tmp_path / "kernel-queued").exists()
    deadline = time.monotonic() + 30  # the ranks notice their kernel is gone (their stdin closes) and exit

    def running(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    while alive := [pid for pid in pids if running(pid)]:
        assert time.monotonic() < deadline, f"left running: {alive}"
        time.sleep(0.1)
