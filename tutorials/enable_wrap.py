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
# (tutorial-enable-wrap)=
# # Choosing FSDP units: `enable_wrap`, `wrap` and automatic wrapping
#
# **What you will learn**
#
# - how `enable_wrap(wrapper_cls=..., **params)` with `wrap(...)` applies the same FSDP
#   parameters to every unit you mark, with FSDP1 (`FullyShardedDataParallel`) and
#   with FSDP2 (`fully_shard`), and how to override them for one unit;
# - how FSDP1's `auto_wrap_policy` chooses units, and how {func}`fsdp_guide.auto_wrap`
#   makes the same choice for FSDP2, which has no policy argument;
# - how wrapping each block as you build it keeps a model that does not fit in one
#   process from ever existing whole: its parameter bytes counted between blocks, against
#   building first, and against building on the `meta` device.
#
# **What you need**: a CPU; 2 processes on gloo; about 5 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The code
# is written to run unchanged with one GPU per rank (NCCL): every rank takes its device from
# {func}`fsdp_guide.device`, the rank's own GPU (`cuda:LOCAL_RANK`) where each rank has one,
# else the CPU (as on the machine that executed this page). The tips it demonstrates are
# listed {ref}`at the end <enable-wrap-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`enable-wrap-script` ({download}`download <scripts/enable_wrap.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# ## Same parameters for every unit: `enable_wrap` and `wrap`
#
# Inside `enable_wrap`, `wrap(module)` calls `wrapper_cls(module, **params)`; outside it,
# `wrap` returns the module unchanged. With FSDP1, each wrapped block becomes a
# `FullyShardedDataParallel` unit with the context's `device_id` (the rank's device) and
# `sharding_strategy`, except the one that overrides it:

# %%
import fsdp_guide
import torch.nn as nn
from fsdp_guide import launch
from fsdp_guide.table import Table
from IPython.display import display
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy, fully_shard
from torch.distributed.fsdp.wrap import enable_wrap, wrap


def block(width=8):
    return nn.Sequential(nn.Linear(width, width), nn.GELU())


def fsdp1_units():
    device = fsdp_guide.device()
    with enable_wrap(
        wrapper_cls=FSDP, device_id=device, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP
    ):
        model = wrap(
            nn.Sequential(
                wrap(block()),
                wrap(block()),
                wrap(block(), sharding_strategy=ShardingStrategy.FULL_SHARD),
            )
        )
    return [
        (name.replace("_fsdp_wrapped_module.", "") or "(root)", unit.sharding_strategy.name)
        for name, unit in model.named_modules()
        if isinstance(unit, FSDP)
    ]


for name, strategy in launch(fsdp1_units, world_size=2, output="none")[0]:
    print(f"FSDP1 unit {name:7} sharding_strategy={strategy}")

# %% [markdown]
# `fully_shard` works as a `wrapper_cls` too. Its counterpart of `SHARD_GRAD_OP` is
# `reshard_after_forward=False`: the unit keeps its parameters gathered from forward to
# backward. That is visible right after a forward: the unit's weight is still a plain
# tensor of the full shape, where a unit that reshards is back to a `DTensor` whose rank
# holds half the rows.

# %%
from torch.distributed.tensor import DTensor


def fsdp2_units():
    device = fsdp_guide.device()
    with enable_wrap(wrapper_cls=fully_shard, reshard_after_forward=False):
        model = nn.Sequential(
            wrap(block()), wrap(block()), wrap(block(), reshard_after_forward=True)
        )
    fully_shard(model)
    model(torch.randn(2, 8).to(device))
    weights = [b[0].weight for b in model]
    return [
        (
            str(i),
            type(w).__name__,
            tuple(w.shape),
            tuple((w.to_local() if isinstance(w, DTensor) else w).shape),
        )
        for i, w in enumerate(weights)
    ]


for name, kind, shape, held in launch(fsdp2_units, world_size=2, output="none")[0]:
    print(
        f"FSDP2 unit {name} after forward: weight is a {kind}, shape {shape}, "
        f"this rank holds {held}"
    )

# %% [markdown]
# ## Automatic wrapping
#
# FSDP1 can choose the units itself from a policy: by module class
# (`ModuleWrapPolicy`), or by size (`size_based_auto_wrap_policy` wraps a subtree once it
# holds at least `min_num_params` parameters not already in a unit). `fully_shard` takes
# no policy; {func}`fsdp_guide.auto_wrap` asks torch's policy code which modules to
# shard, so it chooses what FSDP1 chooses (except a module that shares a parameter with one
# outside it, a tied embedding, which stays in the unit around both), then calls
# `fully_shard` on them bottom-up and on the root.
#
# (fsdp2-fsdpmodule)=

# %%
import functools

from fsdp_guide import auto_wrap
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy


class Block(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.attn = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        return x + self.mlp(x + self.attn(x))


class Net(nn.Module):
    def __init__(self, depth=2):
        super().__init__()
        self.embed = nn.Linear(4, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(16, 2)


POLICIES = {
    "ModuleWrapPolicy({Block})": lambda: ModuleWrapPolicy({Block}),
    "size_based, min_num_params=1000": lambda: functools.partial(
        size_based_auto_wrap_policy, min_num_params=1000
    ),
}


def units_chosen(policy_name):
    device = fsdp_guide.device()
    fsdp1 = FSDP(Net(), auto_wrap_policy=POLICIES[policy_name](), device_id=device)
    fsdp2 = auto_wrap(Net(), POLICIES[policy_name]())
    return {
        "FSDP1 auto_wrap_policy": [
            n.replace("_fsdp_wrapped_module.", "") or "(root)"
            for n, m in fsdp1.named_modules()
            if isinstance(m, FSDP)
        ],
        "fsdp_guide.auto_wrap": [
            n or "(root)" for n, m in fsdp2.named_modules() if isinstance(m, FSDPModule)
        ],
    }


for policy_name in POLICIES:
    chosen = launch(units_chosen, policy_name, world_size=2, output="none")[0]
    print(policy_name)
    for api, units in chosen.items():
        print(f"  {api:24} {', '.join(units)}")
    assert chosen["FSDP1 auto_wrap_policy"] == chosen["fsdp_guide.auto_wrap"]

# %% [markdown]
# By size, the policy looks at the leaves first: each of the two linear layers of a
# block's `mlp` (1,088 and 1,040 parameters) crosses the threshold and becomes a unit;
# nothing of the `mlp` is left over, and `attn` (272 parameters) never crosses it, so it
# joins the root.
#
# ## Wrapping as you build: the model never exists whole
#
# The second use of `wrap`: a model too big for one process's memory can be built one
# block at a time, each block sharded as soon as it exists. Between blocks, a rank's
# parameters then take its shards plus one full block. What we count: the bytes of the
# storages reachable from the modules' `parameters()` on each rank (a shard counts its
# local storage), right after each block is built, building a 16-block model three ways;
# the table shows the largest count on rank 0. This is not the process's memory peak (a
# `fully_shard` call briefly holds a block and this rank's shard of it, and the allocator may keep freed
# memory). Each block is built directly on the rank's device, whose memory is the one that
# runs out:

# %%
N_BLOCKS, WIDTH = 16, 512


class Stack(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)


def parameter_bytes(modules):
    """Bytes of parameter storage these modules hold on this rank (meta tensors hold none)."""
    storages = {}
    for module in modules:
        for p in module.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            if local.device.type != "meta":
                storage = local.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def build_then_wrap():
    device = fsdp_guide.device()
    blocks, peak = [], 0
    for _ in range(N_BLOCKS):
        blocks.append(nn.Linear(WIDTH, WIDTH, device=device))
        peak = max(peak, parameter_bytes(blocks))
    model = Stack(blocks)
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    return peak, parameter_bytes([model])


def wrap_as_you_build():
    device = fsdp_guide.device()
    blocks, peak = [], 0
    with enable_wrap(wrapper_cls=fully_shard):
        for _ in range(N_BLOCKS):
            blocks.append(nn.Linear(WIDTH, WIDTH, device=device))  # one full block ...
            peak = max(peak, parameter_bytes(blocks))
            blocks[-1] = wrap(blocks[-1])  # ... sharded at once
    model = fully_shard(Stack(blocks))
    return peak, parameter_bytes([model])


def on_meta_then_materialise():
    device = fsdp_guide.device()
    with torch.device("meta"):  # shapes only: no storage at all
        model = Stack([nn.Linear(WIDTH, WIDTH) for _ in range(N_BLOCKS)])
    peak = parameter_bytes([model])
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    model.to_empty(device=device)  # allocates the local shards only
    peak = max(peak, parameter_bytes([model]))
    # The weights are still uninitialised here: see the deterministic-init tutorial.
    return peak, parameter_bytes([model])


BUILDS = {
    "build, then wrap": build_then_wrap,
    "wrap as you build": wrap_as_you_build,
    "meta device, shard, to_empty": on_meta_then_materialise,
}
measured = {name: launch(fn, world_size=2, output="none") for name, fn in BUILDS.items()}

full_model = N_BLOCKS * (WIDTH * WIDTH + WIDTH) * 4
print(f"full model: {full_model:,} bytes of fp32 parameters")
print(
    "parameter bytes on rank 0: the most between blocks, its ratio to building first's, and after sharding"
)
baseline = measured["build, then wrap"][0][0]
rows = []
for name, per_rank in measured.items():
    peak, after = per_rank[0]
    rows.append([name, f"{peak:,}", f"{peak / baseline:.2f}", f"{after:,}"])
display(Table(["build", "most between blocks", "ratio", "after sharding"], rows))

# the figures the text quotes, from this run (JupyterLab shows glue's roles unrendered)
from myst_nb import glue

glue("wrap_build_first", baseline / full_model, display=False)
glue("wrap_as_you_build", measured["wrap as you build"][0][0] / baseline, display=False)

# %% [markdown]
# The figures in this text are this run's, taken from the outputs by myst-nb's `glue`; in
# JupyterLab, which does not render glue's roles, read them from the output above each paragraph.
#
# Building first needs the whole model on every rank: {glue:text}`wrap_build_first:.0%`. Wrapping
# as you build reaches at most the shards of the blocks built so far plus one full block: 15/16 ·
# 1/2 + 1/16 ≈ {glue:text}`wrap_as_you_build:.2f` of it, approaching 1/world_size as blocks get
# smaller relative to the model. The full block's storage is gone once it is sharded because
# nothing refers to it any more: `FSDPParam._init_sharded_param`
# (`torch/distributed/fsdp/_fully_shard/_fsdp_param.py`) copies the rank's rows into a new shard
# and lets the original "be freed normally when its ref count reaches 0", as its comment says.
# (While `fully_shard` copies a block into its shard, the block and its shard briefly exist together; the counts
# above are taken between blocks.) On the `meta` device nothing is allocated until `to_empty`,
# which allocates only the shards: 1/world_size. But `to_empty` leaves the memory uninitialised,
# and initialising *after* sharding is where the
# {ref}`deterministic-init pitfall <tip-init-before-sharding>` waits.

# %%
for per_rank in measured.values():
    assert per_rank[0][1] == per_rank[1][1] == full_model // 2  # same shards every way
assert measured["wrap as you build"][0][0] < 0.6 * baseline
assert measured["meta device, shard, to_empty"][0][0] == full_model // 2

# %% [markdown]
# (enable-wrap-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/enable_wrap.py`.
# Its three ways of building cut to the one to copy: `torchrun --nproc-per-node=2 enable_wrap.py`
# builds a 16-block model on every rank twice, once whole and then sharded, once with each block
# `wrap`-ped into `fully_shard` as it is built (the last block overriding the context's
# `reshard_after_forward`), and rank 0 prints the most parameter bytes a rank held while building
# each way, as a fraction of the model, and that both give the same output. The tests run it on
# 2 CPU ranks and check that wrapping as you build stays under 0.6 of the model, building first
# holds all of it, a rank holds half once sharded, and the outputs agree (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/enable_wrap.py
# :language: python
# ```

# %% [markdown]
# (enable-wrap-tips)=
# ## What this showed, and the tips behind it
#
# - `enable_wrap` gives every `wrap`-ed unit the same FSDP parameters, FSDP1 or FSDP2,
#   with per-call overrides: {ref}`tip-enable-wrap`.
# - FSDP2 has no `auto_wrap_policy`; `fsdp_guide.auto_wrap` chooses the same units
#   FSDP1 does, but for tied parameters: {ref}`tip-auto-wrap-fsdp2`.
# - Wrapping as you build (or building on `meta`) keeps the whole model from ever
#   existing on one rank: {ref}`tip-wrap-as-you-build`.
#
# What a unit is and why its size sets peak memory: {ref}`fsdp-sharding`.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("enable_wrap")
