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
# (tutorial-world-sizes)=
# # Equal across world sizes?
#
# **What you will learn**: what stays bit-equal when the same global batch trains on 1, 2
# or 4 ranks, and what is only close; why (the order in which numbers are summed, here);
# and a rule for telling a real divergence from rounding: compare the first gradients with
# one process's on the same batch in micro-batches.
#
# **What you need**: a CPU; up to 4 processes on gloo; about 15 seconds on 2 CPU cores ({ref}`measured <measured-times>`).
# This page is about the CPU: every run, ranks and one process, computes there (`backend="gloo"`),
# where each is deterministic; what GPUs change is said below as expectation. The tips are listed {ref}`at the end <world-sizes-tips>`. Its idea as a plain
# torchrun script to copy: {ref}`world-sizes-script` ({download}`download <scripts/world_sizes.py>`).

# %%
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

STEPS, GLOBAL_BATCH = 20, 16


def build():
    torch.manual_seed(0)  # the same weights on every rank and in every run
    return nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4)
    )


def batch(step):
    """The global batch of a step, whatever the world size."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 32, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)


def flat(tensors):
    """Parameters or gradients, whole (a DTensor gathered), as one vector on the CPU."""
    return torch.cat(
        [getattr(t, "full_tensor", t.detach)().detach().flatten().cpu() for t in tensors]
    )


# %% [markdown]
# One process, the whole batch at once or in micro-batches whose losses are averaged
# (gradient accumulation); and sharded runs, FSDP2 or DDP, each rank on its rows of the same
# global batch. Each run records its losses (the mean over the batch), the gradients of the
# first step and the weights after 20 steps of AdamW.


# %%
def one_process(micro_batches=1):
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, first = [], None
    for step in range(STEPS):
        x, y = batch(step)
        loss = torch.zeros(())
        for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            part = F.mse_loss(model(xs), ys) / micro_batches  # each micro-batch's share of the mean
            part.backward()
            loss += part.detach()  # in float32, as the ranks' losses are summed
        if step == 0:
            first = flat(p.grad for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, first, flat(model.parameters())


def sharded(kind, bug=None, deterministic=False):
    import fsdp_guide
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    device, rank, world = fsdp_guide.device(), dist.get_rank(), dist.get_world_size()
    torch.use_deterministic_algorithms(
        deterministic
    )  # raises where an op has no deterministic kernel
    model = build().to(device)
    if kind == "FSDP2":
        for layer in model[::2]:
            fully_shard(layer)
        fully_shard(model)
        if bug == "gradients summed":  # not averaged over the ranks: a missed division
            for layer in model[::2]:
                layer.set_gradient_divide_factor(1.0)  # divide by 1: a sum
                layer.set_force_sum_reduction_for_comms(
                    True
                )  # as a SUM with scaling (gloo has no PREMUL_SUM)
    else:
        model = DDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, first = [], None
    for step in range(STEPS):
        rows = 0 if bug == "same rows" else rank  # the bug: every rank on the first rows
        x, y = (t.to(device).chunk(world)[rows] for t in batch(step))
        loss = F.mse_loss(
            model(x), y
        )  # this rank's rows' mean; FSDP2 and DDP average the gradients
        loss.backward()
        if step == 0:
            first = flat(p.grad for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach() / world  # each rank's share of the batch's mean, summed in float32
        dist.all_reduce(loss)
        losses.append(loss.item())
    return losses, first, flat(model.parameters())


# %%
from fsdp_guide import launch

runs = {"one process": one_process(), "one process, again": one_process()}
for world in (1, 2, 4):
    if world > 1:
        runs[f"one process, {world} micro-batches"] = one_process(world)
    for kind in ("FSDP2", "DDP"):
        name = f"{kind}, {world} rank{'s' * (world > 1)}"
        runs[name] = launch(sharded, kind, world_size=world, backend="gloo", output="none")[0]
runs["FSDP2, 4 ranks again"] = launch(
    sharded, "FSDP2", world_size=4, backend="gloo", output="none"
)[0]
runs["FSDP2, 4 ranks, use_deterministic_algorithms"] = launch(
    sharded, "FSDP2", None, True, world_size=4, backend="gloo", output="none"
)[0]
for bug in ("same rows", "gradients summed"):
    runs[f"FSDP2, 2 ranks, {bug} (a bug)"] = launch(
        sharded, "FSDP2", bug, world_size=2, backend="gloo", output="none"
    )[0]
assert all(torch.isfinite(torch.tensor(run[0])).all() for run in runs.values())  # no NaN below

# %%
from fsdp_guide.table import Table
from myst_nb import glue


def bit_equal(a, b):
    """The same gradients and weights, bit for bit (torch.equal: a NaN is never equal)."""
    return torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])


reference = runs["one process"]
first_gaps = {name: float((run[1] - reference[1]).abs().max()) for name, run in runs.items()}
rows = []
for name, (losses, _, weights) in runs.items():
    twins = [other for other in runs if other != name and bit_equal(runs[other], runs[name])]
    rows.append(
        [
            name,
            f"{abs(losses[0] - reference[0][0]):.1e}",
            f"{first_gaps[name]:.1e}",
            f"{float((weights - reference[2]).abs().max()):.1e}",
            "; ".join(twins) or "none",
        ]
    )
floor = max(
    gap for name, gap in first_gaps.items() if "bug" not in name
)  # the largest rounding here
data_bug, scale_bug = (
    first_gaps[f"FSDP2, 2 ranks, {bug} (a bug)"] for bug in ("same rows", "gradients summed")
)
loss_gaps = {
    name: max(abs(a - b) for a, b in zip(run[0], reference[0])) for name, run in runs.items()
}
glue("floor", f"{floor:.0e}", display=False)
glue("data_bug_over_floor", f"{data_bug / floor:,.0f}", display=False)
glue("scale_bug_over_floor", f"{scale_bug / floor:,.0f}", display=False)
glue(
    "scale_bug_losses",
    f"{loss_gaps['FSDP2, 2 ranks, gradients summed (a bug)']:.0e}",
    display=False,
)
glue(
    "rounding_losses",
    f"{max(g for n, g in loss_gaps.items() if 'bug' not in n):.0e}",
    display=False,
)
columns = ["run", "Δ first loss", "Δ first gradients", "Δ weights after 20 steps"]
Table([*columns, "bit-equal (gradients and weights) to"], rows)

# %% [markdown]
# Δ: the largest absolute difference from the first run, one process on the whole batch.
# Read from the last column:
#
# - **The runs repeated here are bit-equal to their first runs** (one process, FSDP2 on 4
#   ranks): on the CPU, a run is deterministic. So `torch.use_deterministic_algorithms(True)`
#   changes nothing here (bit-equal to FSDP2 on 4 ranks without it): it makes a run
#   repeatable (on a GPU, where it matters: below), not equal across world sizes.
# - **1 rank is one process**, FSDP2 and DDP alike.
# - **2 ranks are one process with 2 micro-batches**, FSDP2 and DDP alike, bit for bit:
#   each rank's half-batch gradient is what that micro-batch computes; FSDP2 (gloo's
#   average: a sum, then a division), DDP (a division, then a sum) and accumulation (the
#   loss halved before backward) halve at different places, and halving is exact in binary
#   floating point; adding two numbers has no order.
# - **4 ranks are only close**: dividing by 4 is exact too, so what differs is the order in
#   which four gradients are summed (gloo's reduce-scatter for FSDP2, its all-reduce for
#   DDP, one after another for accumulation), and FSDP2 and DDP differ from each other too.
#   With 3 ranks, where the division by 3 happens would matter as well.
# - **The whole batch at once differs from every split**, by rounding: a weight's gradient
#   sums over the batch's rows, in one product over 16 rows here, in two over 8 and one
#   addition there.
#
# All of these differ by at most {glue:text}`floor` in the first gradients. Both bugs stand
# far above that from the first step: every rank on the same rows by
# {glue:text}`data_bug_over_floor` times, gradients summed instead of averaged (a missed
# division) by {glue:text}`scale_bug_over_floor` times. But the second barely shows in the
# losses: AdamW's step does not depend on the gradient's scale (but for its `eps`), so its
# losses stay within {glue:text}`scale_bug_losses` of one process's, against
# {glue:text}`rounding_losses` for rounding.

# %% mystnb={"image": {"alt": "Log-scale plot of the difference between each run's loss and one process's at each of 20 steps: one process in 4 micro-batches and FSDP2 on 4 ranks stay at rounding's size, or equal (no point); every rank on the same rows stays many orders of magnitude above from the first step; gradients summed instead of averaged stay close to rounding's size in the losses."}}
import matplotlib.pyplot as plt

figure, ax = plt.subplots(figsize=(7, 3.2))
shown = ["one process, 4 micro-batches", "FSDP2, 4 ranks", "FSDP2, 2 ranks, same rows (a bug)"]
for name in [*shown, "FSDP2, 2 ranks, gradients summed (a bug)"]:
    gaps = [
        abs(a - b) or float("nan") for a, b in zip(runs[name][0], reference[0])
    ]  # equal: no point
    ax.semilogy(range(STEPS), gaps, marker=".", label=name)
ax.set_xlabel("step")
ax.set_ylabel("|loss - one process's| (no point: equal)", fontsize=8)
ax.legend(fontsize=8)
ax.set_title("Losses over 20 steps: rounding, a data bug, and a bug the losses hide", fontsize=10)
figure.tight_layout()
plt.show()

# %% [markdown]
# (world-sizes-rule)=
# ## The rule
#
# Run the first step twice in one process: once on the whole batch, once in as many
# micro-batches as you have ranks. Their difference is the rounding this model and batch
# have. A sharded run whose **first gradients** differ from one process's by about that
# much is rounding; one that differs by orders of magnitude more computes something else:
# the data split, a missed or doubled reduction, the loss normalisation with uneven batches
# ({ref}`tutorial-loss-and-accumulation`; with equal batches per rank a mean of means is the
# mean). Compare gradients: the forward does not see the reduction, and AdamW barely sees
# the gradient's scale (through its `eps` only), so losses and weights move little. Start from the same weights (copied from the
# sharded model's full state dict, {ref}`tutorial-deterministic-init`), with dropout off and
# the same precision policy, and compare per tensor (a global maximum lets a bug in a small
# tensor hide under another's rounding). Over long runs rounding grows too, which is why the
# first step is the one to compare. The rule checks forward, backward and reduction; the
# optimizer's own path (clipping, the schedule) needs its own step compared.
#
# What GPUs change, as expectation (no GPU run is recorded here): NCCL chooses its algorithm
# (ring, tree, and for reduce-scatter PAT or NVLS) and protocol by size, world size and
# machine, so the order of a sum can change between world sizes and machines (deterministic
# for a fixed job); some CUDA kernels (atomics in scatter-add, some convolution and
# attention backward paths) differ from run to run unless
# `torch.use_deterministic_algorithms(True)` chooses others or raises (cuBLAS then needs
# `CUBLAS_WORKSPACE_CONFIG=:4096:8`). torchtitan's `DebugConfig(batch_invariant=True)`
# ([`set_batch_invariance`](https://github.com/pytorch/torchtitan/blob/b5bcd76c66d0acb1a08b176d9639425bc55e0b2a/torchtitan/distributed/utils.py#L318-L396))
# swaps in batch-invariant forward kernels and pins NCCL's reduction (`NCCL_ALGO`,
# `NCCL_PROTO=Simple`, one channel) for bit-equal log-probabilities between an inference
# engine and the trainer; it makes a forward independent of the other rows, not the
# gradients of a batch split otherwise. torchtitan's
# [`converging.md`](https://github.com/pytorch/torchtitan/blob/b5bcd76c66d0acb1a08b176d9639425bc55e0b2a/docs/converging.md)
# overlays loss curves across parallelisms instead, since accumulation orders differ (its
# footnote 2).
#
# (world-sizes-script)=
# ## The script to copy
#
# This page's rule as a plain torchrun script with torch alone: {download}`scripts/world_sizes.py`.
# Every rank trains one step of FSDP2 on its rows of the global batch; rank 0 then runs the
# same step in one process, on the whole batch and in as many micro-batches as there are
# ranks, and prints whether the sharded gradients are bit-equal to the micro-batched ones
# and each difference from the whole batch's. The tests run this file under torchrun on 2
# CPU ranks and check those lines (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/world_sizes.py
# :language: python
# ```

# %% [markdown]
# (world-sizes-tips)=
# ## The tips behind this
#
# - {ref}`tip-world-size-rounding`
# - {ref}`tip-loss-global-token-count`: the normalisation that makes ranks sum to one process.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("world_sizes")
