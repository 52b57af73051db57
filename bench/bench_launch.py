"""How fast ranks start (the site's build speed: bench_site.py).

Prints, from one run (each timing the median of --repeat runs):
- warm launches: inside one process, the first `launch` (which starts the pre-imported
  server and waits for its imports) and the next ones (ranks forked from it), from call
  to return, against `FSDP_GUIDE_WARM=0` (every launch cold). The goal is on the first
  two launches together, what any notebook page makes: the first alone waits for the
  server, which imports FSDP, DTensor, DCP and dynamo besides what this test's cold ranks import;
- warm launches of a model built on the meta device, with torch._dynamo preloaded by the
  server (the default) and not: torch imports dynamo at the first op on the meta device;
- the latency of 2 ranks doing one all-reduce, as a whole process, for
  `fsdp_guide.launch`, `torchrun --nproc-per-node=2`, a bare
  `torch.multiprocessing.spawn` script, and the floor: two
  `python -c "import torch.distributed"` in parallel (what any launcher pays).

Run it in the pinned environment: `nox -s bench` (or `python bench/bench_launch.py`
with the package installed). Every variant runs in a network namespace of its own
with only loopback, as torchrun's store would otherwise listen on every interface.
The printout is kept in bench/results/launch.txt, with the machine it ran on.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
from isolation import loopback_only  # noqa: E402
from results import recorded  # noqa: E402

WORK = """
import torch, torch.distributed as dist

def all_reduce_once():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()
"""

SCRIPTS = {
    # The parent of a launch needs no torch: the worker imports it, on each rank.
    "launch": textwrap.dedent(
        """
        from fsdp_guide import launch

        def all_reduce_once():
            import torch, torch.distributed as dist
            t = torch.ones(1)
            dist.all_reduce(t)
            return t.item()

        if __name__ == "__main__":
            assert launch(all_reduce_once, world_size=2, output="none") == [2.0, 2.0]
        """
    ),
    "torchrun": WORK
    + textwrap.dedent(
        """
        dist.init_process_group("gloo")
        assert all_reduce_once() == 2.0
        dist.destroy_process_group()
        """
    ),
    "mp.spawn": WORK
    + textwrap.dedent(
        """
        import os
        import torch.multiprocessing as mp

        def worker(rank):
            dist.init_process_group("gloo", rank=rank, world_size=2)
            assert all_reduce_once() == 2.0
            dist.destroy_process_group()

        if __name__ == "__main__":
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
            mp.spawn(worker, nprocs=2)
        """
    ),
}


def commands(tmp: Path) -> dict[str, list[str]]:
    for name, source in SCRIPTS.items():
        (tmp / f"{name}.py").write_text(source)
    py = sys.executable
    floor = f'{py} -c "import torch.distributed" & {py} -c "import torch.distributed" & wait'
    return {
        "floor (2 x import torch.distributed)": ["sh", "-c", floor],
        "fsdp_guide.launch": [py, str(tmp / "launch.py")],
        "torchrun --nproc-per-node=2": [
            py,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            "--master-addr=127.0.0.1",
            "--master-port=29522",
            str(tmp / "torchrun.py"),
        ],
        "torch.multiprocessing.spawn": [py, str(tmp / "mp.spawn.py")],
    }


def seconds(argv: list[str], cwd: Path | None = None) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True, cwd=cwd)
    return time.perf_counter() - start


def bench_launchers(repeat: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cmds = {name: loopback_only(argv) for name, argv in commands(tmp).items()}
        times = {name: [] for name in cmds}
        for _ in range(repeat):  # interleaved, so drift affects every variant alike
            for name, argv in cmds.items():
                times[name].append(seconds(argv, cwd=tmp))
    median = {name: statistics.median(ts) for name, ts in times.items()}
    floor, ours, torchrun = (
        median[n] for n in ("floor (2 x import torch.distributed)", "fsdp_guide.launch", "torchrun --nproc-per-node=2")
    )
    print(f"\n2 ranks, one all-reduce, whole process (median of {repeat}):")
    print(f"{'':38} {'seconds':>8} {'x floor':>8}")
    for name, t in median.items():
        print(f"{name:38} {t:8.2f} {t / floor:8.2f}")
    print(f"launch / floor = {ours / floor:.2f} (goal <= 1.2); launch / torchrun = {ours / torchrun:.2f} (goal <= 0.6)")


WARM = textwrap.dedent(
    """
    import json, os, statistics, sys, time
    from fsdp_guide import _warm, launch

    def all_reduce_once():
        import torch, torch.distributed as dist
        t = torch.ones(1)
        dist.all_reduce(t)
        return t.item()

    def build_on_meta_and_step():  # what FSDP2 code does first: the meta op, or fully_shard, imports dynamo
        import sys
        import torch
        from torch.distributed.fsdp import fully_shard
        import fsdp_guide
        imported_before = "torch._dynamo" in sys.modules
        with torch.device("meta"):
            model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
        fully_shard(model[0]), fully_shard(model[2]), fully_shard(model)
        model.to_empty(device=fsdp_guide.device())
        model.apply(lambda m: m.reset_parameters() if isinstance(m, torch.nn.Linear) else None)
        model(torch.ones(8, 64, device=fsdp_guide.device())).sum().backward()
        return imported_before

    if __name__ == "__main__":
        work, preload_dynamo = sys.argv[2], sys.argv[3] == "1"
        if not preload_dynamo:
            _warm.PRELOAD.remove("torch._dynamo")
        times, preloaded = [], []
        for _ in range(int(sys.argv[1])):
            start = time.perf_counter()
            result = launch(globals()[work], world_size=2, output="none")
            times.append(time.perf_counter() - start)
            preloaded.append(result[0])
        assert work != "build_on_meta_and_step" or preloaded == [preload_dynamo] * len(times)
        print(json.dumps({"first": times[0], "next": statistics.median(times[1:])}))
    """
)


def _warm_times(tmp: str, repeat: int, work: str, warm: str = "1", preload_dynamo: str = "1") -> dict:
    import json
    import os

    script = Path(tmp) / "warm.py"
    script.write_text(WARM)
    out = subprocess.run(
        loopback_only([sys.executable, str(script), str(repeat + 1), work, preload_dynamo]),
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp,
        env={**os.environ, "FSDP_GUIDE_WARM": warm},
    )
    return json.loads(out.stdout.splitlines()[-1])


def bench_warm(repeat: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = {
            name: _warm_times(tmp, repeat, "all_reduce_once", warm)
            for name, warm in (("warm (the default)", "1"), ("cold (FSDP_GUIDE_WARM=0)", "0"))
        }
        meta = {
            name: _warm_times(tmp, repeat, "build_on_meta_and_step", preload_dynamo=dynamo)
            for name, dynamo in (("dynamo preloaded (the default)", "1"), ("dynamo not preloaded", "0"))
        }
    print(f"\nlaunch inside one process, 2 ranks, one all-reduce, call to return (next: median of {repeat}):")
    print(f"{'':28} {'first':>8} {'next':>8}")
    for name, r in results.items():
        print(f"{name:28} {r['first']:8.2f} {r['next']:8.2f}")
    warm, cold = results["warm (the default)"], results["cold (FSDP_GUIDE_WARM=0)"]
    two = (warm["first"] + warm["next"]) / (cold["first"] + cold["next"])
    print(
        f"warm next launch: {warm['next']:.2f} s (goal <= 0.3); warm first / cold first = "
        f"{warm['first'] / cold['first']:.2f}; first two launches, warm / cold = {two:.2f} (goal: no slower)"
    )
    print(f"\nwarm launches of a 3-layer model built on the meta device, sharded, one step (next: median of {repeat}):")
    print(f"{'':32} {'first':>8} {'next':>8}")
    for name, r in meta.items():
        print(f"{name:32} {r['first']:8.2f} {r['next']:8.2f}")
    on, off = meta["dynamo preloaded (the default)"], meta["dynamo not preloaded"]
    saved, cost = off["next"] - on["next"], on["first"] - off["first"]
    print(
        f"preloading dynamo: each next launch {saved:.2f} s faster, the first {cost:.2f} s slower "
        f"(repaid by the second launch: {cost < saved})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs of each launcher variant (median reported)")
    args = parser.parse_args()
    with recorded("launch", f"python bench/bench_launch.py --repeat {args.repeat}"):
        bench_warm(args.repeat)
        bench_launchers(args.repeat)


if __name__ == "__main__":
    main()
