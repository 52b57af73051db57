"""Notebook cells on 2 ranks, tool against tool: the time a cell takes, to start, memory, listeners.

    nox -s bench_live [-- --cells 60 --record]      (or: python bench/live_cells.py, in an
                                                     environment with the three tools below)

Each tool runs in its own Jupyter kernel, driven by nbclient, the way its documentation says:

* ``%%ranks`` (this guide, :mod:`fsdp_guide.live`): ``%load_ext fsdp_guide``, ``%%ranks -n 2``;
  the process group is ready on each rank when the first cell runs.
* ``launch`` (this guide, warm): each cell launches fresh ranks (``launch(fn, world_size=2)``).
* jupyter-distributed 0.1.1: a Jupyter server extension that, when the notebook's process count
  is set, restarts the kernel as its proxy (``python -m jupyter_distributed.kernel``, with
  ``JUPYTER_DISTRIBUTED_WORLD_SIZE`` and the base kernel's name in its environment); the proxy
  starts one ipykernel per rank with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set.
  Here the kernel is launched with that same command and environment from a kernel spec
  (``coordinator.KernelLaunchAdapter.configure_proxy``), without the server: every tool is
  reached over the kernel's own ZMQ channels, none through a server's websocket. It creates no
  process group: a cell calls ``init_process_group("gloo")`` (``env://``, from those variables).
* ipyparallel 9.2.0 ``%%px``: ``ipp.Cluster(n=2).start_and_connect_sync(activate=True)``; each
  engine is given its rank (``scatter`` of the engine ids) and a cell initialises the group.
* nbdistributed 0.1.0: ``%load_ext nbdistributed``, ``%dist_init -n 2``; after that every cell
  runs on the workers, whose group the workers initialise themselves. Its workers are started
  as ``python`` from ``PATH`` (not the kernel's interpreter), so the kernel's ``PATH`` starts
  with this interpreter's folder. It is stopped by ending its processes here, not with
  ``%dist_shutdown``: that runs ``pkill -f worker.py``, ``pkill -9 -f 'python.*worker'`` and
  ``pkill -9 -f 'torch.*distributed'``, which end any matching process on the machine. Its
  first cell after ``%dist_init`` is sent at once, as nbclient runs a notebook: the workers
  have not connected yet, and the cell waits out its 30 s timeout.

Measured for each tool, in one run on one machine: the wall time of a cell, from nbclient's
request to the kernel's reply with its outputs, for ``--cells`` cells each doing one 2-rank
all-reduce of a fresh tensor, and as many empty cells (median and 90th percentile); the time to
start (the kernel's own start until it answers, which for jupyter-distributed includes
starting its rank kernels, then the set-up cells and the first all-reduce); the proportional set
size (PSS, shared pages split between the processes sharing them) of the processes the tool
started under the kernel, and how many, after the cells (for ``launch``, whose ranks end with
each cell, what stays between cells: its warm server and resource tracker); every address they and the kernel
listen on (TCP), with the command holding each one beyond loopback; and whether any of them is
left once the kernel is shut down (those are then ended here). A final cell prints each rank's
all-reduced value, which must be 2 on both ranks: a tool whose cells do not reach the ranks is
reported as failed, not timed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

CHECK = re.compile(r"allreduce-check (\d) ([-\d.]+)")


@dataclass
class Tool:
    name: str
    setup: list[str]  # cells that start the ranks and make the process group ready
    allreduce: str  # one 2-rank all-reduce of a fresh tensor, on every rank
    empty: str  # a cell that does nothing on every rank
    check: str  # prints "allreduce-check RANK VALUE" for each rank
    teardown: list[str] = field(default_factory=list)  # run (untimed) before the kernel shuts down
    kernel: str = "python3"
    version: str = ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tools() -> list[Tool]:
    on_each_rank = "print(f'allreduce-check {rank} {t.item()}')"
    return [
        Tool(
            "fsdp_guide %%ranks",
            ["%load_ext fsdp_guide", "%%ranks -n 2\nimport torch\nimport torch.distributed as dist"],
            "%%ranks\nt = torch.ones(1)\ndist.all_reduce(t)",
            "%%ranks\npass",
            f"%%ranks\n{on_each_rank}",
            ["%ranks stop"],
            version=_version("fsdp_guide"),
        ),
        Tool(
            "fsdp_guide launch (warm)",
            [
                "import torch\nimport torch.distributed as dist\nfrom fsdp_guide import launch\n\n\n"
                "def allreduce():\n    t = torch.ones(1)\n    dist.all_reduce(t)\n    return t.item()\n\n\n"
                "def nothing():\n    pass"
            ],
            "launch(allreduce, world_size=2)",
            "launch(nothing, world_size=2)",
            "for rank, value in enumerate(launch(allreduce, world_size=2)):\n"
            "    print(f'allreduce-check {rank} {value}')",
            version=_version("fsdp_guide"),
        ),
        Tool(
            "jupyter-distributed",
            ["import torch\nimport torch.distributed as dist\ndist.init_process_group('gloo')"],
            "t = torch.ones(1)\ndist.all_reduce(t)",
            "pass",
            "rank = dist.get_rank()\n" + on_each_rank,
            kernel="jupyter-distributed-2",
            version=_version("jupyter-distributed"),
        ),
        Tool(
            "ipyparallel %%px",
            [
                "import ipyparallel as ipp\ncluster = ipp.Cluster(n=2)\n"
                "rc = cluster.start_and_connect_sync(activate=True)",
                f"rc[:].scatter('rank', rc.ids, flatten=True)\nrc[:].push(dict(world_size=2, port={_free_port()}))",
                "%%px\nimport torch\nimport torch.distributed as dist\n"
                "dist.init_process_group(\n"
                "    'gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=world_size\n)",
            ],
            "%%px\nt = torch.ones(1)\ndist.all_reduce(t)",
            "%%px\npass",
            f"%%px\n{on_each_rank}",
            ["cluster.stop_cluster_sync()"],
            version=_version("ipyparallel"),
        ),
        Tool(
            "nbdistributed",
            ["%load_ext nbdistributed", "%dist_init -n 2"],
            "t = torch.ones(1)\ndist.all_reduce(t)",
            "pass",
            on_each_rank,
            version=_version("nbdistributed"),
        ),
    ]


def _version(distribution: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


def kernel_specs(folder: Path) -> None:
    """jupyter-distributed's proxy as a kernel spec: the command and environment its server
    extension gives a notebook's kernel when its process count is set to 2."""
    spec = folder / "kernels" / "jupyter-distributed-2"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "jupyter_distributed.kernel", "-f", "{connection_file}"],
                "display_name": "jupyter-distributed, 2 processes",
                "language": "python",
                "interrupt_mode": "message",
                "env": {
                    "JUPYTER_DISTRIBUTED_BASE_KERNEL": "python3",
                    "JUPYTER_DISTRIBUTED_WORLD_SIZE": "2",
                    "JUPYTER_DISTRIBUTED_REGISTRY_FILE": str(folder / "jupyter-distributed-registry.json"),
                },
            }
        )
    )


def _tree(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _pss_mib(processes: list) -> float:
    import psutil

    total = 0
    for p in processes:
        try:
            total += p.memory_full_info().pss
        except psutil.Error:
            pass
    return total / 2**20


def _listening(pids: set[int]) -> Counter:
    import psutil

    return Counter(
        c.laddr.ip for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.pid in pids
    )


def _wide(pids: set[int]) -> list[str]:
    """Each listener beyond loopback: its address and the command of the process that holds it."""
    import psutil

    found = []
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.pid in pids and c.laddr.ip not in ("127.0.0.1", "::1"):
            with contextlib.suppress(psutil.Error):
                command = re.sub(r"\S*/", "", " ".join(psutil.Process(c.pid).cmdline()))  # no paths of this machine
                found.append(f"[{c.laddr.ip}]:{c.laddr.port} held by {command[:100]}")
    return found


def _text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type == "error":
            parts.append(f"{out.ename}: {out.evalue}")
        elif "data" in out:
            parts.append(str(out.data.get("text/plain", "")) + str(out.data.get("text/html", "")))
    return "".join(parts)


def measure(tool: Tool, cells: int, timeout: float) -> dict:
    import nbformat
    import psutil
    from nbclient import NotebookClient

    result: dict = {"tool": tool.name, "version": tool.version}
    if not tool.version:
        return {**result, "failed": "not installed"}
    sources = [*tool.setup, tool.allreduce] + [tool.allreduce] * cells + [tool.empty] * cells + [tool.check]
    # nbclient keeps a cell's outputs at its index in the notebook: the teardown cells are in it too
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in [*sources, *tool.teardown]])
    client = NotebookClient(nb, timeout=timeout, kernel_name=tool.kernel, allow_errors=False)
    seconds: list[float] = []
    launched = time.perf_counter()
    with client.setup_kernel():
        # until the kernel answers: jupyter-distributed's proxy starts its rank kernels in this time
        result["kernel_s"] = time.perf_counter() - launched
        kernel = psutil.Process(client.km.provisioner.process.pid)
        try:
            for index, cell in enumerate(nb.cells[: len(sources)]):
                start = time.perf_counter()
                client.execute_cell(cell, index)
                seconds.append(time.perf_counter() - start)
        except Exception as e:  # a tool that cannot run here is reported with what failed
            done = len(seconds)
            return {
                **result,
                "failed": f"cell {done} ({sources[done].splitlines()[0]!r}): {type(e).__name__}: {e}"[:600],
            }
        finally:
            started = _tree(kernel.pid)
            result["processes"] = len(started)
            result["pss_mib"] = _pss_mib(started)
            result["listening"] = _listening({kernel.pid, *(p.pid for p in started)})
            result["wide"] = _wide({kernel.pid, *(p.pid for p in started)})
            for index in range(len(sources), len(nb.cells)):
                try:
                    client.execute_cell(nb.cells[index], index)
                except Exception as e:
                    result["teardown"] = f"{nb.cells[index].source!r}: {type(e).__name__}: {e}"[:300]
    # the kernel is shut down (nbclient's setup_kernel): what of the tool's is still running?
    deadline = time.monotonic() + 10

    def running(p) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:  # gone meanwhile
            return False

    while (left := [p for p in started if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    result["left_behind"] = len(left)
    for p in left:  # the kernel's own descendants (psutil checks the pid is still theirs): end them
        with contextlib.suppress(psutil.Error):
            p.kill()
    check = _text(nb.cells[len(sources) - 1])
    values = {int(r): float(v) for r, v in CHECK.findall(check)}
    if values != {0: 2.0, 1: 2.0}:
        return {**result, "failed": f"the all-reduce did not give 2 on both ranks: {values or check[:300]}"}
    setup = len(tool.setup) + 1
    result["setup_s"] = seconds[:setup]
    # what a set-up cell or the first all-reduce said went wrong (a cell may print an error and not raise)
    result["said"] = [
        line.strip()
        for cell in nb.cells[:setup]
        for line in _text(cell).splitlines()
        if re.search(r"error|timed? ?out|fail", line, re.IGNORECASE)
    ]
    allreduce, empty = seconds[setup : setup + cells], seconds[setup + cells : setup + 2 * cells]
    return {
        **result,
        "start_s": result["kernel_s"] + sum(seconds[:setup]),
        "allreduce_ms": (1e3 * statistics.median(allreduce), 1e3 * _p90(allreduce)),
        "empty_ms": (1e3 * statistics.median(empty), 1e3 * _p90(empty)),
    }


def _p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1]


def table(results: list[dict], cells: int) -> str:
    lines = [
        f"{'tool':<27} {'all-reduce cell ms':>19} {'empty cell ms':>14} {'start s':>8} {'procs':>6} "
        f"{'PSS MiB':>8} {'left':>5}  listening on",
        f"{'':<27} {'median / p90':>19} {'median / p90':>14}",
    ]
    for r in results:
        name = f"{r['tool']} {r['version']}".strip()
        if "failed" in r:
            lines.append(f"{name:<27} failed: {r['failed']}")
            if "processes" not in r:
                continue
        listening = ", ".join(f"{ip} x{n}" for ip, n in sorted(r.get("listening", {}).items())) or "nothing"
        timed = (
            f"{r['allreduce_ms'][0]:>9.1f} / {r['allreduce_ms'][1]:<7.1f} "
            f"{r['empty_ms'][0]:>6.1f} / {r['empty_ms'][1]:<5.1f} "
            f"{r['start_s']:>8.2f}"
            if "start_s" in r
            else f"{'':>19} {'':>14} {'':>8}"
        )
        lines.append(f"{name:<27} {timed} {r['processes']:>6} {r['pss_mib']:>8.0f} {r['left_behind']:>5}  {listening}")
        if "setup_s" in r:
            by_cell = " + ".join(f"{x:.2f}" for x in r["setup_s"])
            lines.append(f"{'':<27} start: kernel {r['kernel_s']:.2f} + cells {by_cell} s")
        for wide in r.get("wide", []):
            lines.append(f"{'':<27} listens {wide}")
        for said in r.get("said", []):
            lines.append(f"{'':<27} it said: {said[:150]}")
        if "teardown" in r:
            lines.append(f"{'':<27} teardown failed: {r['teardown']}")
    lines.append(
        f"{cells} cells of each kind per tool; ms: wall time of a cell from nbclient's request to the kernel's reply;"
        " start: the kernel's start, its set-up cells and the first all-reduce; procs, PSS: what the tool started"
        " under the kernel, ranks up; left: of those, still running 10 s after the kernel's shutdown"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cells", type=int, default=60, help="cells of each kind per tool (at least 50 for the record)"
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a cell may take before the tool is failed")
    parser.add_argument("--only", nargs="*", default=None, help="tools whose name contains one of these")
    parser.add_argument("--record", action="store_true", help="keep the printout in bench/results/live_cells.txt")
    options = parser.parse_args()
    from results import recorded

    with tempfile.TemporaryDirectory() as tmp:
        kernel_specs(Path(tmp))
        os.environ["JUPYTER_PATH"] = os.pathsep.join([tmp, os.environ.get("JUPYTER_PATH", "")])
        # nbdistributed starts its workers as `python`: the one beside this interpreter
        os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
        chosen = [t for t in tools() if options.only is None or any(o in t.name for o in options.only)]
        command = "python bench/live_cells.py " + " ".join(sys.argv[1:])
        results = []
        for tool in chosen:
            print(f"# {tool.name} ...", file=sys.stderr, flush=True)
            results.append(measure(tool, options.cells, options.timeout))
        if options.record:
            with recorded("live_cells", command.strip()):
                print(table(results, options.cells))
        else:
            print(table(results, options.cells))


if __name__ == "__main__":
    main()
