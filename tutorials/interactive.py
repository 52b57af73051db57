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
# (tutorial-interactive)=
# # Exploring a sharded model interactively
#
# **What you will learn**
#
# - how to keep ranks, with their process group, running from one notebook cell to the next
#   (`%%ranks`), so a sharded model built in one cell can be looked at in the next;
# - what each rank holds of a `fully_shard`-ed model, around a forward and backward: the
#   placements, each rank's shard, the gradients, the full tensor, and what changes when the
#   wrapping does;
# - what happens when a cell fails on one rank while the other waits in a collective;
# - how to run an unmodified torchrun script from the notebook (`%torchrun`).
#
# **What you need**: a CPU; 2 processes on gloo; about 10 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The same code
# is written to run unchanged with one GPU per rank (NCCL): each rank's `device` is
# {func}`fsdp_guide.device`, its GPU `cuda:LOCAL_RANK` where it has one, else the CPU.
# The tips are listed {ref}`at the end <interactive-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`interactive-script` ({download}`download <scripts/interactive.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# ## Ranks that stay up
#
# `%load_ext fsdp_guide` adds the magics. The first `%%ranks` cell starts 2 ranks, each a
# process with its process group ready, and runs the cell on both; every later `%%ranks` cell
# runs in the same ranks, so what a cell defines stays. Each rank starts with `rank`,
# `world_size` and `device` defined. What the ranks print is shown once where they printed
# the same, and per rank where they did not.
#
# (interactive-start)=

# %%
# %load_ext fsdp_guide

# %%
# %%ranks -n 2
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

torch.manual_seed(0)  # the same weights on every rank
model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2)).to(device)
for layer in (model[0], model[2]):
    fully_shard(layer)
fully_shard(model)
model

# %% [markdown]
# Each `fully_shard` turned its module into an FSDP unit (`FSDPLinear`), and each parameter
# into a `DTensor`: the full shape, a placement, and the shard this rank keeps:

# %%
# %%ranks
for name, p in model.named_parameters():
    print(f"{name:8} {tuple(p.shape)} {p.placements} shard {tuple(p.to_local().shape)}")

# %% [markdown]
# The same on both ranks, so shown once: `Shard(dim=0)` splits each parameter's rows
# between the ranks. The rows themselves differ, so the ranks' outputs are shown apart:

# %%
# %%ranks
model[0].weight.to_local()[:, :3]  # this rank's rows, the first 3 columns

# %% [markdown]
# ## A forward and backward, and the gradients
#
# Each rank runs the model on a batch of its own and backward; the gradients come out
# sharded like the parameters, each rank holding its rows of the gradient averaged over both
# ranks' batches (FSDP2's reduce-scatter divides by the world size):

# %%
# %%ranks
torch.manual_seed(rank)  # each rank its own batch
x = torch.randn(4, 6, device=device)
model(x).sum().backward()
grad = model[0].weight.grad
print(type(grad).__name__, grad.placements, tuple(grad.to_local().shape))

# %% [markdown]
# `--return` brings a variable back to the notebook, one value per rank. `full_tensor()` is
# a collective (every rank gathers every shard), so each rank can return the whole weight,
# and the notebook can check that the ranks agree and that the weight is the one seed 0 made:

# %%
# %%ranks --return full
full = model[0].weight.full_tensor().detach().cpu()

# %%
torch.manual_seed(0)
unsharded = torch.nn.Linear(6, 8).weight.detach()
print("both ranks gathered the same weight:", torch.equal(full[0], full[1]))
print("it is the unsharded model's:", torch.equal(full[0], unsharded))

# %% [markdown]
# To look at the whole weights in place, in the model, FSDP1's `summon_full_params` has no
# FSDP2 method; {func}`fsdp_guide.summon_full_params` does the same for a `fully_shard`-ed
# model: inside the block each parameter is a full plain tensor, after it the shards are back:

# %%
# %%ranks
from fsdp_guide import summon_full_params

with summon_full_params(model):
    print("inside: ", type(model[0].weight).__name__, tuple(model[0].weight.shape))
print("outside:", type(model[0].weight).__name__, tuple(model[0].weight.to_local().shape))

# %% [markdown]
# ## A different wrapping, looked at again
#
# With `reshard_after_forward=False` on a unit, the forward leaves its parameters gathered
# for the backward, which then does not all-gather them again. The root unit does so by
# default already (FSDP2 sets the flag to `False` for the root and `True` for the others when
# it is not given, as `fully_shard`'s docstring says), so the flag goes on the layers. A second
# model beside the first shows the difference, between forward and backward:

# %%
# %%ranks
kept = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2)).to(device)
for layer in (kept[0], kept[2]):
    fully_shard(layer, reshard_after_forward=False)
fully_shard(kept)
for name, m in (("default", model), ("reshard_after_forward=False", kept)):
    out = m(x)
    after_forward = type(m[0].weight).__name__
    out.sum().backward()
    print(
        f"{name:27} 0.weight after forward: {after_forward}, after backward: {type(m[0].weight).__name__}"
    )

# %% [markdown]
# By default the layer's weight is a shard again as soon as its forward ends; with the flag it
# stays a plain full `Parameter` until its backward, then it is a shard again.

# %% [markdown]
# ## When a cell fails on one rank
#
# A mistake that raises on one rank only leaves the other waiting in the next collective. In
# a script the failing rank exits, its peers' collectives fail on the closed connection and
# torchrun stops them all; here the failing rank stays up, so its peer would wait until the
# process group's timeout. Below, rank 0 logs a loss that no cell defined. The rank still in
# the cell is interrupted; one that does not stop within 2 s (blocked in the collective) is
# shown where it waits, and the ranks are started again, empty:
#
# (interactive-failure)=

# %% tags=["raises-exception"]
# %%ranks
if rank == 0:
    print(f"loss {loss.item():.3f}")  # no cell defined loss
dist.all_reduce(torch.ones(1, device=device))

# %% [markdown]
# Rank 0's traceback is in the output, and rank 1's stack shows it in `all_reduce`, on line
# 3 of the cell. The ranks were restarted: the next cell starts from an empty namespace.
# Had every rank raised, or had rank 1 stopped when interrupted, the ranks would have kept
# their state, once a check found that every rank had issued as many collectives as the
# others. Ctrl-C (Jupyter's stop button) ends a cell on every rank the same way, and a cell
# run with `%%ranks --timeout 60` ends after 60 s with each rank's stack. With NCCL (not run
# here), we expect rank 1's all-reduce to be queued without blocking, so rank 1 ends the
# cell, and the check to find it one collective ahead of rank 0: the same restart.

# %% [markdown]
# ## What a cell costs
#
# A cell on live ranks sends the code to ranks that are already running; a
# {func}`fsdp_guide.launch` starts its ranks and their process group for each call. Both
# below run a one-element all-reduce on 2 ranks, the live ones through
# {class}`fsdp_guide.live.Ranks`, the object behind `%%ranks`:
#
# (interactive-cost)=

# %% tags=["alone"]
import statistics
import time

from fsdp_guide import Ranks, launch
from fsdp_guide.table import Table
from myst_nb import glue


def all_reduce_one():
    import torch
    import torch.distributed as dist
    from fsdp_guide import device

    t = torch.ones(1, device=device())
    dist.all_reduce(t)
    return t.item()


def median_ms(call, times):
    seconds = []
    for _ in range(times):
        start = time.perf_counter()
        assert call() == [2.0, 2.0]  # the all-reduce ran on both ranks
        seconds.append(time.perf_counter() - start)
    return 1000 * statistics.median(seconds)


with Ranks(world_size=2) as ranks:  # the API behind %%ranks, from Python
    live = median_ms(lambda: ranks.run(all_reduce_one), 20)
fresh = median_ms(lambda: launch(all_reduce_one, world_size=2), 5)
glue("live_ms", live, display=False)
glue("launch_ms", fresh, display=False)
glue("live_faster", fresh / live, display=False)
Table(
    ["2 ranks, one all-reduce", "median ms"],
    [["live ranks", f"{live:.1f}"], ["launch", f"{fresh:.1f}"]],
)

# %% [markdown]
# A cell on live ranks took {glue:text}`live_ms:.1f` ms here, {glue:text}`live_faster:.0f`
# times less than a launch ({glue:text}`launch_ms:.0f` ms). Use live ranks to explore; use
# `launch`, whose ranks are new each time, where a page must show that a result does not
# depend on what ran before.

# %% [markdown]
# ## A torchrun script, run from the notebook
#
# `%torchrun` runs an unmodified torchrun script, one that calls `init_process_group` itself,
# on local ranks with torchrun's environment, and streams each rank's output into the cell
# ({func}`fsdp_guide.run` from Python). This page's script repeats the exploration above,
# rank 0 printing what every rank holds:
#
# (interactive-torchrun)=

# %%
# %torchrun --nproc-per-node 2 scripts/interactive.py

# %%
# %ranks stop

# %% [markdown]
# (interactive-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/interactive.py`.
# It shards the same model, runs a forward and backward and prints, for every rank, the first layer's
# placement and shard, its gradient's placement, whether the gathered weight is the unsharded
# model's, and what `reshard_after_forward=False` leaves after forward and after backward. The
# tests run this file under torchrun on 2 CPU ranks and check each line
# (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/interactive.py
# :language: python
# ```

# %% [markdown]
# (interactive-tips)=
# ## The tips behind this
#
# - {ref}`tip-live-ranks`

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("interactive")
