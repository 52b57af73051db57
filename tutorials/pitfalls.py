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
# (tutorial-pitfalls)=
# # Pitfalls: the wrong way failing, the right way working
#
# **What you will learn**: seven mistakes FSDP users keep making, each shown failing and
# then fixed, on FSDP2 and, where it differs, FSDP1:
#
# 1. clipping gradients by a shard's norm instead of the global norm;
# 2. building the optimizer before sharding, or after a forward;
# 3. calling a method other than `forward` on an FSDP2 module;
# 4. editing weights outside forward and backward;
# 5. expecting DDP's results from an optimizer that is not pointwise;
# 6. putting activation checkpointing around an FSDP unit instead of inside it;
# 7. running code on DTensors that DTensor has no sharding strategy for.
#
# **What you need**: a CPU; 2 processes on gloo; about 10 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The code
# is written to run unchanged with one GPU per rank (NCCL): each rank computes on
# {func}`fsdp_guide.device`, its own GPU (`cuda:LOCAL_RANK`) where each rank has one, else
# the CPU (as on the machine that executed this page). Batches are built on the CPU from
# seeded generators, so their numbers do not depend on the device, and moved there with
# `.to(device)`, inputs and targets alike. The tips are listed {ref}`at the end <pitfalls-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`pitfalls-script` ({download}`download <scripts/pitfalls.py>`).

# %%
import itertools
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %%
import fsdp_guide
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from fsdp_guide import launch, summon_full_params
from fsdp_guide.compare import largest_difference
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.debug import CommDebugMode


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def shard_each_linear(model):
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def my_slice(t):
    return t.chunk(dist.get_world_size())[dist.get_rank()]


def backward_on_my_slice(model, device):
    x, y = batch()
    x, y = x.to(device), y.to(device)
    F.mse_loss(model(my_slice(x)), my_slice(y)).backward()


# %% [markdown]
# (pitfalls-clip)=
# ## 1. Clip by the global gradient norm
#
# Gradient clipping scales all gradients by `max_norm / total_norm` (when that is below 1),
# where `total_norm` is the norm of *all* the gradients (`_clip_grads_with_norm_` in
# `torch/nn/utils/clip_grad.py`). A rank holds a shard of them: the norm of its shard is
# not the total, and differs from rank to rank, so clipping by it would scale each rank's
# gradients by a different factor. The cell below passes `max_norm=1e9`, far above every
# norm, so nothing is actually clipped: they compare the norm each call returns, which is
# the norm it would clip by. The reference is one process on the whole batch:


# %%
def single_process_grad_norm():
    model = make_model()
    x, y = batch()
    F.mse_loss(model(x), y).backward()
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9).item()


def fsdp2_grad_norms():
    device = fsdp_guide.device()
    model = shard_each_linear(make_model())
    backward_on_my_slice(model, device)
    shard_norm = torch.linalg.vector_norm(
        torch.stack([p.grad.to_local().norm() for p in model.parameters()])
    ).item()
    # On DTensor gradients, torch's clip_grad_norm_ reduces across ranks itself.
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
    return shard_norm, total.full_tensor().item()


def fsdp1_grad_norms():
    device = fsdp_guide.device()
    model = FSDP(make_model(), device_id=device)
    backward_on_my_slice(model, device)
    # On FSDP1's flat shards, torch's function sees only this rank's shard ...
    local = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9).item()
    # ... while the FSDP1 method reduces across ranks.
    return local, model.clip_grad_norm_(max_norm=1e9).item()


truth = single_process_grad_norm()
print(f"one process, whole batch:               total norm {truth:.6f}")
# One launch runs both: a process group is reusable, and one launch is one rendezvous.
results = launch(lambda: (fsdp2_grad_norms(), fsdp1_grad_norms()), output="none")
for rank, ((shard_norm, total), _) in enumerate(results):
    print(f"FSDP2 rank {rank}: norm of its shard {shard_norm:.6f}, clip_grad_norm_ {total:.6f}")
    assert abs(total - truth) < 1e-5 and abs(shard_norm - truth) > 0.1
for rank, (_, (local, total)) in enumerate(results):
    print(
        f"FSDP1 rank {rank}: torch.nn.utils.clip_grad_norm_ {local:.6f}, "
        f"model.clip_grad_norm_ {total:.6f}"
    )
    assert abs(total - truth) < 1e-5 and abs(local - truth) > 0.1

# %% [markdown]
# With FSDP2, `torch.nn.utils.clip_grad_norm_` is right (it returns the norm as a
# `DTensor`; `.full_tensor()` makes it a number). With FSDP1, call the module's own
# `clip_grad_norm_`: the generic function only sees this rank's flat shard.
#
# (pitfalls-optimizer-after-sharding)=
# ## 2. Build the optimizer after sharding, before any forward
#
# Sharding replaces each parameter with a new one (a `DTensor` shard). An optimizer built
# before holds the old tensors, which no longer receive gradients: it steps nothing, and
# the loss never moves.


# %%
def three_steps(model, optimizer, x, y):
    """Three optimizer steps on one batch; the loss before each."""
    losses = []
    for _ in range(3):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(round(loss.item(), 5))
    return losses


def train_three_steps(optimizer_first):
    device = fsdp_guide.device()
    model = make_model()
    if optimizer_first:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    shard_each_linear(model)
    if not optimizer_first:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = batch()
    return three_steps(model, optimizer, x.to(device), y.to(device))


before, after = launch(
    lambda: [train_three_steps(first) for first in (True, False)], output="none"
)[0]
print(f"optimizer built before sharding: losses {before}")
print(f"optimizer built after sharding:  losses {after}")

# %% [markdown]
# A forward between sharding and building the optimizer does the same to the root's
# parameters (pytorch/pytorch#149205). With the default `reshard_after_forward`, FSDP2 does
# not reshard the root after its forward, since backward comes next and would gather it
# again (`FSDPState._lazy_init` in `_fsdp_state.py` clears the root's post-forward reshard), so
# until the next backward the root's parameters are the gathered plain tensors, and
# `model.parameters()` hands those to the optimizer. Below, the whole model one unit (the
# root), and a forward before the optimizer, as a check of the untrained model's loss
# would do:


# %%
def forward_before_the_optimizer(order):
    device = fsdp_guide.device()
    model = fully_shard(make_model())  # one unit: the root holds every parameter
    x, y = batch()
    x, y = x.to(device), y.to(device)
    if order != "optimizer, then forward":
        with torch.no_grad():
            model(x)  # the untrained model's output
        if order == "forward, reshard(), optimizer":
            model.reshard()  # back to the shards
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    kinds = sorted({type(p).__name__ for p in optimizer.param_groups[0]["params"]})
    return kinds, three_steps(model, optimizer, x, y)


ORDERS = ("optimizer, then forward", "forward, then optimizer", "forward, reshard(), optimizer")
for order, (kinds, losses) in zip(
    ORDERS, launch(lambda: [forward_before_the_optimizer(o) for o in ORDERS], output="none")[0]
):
    print(f"{order:30} the optimizer holds {kinds}; losses {losses}")

# %% [markdown]
# After a forward the optimizer holds plain `Parameter`s, the gathered copies that the
# next reshard frees, and the loss never moves; `model.reshard()` before building it, or
# building it before any forward, gives it the `DTensor` shards. The same happens on
# torch 2.9.1 (`tests/test_sharp_edges.py` checks it on the oldest and newest supported
# torch).


# %% [markdown]
# ## 3. Methods other than `forward` on FSDP2 modules
#
# FSDP2 gathers a unit's parameters in hooks around `forward`. A method such as
# `generate` that calls submodules directly skips those hooks for the root, so it meets
# sharded `DTensor` parameters and fails. `register_fsdp_forward_method` gives the method
# the same hooks.

# %%
from torch.distributed.fsdp import register_fsdp_forward_method


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.embed(x)))

    def generate(self, x):
        return self.out(torch.tanh(self.embed(x))).argmax(-1)


def call_generate(register):
    device = fsdp_guide.device()
    model = fully_shard(Generator())
    if register:
        register_fsdp_forward_method(model, "generate")
    logits = []  # what `out` computes inside generate, as CPU tensors

    def record_logits(module, args, output):
        logits.append(output.detach().cpu())

    model.out.register_forward_hook(record_logits)
    try:
        return model.generate(torch.ones(2, 4).to(device)).tolist(), logits[0]
    except RuntimeError as err:
        return f"RuntimeError: {str(err).splitlines()[0]}", None  # the line that names the cause


(unregistered, _), (registered, logits) = launch(
    lambda: [call_generate(register) for register in (False, True)], output="none"
)[0]
one_process = Generator()
print("unregistered:", unregistered)
print("registered:  ", registered)
print("one process: ", one_process.generate(torch.ones(2, 4)).tolist())
print(
    "registered vs one process, max |logit difference|: "
    f"{(logits - one_process(torch.ones(2, 4))).abs().max().item():.1e}"
)

# %% [markdown]
# ## 4. Editing weights outside forward and backward
#
# After its first forward, FSDP2 holds its own references to each unit's sharded
# parameters and registers them on the module at every forward (`FSDPParam.to_unsharded`
# and `to_sharded` in `torch/distributed/fsdp/_fully_shard/_fsdp_param.py` set the
# module's attribute). Assigning a new `nn.Parameter` to `layer.bias` is therefore undone
# by the next forward: it sees the bias from before the edit, and the edit is lost,
# silently. (FSDP1 is worse: outside forward its `layer.weight` is a view whose
# storage has been freed, as the {ref}`state tutorial <tutorial-state-attributes>`
# shows.) `summon_full_params` edits the full tensor and writes it back into the shards.


# %%
def edit_bias(use_summon):
    device = fsdp_guide.device()
    model = shard_each_linear(make_model())
    model(torch.ones(2, 8).to(device))  # a first forward: FSDP2 has initialised itself
    if use_summon:
        with summon_full_params(model), torch.no_grad():
            model[0].bias.fill_(1.0)
    else:
        model[0].bias = nn.Parameter(torch.ones(16, device=device))  # a full new parameter
    seen = []

    def record_bias(module, args):
        seen.append(module.bias[:4].tolist())

    model[0].register_forward_pre_hook(record_bias)
    model(torch.ones(2, 8).to(device))
    return seen[0]


assigned, summoned = launch(lambda: [edit_bias(summon) for summon in (False, True)], output="none")[
    0
]
print(
    "the bias before the edit (one process):      ",
    [round(v, 4) for v in make_model()[0].bias[:4].tolist()],
)
print("new Parameter assigned: the next forward sees", [round(v, 4) for v in assigned])
print("summon_full_params:     the next forward sees", summoned)

# %% [markdown]
# (pitfalls-pointwise-optimizers)=
# ## 5. Only pointwise optimizers give DDP's results
#
# DDP keeps every parameter whole on every rank; FSDP gives each rank a shard. An
# optimizer whose update for an element depends only on that element's own gradient and
# state (SGD, Adam, AdamW: *pointwise*) computes the same numbers on a shard as on the
# whole tensor. One that looks across a tensor does not: Adafactor factors its second
# moment over rows and columns and scales the step by the parameter's RMS; Muon
# orthogonalises the whole gradient matrix. Five steps of each, on the same data, against
# DDP on the same 2 ranks:

# %%
from unittest import mock

from torch.nn.parallel import DistributedDataParallel as DDP

OPTIMIZERS = {
    "AdamW": lambda params: torch.optim.AdamW(params, lr=1e-2),
    "Adafactor": lambda params: torch.optim.Adafactor(params, lr=1e-2),
    "Muon": lambda params: torch.optim.Muon(params, lr=1e-2),
}


def make_matrix_model():  # Muon takes only 2-D parameters: no biases
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16, bias=False), nn.Tanh(), nn.Linear(16, 4, bias=False))


def full_weights(model):
    if FSDP.fsdp_modules(model):  # FSDP1: gather the shards (flat ones, too) first
        with FSDP.summon_full_params(model):
            return torch.cat([p.detach().flatten() for p in model.parameters()])
    full = [getattr(p, "full_tensor", p.detach)() for p in model.parameters()]  # DTensor or not
    return torch.cat([p.flatten() for p in full])


def five_steps(model, make_optimizer, device):
    optimizer = make_optimizer(list(model.parameters()))
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
        x, y = x.to(device), y.to(device)
        F.mse_loss(model(my_slice(x)), my_slice(y)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return full_weights(model)


def difference_from_ddp(make_optimizer, build, device):
    ddp = five_steps(DDP(make_matrix_model().to(device)), make_optimizer, device)
    try:
        return f"{(five_steps(build(), make_optimizer, device) - ddp).abs().max().item():.1e}"
    except (RuntimeError, ValueError) as err:
        return f"{type(err).__name__}: {str(err).splitlines()[0]}"  # the line that names the cause


def compare_optimizers():
    device = fsdp_guide.device()
    builds = {
        "FSDP2": lambda: shard_each_linear(make_matrix_model()),
        "FSDP1": lambda: FSDP(make_matrix_model(), device_id=device),
    }
    return {
        (opt, api): difference_from_ddp(make_optimizer, build, device)
        for opt, make_optimizer in OPTIMIZERS.items()
        for api, build in builds.items()
    }


print("optimizer  API    max |weight - DDP| after 5 steps")
for (opt, api), result in launch(compare_optimizers, output="none")[0].items():
    print(f"{opt:10} {api:6} {result}")

# %% [markdown]
# AdamW matches DDP exactly, on both. The others fail in three different ways:
#
# - **Adafactor on FSDP1 runs and silently computes something else** (its row above).
#   FSDP1 hands the optimizer one flat 1-D shard per unit, and in `torch/optim/_adafactor.py`
#   `Adafactor._init_group` factors the second moment only for gradients with more than one
#   dimension, while `_single_tensor_adafactor` scales the step by the RMS of the tensor it
#   is given (`param.norm(2) / sqrt(param.numel())`): here the flat shard's, not each
#   weight matrix's.
# - **Adafactor on FSDP2 stops with the error above.** `_single_tensor_adafactor` squares,
#   in place, the norm of the gradient over dimension -2
#   (`torch.norm(grad, dim=-2, keepdim=True).square_()`), which is the sharded dimension:
#   that norm is a `_NormPartial` DTensor, one partial result per rank still to be
#   combined. `square_` (`aten.pow_`) needs the combined value, a change of placement, and
#   DTensor refuses to make one in place (the message comes from
#   `expand_to_full_mesh_op_strategy` in `torch/distributed/tensor/_ops/utils.py`).
# - **Muon on FSDP1 refuses** the flat 1-D parameters.
# - **Muon on FSDP2 runs, on the DTensor gradients**, and lands close to DDP but not on
#   it. Muon orthogonalises in bfloat16 (`grad.bfloat16()` in
#   `_zeropower_via_newtonschulz`, `torch/optim/_muon.py`). An experiment (not a recipe)
#   shows that bfloat16 rounding is all of the difference but float32 rounding: let
#   `.bfloat16()` mean float32 for one run.


# %%
def muon_in_float32():
    device = fsdp_guide.device()
    with mock.patch.object(torch.Tensor, "bfloat16", torch.Tensor.float):
        return difference_from_ddp(
            OPTIMIZERS["Muon"], lambda: shard_each_linear(make_matrix_model()), device
        )


print(
    "Muon, FSDP2, iterating in float32: max |weight - DDP| =",
    launch(muon_in_float32, output="none")[0],
)

# %% [markdown]
# So: with a pointwise optimizer, FSDP and DDP agree. With any other, check the
# optimizer against DDP on a small model before a long run: it must either work on
# DTensors through DTensor operations (as Muon does here), or gather what it needs
# itself.
#
# (pitfalls-checkpoint-inside-unit)=
# ## 6. Activation checkpointing goes inside the FSDP unit
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


print(
    f"{'':6} {'checkpoint':12} {'placement':12} all-gathers  reduce-scatters  max |w - 1 process|"
)
rows = launch(compare_checkpoint_placements, output="none")[0]
for api, impl, where, gathers, scatters, error in rows:
    print(f"{api:6} {impl:12} {where:12} {gathers:11}  {scatters:15}  {error:.1e}")

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
# ## 7. Code on DTensors with no sharding strategy
#
# Under FSDP2 every parameter, gradient and optimizer moment is a `DTensor`, and each
# operation on one needs a sharding strategy: a rule for which input placements it
# accepts and what it returns. Most operations have one; code an optimizer or a training
# loop adds can meet one without. Below, a max-norm constraint that rescales each row of
# each weight to a norm of at most 0.5 after every step, `weight.renorm(2, 0, 0.5)`. The two
# ways out: apply it to the rank's own shard (`to_local()`), which is right for
# elementwise code and for code that works on whole rows, since FSDP shards dimension 0
# (by default: not with `shard_placement_fn`, nor under tensor parallelism);
# or tell DTensor which placements the operation accepts with `register_sharding`. Each
# trains 3 steps against one process:

# %%
MAX_ROW_NORM = 0.5


def renorm_sharded_rows(x, p, dim, maxnorm):
    """renorm's placements: each slice along `dim` is rescaled alone, so split along `dim` it stays on one rank."""
    from torch.distributed.tensor import Replicate, Shard

    return [
        ([Shard(dim)], [Shard(dim), None, None, None]),
        ([Replicate()], [Replicate(), None, None, None]),
    ]


def train_with_row_max_norm(how):
    device = fsdp_guide.device()
    model = make_model().to(device)
    if how != "one process":
        shard_each_linear(model)
    if how == "register_sharding":
        from torch.distributed.tensor.experimental import register_sharding
        from torch.ops import aten

        register_sharding(aten.renorm.default)(renorm_sharded_rows)  # in this process only
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = batch()
    x, y = x.to(device), y.to(device)
    if how != "one process":
        x, y = my_slice(x), my_slice(y)
    for _ in range(3):
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for weight in (model[0].weight, model[2].weight):
                if how == "to_local()":  # the rank's rows: FSDP shards dimension 0
                    weight.to_local().copy_(weight.to_local().renorm(2, 0, MAX_ROW_NORM))
                else:  # one process, the DTensor as it is, or with the strategy registered
                    weight.copy_(weight.renorm(2, 0, MAX_ROW_NORM))
    return [
        (w.full_tensor() if how != "one process" else w).detach().cpu()
        for w in (model[0].weight, model[2].weight)
    ]


alone = launch(train_with_row_max_norm, "one process", world_size=1, output="none")[0]
for how in ("on the DTensor", "to_local()", "register_sharding"):
    try:
        weights = launch(train_with_row_max_norm, how, world_size=2, output="none")[0]
        error = largest_difference(zip(weights, alone))
        largest = torch.stack([w.norm(dim=1).max() for w in weights]).max().item()  # a NaN shows
        print(f"{how:18} largest row norm {largest:.3f}; max |weight - one process| = {error:.1e}")
    # every rank raised it: the one that exited first is chance
    except fsdp_guide.LaunchError as failure:
        print(
            f"{how:18} ranks {sorted(failure.failed)} raised {str(failure).splitlines()[0].split(' raised ', 1)[1]}"
        )

# %% [markdown]
# On the DTensor the step fails with DTensor's message. On the rank's own rows it is
# right, but only because renorm works row by row and every row is whole on one rank: an
# operation that mixes rows (a norm over the whole matrix, as the first pitfall shows for
# clipping) would compute on the shard alone. `register_sharding` says so once for
# DTensor, which then runs the operation on each rank's shard when the placements match
# and redistributes when they do not. The function it registers must be true for the
# operation: DTensor uses the placements it returns as given (`_register_sharding.py`), so
# a strategy that accepts a placement the operation cannot work on gives wrong numbers
# without an error. `register_sharding` is experimental in torch 2.13 (its
# docstring).


# %% [markdown]
# (pitfalls-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/pitfalls.py`.
# It avoids the pitfall a training script meets first,
# {ref}`the second <pitfalls-optimizer-after-sharding>`: it builds the optimizer after `fully_shard`
# and before any forward. Rank 0 prints how many of the optimizer's parameters are `DTensor`
# shards, then the largest difference of the losses from one process's. The tests run it on 2 CPU
# ranks and check that all of them are shards and that the difference is at most 1e-5
# (`tests/test_scripts.py`). The wrong way is {ref}`above <pitfalls-optimizer-after-sharding>`.
#
# ```{literalinclude} scripts/pitfalls.py
# :language: python
# ```

# %% [markdown]
# (pitfalls-tips)=
# ## The tips behind these
#
# 1. {ref}`tip-clip-grad-norm`
# 2. {ref}`tip-optimizer-after-sharding`
# 3. {ref}`tip-fsdp-forward-method`
# 4. {ref}`tip-edit-weights-summon`
# 5. {ref}`tip-pointwise-optimizers`
# 6. {ref}`tip-checkpoint-inside-unit`
# 7. {ref}`tip-no-sharding-strategy`
#
# Why a rank holds only part of each tensor: {ref}`fsdp-how-it-works`.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("pitfalls")
