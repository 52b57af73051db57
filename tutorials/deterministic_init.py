# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# (tutorial-deterministic-init)=
# # The deterministic-init pitfall: N identical shards
#
# > If weight initialisation happens deterministically *after* sharding, the final
# > weights are N identical shards.
#
# **What you will learn**
#
# - to reproduce the pitfall, see it in the gathered weights, and measure the harm;
# - that the standard "build on `meta`, `fully_shard`, `to_empty`, initialise" recipe
#   walks straight into it on a CPU device mesh, with only a warning;
# - four fixes, each checked bit for bit against a single process that builds the same
#   model with the same seed, and what each costs.
#
# **What you need**: a CPU; 2 processes on gloo; about 25 seconds. The tips it
# demonstrates are listed {ref}`at the end <deterministic-init-tips>`.

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# ## The reference: one process, one seed
#
# Every fix below must produce exactly these weights.

# %%
import torch.nn as nn

SEED = 0


def make_model():
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))


def reference_model():
    torch.manual_seed(SEED)
    return make_model()


reference = {n: p.detach().clone() for n, p in reference_model().named_parameters()}


def equals_reference(weights):
    return all(torch.equal(weights[n], reference[n]) for n in reference)


# %% [markdown]
# ## The pitfall, on purpose
#
# Shard first, then let every rank initialise *its shard* with the same seed. Each rank
# draws the same numbers, so rank 0's rows and rank 1's rows are the same rows:

# %%
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from fsdp_guide import launch, summon_full_params


def shard(model):
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def gather(model):
    """Every parameter, full, as plain tensors (a collective: all ranks call it)."""
    with summon_full_params(model, writeback=False):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def init_after_sharding():
    model = shard(make_model())
    torch.manual_seed(SEED)
    with torch.no_grad():
        for p in model.parameters():
            nn.init.normal_(p.to_local(), std=0.25)  # each rank: its own shard
    return gather(model)


wrong = launch(init_after_sharding, world_size=2, output="none")[0]
w = wrong["0.weight"]  # (32, 16): rank 0 holds rows 0-15, rank 1 rows 16-31
print("rank 0's rows == rank 1's rows:", torch.equal(w[:16], w[16:]))
print("matrix rank:", torch.linalg.matrix_rank(w).item(), "of a possible", min(w.shape))

# %% [markdown]
# A 32x16 weight of independent random numbers has rank 16; this one has rank 16 too,
# but only because each half alone has rank 16. Its 32 output features come in 16
# identical pairs: the layer is really half as wide, and since the pairs get identical
# gradients, training never separates them. A square layer shows the rank loss directly:

# %%
def square_layer_after_sharding():
    layer = fully_shard(nn.Linear(16, 16))
    torch.manual_seed(SEED)
    with torch.no_grad():
        nn.init.normal_(layer.weight.to_local())
    return layer.weight.full_tensor()


square = launch(square_layer_after_sharding, world_size=2, output="none")[0]
print("16x16 weight initialised after sharding: rank",
      torch.linalg.matrix_rank(square).item(), "of 16")

# %%
import matplotlib.pyplot as plt

fig, axes = plt.subplots(1, 2, figsize=(7, 3.4))
for ax, (title, weight) in zip(axes, [("initialised after sharding", w),
                                      ("single process", reference["0.weight"])]):
    ax.imshow(weight, cmap="RdBu", vmin=-0.6, vmax=0.6)
    ax.set(title=title, xlabel="input feature", ylabel="output feature")
axes[0].axhline(15.5, color="black", linewidth=1)
fig.suptitle("first layer, 32x16: the two shards are copies")
fig.tight_layout()

# %% [markdown]
# ## The same bug, without trying: `meta` + `fully_shard` + `to_empty` on CPU
#
# The recipe for models too big to build whole is: build on the `meta` device (no
# memory), `fully_shard`, `to_empty` (allocate the shards), then initialise, e.g. with
# each module's `reset_parameters()`. The parameters are DTensors by then, so the random
# ops run through DTensor. On GPU meshes, DTensor coordinates the random number
# generator across ranks so that each shard draws a different part of one random stream
# (not executed here: this page ran on CPU). On a CPU mesh it does not: each rank uses
# its own generator, and all that says so is a warning:

# %%
import warnings


def meta_recipe():
    with torch.device("meta"):
        model = make_model()
    shard(model)
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            for layer in model:
                if isinstance(layer, nn.Linear):
                    layer.reset_parameters()
    messages = sorted({str(c.message) for c in caught})
    return gather(model), messages


meta_weights, messages = launch(meta_recipe, world_size=2, output="none")[0]
print("warnings:", messages)
w = meta_weights["0.weight"]
print("rank 0's rows == rank 1's rows:", torch.equal(w[:16], w[16:]))
print("equals the single process:", equals_reference(meta_weights))

# %% [markdown]
# ## Four fixes, each checked against the single process
#
# **1. Initialise before sharding.** Every rank builds the full model from the same seed,
# then shards it: each keeps its slice of identical full tensors (the quickstart does
# this).

# %%
def init_before_sharding():
    torch.manual_seed(SEED)
    return gather(shard(make_model()))


# %% [markdown]
# **2. FSDP1: `param_init_fn` on a `meta` model.** FSDP1 materialises each unit *full*,
# calls `param_init_fn` on its modules, and only then flattens and shards it. Seed first:

# %%
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def fsdp1_param_init_fn():
    with torch.device("meta"):
        model = make_model()

    def materialise(module):
        module.to_empty(device="cpu", recurse=False)
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()

    torch.manual_seed(SEED)
    fsdp = FSDP(model, param_init_fn=materialise, device_id=torch.device("cpu"),
                use_orig_params=True)
    with summon_full_params(fsdp, writeback=False):
        return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                for n, p in fsdp.named_parameters()}


# %% [markdown]
# **3. Broadcast rank 0's weights before sharding.** FSDP1's `sync_module_states=True` does
# this, but only for GPU modules, as it says on CPU:

# %%
def fsdp1_sync_module_states_on_cpu():
    try:
        FSDP(make_model(), sync_module_states=True, device_id=torch.device("cpu"))
    except ValueError as err:
        return str(err)


print(launch(fsdp1_sync_module_states_on_cpu, world_size=2, output="none")[0])

# %% [markdown]
# The same thing by hand works everywhere: only rank 0 needs the seed, the other ranks may
# hold anything.

# %%
def broadcast_from_rank_0():
    torch.manual_seed(SEED if dist.get_rank() == 0 else 1000 + dist.get_rank())
    model = make_model()
    with torch.no_grad():
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0)
    return gather(shard(model))


# %% [markdown]
# **4. `meta`, shard, `to_empty`, then initialise inside `summon_full_params`.** Keep the
# memory savings of the meta recipe, but initialise full tensors, one unit at a time:
# inside the context each rank draws the full tensor with the same seed, in the order the
# single process does, and keeps its slice.

# %%
def meta_then_summon():
    with torch.device("meta"):
        model = make_model()
    shard(model)
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)
    for layer in model:
        if isinstance(layer, nn.Linear):
            with summon_full_params(layer):  # one unit full at a time
                layer.reset_parameters()
    return gather(model)


# %%
FIXES = {
    "1. init before sharding": init_before_sharding,
    "2. FSDP1 param_init_fn on meta": fsdp1_param_init_fn,
    "3. broadcast from rank 0": broadcast_from_rank_0,
    "4. meta + to_empty + summon_full_params": meta_then_summon,
}
for name, fix in FIXES.items():
    per_rank = launch(fix, world_size=2, output="none")
    exact = all(equals_reference(weights) for weights in per_rank)
    print(f"{name:42} equals the single process exactly: {exact}")
    assert exact

# %% [markdown]
# All four are exact: same seed, same order of random draws, same numbers. The bug's
# version (initialising shards with per-shard random ops) cannot be made exact on CPU:
# each rank would need the part of the random stream that falls on its rows, which is
# what DTensor's coordinated RNG provides on GPUs and not on a CPU mesh.
#
# | fix | use it when | peak parameter memory per rank | extra cost |
# |---|---|---|---|
# | 1. init before sharding | the model fits on one rank | the whole model, until sharded | none |
# | 2. FSDP1 `param_init_fn` on `meta` | FSDP1, large models | shards + one full unit | none |
# | 3. broadcast from rank 0 (`sync_module_states` on GPU) | init that only rank 0 can do (e.g. loading weights) | the whole model, until sharded | one broadcast of the model |
# | 4. `meta` + `to_empty` + init in `summon_full_params` | FSDP2, large models, CPU or GPU | shards + one full unit | one all-gather of the model |
#
# (deterministic-init-tips)=
# ## What this showed, and the tips behind it
#
# - Initialising shards with the same seed gives identical shards; initialise full
#   tensors, before sharding or inside `summon_full_params`: {ref}`tip-init-before-sharding`.
# - The meta-device recipe with DTensor random ops silently produces the bug on a CPU
#   mesh: {ref}`tip-meta-init-cpu`.
# - Whole-tensor initialisation inside the context: {ref}`tip-custom-init-summon`, with the
#   same seed on every rank: {ref}`tip-same-seed-inside-summon`.
