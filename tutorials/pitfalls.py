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
# # The step on shards: clipping, the optimizer, and which optimizers
#
# **What you will learn**: under FSDP each rank's optimizer steps a shard of every
# parameter, and three mistakes follow from forgetting it, each shown failing and then
# fixed, on FSDP2 and, where it differs, FSDP1:
#
# 1. clipping gradients by a shard's norm instead of the global norm;
# 2. building the optimizer before sharding, or after a forward;
# 3. expecting DDP's results from an optimizer that is not pointwise.
#
# Code that touches a sharded model outside forward and backward (other methods, edited
# weights, operations DTensor has no strategy for) is {ref}`its own page
# <tutorial-outside-forward>`, and where activation checkpointing goes
# {ref}`another <tutorial-checkpoint-placement>`.
#
# **What you need**: a CPU; 2 processes on gloo; about 5 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The code
# is written to run unchanged with one GPU per rank (NCCL): each rank computes on
# {func}`fsdp_guide.device`, its own GPU (`cuda:LOCAL_RANK`) where each rank has one, else
# the CPU (as on the machine that executed this page). Batches are built on the CPU from
# seeded generators, so their numbers do not depend on the device, and moved there with
# `.to(device)`, inputs and targets alike. The tips are listed {ref}`at the end <pitfalls-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`pitfalls-script` ({download}`download <scripts/pitfalls.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %%
import fsdp_guide
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from fsdp_guide import launch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard


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
# (pitfalls-pointwise-optimizers)=
# ## 3. Only pointwise optimizers give DDP's results
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

# %% [markdown]
# (pitfalls-script)=
# ## The script to copy
#
# The lesson a training script meets first, {ref}`the second <pitfalls-optimizer-after-sharding>`,
# as a plain torchrun script with torch alone: {download}`scripts/pitfalls.py`. It builds the
# optimizer after `fully_shard` and before any forward. Rank 0 prints how many of the optimizer's parameters are `DTensor`
# shards, then the largest difference of the losses from one process's. The tests run it on 2 CPU
# ranks and check that all of them are shards and that the difference is at most 1e-5
# (`tests/test_scripts.py`). The wrong way is {ref}`above <pitfalls-optimizer-after-sharding>`.
#
# ```{literalinclude} scripts/pitfalls.py
# :language: python
# ```

# %% [markdown]
# (pitfalls-tips)=
# ## The tips behind this
#
# 1. {ref}`tip-clip-grad-norm`
# 2. {ref}`tip-optimizer-after-sharding`
# 3. {ref}`tip-pointwise-optimizers`
#
# Why a rank holds only part of each tensor: {ref}`fsdp-how-it-works`.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("pitfalls")
