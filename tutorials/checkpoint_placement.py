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
# (tutorial-checkpoint-placement)=
# # Activation checkpointing inside the FSDP unit
#
# **What you will learn**
#
# - why activation checkpointing goes *inside* an FSDP unit (`fully_shard(checkpoint_wrapper(block))`),
#   with the collectives counted for every placement, on FSDP2 and FSDP1, with torch's two
#   checkpoint implementations, and the weights after a step checked against one process;
# - why the reentrant implementation trains nothing on an input that needs no gradient, and
#   the non-reentrant one does.
#
# **What you need**: a CPU; 2 processes on gloo; about 5 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The code
# is written to run unchanged with one GPU per rank (NCCL): each rank computes on
# {func}`fsdp_guide.device`, its own GPU (`cuda:LOCAL_RANK`) where each rank has one, else
# the CPU (as on the machine that executed this page). Inputs are built on the CPU from
# seeded generators, so their numbers do not depend on the device, and moved there with
# `.to(device)`. The tips are listed {ref}`at the end <checkpoint-placement-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`checkpoint-placement-script` ({download}`download <scripts/checkpoint_placement.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %%
import itertools

import fsdp_guide
import torch.distributed as dist
import torch.nn as nn
from fsdp_guide import launch
from fsdp_guide.table import Table
from IPython.display import display
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.debug import CommDebugMode


def my_slice(t):
    return t.chunk(dist.get_world_size())[dist.get_rank()]


def full_weights(model):
    if FSDP.fsdp_modules(model):  # FSDP1: gather the shards (flat ones, too) first
        with FSDP.summon_full_params(model):
            return torch.cat([p.detach().flatten() for p in model.parameters()])
    full = [getattr(p, "full_tensor", p.detach)() for p in model.parameters()]  # DTensor or not
    return torch.cat([p.flatten() for p in full])


# %% [markdown]
# (pitfalls-checkpoint-inside-unit)=
# ## Checkpoint inside the unit, then shard it
#
# Activation checkpointing drops a block's activations in forward and recomputes them in
# backward. Apply it *inside* the FSDP unit, `FSDP(checkpoint_wrapper(block))` or
# `fully_shard(checkpoint_wrapper(block))`, so the recomputation runs while FSDP has the
# unit's parameters gathered for its backward. Wrapped *around* the unit (or around the
# whole model), the recomputation runs the unit's forward again. The cell counts the
# collectives in one forward and backward of three units for every arrangement, with
# torch's two checkpoint implementations, and checks the weights after one SGD step
# against one process:

# %%
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)


def make_blocks():
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3)))


def one_sgd_step(model, x):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with CommDebugMode() as comm:
        model(x).square().mean().backward()
    optimizer.step()
    counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    return counts, model


PLACEMENTS = ("inside", "around", "whole-model")  # the last: one checkpoint around it all


def checkpointed(wrap, impl, where):
    """Three blocks, each an FSDP unit made by `wrap`, checkpointed at `where`."""

    def checkpoint(module):
        return checkpoint_wrapper(module, checkpoint_impl=impl)

    model = make_blocks()
    for i, block in enumerate(model):
        if where == "inside":
            model[i] = wrap(checkpoint(block))
        elif where == "around":
            model[i] = checkpoint(wrap(block))
        else:
            model[i] = wrap(block)
    model = wrap(model)
    return checkpoint(model) if where == "whole-model" else model


def compare_checkpoint_placements():
    device = fsdp_guide.device()
    # requires_grad: reentrant checkpointing only records a graph for inputs that need one
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_()
    _, reference = one_sgd_step(make_blocks().to(device), x)  # one process, the whole batch
    wraps = {
        "FSDP1": lambda m: FSDP(m, device_id=device, use_orig_params=True),
        "FSDP2": fully_shard,
    }
    rows = []
    for api, impl, where in itertools.product(wraps, CheckpointImpl, PLACEMENTS):
        counts, model = one_sgd_step(checkpointed(wraps[api], impl, where), my_slice(x))
        # every c10d all-gather op
        all_gathers = sum(n for op, n in counts.items() if "allgather" in op)
        error = (full_weights(model) - full_weights(reference)).abs().max().item()
        reduce_scatters = counts["_reduce_scatter_base_"]
        rows.append((api, impl.name.lower(), where, all_gathers, reduce_scatters, error))
    return rows


rows = launch(compare_checkpoint_placements, output="none")[0]
shown = []
for api, impl, where, gathers, scatters, error in rows:
    shown.append([api, impl, where, gathers, scatters, f"{error:.1e}"])
header = ["API", "checkpoint", "placement", "all-gathers", "reduce-scatters", "max |w - 1 process|"]
display(Table(header, shown))

from myst_nb import glue  # the counts the text below quotes, from this table

all_gathers = {(api, impl, where): gathers for api, impl, where, gathers, _, _ in rows}
glue("fsdp1_reentrant_around", all_gathers["FSDP1", "reentrant", "around"], display=False)
glue("fsdp1_reentrant_inside", all_gathers["FSDP1", "reentrant", "inside"], display=False)
glue("fsdp1_whole_model", all_gathers["FSDP1", "no_reentrant", "whole-model"], display=False)
fsdp2_counts = {n for (api, _, _), n in all_gathers.items() if api == "FSDP2"}
assert len(fsdp2_counts) == 1, fsdp2_counts  # the prose: the same in every arrangement
glue("fsdp2_all_gathers", fsdp2_counts.pop(), display=False)

# %% [markdown]
# The counts below are this run's, glued from the table by myst-nb's `glue` (JupyterLab does
# not render glue's roles: read them in the table).
#
# Every arrangement trains correctly, but not at the same cost. With FSDP1 and the
# reentrant implementation (`torch.utils.checkpoint.checkpoint(..., use_reentrant=True)`,
# still common in older code) around each unit, the recomputation all-gathers every unit
# a second time: {glue:text}`fsdp1_reentrant_around` all-gathers instead of {glue:text}`fsdp1_reentrant_inside`, half as much parameter traffic again. Around
# the whole model, even the non-reentrant one makes {glue:text}`fsdp1_whole_model`. FSDP2 recognises the recomputation:
# `FSDPState._pre_forward` (`torch/distributed/fsdp/_fully_shard/_fsdp_state.py`) returns
# early while the unit is in `TrainingState.PRE_BACKWARD`, all-gathering only a unit that
# is not already unsharded, so on this torch it makes {glue:text}`fsdp2_all_gathers` in every arrangement. Inside the
# unit never makes more all-gathers than any other arrangement, on either API: checkpoint
# each block, then shard it.
#
# The `UserWarning`s printed with the table (the collectives are counted with it) come from `CommDebugMode`, not from the model. On
# entry it registers a full backward pre-hook on every module (`_CommModeModuleTracker.__enter__`
# in `torch/distributed/tensor/debug/_comm_mode.py`), and torch runs such hooks by passing each
# module's output through an identity autograd function (`BackwardHook` in
# `torch/utils/hooks.py`, `BackwardHookFunction`): FSDP2 then sees a view as the unit's output
# and warns. With an input that needs no gradient (not this cell's), the hook also warns
# that it fires with respect to the module's outputs (`BackwardHook` takes that branch
# when no input requires grad); {ref}`cluster`'s HSDP cell shows it.
#
# (pitfalls-reentrant-frozen-input)=
# The cell above makes its input require a gradient, because the reentrant implementation
# needs one: it records a graph only when an input of the checkpointed call requires
# grad. When every block is checkpointed and nothing before them trains (a frozen
# embedding under LoRA, or a plain input), the loss has no graph at all:

# %%
import traceback
import warnings


def checkpointed_blocks_on_a_frozen_input(impl):
    device = fsdp_guide.device()
    model = make_blocks().to(device)
    for i, block in enumerate(model):
        model[i] = fully_shard(checkpoint_wrapper(block, checkpoint_impl=impl))
    fully_shard(model)
    # needs no grad
    x = my_slice(torch.randn(8, 32, generator=torch.Generator().manual_seed(1))).to(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model(x).square().mean().backward()
            outcome = f"trained: {sum(p.grad is not None for p in model.parameters())} gradients"
        except RuntimeError as error:
            outcome = "".join(traceback.format_exception_only(error)).strip()
    return outcome, sorted(
        {f"{w.category.__name__}: {w.message}" for w in caught if "requires_grad" in str(w.message)}
    )


def both_implementations():
    return {
        impl.name.lower(): checkpointed_blocks_on_a_frozen_input(impl) for impl in CheckpointImpl
    }


for impl, (outcome, said) in launch(both_implementations, output="none")[0].items():
    print(f"{impl}:", *said, outcome, sep="\n    ")

# %% [markdown]
# The reentrant implementation warns that no input requires grad, and the backward then
# finds a loss with no graph. The non-reentrant one (`use_reentrant=False`, which torch
# recommends: `torch.utils.checkpoint.checkpoint` still falls back to the reentrant one,
# with a warning, when it is not passed) records the parameters' graph whatever the input.
# transformers 5.24's `activation_checkpointing_enable()` (the new name of
# `gradient_checkpointing_enable`, which it deprecates) does both by default: it passes
# `use_reentrant=False` and, for a model that takes `input_ids` or carries PEFT adapters,
# calls `enable_input_require_grads()`, which makes the embedding's output require grad
# (`PreTrainedModel._activation_checkpointing_enable` in `transformers/modeling_utils.py`).

# %% [markdown]
# (checkpoint-placement-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/checkpoint_placement.py`.
# It wraps each block with `checkpoint_wrapper` (non-reentrant) first and shards it second, counts
# the all-gathers of one forward and backward with and without checkpointing (`CommDebugMode`; its
# module hooks are what make FSDP2 warn about a view, as {ref}`above
# <pitfalls-checkpoint-inside-unit>`), then trains on an input that needs no gradient and compares
# the losses with one process's. The tests run it on 2 CPU ranks and check that checkpointing
# inside the units adds no all-gather, that the loss falls, and that it is within 1e-5 of one
# process's (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/checkpoint_placement.py
# :language: python
# ```

# %% [markdown]
# (checkpoint-placement-tips)=
# ## The tips behind this
#
# - {ref}`tip-checkpoint-inside-unit`
#
# Why a rank holds only part of each tensor: {ref}`fsdp-how-it-works`.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("checkpoint_placement")
