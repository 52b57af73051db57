# ---
# jupyter:
#   jupytext:
#     notebook_metadata_filter: -jupytext.text_representation.jupytext_version,-jupytext.text_representation.format_version
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# (tutorial-rank-dies)=
# # When a rank dies
#
# **What you will learn**
#
# - what `torchrun --max-restarts` does when a rank is killed: every worker stopped and
#   started again, resuming from the newest complete checkpoint (`--resume auto`), and
#   ending bit for bit where a run that was never interrupted ends, whether the rank died
#   between checkpoints or in the middle of one;
# - what such a failure costs (the steps done again and the restart), measured, and how
#   often to save for a given failure rate (Young's and Daly's interval, with this page's
#   own save cost in it);
# - how torchft keeps training through the same failure instead: replica groups of the
#   same model, FSDP2 inside each, a quorum that shrinks when a group dies and grows back
#   when it restarts, and the restarted group taking its weights and optimizer state from
#   a live peer, not from disk;
# - what each guarantees, what each costs and what each needs from the training script.
#
# **What you need**: Linux with `unshare` (util-linux; as root, or with unprivileged user
# namespaces) and `torchft`, which the test and docs environments install. torchrun's rendezvous store and torchft's manager listen on
# every interface, so the page runs them in a network namespace of their own where only
# loopback exists ({func}`fsdp_guide.isolation.loopback_only`); on a cluster they run as
# they are. 2 to 4 processes on gloo at a time; about 50 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The training code is written to run unchanged with
# one GPU per rank (NCCL inside a group, torchft's NCCL group across groups, each group on
# GPUs of its own): each rank's device is {func}`fsdp_guide.device`'s. The tips it demonstrates are listed {ref}`at the end <rank-dies-tips>`.

# %%
import sys
from importlib.metadata import version

import torch

print(f"torch {torch.__version__}, torchft {version('torchft')}, Python {sys.version.split()[0]}")

# %% [markdown]
# ## The run a failure must not change
#
# The model is the {ref}`LLM recipe <tutorial-llm>`'s GPT, made small (2 blocks of width
# 32), trained for 12 steps on 2 ranks and saved every 2 steps. This run is never
# interrupted: the runs below, which lose a rank, must end exactly where it ends.

# %%
import json
import os
import subprocess
import tempfile
from pathlib import Path

from fsdp_guide import launch
from fsdp_guide.recipes.train_llm import TrainConfig, train

workdir = Path(tempfile.mkdtemp(prefix="rank-dies-"))
STEPS = 12
SMALL = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=4, warmup=2)
straight = launch(
    train,
    TrainConfig(
        steps=STEPS,
        **SMALL,
        log_every=STEPS,
        progress=False,
        checkpoint_dir=str(workdir / "straight"),
        checkpoint_every=2,
    ),
    world_size=2,
    output="none",
)[0]
# saves included
run_seconds = STEPS * SMALL["batch_size"] * SMALL["block_size"] / straight["tokens_per_s"]
save_seconds = sum(straight["save_stall_s"]) / len(straight["save_stall_s"])
step_seconds = (run_seconds - sum(straight["save_stall_s"])) / STEPS
print(
    f"{STEPS} steps, final loss {straight['losses'][-1]:.4f}; a step {step_seconds * 1000:.0f} ms, "
    f"a save {save_seconds * 1000:.0f} ms on average ({len(straight['save_stall_s'])} saves)"
)

# %% [markdown]
# (rank-dies-torchrun)=
# ## torchrun restarts every worker
#
# `torchrun --max-restarts=1` watches its workers; when one dies it stops the others and
# starts them all again, once. The restarted workers run the same command, so the command
# must do the right thing on a first start and on a restart alike: `--resume auto`
# resumes from the newest complete checkpoint in `--checkpoint-dir` when there is one, and
# starts at step 1 when there is none. Here rank 1 is killed with SIGKILL (no exception, no
# clean-up: as the kernel's OOM killer ends a process) by
# `fsdp_guide.recipes.killed_rank`, which wraps the recipe and kills in the first attempt
# only: once after step 7 with a checkpoint every 2 steps, and once in the middle of
# writing step 12's checkpoint with a checkpoint every 6 steps.

# %%
import re

from fsdp_guide.isolation import loopback_only

RECIPE_FLAGS = [
    "--steps",
    str(STEPS),
    "--n-layer",
    "2",
    "--n-head",
    "2",
    "--n-embd",
    "32",
    "--block-size",
    "32",
    "--batch-size",
    "4",
    "--warmup",
    "2",
    "--log-every",
    str(STEPS),
    "--no-progress",
]


def torchrun_with_a_killed_rank(name: str, every: int, how: str, at: int) -> dict:
    """The recipe under ``torchrun --max-restarts=1``, rank 1 killed once; its log, summary and checkpoints."""
    directory = workdir / name
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "-m",
        "fsdp_guide.recipes.killed_rank",
        how,
        str(at),
        *RECIPE_FLAGS,
        "--checkpoint-dir",
        str(directory),
        "--checkpoint-every",
        str(every),
        "--resume",
        "auto",
        "--out",
        str(workdir / f"{name}.json"),
    ]
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        # the workers' store, new for each attempt: on a shared one a restarted rank can read a dead rank's address
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        # the threads launch gave each rank above: the same arithmetic, so the runs can be compared bit for bit
        "OMP_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) // 2)),
    }
    done = subprocess.run(
        loopback_only(command), capture_output=True, text=True, timeout=180, env=env
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    return {
        "log": done.stdout + done.stderr,
        "summary": json.loads((workdir / f"{name}.json").read_text()),
        "checkpoints": directory,
        "every": every,
        "computed": at,
    }


restarted = {
    "killed after step 7": torchrun_with_a_killed_rank("after-step", 2, "--kill-after-step", 7),
    "killed saving step 12": torchrun_with_a_killed_rank(
        "while-saving", 6, "--kill-while-saving", 12
    ),
}
for name, run in restarted.items():
    print(
        f"--- {name}, a checkpoint every {run['every']} steps: what torchrun and the recipe printed"
    )
    # Shown without what changes from run to run: the folder (relative to this run's own), the
    # clock's time (the restart time is computed from it below) and the process ids.
    for line in run["log"].replace(f"{workdir}/", "").splitlines():
        if line.startswith("[killed_rank]"):
            print(re.sub(r" at [\d.]+$", "", line))
        elif any(key in line for key in ("--resume auto", "resumed from")):
            print(line)
        elif said := re.search(
            r"Sending process \d+ closing signal \w+|failed \(exitcode: -?\d+\) local_rank: \d+",
            line,
        ):
            # its agent's log (stderr, printed after the ranks' stdout)
            print("torchrun:", re.sub(r"process \d+", "process (its pid)", said[0]))

# %% [markdown]
# The first attempt found no checkpoint and started at step 1; rank 1 died (torchrun saw
# exit code -9, SIGKILL); torchrun stopped rank 0 (the closing signal) and started both
# again; the second
# attempt found the newest *complete* checkpoint and resumed there. Killed while writing
# step 12, rank 1 left a checkpoint that was not complete: {func}`fsdp_guide.checkpoint.save`
# writes into a temporary directory and renames it only once every rank has written, so
# the restart did not see it and resumed from step 6 ({ref}`tip-exact-resume`). Each run's
# end against the uninterrupted one:

# %%
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def saved(directory: Path) -> dict:
    """Everything a checkpoint holds (model, optimizer, schedule, data position, each rank's RNG), in this process."""
    whole = workdir / f"{directory.parent.name}-{directory.name}.pt"
    dcp_to_torch_save(directory, whole)
    return torch.load(whole, weights_only=False)  # our own file, just written


def identical(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(identical(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return (
            type(a) is type(b) and len(a) == len(b) and all(identical(x, y) for x, y in zip(a, b))
        )
    return a == b


last = f"step-{STEPS:08d}"
reference = saved(workdir / "straight" / last)
print(
    f"{'':24} {'resumed at':>10} {'steps redone':>12} {'restart s':>9}  losses and step {STEPS}'s checkpoint "
    "= uninterrupted"
)
for name, run in restarted.items():
    log, summary = run["log"], run["summary"]
    resumed = summary["first_step"] - 1
    killed, again = (
        float(log.split(f"[killed_rank] {what} at ")[1].split()[0])
        for what in ("rank 1 killed", "training again")
    )
    same = summary["losses"] == straight["losses"][resumed:] and identical(
        saved(run["checkpoints"] / last), reference
    )
    run.update(redone=run["computed"] - resumed, restart=again - killed, same=same)
    print(f"{name:24} {resumed:10} {run['redone']:12} {run['restart']:9.1f}  {same}")

# %% [markdown]
# Both runs end bit for bit where the uninterrupted run ends: the losses of every step
# after the resume, and everything in the last checkpoint, the optimizer's moments, the
# schedule, the data position and each rank's random state included. That is what a
# resume must restore for a restart to change nothing ({ref}`tip-exact-resume`).
#
# The cost is in the columns. **Steps redone**: every step after the checkpoint the
# restart resumes from, computed once before the failure and again after it: fewer than
# the checkpoint interval when the rank dies between saves, and the whole interval when it
# dies during one, because the checkpoint being written does not count. **Restart**: from
# the kill to the start of the restarted rank 0's first step: torchrun noticing, stopping
# the other worker, a new rendezvous, two new Python processes importing torch, building
# the model and loading the checkpoint. Every rank pays it, not only the one that died.
#
# (rank-dies-interval)=
# ## How often to save
#
# Saving often makes the redone steps few and the saves many. With a save costing δ
# seconds of training, a failure every M seconds on average, and R seconds to restart,
# Young's first-order interval between checkpoints (the compute between two saves) is
# τ = √(2δM) (J. W. Young, "A first order approximation to the optimum checkpoint
# interval", *Communications of the ACM* 17(9), 1974). Daly's higher-order estimate is
# τ = √(2δM) [1 + ⅓ (δ/2M)^½ + ⅑ (δ/2M)] − δ for δ < 2M, and τ = M beyond (J. T. Daly, "A
# higher order estimate of the optimum checkpoint interval for restart dumps", *Future
# Generation Computer Systems* 22(3), 2006); the two differ little while δ is small
# against M. To first order in δ/τ and τ/M, the time lost per second of training is δ/τ
# for the saves plus (τ/2 + R)/M for the failures. M is the job's: with n nodes each
# failing every m hours, M = m/n. The function below is Daly's; the first line checks it
# against the paper's own example (its Fig. 3: M = 24 h, δ = 5 min, "τopt = 117 min"),
# then it takes this page's measured save, step and restart:

# %%
import math


def daly_interval(save: float, mtbf: float) -> float:
    """Daly's higher-order optimum compute time between checkpoints (FGCS 22(3), 2006), in the units given."""
    if save >= 2 * mtbf:
        return mtbf
    ratio = save / (2 * mtbf)
    return math.sqrt(2 * save * mtbf) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - save


print(f"Daly's Fig. 3 (M = 24 h, δ = 5 min): τ = {daly_interval(5, 24 * 60):.0f} min")
restart_seconds = sum(run["restart"] for run in restarted.values()) / len(restarted)
print(
    f"measured here: a save δ = {save_seconds * 1000:.0f} ms, a step {step_seconds * 1000:.0f} ms, "
    f"a restart R = {restart_seconds:.1f} s"
)
print(
    f"{'failure every':>14} {'Young τ':>9} {'Daly τ':>9} {'= steps':>8} {'time lost (Daly τ)':>19}"
)
for hours in (1, 8, 24):
    M = hours * 3600
    young, daly = math.sqrt(2 * save_seconds * M), daly_interval(save_seconds, M)
    lost = save_seconds / daly + (daly / 2 + restart_seconds) / M
    print(f"{hours:12} h {young:8.2f}s {daly:8.2f}s {daly / step_seconds:8.0f} {lost:19.2%}")

# %% [markdown]
# This model's save is short, and so are the intervals in the τ columns. Put your own
# numbers in: the recipe returns each save's stall (`save_stall_s`,
# the time training waited) and the LLM page measures it for synchronous and
# {ref}`asynchronous <tip-async-checkpoint>` saves, whose stall is smaller: a smaller δ
# gives a shorter interval and fewer redone steps for the same time spent saving.
#
# (rank-dies-torchft)=
# ## torchft keeps the other replicas training
#
# torchrun's answer stops every rank. [torchft](https://github.com/pytorch/torchft)
# splits the job into replica groups that each hold a whole copy of the model: FSDP2
# shards it over a group's ranks, and torchft's `Manager` averages the gradients across
# the groups that are in each step's quorum, as HSDP's replicate dimension does, but on a
# process group that it rebuilds when the quorum changes. A group that loses a rank
# leaves the quorum; the others go on. When torchrun has restarted that group, it joins
# the next quorum and receives the current step, weights, optimizer state and schedule
# from a live group, over the network; it loads them before its first optimizer step, and
# the gradients it computed in that step are discarded.
#
# The workers are `fsdp_guide.recipes.replicas`, which {func}`fsdp_guide.recipes.replicas.run`
# starts: the recipe's model, optimizer and schedule, and this loop. `should_commit` is a vote among the ranks of one group: the
# group applies the step only if all its ranks say yes, and a rank says no after an error,
# such as an all-reduce that lost its peer. A group that does not commit computes the step
# again; other groups may commit it.

# %%
import inspect

from fsdp_guide.recipes import replicas

print(inspect.getsource(replicas.worker))

# %% [markdown]
# The state a live group sends is a function the `Manager` calls: this rank's shards of
# the model and optimizer (the same rank of every group holds the same slices), and the
# schedule. Receiving, it places each shard as its own parameter is placed and loads it
# through DCP's `set_state_dict`; the optimizer's `load_state_dict` creates AdamW's state
# from the peer's where the restarted group has none yet:

# %%
print(inspect.getsource(replicas.recoverable_state))

# %% [markdown]
# The run: a Lighthouse (torchft's quorum server) on 127.0.0.1 and two groups, each its
# own `torchrun --nproc-per-node=2 --max-restarts=1`. Group 1's rank 1 is killed after
# step 8, and the run ends at least 5 steps after group 1 is back. Each step takes at
# least 0.1 s (`--step-seconds`), as a real model's would; this one's would otherwise race
# through hundreds while group 1 restarts.

# %%
ft = workdir / "torchft"
ft.mkdir()
# the driver stops itself first, and its groups
done = subprocess.run(
    loopback_only(
        [
            sys.executable,
            "-m",
            "fsdp_guide.recipes.replicas",
            "--out",
            str(ft),
            "--kill-at",
            "8",
            "--after-rejoin",
            "5",
            "--step-seconds",
            "0.1",
            "--timeout",
            "240",
        ]
    ),
    capture_output=True,
    text=True,
    timeout=300,
)
assert done.returncode == 0, done.stderr[-3000:]
logs = replicas.read_logs(ft)


def segments(quorums: dict) -> list[tuple[int, int, tuple, tuple]]:
    """Runs of steps with the same groups averaged and the same groups healing (receiving the state)."""
    runs = []
    for step, (averaged, healing) in quorums.items():
        key = (tuple(averaged), tuple(healing))
        if runs and runs[-1][2:] == key:
            runs[-1] = (runs[-1][0], step, *key)
        else:
            runs.append((step, step, *key))
    return runs


# each step of the final weights: which groups averaged it, which received the state
quorums = replicas.quorums(logs)
print(f"{'steps':>7}  {'gradients averaged from':24} {'receiving the state':20}")
for first, last_step, averaged, healing in segments(quorums):
    groups = ", ".join(f"group {g}" for g in averaged)
    print(f"{first:3}-{last_step:<3}  {groups:24} {', '.join(f'group {g}' for g in healing):20}")

# %% [markdown]
# The two groups are started together, and their workers wait for each other before the
# first step (`_wait_for_every_worker`); when one still reaches the Lighthouse first, it
# steps alone until the other has joined and received its state, as a restarted group would.
# After group 1 loses rank 1, group 0 goes on alone for as long as group 1 takes to
# restart; then group 1 receives the state at the step group 0 has reached, and both
# average again. The table follows the final weights back step by step
# ({func}`fsdp_guide.recipes.replicas.quorums`). The Lighthouse leaves out of a quorum a
# group whose last heartbeat is older than the timeout (`quorum_compute`, below), so on a
# busy machine two quorums can compute the same step (both groups taking step 0 alone, or
# one group taking several steps in quorums of its own before it joins the other's); the
# group whose copy is dropped receives the other's state at its next quorum. The time it took, and
# what each group lost:

# %%
g0, killed_rank = logs[(0, 0)], logs[(1, 1)]
death = [line for line in killed_rank if line["attempt"] == 0][-1]
back = [line for line in logs[(1, 0)] if line["attempt"] == 1]
alone = [
    line for line in g0 if death["step"] < line["step"] < back[0]["step"] and line["committed"]
]
# a step group 0 did not commit, then computed again
computed_again = sum(not line["committed"] for line in g0)
pause, after = max((b["time"] - a["time"], a["step"]) for a, b in zip(g0, g0[1:]))
print(
    f"group 1's rank 1 died after step {death['step']}; group 1 back at step {back[0]['step']}, "
    f"{back[0]['time'] - death['time']:.1f} s later"
)
print(
    f"group 0: steps {g0[0]['step']} to {g0[-1]['step']}, every line from its first attempt: "
    f"{all(line['attempt'] == 0 for line in g0)}; {computed_again} computed again; "
    f"{len(alone)} with its own gradients alone; its longest pause {pause:.1f} s, after step {after}"
)

# %% [markdown]
# No rank of group 0 restarted, but group 0 did pause (its longest pause, printed). The
# Lighthouse forms a new quorum only from more than half of the replicas that heartbeat to
# it (torchft's split-brain rule, `quorum_compute` in its `src/lighthouse.rs`), and group
# 1's manager, which runs in its rank 0, heartbeats until that process has gone and for
# the heartbeat timeout after (1 s here, `heartbeat_timeout_ms`; torchrun stops rank 0 once
# it sees rank 1 dead). With three groups or more, the survivors are a majority at once,
# but the Lighthouse still holds a quorum that leaves out a group that heartbeats for up
# to its join timeout (500 ms here, `join_timeout_ms`), so they are expected to pause too (not run here).
# What the failure cost is elsewhere: for the steps group 0 took alone, the quorum averaged one group's rows instead of two, so the
# model trained on half the data it would have seen, with the learning rate of the full
# batch. The run is not the run without a failure, as torchrun's was; it is the run the
# quorums computed. To check that, {func}`fsdp_guide.recipes.replicas.replay` computes it
# without torchft: on 2 ranks, for every step, the rows of the groups the step's quorum
# averaged, their gradients summed and divided by their count (torchft's all-reduce is a
# sum, then a division by the participants), then the recipe's clipping, AdamW and
# schedule. Its final shards against each group's:

# %%
replayed = launch(replicas.replay, quorums, 2, world_size=2, output="none")
same = []
for rank in (0, 1):
    final = {group: torch.load(ft / f"final-group{group}-rank{rank}.pt") for group in (0, 1)}
    per_group = [
        all(torch.equal(a, b) for a, b in zip(final[group], replayed[rank], strict=True))
        for group in (0, 1)
    ]
    same.extend(per_group)
    print(
        f"rank {rank}: group 0's shards = the replay's: {per_group[0]}; group 1's = the replay's: {per_group[1]}"
    )

# %% [markdown]
# Bit for bit: the restarted group holds what the live group holds, and both hold what the
# sequence of quorums computed, with each step's gradients from the groups that were
# there. (With two groups: a sum of two is the same in either order; gloo may add three or
# more in another order than the replay.)
#
# ## The two side by side
#
# Measured above, on the same architecture (the torchft groups train on rows of their
# own), on the machine in the box at the end of the page; one run each, and the times
# move from run to run:

# %%
assert all(run["same"] for run in restarted.values()) and all(same), (
    "a run did not end as it should (see above)"
)
print(f"{'':38} {'torchrun --max-restarts':>24} {'torchft':>10}")
print(
    f"{'steps computed again':38} {', '.join(str(r['redone']) for r in restarted.values()):>24} "
    f"{computed_again:>10}"
)
print(
    f"{'seconds until the lost rank steps again':38} {restart_seconds:24.1f} {back[0]['time'] - death['time']:10.1f}"
)
print(f"{'steps the other ranks took meanwhile':38} {'none: stopped':>24} {len(alone):>10}")

# %% [markdown]
# The seconds are not quite the same measure. torchrun's run from the kill to the start of
# the restarted rank 0's first step, the checkpoint loaded; torchft's from the kill to the
# end of group 1's first step, the one in which it received the state, and they include a
# torchrun restart of the lost group too, on a machine where group 0 keeps computing. What
# differs most is what the rest of the job does meanwhile.
#
# ## What each needs from the training script
#
# | | torchrun `--max-restarts` | torchft |
# |---|---|---|
# | guarantees | the run ends as if nothing had happened, bit for bit (given everything in {ref}`tip-exact-resume`, and deterministic kernels) | the other groups go on stepping while they are a majority of the replicas heartbeating and at least `min_replica_size`; every group ends with the quorums' weights |
# | costs | the steps since the last complete checkpoint, the restart, on every rank; the saves | fewer rows per step while a group is away; a quorum and an all-reduce across groups every step; a Lighthouse to run |
# | checkpoints | the only way back: a cadence (above), written atomically | still needed when the whole job stops; not used to rejoin |
# | resume | idempotent: `--resume auto` is right on the first start and every restart | the `Manager` hands a rejoining group the step and the state |
# | data position | in the checkpoint (the recipe's `TokenBatches` state) | a function of the step, or a per-group state the script restores |
# | random state | each rank's, in the checkpoint | the same, for dropout or sampling: not in this page's model |
# | the step | unchanged | gradients through `manager.allreduce`, `optimizer.step()` only if `should_commit()` |
# | network | torchrun's store (every interface; `--rdzv-endpoint`) | also the manager's server, `[::]` hard-coded in torchft 0.2's `manager.py` |
#
# The choice is a trade between the two cost rows. torchrun's restart costs every rank the
# redone steps and the restart, at each failure; torchft costs every step a quorum and an
# all-reduce across groups, and the job a Lighthouse, and in exchange a failure costs the
# others a pause and some steps on fewer rows. The more often some rank fails (the more
# nodes), and the longer a restart of everything takes, the more the second pays. On a
# cluster, the {ref}`cluster page <cluster-max-restarts>` starts torchrun with
# `--max-restarts`.
#
# (rank-dies-tips)=
# ## The tips behind this
#
# - {ref}`tip-exact-resume`: resume everything a step depends on, from the newest complete checkpoint.
# - {ref}`tip-checkpoint-interval`: choose the checkpoint interval from the failure rate and the save's stall.
# - {ref}`tip-torchft-live-recovery`: keep the other replica groups training, and what the script then needs.
# - {ref}`tip-async-checkpoint`: a smaller stall, and so a shorter interval for the same cost.

# %% tags=["remove-input"]
import shutil

shutil.rmtree(workdir)

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("rank_dies")
