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
# (tutorial-torchft-recovery)=
# # torchft: the other replicas keep training
#
# **What you will learn**
#
# - how torchft keeps training through a rank's death: replica groups of the same model,
#   FSDP2 inside each, a quorum that shrinks when a group dies and grows back when it
#   restarts, and the restarted group taking its weights and optimizer state from a live
#   peer, not from disk;
# - that every group ends with what the sequence of quorums computed, checked bit for bit
#   against a replay without torchft;
# - what it guarantees, costs and needs from the training script, beside torchrun's restart
#   from a checkpoint ({ref}`tutorial-rank-dies`).
#
# **What you need**: Linux with `unshare` (util-linux; as root, or with unprivileged user
# namespaces) and `torchft`, which the test and docs environments install. torchrun's
# rendezvous store and torchft's manager listen on every interface, so the page runs them in
# a network namespace of their own where only loopback exists
# ({func}`fsdp_guide.isolation.loopback_only`); on a cluster they run as they are. 2 and 4
# processes on gloo; about 35 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The training code is written to run unchanged with
# one GPU per rank (NCCL inside a group, torchft's NCCL group across groups, each group on
# GPUs of its own): each rank's device is {func}`fsdp_guide.device`'s. The tips it
# demonstrates are listed {ref}`at the end <torchft-recovery-tips>`.
# Its idea as plain torchrun scripts to copy, a Lighthouse and a `torchrun` per replica group:
# {ref}`torchft-recovery-script` ({download}`download <scripts/torchft_recovery.py>`).

# %%
import sys
from importlib.metadata import version

import torch

print(f"torch {torch.__version__}, torchft {version('torchft')}, Python {sys.version.split()[0]}")

# %%
import json
import os
import subprocess
import tempfile
from pathlib import Path

from fsdp_guide import launch
from fsdp_guide.isolation import loopback_only
from fsdp_guide.table import Table
from IPython.display import display

workdir = Path(tempfile.mkdtemp(prefix="torchft-recovery-"))

# %% [markdown]
# (rank-dies-torchft)=
# ## torchft keeps the other replicas training
#
# torchrun's restart ({ref}`tutorial-rank-dies`) stops every rank. [torchft](https://github.com/pytorch/torchft)
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
rows = []
for first, last_step, averaged, healing in segments(quorums):
    groups, receiving = (", ".join(f"group {g}" for g in gs) for gs in (averaged, healing))
    rows.append([f"{first}-{last_step}", groups, receiving])
header = ["steps", "gradients averaged from", "receiving the state"]
display(Table(header, rows))  # an HTML table on the site, aligned text elsewhere

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

# %% tags=["hide-input"] mystnb={"image": {"alt": "Each worker's steps over time, a tick per step and a row per group and rank: group 0's two ranks step throughout, pausing once; group 1's rank 1 is killed, both of group 1's ranks stop, and after torchrun restarts them their steps resume at the step group 0 has reached; steps not committed are grey."}}
import matplotlib.pyplot as plt

start = min(line["time"] for lines in logs.values() for line in lines)
fig, ax = plt.subplots(figsize=(10, 2.4))
for row, lines in enumerate(logs.values()):
    for line in lines:
        colour = ("tab:blue", "tab:orange")[line["attempt"]] if line["committed"] else "0.6"
        ax.plot(line["time"] - start, row, "|", markersize=14, color=colour)
ax.plot(death["time"] - start, list(logs).index((1, 1)), "kx", markersize=10)
ax.set_yticks(range(len(logs)), [f"group {group}, rank {rank}" for group, rank in logs])
ax.set_ylim(len(logs) - 0.5, -0.5)
ax.set_xlabel(
    "seconds from the first step: a tick per step (orange: after torchrun's restart; x: rank 1 killed)"
)
fig.tight_layout()

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
# torchrun's numbers come from the run of {ref}`rank-dies-torchrun`, repeated here (unfold
# the cell to read it): the LLM recipe's small GPT on 2 ranks under
# `torchrun --max-restarts=1`, a checkpoint every 2 steps, rank 1 killed after step 7.

# %% tags=["hide-input"]
STEPS, EVERY, KILLED_AFTER = 12, 2, 7
flags = "--n-layer 2 --n-head 2 --n-embd 32 --block-size 32 --batch-size 4 --warmup 2 --no-progress".split()
command = [
    *(
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
    ),
    *(
        "-m",
        "fsdp_guide.recipes.killed_rank",
        "--kill-after-step",
        str(KILLED_AFTER),
        "--steps",
        str(STEPS),
    ),
    *(*flags, "--log-every", str(STEPS), "--checkpoint-dir", str(workdir / "torchrun")),
    *(
        "--checkpoint-every",
        str(EVERY),
        "--resume",
        "auto",
        "--out",
        str(workdir / "torchrun.json"),
    ),
]
# a store for each attempt: on a shared one a restarted rank can read a dead rank's address
env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
done = subprocess.run(loopback_only(command), capture_output=True, text=True, timeout=180, env=env)
assert done.returncode == 0, done.stdout + done.stderr[-3000:]
log = done.stdout + done.stderr
killed, again = (
    float(log.split(f"[killed_rank] {what} at ")[1].split()[0])
    for what in ("rank 1 killed", "training again")
)
resumed = json.loads((workdir / "torchrun.json").read_text())["first_step"] - 1
torchrun = {"redone": KILLED_AFTER - resumed, "restart": again - killed}
print(
    f"torchrun: rank 1 killed after step {KILLED_AFTER}, resumed after step {resumed}, "
    f"{torchrun['restart']:.1f} s from the kill to the next step"
)

# %% [markdown]
# Both runs on the same architecture (the torchft groups train on rows of their own), on the
# machine in the box at the end of the page; one run each, and the times move from run to run:

# %%
assert all(same), "a group did not end as the replay (see above)"
rows = [
    ["steps computed again", torchrun["redone"], computed_again],
    [
        "seconds until the lost rank steps again",
        f"{torchrun['restart']:.1f}",
        f"{back[0]['time'] - death['time']:.1f}",
    ],
    ["steps the other ranks took meanwhile", "none: stopped", len(alone)],
]
display(Table(["", "torchrun --max-restarts", "torchft"], rows))

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
# | checkpoints | the only way back: a cadence ({ref}`rank-dies-interval`), written atomically | still needed when the whole job stops; not used to rejoin |
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
# %% [markdown]
# (torchft-recovery-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch and torchft alone:
# {download}`scripts/torchft_recovery.py`. Its docstring gives the commands: a Lighthouse on
# 127.0.0.1, and a `torchrun --max-restarts=1` per replica group, each group 2 ranks of FSDP2;
# group 1's rank 1 kills itself after step 8 in torchrun's first attempt. The state goes to the
# restarted group over torchft's process group (`PGTransport`), shard by shard as above, and the
# data is a function of the step. The run ends once both groups have stepped together past step
# 20, and each rank prints a digest of its shards. The tests run those commands as they are, in a
# network namespace where only loopback exists, and check that group 0 never restarted, that
# group 1 received the state at a later step than the one it died after (the steps group 0 took
# meanwhile) and averaged with group 0 again, and that the same rank of both groups ends with the
# same bytes (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/torchft_recovery.py
# :language: python
# ```

# %% [markdown]
# (torchft-recovery-tips)=
# ## The tips behind this
#
# - {ref}`tip-torchft-live-recovery`: keep the other replica groups training, and what the script then needs.

# %% tags=["remove-input"]
import shutil

shutil.rmtree(workdir)

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("torchft_recovery")
