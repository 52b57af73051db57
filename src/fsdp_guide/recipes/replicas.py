"""The LLM recipe's GPT in replica groups joined by torchft: a group loses a rank, the others train on.

    python -m fsdp_guide.recipes.replicas --out DIR [--groups 2] [--kill-at 5] [--after-rejoin 10]

runs a torchft Lighthouse on 127.0.0.1 and ``--groups`` replica groups, each started by
its own ``torchrun --nproc-per-node=2 --max-restarts=1``: FSDP2 shards the model inside a
group, and torchft's fault-tolerant all-reduce averages the gradients across the groups
in each step's quorum (HSDP, with the replicate dimension made fault tolerant). In group
1's first attempt, rank 1 dies (SIGKILL) after step ``--kill-at`` (or its first step past it); torchrun restarts that
group alone, its workers join the next quorum and receive the step, weights, optimizer
state and schedule from a live group, over the process group, while the other groups go on
stepping (once the Lighthouse has dropped group 1: see the page).

Every worker appends one JSON line per step to ``DIR/group<G>-rank<R>.jsonl`` (see
``_log``) and saves its final shards to ``DIR/final-group<G>-rank<R>.pt``; each group's
output goes to ``DIR/group<G>.log``. The run ends at least ``--after-rejoin`` steps after
group 1 is back (the driver writes the last step to ``DIR/stop``). :func:`replay` computes, on 2
ranks, what the quorum of each step should have computed, for the page and the tests to
compare. Run the driver where only loopback exists (:func:`fsdp_guide.isolation.loopback_only`):
torchft's manager listens on every interface.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_guide.devices import backend
from fsdp_guide.devices import device as rank_device
from fsdp_guide.recipes.train_llm import TrainConfig, build_model, build_optimizer, compute_dtype
from fsdp_guide.tokens import TokenBatches

# The LLM tests' small GPT; the schedule spans MAX_STEPS, of which a run takes as many as it needs.
MAX_STEPS = 400
CONFIG = TrainConfig(
    n_layer=2,
    n_head=2,
    n_embd=32,
    block_size=32,
    batch_size=8,
    steps=MAX_STEPS,
    warmup=2,
    data="repeating",
    progress=False,
)
RANKS_PER_GROUP = 2


def batch(step: int, group: int, rank: int, groups: int, device: torch.device):
    """This rank's rows of step ``step``: each group its own rows of the step's global batch.

    A function of the step alone, so a group that rejoins at step N reads step N's rows:
    the data position is the step torchft hands it, not a state to recover.
    """
    rows = TokenBatches(
        None,
        batch_size=CONFIG.batch_size,
        block_size=CONFIG.block_size,
        seed=CONFIG.seed,
        simulated_size_in_batches=CONFIG.simulated_size_in_batches,
        rank=group * RANKS_PER_GROUP + rank,
        world_size=groups * RANKS_PER_GROUP,
    )
    rows.load_state_dict({"seed": CONFIG.seed, "position": step})
    return tuple(t.to(device) for t in next(rows))


def local_gradients(model, inputs, targets) -> float:
    """Forward and backward on this rank's rows; FSDP2 averages the gradients over the group's ranks."""
    _, loss = model(inputs, targets)
    loss.backward()
    return loss.item()


def apply(model, optimizer, scheduler) -> None:
    """The recipe's step on averaged gradients: clip over the global norm, AdamW, the schedule (no fp16 scaler)."""
    torch.nn.utils.clip_grad_norm_(model.parameters(), CONFIG.clip)
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


def _local(tree):
    """A state dict with each DTensor replaced by this rank's shard, which is what a peer's same rank holds."""
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_map

    return tree_map(lambda v: v.to_local() if isinstance(v, DTensor) else v, tree)


def recoverable_state(model, optimizer, scheduler):
    """The two functions torchft's Manager calls to send this group's state and to load a peer's."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.tensor import DTensor

    params = model.state_dict()  # each name's DTensor, a tied weight under both its names

    def state_dict() -> dict:
        model_state, optim_state = get_state_dict(model, optimizer)
        return {"model": _local(model_state), "optim": _local(optim_state), "scheduler": scheduler.state_dict()}

    def load_state_dict(state: dict) -> None:  # torchft calls it in should_commit, before the optimizer step
        def sharded(name, shard):  # the peer's shard of `name`, placed as this rank's parameter is
            p = params[name]
            return DTensor.from_local(
                shard, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False
            )

        optim = {
            "param_groups": state["optim"]["param_groups"],
            "state": {
                name: {k: sharded(name, v) if k != "step" else v for k, v in kept.items()}
                for name, kept in state["optim"]["state"].items()
            },
        }
        # the optimizer's load_state_dict creates AdamW's state from the peer's
        set_state_dict(
            model,
            optimizer,
            model_state_dict={n: sharded(n, t) for n, t in state["model"].items()},
            optim_state_dict=optim,
        )
        scheduler.load_state_dict(state["scheduler"])

    return state_dict, load_state_dict


def _stop_step(out: Path) -> int:
    stop = out / "stop"  # written whole, by a rename (run)
    return int(stop.read_text()) if stop.exists() else MAX_STEPS


def _log(out: Path, group: int, rank: int, **record) -> None:
    """One line per step: step, participants (groups in the quorum), participating (this group
    contributes; not while it heals), committed, loss, attempt (torchrun's restart count), time."""
    with open(out / f"group{group}-rank{rank}.jsonl", "a") as log:
        log.write(json.dumps({"group": group, "rank": rank, **record, "time": time.time()}) + "\n")


def _wait_for_every_worker(out: Path, groups: int, group: int, rank: int, timeout: float = 120) -> None:
    """Every group's first step waits until all the workers are up, so that the groups begin in one
    quorum: a group still starting (torchrun, imports, the model) on a busy machine joined a CI run's
    quorum at step 12, after the others had stepped past --kill-at alone. A restarted worker finds
    every file there and goes on."""
    (out / f"ready-group{group}-rank{rank}").touch()
    deadline = time.monotonic() + timeout
    while len(list(out.glob("ready-group*-rank*"))) < groups * RANKS_PER_GROUP:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"fsdp_guide.recipes.replicas: not every group's workers were up within {timeout:g} s "
                f"(ready files in {out}: {sorted(path.name for path in out.glob('ready-*'))})"
            )
        time.sleep(0.05)


def worker(out: Path, groups: int, kill_at: int, step_seconds: float) -> None:
    from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
    from torchft.checkpointing.pg_transport import PGTransport

    group, attempt = int(os.environ["REPLICA_GROUP"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    device = rank_device()
    dtype = compute_dtype(CONFIG.precision, device)
    if dtype == torch.float16:
        raise ValueError(
            "fsdp_guide.recipes.replicas: fp16 (a GPU without bf16) needs a gradient scaler, which this "
            "loop does not have; run it where the recipe computes in bf16 or fp32"
        )
    dist.init_process_group(backend())  # this group's ranks: FSDP2 shards over them
    rank = dist.get_rank()
    model = build_model(CONFIG, device, dtype)  # every group: the same weights
    optimizer, scheduler = build_optimizer(model, CONFIG)
    state_dict, load_state_dict = recoverable_state(model, optimizer, scheduler)

    timeout = timedelta(seconds=30)
    # across groups, on the backend used inside them; torchft reconfigures it for each quorum
    across = (ProcessGroupNCCL if backend() == "nccl" else ProcessGroupGloo)(timeout=timeout)
    manager = Manager(
        pg=across,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"group{group}",
        rank=rank,
        world_size=dist.get_world_size(),
        hostname="127.0.0.1",
        store_addr=os.environ["MASTER_ADDR"],
        store_port=int(os.environ["MASTER_PORT"]),
        lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"],
        init_sync=False,
        timeout=timeout,
        quorum_timeout=timeout,
        # the state to a rejoining group over the process group (HTTPTransport would serve it on every interface)
        checkpoint_transport=PGTransport(across, timeout=timeout, device=device),
    )
    _wait_for_every_worker(out, groups, group, rank)
    while manager.current_step() < _stop_step(out):
        started = time.monotonic()
        manager.start_quorum()
        manager.wait_quorum()  # a rejoining group learns the step here and receives the state (loaded in should_commit)
        step = manager.current_step()
        loss = local_gradients(model, *batch(step, group, rank, groups, device))
        # Summed over the groups that participate, then divided by their number; a group receiving
        # the state this step contributes zeros, and its own gradients are discarded.
        for work in [manager.allreduce(p.grad.to_local()) for p in model.parameters()]:
            work.wait()
        committed = manager.should_commit()  # this group's ranks agree; False after an error (a peer lost)
        if committed:
            apply(model, optimizer, scheduler)
        else:
            optimizer.zero_grad()
        # The quorum's id tells two quorums of one step apart (the Lighthouse numbers each new
        # membership); torchft 0.2 has no public accessor for it.
        _log(
            out,
            group,
            rank,
            step=step,
            quorum=manager._quorum_id,
            participants=manager.num_participants(),
            participating=manager.is_participating(),
            committed=committed,
            loss=loss,
            attempt=attempt,
        )
        if group == 1 and rank == 1 and attempt == 0 and step >= kill_at:  # >=: group 1 may join or heal past it
            os.kill(os.getpid(), signal.SIGKILL)  # as a crash: no exception, no goodbye to the quorum
        # A step of a real model takes a while: the tiny one's would race through hundreds while group 1 restarts.
        time.sleep(max(0.0, step_seconds - (time.monotonic() - started)))
    torch.save([p.to_local().cpu() for p in model.parameters()], out / f"final-group{group}-rank{rank}.pt")
    manager.shutdown(wait=False)
    dist.destroy_process_group()


def replay(quorums: dict[int, tuple[list[int], list[int]]], groups: int) -> list[torch.Tensor]:
    """What the quorums computed, on 2 ranks without torchft; returns this rank's final shards.

    ``quorums`` maps each step to the groups whose gradients its quorum averaged, and those
    receiving the state (:func:`quorums`). Each averaged group's rows are run in turn, their
    gradients summed by FSDP's accumulation, divided by their count, then applied: the
    arithmetic of torchft's all-reduce (a sum, then ``/ num_participants``). With 2 groups
    the sums are the same bit for bit (a + b is b + a); with more, gloo may add in another order.
    """
    device, rank = rank_device(), dist.get_rank()
    model = build_model(CONFIG, device, compute_dtype(CONFIG.precision, device))
    optimizer, scheduler = build_optimizer(model, CONFIG)
    for step, (averaged, _) in sorted(quorums.items()):
        for group in averaged:
            local_gradients(model, *batch(step, group, rank, groups, device))
        for p in model.parameters():
            p.grad.to_local().div_(len(averaged))
        apply(model, optimizer, scheduler)
    return [p.to_local().cpu() for p in model.parameters()]


def read_logs(out: Path) -> dict[tuple[int, int], list[dict]]:
    """(group, rank) -> that worker's steps, in order, across attempts (a line still being written is left out)."""
    logs = {}
    for path in Path(out).glob("group*-rank*.jsonl"):
        group, rank = map(int, re.fullmatch(r"group(\d+)-rank(\d+)", path.stem).groups())
        text = path.read_text()
        logs[(group, rank)] = [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]
    return dict(sorted(logs.items()))


def quorums(logs: dict) -> dict[int, tuple[list[int], list[int]]]:
    """Step -> (the groups whose gradients were averaged, the groups receiving the state) in
    the quorum that made that step of the final weights, from each group's rank 0.

    Followed back from group 0's last step through each quorum it was in (the groups that
    committed that step under that quorum id), and where it received the state, on through
    the group that sent it. A quorum can form without a group whose heartbeat the Lighthouse
    has not seen for ``heartbeat_timeout_ms``, so two quorums may compute the same step; the
    group whose copy is dropped receives the other's state later, and its own step is not
    in the final weights. Raises where groups averaged a step after computing the previous
    one in different quorums (their weights differ, which torchft does not check), or where
    the quorum's divisor was not the number of groups it averaged.
    """
    committed = {
        group: [line for line in lines if line["committed"]]
        for (group, rank), lines in sorted(logs.items())
        if rank == 0
    }

    def members(line: dict) -> dict[int, int]:  # group -> index of its line, for each group in line's quorum
        return {
            group: i
            for group, lines in committed.items()
            for i, other in enumerate(lines)
            if (other["step"], other["quorum"]) == (line["step"], line["quorum"])
        }

    found, group, at = {}, 0, len(committed[0]) - 1
    while at >= 0:
        step = committed[group][at]["step"]
        quorum = members(committed[group][at])
        averaged = sorted(g for g, i in quorum.items() if committed[g][i]["participating"])
        found[step] = (averaged, sorted(set(quorum) - set(averaged)))
        divisors = {committed[g][i]["participants"] for g, i in quorum.items()}
        if divisors != {len(averaged)}:  # torchft's divisor: the replay divides by len(averaged)
            raise ValueError(
                f"step {step}: groups {averaged} averaged their gradients, but the quorum divided "
                f"by {sorted(divisors)}: the replay cannot reproduce it"
            )
        if not averaged or step == 0:
            break
        before = {
            (committed[g][i - 1]["step"], committed[g][i - 1]["quorum"]) if i else None
            for g, i in quorum.items()
            if g in averaged
        }
        if len(before) != 1 or None in before or next(iter(before))[0] != step - 1:
            raise ValueError(
                f"step {step}: groups {averaged} averaged their gradients without having computed "
                f"step {step - 1} in one quorum ({sorted(before, key=str)}): their weights differ, "
                "which torchft does not check"
            )
        group = averaged[0]  # the group itself, or the one whose state it received
        at = quorum[group] - 1
    if min(found) != 0 or len(found) != max(found) + 1:
        raise ValueError(f"the final weights' steps {sorted(found)} do not go back to step 0 without a gap")
    return dict(sorted(found.items()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _back_for(logs: dict, steps: int) -> bool:
    return sum(1 for line in logs.get((1, 0), []) if line["attempt"] == 1 and line["committed"]) >= steps


def run(
    out: Path,
    groups: int = 2,
    kill_at: int = 5,
    after_rejoin: int = 10,
    rejoin_after: float = 0.0,
    step_seconds: float = 0.1,
    timeout: float = 240,
) -> None:
    """The driver: a Lighthouse, ``groups`` torchrun jobs, and the stop once group 1 is back ``after_rejoin`` steps."""
    from torchft.coordination import LighthouseServer

    from fsdp_guide.launcher import _threads_per_rank

    out = Path(out)
    # A replica that stops heartbeating for a second leaves the next quorum: the others go on without it.
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=500, heartbeat_timeout_ms=1000)
    jobs = []
    try:
        for group in range(groups):
            env = {
                **os.environ,
                "REPLICA_GROUP": str(group),
                "GLOO_SOCKET_IFNAME": "lo",
                "REJOIN_AFTER": str(rejoin_after),
                # the threads launch(world_size=2) gives a rank: replay's arithmetic, bit for bit
                "OMP_NUM_THREADS": str(_threads_per_rank(RANKS_PER_GROUP)),
                # its address as a number: the lighthouse advertises the host's name
                "TORCHFT_LIGHTHOUSE": "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1],
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",  # a store per attempt (fsdp_guide.launcher._restart_hazard)
            }
            if torch.cuda.is_available():  # each group its own GPUs: both groups' local rank 0 would pick the first
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(group * RANKS_PER_GROUP + r) for r in range(RANKS_PER_GROUP))
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nproc-per-node={RANKS_PER_GROUP}",
                "--max-restarts=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
                "--local-addr=127.0.0.1",
                "-m",
                "fsdp_guide.recipes.replicas",
                "--worker",
                "--out",
                str(out),
                "--groups",
                str(groups),
                "--kill-at",
                str(kill_at),
                "--step-seconds",
                str(step_seconds),
            ]
            # To a file, not a pipe: torchft logs every step, and an unread pipe fills and blocks the group.
            with open(out / f"group{group}.log", "w") as log:
                jobs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        while not (out / "stop").exists():
            if time.monotonic() > deadline or any(job.poll() is not None for job in jobs):
                raise RuntimeError(
                    f"the replica groups did not get group 1 back within {timeout} s, or one ended "
                    f"early (exit codes {[job.poll() for job in jobs]}): see {out}/group*.log"
                )
            logs = read_logs(out)
            if _back_for(logs, after_rejoin):
                last = max(line["step"] for lines in logs.values() for line in lines)
                # Well ahead of every rank (none is more than a step past the logs), so each stops at the same
                # step; written whole, then renamed, so that no worker reads half of it.
                (out / "stop.tmp").write_text(str(last + 5))
                os.replace(out / "stop.tmp", out / "stop")
            time.sleep(0.2)
        for group, job in enumerate(jobs):
            try:
                code = job.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired as still_running:
                log = f"{out}/group{group}.log"
                raise RuntimeError(
                    f"replica group {group} still running after {timeout} s: see {log}"
                ) from still_running
            if code != 0:
                raise RuntimeError(f"replica group {group} exited with {code}: see {out}/group{group}.log")
        ends = {key: lines[-1]["step"] for key, lines in read_logs(out).items()}
        if len(set(ends.values())) != 1:
            raise RuntimeError(f"the workers stopped at different steps: {ends}")
    finally:
        for job in jobs:  # torchrun stops its workers on SIGTERM (they are in sessions of their own: not on SIGKILL)
            if job.poll() is None:
                job.terminate()
                try:
                    job.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    job.kill()
                    job.wait()
        lighthouse.shutdown()


# The files a run writes into --out (worker, _wait_for_every_worker, run): another run's would mix with them.
_RUN_FILES = re.compile(
    r"group\d+(\.log|-rank\d+\.jsonl)|final-group\d+-rank\d+\.pt|ready-group\d+-rank\d+|stop(\.tmp)?"
)


def _previous_run(out: Path) -> list[str]:
    return sorted(path.name for path in out.iterdir() if _RUN_FILES.fullmatch(path.name))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out", required=True, type=Path, help="an existing directory for the logs, holding no previous run"
    )
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=5, help="group 1's rank 1 dies after this step")
    parser.add_argument("--after-rejoin", type=int, default=10, help="steps to run once group 1 is back")
    parser.add_argument("--rejoin-after", type=float, default=0.0, help="seconds group 1's restart waits")
    parser.add_argument("--step-seconds", type=float, default=0.1, help="the least time a step takes")
    parser.add_argument("--timeout", type=float, default=240, help="seconds the whole run may take")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # torchrun's workers
    args = parser.parse_args(argv)
    if not args.out.is_dir():
        parser.error(f"--out {args.out}: not a directory; create it first")
    if args.groups < 2 or not 0 <= args.kill_at < MAX_STEPS:
        parser.error(f"expected --groups 2 or more and --kill-at 0 to {MAX_STEPS - 1}")
    # written so that NaN fails each too
    if args.after_rejoin < 1 or not (
        0 <= args.rejoin_after < math.inf and 0 <= args.step_seconds < math.inf and 0 < args.timeout < math.inf
    ):
        parser.error(
            f"expected --after-rejoin 1 or more (got {args.after_rejoin}), --rejoin-after and --step-seconds "
            f"0 or more, finite (got {args.rejoin_after:g}, {args.step_seconds:g}), --timeout above 0, finite "
            f"(got {args.timeout:g})"
        )
    if not args.worker and (previous := _previous_run(args.out)):
        parser.error(
            f"--out {args.out} holds a previous run's files ({', '.join(previous[:3])}"
            f"{', ...' if len(previous) > 3 else ''}): the two would mix; pass an empty directory"
        )
    if interfaces := sorted({name for _, name in socket.if_nameindex()} - {"lo"}):
        parser.error(
            f"interfaces other than loopback exist ({', '.join(interfaces)}), and torchft's manager listens "
            "on every interface: run it where only lo exists, e.g. in a network namespace of its own, "
            "fsdp_guide.isolation.loopback_only([sys.executable, '-m', 'fsdp_guide.recipes.replicas', ...])"
        )
    if args.worker:
        if os.environ["TORCHELASTIC_RESTART_COUNT"] != "0":
            time.sleep(float(os.environ["REJOIN_AFTER"]))  # a slow restart: a new node, a long import
        return worker(args.out, args.groups, args.kill_at, args.step_seconds)
    run(args.out, args.groups, args.kill_at, args.after_rejoin, args.rejoin_after, args.step_seconds, args.timeout)


if __name__ == "__main__":
    main()
