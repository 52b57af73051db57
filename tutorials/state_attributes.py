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
# (tutorial-state-attributes)=
# # What FSDP keeps on each parameter, and when
#
# **What you will learn**
#
# - what a rank holds for each parameter, in one table, with
#   {func}`fsdp_guide.describe_sharding` (FSDP2, FSDP1 and plain modules);
# - the state FSDP2 keeps: `DTensor` parameters with `placements`, a `device_mesh` and a
#   local shard;
# - the state FSDP1 keeps on its `FlatParameter`: every attribute set at construction in
#   this torch version, most of them private;
# - a timeline, observed with hooks: what the module sees as its weight before, inside and
#   after forward and backward, and after the optimizer step.
#
# **What you need**: a CPU; 2 processes on gloo that stay up for the whole page (`%%ranks`,
# {ref}`tutorial-interactive`), so the two models are built once and looked at cell after
# cell; about 5 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The code
# is written to run unchanged with one GPU per rank (NCCL): FSDP1's `device_id` and the
# timeline's input are `device`, which `%%ranks` sets on each rank to {func}`fsdp_guide.device`,
# the rank's own GPU (`cuda:LOCAL_RANK`) where each rank has one, else the CPU (as on the
# machine that executed this page).
# Its idea as a plain torchrun script to copy: {ref}`state-attributes-script` ({download}`download <scripts/state_attributes.py>`).
#
# Private attributes change between torch versions; this page was executed with:

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# ## One table per rank: `describe_sharding`

# %%
# %load_ext fsdp_guide

# %%
# %%ranks -n 2 --return tables
import torch
import torch.nn as nn
from fsdp_guide import describe_sharding
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 2))


fsdp2 = make_model()  # FSDP2: each Linear a unit of its own, then the root
fully_shard(fsdp2[0])
fully_shard(fsdp2[2])
fully_shard(fsdp2)
fsdp1 = FSDP(make_model(), device_id=device)  # FSDP1 moves it to the rank's device
tables = {"FSDP2": describe_sharding(fsdp2), "FSDP1": describe_sharding(fsdp1)}

# %% [markdown]
# The two models now live on both ranks, and every later `%%ranks` cell of this page looks at
# them again, as they are: nothing is rebuilt ({ref}`tutorial-interactive` shows how). `--return
# tables` brought each rank's two tables back to the notebook, one per rank:

# %%
from IPython.display import display

for api in ("FSDP2", "FSDP1"):
    for rank in (0, 1):
        print(f"{api}, rank {rank}:")
        display(tables[rank][api])  # an HTML table on the site, aligned text elsewhere

import math
import re

# the figures the text quotes, from this run (JupyterLab shows glue's roles unrendered)
from myst_nb import glue

fsdp2_rows, fsdp1_rows = (
    [{row.name: row for row in tables[rank][api]} for rank in (0, 1)] for api in ("FSDP2", "FSDP1")
)


def first_to_last(span):
    """'elements 34:48 (flattened)' or 'at [0:14] of this rank's flat shard' -> '34 to 47'"""
    start, stop = re.search(r"(\d+):(\d+)", span).groups()
    return f"{start} to {int(stop) - 1}"


glue("sa_small_rows_0", fsdp2_rows[0]["2.weight"].local_shape[0], display=False)
glue("sa_small_rows_1", fsdp2_rows[1]["2.weight"].local_shape[0], display=False)
glue("sa_large_rows_0", fsdp2_rows[0]["0.weight"].local_shape[0], display=False)
glue("sa_large_rows_1", fsdp2_rows[1]["0.weight"].local_shape[0], display=False)
glue(
    "sa_flat_numel",
    sum(math.prod(row.local_shape) for rows in fsdp1_rows for row in rows.values()),
    display=False,
)
glue(
    "sa_flat_shard",
    sum(math.prod(row.local_shape) for row in fsdp1_rows[0].values()),
    display=False,
)
glue("sa_r1_weight_elements", first_to_last(fsdp1_rows[1]["0.weight"].holds), display=False)
glue("sa_r1_weight_at", first_to_last(fsdp1_rows[1]["0.weight"].placement), display=False)
glue("sa_r1_bias_at", first_to_last(fsdp1_rows[1]["0.bias"].placement), display=False)

# %% tags=["hide-input"] mystnb={"image": {"alt": "Two bars of the model's 68 numbers, parameter after parameter, coloured by the rank that holds each: with FSDP1 the first half of the flat vector is rank 0's and the second rank 1's, so 0.weight straddles the ranks and the rest lies on rank 1; with FSDP2 every parameter is split in two, its first rows on rank 0 and the rest on rank 1."}}
import matplotlib.pyplot as plt


def element_ranges(row, rank):
    """(first, stop) of the elements of the flattened parameter this rank's row says it holds."""
    if row.holds == "none":
        return None
    if row.holds.startswith("elements"):  # FSDP1: elements a:b (flattened)
        return tuple(map(int, re.search(r"(\d+):(\d+)", row.holds).groups()))
    rows = re.search(r"\[(\d+):(\d+)", row.holds).groups()  # FSDP2: rows a:b of dim 0
    per_row = math.prod(row.full_shape[1:])
    return int(rows[0]) * per_row, int(rows[1]) * per_row


fig, axes = plt.subplots(2, 1, figsize=(9, 2.6), sharex=True)
for ax, (api, by_rank) in zip(axes, (("FSDP1", fsdp1_rows), ("FSDP2", fsdp2_rows))):
    start = 0
    for name, row in by_rank[0].items():  # the parameters in the model's order
        for rank in (0, 1):
            held = element_ranges(by_rank[rank][name], rank)
            if held and held[1] > held[0]:
                left, width = start + held[0], held[1] - held[0]
                ax.barh(
                    0, width, left=left, color=plt.get_cmap("Pastel1").colors[rank], edgecolor="0.3"
                )
                ax.text(left + width / 2, 0, f"r{rank}", ha="center", va="center", fontsize=7)
        size = math.prod(row.full_shape)
        ax.text(start + size / 2, 0.55, name, ha="center", va="bottom", fontsize=7)
        ax.axvline(start, color="black", linewidth=1.5)
        start += size
    ax.set(
        xlim=(0, start), ylim=(-0.5, 1.1), yticks=[], title=f"{api}: who holds each number (r0, r1)"
    )
axes[1].set_xlabel(
    "the model's numbers, parameter after parameter (black lines: where a parameter starts)"
)
fig.tight_layout()

# %% [markdown]
# The figures in this text are this run's, taken from the outputs by myst-nb's `glue`; in
# JupyterLab, which does not render glue's roles, read them from the output above each paragraph.
#
# FSDP2 gives each rank a block of rows of every parameter (`torch.chunk` on dim 0, so the 2x6
# weight splits {glue:text}`sa_small_rows_0` + {glue:text}`sa_small_rows_1` and a 6x8 one
# {glue:text}`sa_large_rows_0` + {glue:text}`sa_large_rows_1`). FSDP1 concatenates all the
# parameters of a unit into one flat vector of {glue:text}`sa_flat_numel` numbers and gives each
# rank {glue:text}`sa_flat_shard` of them, so a parameter may sit wholly on one rank (`0.bias` on
# rank 1) or straddle both (`0.weight`). Each FSDP1 row says which elements of the flattened
# parameter the rank holds, and where they lie in its flat shard: rank 1 holds elements
# {glue:text}`sa_r1_weight_elements` of `0.weight` at positions {glue:text}`sa_r1_weight_at` of
# its shard, then all of `0.bias` at {glue:text}`sa_r1_bias_at`. `describe_sharding` returns a
# `ShardingTable`, which defines `_repr_html_` (`src/fsdp_guide/describe.py`): as the last line of
# a notebook cell it displays as an HTML table.
#
# ## FSDP2: parameters are DTensors


# %%
# %%ranks --return dtensor
w = fsdp2[0].weight
dtensor = {
    "type": type(w).__name__,
    "placements": w.placements,
    "mesh": str(w.device_mesh),
    "global shape": tuple(w.shape),
    "to_local().shape": tuple(w.to_local().shape),
    "full_tensor().shape": tuple(w.full_tensor().shape),
    "module class": type(fsdp2[0]).__name__,
}

# %%
for key, value in dtensor[1].items():
    print(f"rank 1  {key:20} {value}")

# %% [markdown]
# The parameter keeps its name and its global shape; `to_local()` is what this rank
# stores, `full_tensor()` all-gathers the whole (a collective: every rank must call it).
# `fully_shard` also changed the module's class to `FSDPLinear`, a subclass that adds
# `reshard()`, `unshard()` and friends.
#
# ## FSDP1: the `FlatParameter` and its private attributes
#
# Everything FSDP1 knows about a unit hangs on one `FlatParameter`. Here is every
# attribute it has right after construction in this torch version (the underscore means
# private: read them to understand, not to build on). More are added later: the first
# forward runs `FlatParamHandle.init_flat_param_attributes`
# (`torch/distributed/fsdp/_flat_param.py`), which adds `_local_shard` and
# `_full_param_padded` among others, and forward and backward set more (`_saved_grad_shard`,
# for one).


# %%
# %%ranks --return attributes
flat = fsdp1._handle.flat_param  # no forward has run on fsdp1 yet


def text(value):  # a set prints in hash order: sort it, so the page is the same every run
    return repr(sorted(value, key=repr)) if isinstance(value, set) else repr(value)


attributes = {name: (type(value).__name__, text(value)) for name, value in vars(flat).items()}


# %%
def short(text, width=58):
    return text if len(text) <= width else text[: width - 3] + "..."


for name, (kind, value) in attributes[0].items():
    print(f"{name:26} {kind:9} {short(value)}")

# %% [markdown]
# The ones worth knowing: `_fqns`, `_shapes` and `_numels` describe the original
# parameters in flattening order; `_unpadded_unsharded_size` is the flat length ({glue:text}`sa_flat_numel`) and
# `_sharded_size` a rank's share of it after padding; `_shard_param_infos` says which part
# of each original parameter lies in this rank's shard (what `describe_sharding` reads);
# `_shard_numel_padded` is the padding at the end of this rank's shard.
#
# ## A timeline: what the module sees, step by step
#
# Hooks record, for the first layer, what its `weight` attribute is and how much storage
# backs it: before the forward, inside it (a forward pre-hook), after it, inside the
# backward (a hook on the layer's output gradient), after the backward and after the
# optimizer step.

# %%
# %%ranks --return timeline2
from torch.distributed.tensor import DTensor


def record_timeline(model, layer, snapshot):
    rows = [snapshot("before forward")]
    layer.register_forward_pre_hook(lambda m, args: rows.append(snapshot("inside forward")))

    def on_output(module, args, output):
        output.register_hook(lambda grad: rows.append(snapshot("inside backward")))

    layer.register_forward_hook(on_output)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = model(torch.randn(4, 8).to(device))
    rows.append(snapshot("after forward"))
    out.sum().backward()
    rows.append(snapshot("after backward"))
    optimizer.step()
    rows.append(snapshot("after optimizer step"))
    return rows


shards, grad_types = {}, {}  # filled at each snapshot


def snapshot2(when):
    w = fsdp2[0].weight
    local = w.to_local() if isinstance(w, DTensor) else w
    grad = w.grad.to_local() if isinstance(w.grad, DTensor) else w.grad
    if isinstance(w, DTensor):  # the shard: where it lives, and a copy of its values
        shards[when] = (local.data_ptr(), local.detach().cpu().clone())
    if w.grad is not None:
        grad_types[when] = type(w.grad).__name__
    return (
        when,
        type(w).__name__,
        tuple(w.shape),
        local.untyped_storage().nbytes(),
        None if grad is None else tuple(grad.shape),
    )


rows = record_timeline(fsdp2, fsdp2[0], snapshot2)
(ptr_before, values_before), (ptr_after, values_after) = (
    shards["after backward"],
    shards["after optimizer step"],
)
timeline2 = {
    "rows": rows,
    "grad type": grad_types["after backward"],
    "same storage": ptr_before == ptr_after,
    "values changed": not torch.equal(values_before, values_after),
}

# %%
from fsdp_guide.table import Table

fsdp2_rank0 = timeline2[0]
header = ["when", "weight is a", "its shape", "bytes stored", "local grad"]
display(Table(header, fsdp2_rank0["rows"]))
print(f"after backward, weight.grad is a {fsdp2_rank0['grad type']}")
print(
    f"optimizer step: the shard's storage is the same: {fsdp2_rank0['same storage']}, "
    f"its values changed: {fsdp2_rank0['values changed']}"
)

fsdp2_when = {when: values for when, *values in fsdp2_rank0["rows"]}
glue("sa_fsdp2_full_bytes", fsdp2_when["inside forward"][2], display=False)
glue("sa_fsdp2_shard_bytes", fsdp2_when["before forward"][2], display=False)

# %% [markdown]
# FSDP2 swaps what is registered on the module: the sharded `DTensor` outside, the full plain
# `Parameter` ({glue:text}`sa_fsdp2_full_bytes` bytes instead of
# {glue:text}`sa_fsdp2_shard_bytes`) while the layer computes, in forward and again in backward.
# The gradient arrives after backward as a `DTensor` whose local part is the shard's shape, and
# the optimizer step changes the shard's values in the same storage: it updates the shard in
# place.


# %%
# %%ranks --return timeline1
layer, flat = fsdp1.module[0], fsdp1._handle.flat_param


def snapshot1(when):
    w = layer.weight
    return (
        when,
        type(w).__name__,
        tuple(w.shape),
        w.untyped_storage().nbytes(),
        flat.untyped_storage().nbytes(),
        None if flat.grad is None else tuple(flat.grad.shape),
    )


timeline1 = record_timeline(fsdp1, layer, snapshot1)

# %%
fsdp1_rank0 = timeline1[0]
header = ["when", "weight is a", "its shape", "weight's bytes", "flat's bytes", "flat grad"]
display(Table(header, fsdp1_rank0))

fsdp1_when = {when: values for when, *values in fsdp1_rank0}
glue("sa_fsdp1_freed_bytes", fsdp1_when["before forward"][2], display=False)  # the weight's
glue("sa_fsdp1_shard_bytes", fsdp1_when["before forward"][3], display=False)  # the FlatParameter's
glue("sa_fsdp1_full_bytes", fsdp1_when["inside forward"][3], display=False)

# %% [markdown]
# FSDP1 (with the default `use_orig_params=False`) leaves `layer.weight` a plain tensor of the
# full shape at all times, but it is a *view* into the unsharded flat parameter. Before the first
# forward and after backward its storage is freed ({glue:text}`sa_fsdp1_freed_bytes` bytes):
# reading or editing `layer.weight` there touches nothing real. Right after forward it still holds
# the gathered values, because FSDP1 does not *free* the root unit's gathered parameters after
# forward (backward needs them at once: `_post_forward_reshard` in
# `torch/distributed/fsdp/_runtime_utils.py` passes `free_unsharded_flat_param=False` for the
# root); it still points the `FlatParameter` back at its shard, as the table shows. This model
# has only the root unit. The `FlatParameter` itself points at its
# {glue:text}`sa_flat_shard`-number shard ({glue:text}`sa_fsdp1_shard_bytes` bytes) outside the
# computation and at the full {glue:text}`sa_flat_numel` numbers ({glue:text}`sa_fsdp1_full_bytes`
# bytes) inside it, and its gradient is a flat shard too. To read or change weights outside
# forward, use {func}`fsdp_guide.summon_full_params`.

# %%
# %ranks stop

# %% [markdown]
# (state-attributes-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/state_attributes.py`.
# It shards a small model with `fully_shard`, trains it one step, and rank 0 prints in one line
# what the first layer's weight is between steps (a `DTensor`, `Shard(dim=0)`, its local rows),
# inside its forward (the gathered `Parameter`), what its gradient and AdamW's state are, and
# whether the step updated the shard in place. The tests run this file under torchrun on 2 CPU
# ranks and check that line (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/state_attributes.py
# :language: python
# ```

# %% [markdown]
# (state-attributes-tips)=
# ## What this showed, and the tips behind it
#
# - `describe_sharding` shows what a rank holds, the same way for FSDP1 and FSDP2:
#   {ref}`tip-describe-sharding`.
# - FSDP1's `FlatParameter` attributes are private and version-dependent; FSDP2's
#   DTensor parameters are the public state: {ref}`tip-private-state`.
# - Outside forward and backward, a module's weights are shards (FSDP2) or views whose
#   storage is freed (FSDP1); in both, the root unit's own parameters stay gathered from
#   forward to backward:
#   {ref}`tip-custom-init-summon`.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("state_attributes")
