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
# (tutorial-deterministic-init)=
# # The deterministic-init pitfall: N identical shards
#
# > If weight initialisation happens deterministically *after* sharding, the final
# > weights are N identical shards.
#
# **What you will learn**
#
# - to reproduce the pitfall and see it in the gathered weights: repeated rows, and a
#   square layer that loses half its rank;
# - that the standard "build on `meta`, `fully_shard`, `to_empty`, initialise" recipe
#   walks straight into it on a CPU device mesh, with only a warning;
# - four fixes, each checked bit for bit against a single process that builds the same
#   model with the same seed, and what each needs.
#
# **What you need**: a CPU; 2 processes on gloo; about 5 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The code
# is written to run unchanged with one GPU per rank (NCCL), except two demonstrations that
# are about the CPU and stay on it on purpose. The tips it demonstrates are listed
# {ref}`at the end <deterministic-init-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`deterministic-init-script` ({download}`download <scripts/deterministic_init.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# ## The reference: one process, one seed
#
# Every fix below must produce exactly these weights. torch's Reproducibility notes warn
# that results may not be reproducible between CPU and GPU executions, even with identical
# seeds, so the reference is drawn where the sharded models below are: on the rank's device,
# {func}`fsdp_guide.device` (the rank's own GPU, `cuda:LOCAL_RANK`, where each rank has
# one, else the CPU, as on the machine that executed this page). Rank 0 builds it alone,
# with no collective: what it returns is one process's model, as CPU tensors.

# %%
import fsdp_guide
import torch.nn as nn
from fsdp_guide import launch

SEED = 0


def make_model():
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))


def reference_weights():
    device = fsdp_guide.device()
    torch.manual_seed(SEED)
    with device:  # draw on the rank's device, as the sharded models do
        model = make_model()
    return {n: p.detach().cpu() for n, p in model.named_parameters()}


reference = launch(reference_weights, world_size=2, output="none")[0]  # rank 0's


def equals_reference(weights):
    return all(torch.equal(weights[n], reference[n]) for n in reference)


# %% [markdown]
# ## The pitfall, on purpose
#
# Shard first, then let every rank initialise *its shard* with the same seed. Each rank
# draws the same numbers, so rank 0's rows and rank 1's rows are the same rows:

# %%
import torch.distributed as dist
from fsdp_guide import summon_full_params
from torch.distributed.fsdp import fully_shard


def shard(model, mesh=None):  # mesh=None: fully_shard's default, over all ranks
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def gather(model):
    """Every parameter, full, as plain CPU tensors (a collective: all ranks call it)."""
    with summon_full_params(model, writeback=False):
        return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


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
weight_rank = torch.linalg.matrix_rank(w).item()
print("matrix rank:", weight_rank, "of a possible", min(w.shape))

from myst_nb import glue  # the figure the text below quotes, from this run

glue("sharded_init_rank", weight_rank, display=False)

# %% [markdown]
# A 32x16 weight of independent random numbers has rank 16; this one has rank {glue:text}`sharded_init_rank` too
# (this run's, glued from the line above by myst-nb's `glue`; JupyterLab does not render it: read it there),
# but only because each half alone has rank 16. Its 32 output features start as 16
# identical pairs. A square layer shows the rank loss directly:


# %%
def square_layer_after_sharding():
    layer = fully_shard(nn.Linear(16, 16))
    torch.manual_seed(SEED)
    with torch.no_grad():
        nn.init.normal_(layer.weight.to_local())
    return layer.weight.full_tensor().cpu()


square = launch(square_layer_after_sharding, world_size=2, output="none")[0]
print(
    "16x16 weight initialised after sharding: rank",
    torch.linalg.matrix_rank(square).item(),
    "of 16",
)

# %% mystnb={"image": {"alt": "Two heat maps of the first layer's 32 by 16 weight. Initialised after sharding (left), the rows above and below the line at row 16 show the same pattern: the two shards are copies. Initialised as one process would (right), no such repetition."}}
import matplotlib.pyplot as plt

fig, axes = plt.subplots(1, 2, figsize=(7, 3.4))
for ax, (title, weight) in zip(
    axes, [("initialised after sharding", w), ("single process", reference["0.weight"])]
):
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
# ops run through DTensor.
#
# This trap belongs to CPU meshes, so the cell stays on the CPU on purpose, wherever it
# runs: `launch(..., backend="gloo")` keeps every rank on the CPU, and the mesh is
# a CPU mesh. What differs on GPUs is in torch's source (`torch/distributed/tensor/_random.py`;
# not executed here): on a CUDA mesh, DTensor's `OffsetBasedRNGTracker` is written to
# coordinate the random number generator across ranks, so that each shard draws a
# different part of one random stream, and `is_rng_supported_mesh` says that only
# CUDA-like devices get this. On a CPU mesh each rank uses its own generator, and all
# that says so is a warning:

# %%
import warnings

from torch.distributed.device_mesh import init_device_mesh


def meta_recipe():
    world = dist.get_world_size()
    cpu_mesh = init_device_mesh("cpu", (world,))  # cpu-only: the trap is a CPU-mesh one
    with torch.device("meta"):
        model = make_model()
    shard(model, cpu_mesh)
    model.to_empty(device="cpu")  # cpu-only: the shards of the CPU mesh
    torch.manual_seed(SEED)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            for layer in model:
                if isinstance(layer, nn.Linear):
                    layer.reset_parameters()
    messages = sorted({f"{c.category.__name__}: {c.message}" for c in caught})
    return gather(model), messages


meta_weights, messages = launch(meta_recipe, world_size=2, backend="gloo", output="none")[0]
print("warnings:", messages)
w = meta_weights["0.weight"]
print("rank 0's rows == rank 1's rows:", torch.equal(w[:16], w[16:]))
print("equals the single process:", equals_reference(meta_weights))

# %% [markdown]
# ## Four fixes, each checked against the single process
#
# **1. Initialise before sharding.** Every rank builds the full model from the same seed,
# on its device, then shards it: each keeps its slice of identical full tensors (the
# quickstart does this).


# %%
def init_before_sharding():
    device = fsdp_guide.device()
    torch.manual_seed(SEED)
    with device:  # drawn where the reference was drawn
        model = make_model()
    return gather(shard(model))


# %% [markdown]
# **2. FSDP1: `param_init_fn` on a `meta` model.** FSDP1 materialises each unit *full*,
# calls `param_init_fn` on its modules, and only then flattens and shards it. Seed first:

# %%
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def fsdp1_param_init_fn():
    device = fsdp_guide.device()
    with torch.device("meta"):
        model = make_model()

    def materialise(module):
        module.to_empty(device=device, recurse=False)
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()

    torch.manual_seed(SEED)
    fsdp = FSDP(model, param_init_fn=materialise, device_id=device, use_orig_params=True)
    with summon_full_params(fsdp, writeback=False):
        return {
            n.replace("_fsdp_wrapped_module.", ""): p.detach().cpu().clone()
            for n, p in fsdp.named_parameters()
        }


# %% [markdown]
# **3. Broadcast rank 0's weights before sharding.** FSDP1's `sync_module_states=True` does
# this, but only for GPU modules. The cell keeps the module on the CPU on purpose (and
# `backend="gloo"` keeps the ranks there), to show what FSDP1 says to a CPU module. With a
# GPU `device_id`, torch documents that each FSDP module broadcasts its parameters and
# buffers from rank 0 instead (not executed here).


# %%
def fsdp1_sync_module_states_on_cpu():
    try:
        cpu = torch.device("cpu")  # cpu-only: shows FSDP1's refusal on CPU
        FSDP(make_model(), sync_module_states=True, device_id=cpu)
    except ValueError as err:
        return f"{type(err).__name__}: {err}"


print(launch(fsdp1_sync_module_states_on_cpu, world_size=2, backend="gloo", output="none")[0])

# %% [markdown]
# The same thing by hand works on any device: only rank 0 needs the seed, the other ranks
# may hold anything. The tensors it broadcasts are on the rank's device (torch.distributed's
# backend table lists NCCL for GPU tensors only).


# %%
def broadcast_from_rank_0():
    device = fsdp_guide.device()
    torch.manual_seed(SEED if dist.get_rank() == 0 else 1000 + dist.get_rank())
    with device:
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
    device = fsdp_guide.device()
    with torch.device("meta"):
        model = make_model()
    shard(model)
    model.to_empty(device=device)
    torch.manual_seed(SEED)
    for layer in model:
        if isinstance(layer, nn.Linear):
            with summon_full_params(layer):  # one unit full at a time
                layer.reset_parameters()
    return gather(model)


# %% [markdown]
# (deterministic-init-meta-errors)=
# Two steps of fix 4 are easy to miss, and each has its message: a forward before
# `to_empty` (the shards are still on `meta`, with no data), and `.to(device)` in place of
# `to_empty` (`.to` copies, and there is nothing to copy from):

# %%
import traceback


def meta_mistakes():
    said = []
    for mistake in ("forward before to_empty", "to() instead of to_empty"):
        with torch.device("meta"):
            model = make_model()
        try:
            if mistake == "forward before to_empty":
                shard(model)
                model(torch.ones(1, model[0].in_features, device=fsdp_guide.device()))
            else:
                model.to(fsdp_guide.device())
        except (RuntimeError, NotImplementedError) as error:
            said.append(f"{mistake}: " + "".join(traceback.format_exception_only(error)).strip())
    return said


print(*launch(meta_mistakes, world_size=2, output="none")[0], sep="\n")

# %% [markdown]
# Both are fixed by fix 4's order: `to_empty(device=...)` allocates the shards (uninitialised
# memory), then the initialisation fills them.

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
# All four are exact: same seed, same order of random draws, on the same kind of device,
# same numbers. The bug's version (initialising shards with per-shard random ops) is not
# exact here: each rank draws from its own generator as if its rows were the whole tensor.
# On CUDA meshes DTensor's RNG gives each shard its own part of one Philox stream
# (`OffsetBasedRNGTracker` in `torch/distributed/tensor/_random.py`), so the shards differ;
# whether they then equal one process's draw is not checked here (no GPU run).
#
# The table's last two columns are what each method needs by construction, not
# measurements: this page only checks the weights. "One full unit" assumes one unit per
# block; fix 2 above passes no wrap policy, so its one unit is the whole model.
#
# | fix | use it when | parameter memory per rank, by construction (not measured here) | extra communication, by construction |
# |---|---|---|---|
# | 1. init before sharding | the model fits on one rank | the whole model, until sharded | none |
# | 2. FSDP1 `param_init_fn` on `meta` | FSDP1, large models | shards + one full unit | none |
# | 3. broadcast from rank 0 (`sync_module_states` on GPU) | init that only rank 0 can do (e.g. loading weights) | the whole model, until sharded | one broadcast of the model |
# | 4. `meta` + `to_empty` + init in `summon_full_params` | FSDP2, large models, CPU or GPU | shards + one full unit | one all-gather of the model |

# %% [markdown]
# (deterministic-init-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/deterministic_init.py`.
# `torchrun --nproc-per-node=2 deterministic_init.py` builds the model on `meta`, shards it,
# allocates the shards with `to_empty` and fills them as fix 4 does, without the guide's
# `summon_full_params`: one layer at a time, every rank draws the full tensors with the same seed
# and keeps its slice. Rank 0 prints the largest difference from one process's model built with
# that seed; the tests run it on 2 CPU ranks and check that the difference is 0
# (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/deterministic_init.py
# :language: python
# ```

# %% [markdown]
# (deterministic-init-tips)=
# ## What this showed, and the tips behind it
#
# - Initialising shards with the same seed gives identical shards; initialise full
#   tensors, before sharding or inside `summon_full_params`: {ref}`tip-init-before-sharding`.
# - The meta-device recipe with DTensor random ops silently produces the bug on a CPU
#   mesh: {ref}`tip-meta-init-cpu`.
# - Whole-tensor initialisation inside the context: {ref}`tip-custom-init-summon`, with the
#   same seed on every rank: {ref}`tip-same-seed-inside-summon`.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("deterministic_init")
