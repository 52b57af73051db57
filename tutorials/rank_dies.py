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
# # When a rank dies: torchrun restarts from the last checkpoint
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
# - what the training script needs for a restart to change nothing.
#
# **What you need**: Linux with `unshare` (util-linux; as root, or with unprivileged user
# namespaces): torchrun's rendezvous store listens on every interface, so the page runs it
# in a network namespace of its own where only loopback exists
# ({func}`fsdp_guide.isolation.loopback_only`); on a cluster it runs as it is. 2 processes
# on gloo; about 20 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The training code is written to run unchanged with
# one GPU per rank (NCCL): each rank's device is {func}`fsdp_guide.device`'s. The tips it
# demonstrates are listed {ref}`at the end <rank-dies-tips>`. Keeping the other ranks
# training instead, with torchft: {ref}`tutorial-torchft-recovery`.
# Its idea as a plain torchrun script to copy: {ref}`rank-dies-script` ({download}`download <scripts/rank_dies.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

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
# end (its losses and its last checkpoint) against the uninterrupted one:

# %%
from fsdp_guide.table import Table
from IPython.display import display
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
rows = []
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
    rows.append([name, resumed, run["redone"], f"{run['restart']:.1f}", same])
display(Table(["run", "resumed at", "steps redone", "restart s", "= uninterrupted"], rows))

# %% tags=["hide-input"] mystnb={"image": {"alt": "Two runs as timelines of steps: the first attempt computes steps up to where rank 1 is killed, the second resumes after the newest complete checkpoint and computes to the last step; the steps computed twice are red. The run killed between saves redoes the steps since its last checkpoint; the run killed while saving redoes a whole checkpoint interval."}}
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(8, 2.2))
for row, run in enumerate(restarted.values()):
    resumed = run["computed"] - run["redone"]
    y = 2 * row
    ax.barh(y + 0.45, run["computed"], left=0.5, height=0.8, color="0.8", edgecolor="0.3")
    ax.barh(y - 0.45, STEPS - resumed, left=resumed + 0.5, height=0.8, color="tab:blue", alpha=0.5)
    ax.barh(y - 0.45, run["redone"], left=resumed + 0.5, height=0.8, color="tab:red", alpha=0.8)
    ax.plot(run["computed"] + 0.5, y + 0.45, "kx", markersize=10)  # rank 1 killed
ax.set_yticks(
    [y for row in range(len(restarted)) for y in (2 * row + 0.45, 2 * row - 0.45)],
    [f"{name}: attempt {n}" for name in restarted for n in (1, 2)],
)
ax.set(
    xlabel="step (x: rank 1 killed; red: computed again after the restart)", xlim=(0.5, STEPS + 0.5)
)
ax.set_xticks(range(1, STEPS + 1))
fig.tight_layout()

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
rows = []
for hours in (1, 8, 24):
    M = hours * 3600
    young, daly = math.sqrt(2 * save_seconds * M), daly_interval(save_seconds, M)
    lost = save_seconds / daly + (daly / 2 + restart_seconds) / M
    rows.append(
        [f"{hours} h", f"{young:.2f}", f"{daly:.2f}", f"{daly / step_seconds:.0f}", f"{lost:.2%}"]
    )
header = ["failure every", "Young τ (s)", "Daly τ (s)", "Daly τ (steps)", "time lost (Daly τ)"]
display(Table(header, rows))

# %% [markdown]
# This model's save is short, and so are the intervals in the τ columns. Put your own
# numbers in: the recipe returns each save's stall (`save_stall_s`,
# the time training waited) and the LLM page measures it for synchronous and
# {ref}`asynchronous <tip-async-checkpoint>` saves, whose stall is smaller: a smaller δ
# gives a shorter interval and fewer redone steps for the same time spent saving.
#
# ## What the training script needs
#
# | | under `torchrun --max-restarts` |
# |---|---|
# | guarantees | the run ends as if nothing had happened, bit for bit (given everything in {ref}`tip-exact-resume`, and deterministic kernels) |
# | costs | the steps since the last complete checkpoint, the restart, on every rank; the saves |
# | checkpoints | the only way back: a cadence (above), each written into a temporary folder and renamed once every rank has written |
# | resume | idempotent: `--resume auto` is right on the first start and on every restart |
# | data position | in the checkpoint (the recipe's `TokenBatches` state), or a function of the step |
# | random state | each rank's, in the checkpoint |
# | the step | unchanged |
# | network | a store per attempt: `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` ({ref}`why <cluster-max-restarts>`), or a key prefix per attempt as in the script below |
#
# On a cluster, the {ref}`cluster page <cluster-max-restarts>` starts torchrun with
# `--max-restarts`. {ref}`tutorial-torchft-recovery` keeps the other replicas training
# instead of stopping them, and sets the two side by side.

# %% [markdown]
# (rank-dies-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/rank_dies.py`.
# Run it as `torchrun --nproc-per-node=2 --max-restarts=1 rank_dies.py`. Two ranks train a small
# FSDP2 model for 8 steps with a DCP checkpoint every 3 steps, each written into a temporary folder
# renamed once every rank has written. In torchrun's first attempt rank 1 kills itself with SIGKILL
# after step 5; torchrun restarts both, and the same command resumes from step 3's checkpoint
# (model, optimizer and step; the data is a function of the step), trains to step 8 and compares
# the weights with a run of the same ranks never interrupted. Each attempt's process group uses a
# key prefix of its own in torchrun's store. The tests run it on 2 CPU ranks under
# `--max-restarts=1` and check that rank 1 died once, that the restart resumed after step 3, and that
# the weights equal the uninterrupted run's bit for bit (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/rank_dies.py
# :language: python
# ```

# %% [markdown]
# (rank-dies-tips)=
# ## The tips behind this
#
# - {ref}`tip-exact-resume`: resume everything a step depends on, from the newest complete checkpoint.
# - {ref}`tip-checkpoint-interval`: choose the checkpoint interval from the failure rate and the save's stall.
# - {ref}`tip-async-checkpoint`: a smaller stall, and so a shorter interval for the same cost.

# %% tags=["remove-input"]
import shutil

shutil.rmtree(workdir)

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("rank_dies")
