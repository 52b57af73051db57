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
# or 4 ranks, and what is only close; why (the order in which numbers are summed, nothing
# else, in this run); and a rule for telling a real divergence from rounding: compare it
# with one process trained on the same batch in micro-batches.
#
# **What you need**: a CPU; up to 4 processes on gloo; about 10 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The code is written to run unchanged with one GPU per
# rank (NCCL), but no GPU run of it is recorded: what GPUs change is said below as
# expectation. The tips are listed {ref}`at the end <world-sizes-tips>`. Its idea as a plain
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
        loss = 0.0
        for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            part = F.mse_loss(model(xs), ys) / micro_batches  # each micro-batch's share of the mean
            part.backward()
            loss += part.item()
        if step == 0:
            first = flat(p.grad for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss)
    return losses, first, flat(model.parameters())


def sharded(kind, same_rows=False):
    import fsdp_guide
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    device, rank, world = fsdp_guide.device(), dist.get_rank(), dist.get_world_size()
    model = build().to(device)
    if kind == "FSDP2":
        for layer in model[::2]:
            fully_shard(layer)
        fully_shard(model)
    else:
        model = DDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, first = [], None
    for step in range(STEPS):
        x, y = (t.to(device).chunk(world)[0 if same_rows else rank] for t in batch(step))
        loss = F.mse_loss(
            model(x), y
        )  # the mean over this rank's rows; FSDP2 and DDP average the gradients
        loss.backward()
        if step == 0:
            first = flat(p.grad for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad()
        every = [None] * world
        dist.all_gather_object(every, loss.item())
        losses.append(sum(every) / world)  # the mean over the batch, summed as one process sums it
    return losses, first, flat(model.parameters())


# %%
from fsdp_guide import launch

runs = {"one process": one_process(), "one process, again": one_process()}
for world in (1, 2, 4):
    if world > 1:
        runs[f"one process, {world} micro-batches"] = one_process(world)
    for kind in ("FSDP2", "DDP"):
        runs[f"{kind}, {world} rank{'s' * (world > 1)}"] = launch(
            sharded, kind, world_size=world, output="none"
        )[0]
runs["FSDP2, 2 ranks again"] = launch(sharded, "FSDP2", world_size=2, output="none")[0]
runs["FSDP2, 2 ranks on the same rows (a bug)"] = launch(
    sharded, "FSDP2", True, world_size=2, output="none"
)[0]

# %%
from fsdp_guide.table import Table
from myst_nb import glue


def bit_equal(a, b):
    """The same gradients and weights, bit for bit (torch.equal: a NaN is never equal)."""
    return torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])


reference = runs["one process"]
rows = []
for name, (losses, first, weights) in runs.items():
    twins = [other for other in runs if other != name and bit_equal(runs[other], runs[name])]
    rows.append(
        [
            name,
            f"{abs(losses[0] - reference[0][0]):.1e}",
            f"{float((first - reference[1]).abs().max()):.1e}",
            f"{float((weights - reference[2]).abs().max()):.1e}",
            "; ".join(twins) or "none",
        ]
    )
first_gaps = {name: float((run[1] - reference[1]).abs().max()) for name, run in runs.items()}
floor = max(
    gap for name, gap in first_gaps.items() if "bug" not in name
)  # the largest rounding here
bug = first_gaps["FSDP2, 2 ranks on the same rows (a bug)"]
glue("floor", f"{floor:.0e}", display=False)
glue("bug_over_floor", f"{bug / floor:.0e}", display=False)
columns = ["run", "first loss", "first gradients", "weights after 20 steps"]
Table([*columns, "bit-equal (gradients and weights) to"], rows)

# %% [markdown]
# Differences are the largest absolute ones from the first run, one process on the whole
# batch. Read from the last column:
#
# - **The same run twice is bit-equal** (one process, and FSDP2 on 2 ranks): on the CPU
#   nothing here varies from run to run.
# - **1 rank is one process**, FSDP2 and DDP alike.
# - **2 ranks are one process with 2 micro-batches**, FSDP2 and DDP alike, bit for bit:
#   each rank's half-batch gradient is what that micro-batch computes, and averaging two of
#   them is one addition, which has no order.
# - **4 ranks are only close**: four gradients summed in other orders (by gloo's
#   reduce-scatter for FSDP2, its all-reduce for DDP, one after another for accumulation)
#   round differently, so FSDP2 and DDP differ from each other too.
# - **The whole batch at once differs from every split**, by rounding: a matrix product over
#   16 rows sums in another order than two over 8.
#
# All of these differ by at most {glue:text}`floor` in the first gradients. The bug, both
# ranks on the same rows, differs by {glue:text}`bug_over_floor` times that from the first step.

# %%
import matplotlib.pyplot as plt

figure, ax = plt.subplots(figsize=(7, 3.2))
shown = [
    "one process, 4 micro-batches",
    "FSDP2, 4 ranks",
    "DDP, 4 ranks",
    "FSDP2, 2 ranks on the same rows (a bug)",
]
for name in shown:
    gaps = [
        abs(a - b) or float("nan") for a, b in zip(runs[name][0], reference[0])
    ]  # equal: no point
    ax.semilogy(range(STEPS), gaps, marker=".", label=name)
ax.set_xlabel("step")
ax.set_ylabel("|loss - one process's| (no point: equal)", fontsize=8)
ax.legend(fontsize=8)
ax.set_title("Rounding stays at rounding's size; a bug starts far above it", fontsize=10)
figure.tight_layout()
plt.show()

# %% [markdown]
# (world-sizes-rule)=
# ## The rule
#
# Run the first step twice more in one process: once on the whole batch, once in as many
# micro-batches as you have ranks (or any other split). Their difference is the rounding
# this model and batch have. A sharded run whose first gradients (or losses) differ from one
# process by about that much is rounding; one that differs by orders of magnitude more, from
# the first step, computes something else: the data split, the loss normalisation
# ({ref}`tutorial-loss-and-accumulation`), a missed reduction. In the figure, rounding stays
# near its size step after step, and the bug starts far above it.
#
# What GPUs change, as expectation (no GPU run is recorded here): NCCL picks its reduction
# algorithm (ring or tree) and protocol by size and topology, so the order of the sum can
# change between world sizes and machines, and some CUDA kernels (atomics in scatter-add,
# some convolution and attention backward paths) are not deterministic from run to run
# unless `torch.use_deterministic_algorithms(True)` chooses others (or raises). Matrix
# products on GPUs also depend on the batch shape: torchtitan's `batch_invariant_mode`
# ([`docs/batch_invariant_mode.md`](https://github.com/pytorch/torchtitan)) swaps in kernels
# whose result for a row does not depend on the other rows, which is what a bit-equal
# comparison across world sizes needs there; torchtitan's `converging.md` compares loss
# curves across parallelisms within a tolerance instead.
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
