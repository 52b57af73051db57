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
# (tutorial-pitfalls)=
# # Pitfalls: the wrong way failing, the right way working
#
# **What you will learn**: four mistakes FSDP users keep making, each shown failing and
# then fixed, on FSDP2 and, where it differs, FSDP1:
#
# 1. clipping gradients by a shard's norm instead of the global norm;
# 2. building the optimizer before sharding;
# 3. calling a method other than `forward` on an FSDP2 module;
# 4. editing weights outside forward and backward.
#
# **What you need**: a CPU; 2 processes on gloo; about 25 seconds. The tips are listed
# {ref}`at the end <pitfalls-tips>`.

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %%
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard

from fsdp_guide import launch, summon_full_params


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def shard(model):
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def my_slice(t):
    return t.chunk(dist.get_world_size())[dist.get_rank()]


def backward_on_my_slice(model):
    x, y = batch()
    F.mse_loss(model(my_slice(x)), my_slice(y)).backward()


# %% [markdown]
# ## 1. Clip by the global gradient norm
#
# Gradient clipping scales all gradients by `max_norm / total_norm`, where `total_norm` is
# the norm of *all* the gradients. A rank holds a shard of them: the norm of its shard is
# not the total, and differs from rank to rank, so each rank would scale differently.
# The reference is one process on the whole batch:

# %%
def single_process_grad_norm():
    model = make_model()
    x, y = batch()
    F.mse_loss(model(x), y).backward()
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9).item()


def fsdp2_grad_norms():
    model = shard(make_model())
    backward_on_my_slice(model)
    shard_norm = torch.linalg.vector_norm(
        torch.stack([p.grad.to_local().norm() for p in model.parameters()])).item()
    # On DTensor gradients, torch's clip_grad_norm_ reduces across ranks itself.
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
    return shard_norm, total.full_tensor().item()


def fsdp1_grad_norms():
    model = FSDP(make_model(), device_id=torch.device("cpu"))
    backward_on_my_slice(model)
    # On FSDP1's flat shards, torch's function sees only this rank's shard ...
    local = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9).item()
    # ... while the FSDP1 method reduces across ranks.
    return local, model.clip_grad_norm_(max_norm=1e9).item()


truth = single_process_grad_norm()
print(f"one process, whole batch:               total norm {truth:.6f}")
for rank, (shard_norm, total) in enumerate(launch(fsdp2_grad_norms, output="none")):
    print(f"FSDP2 rank {rank}: norm of its shard {shard_norm:.6f}, "
          f"clip_grad_norm_ {total:.6f}")
    assert abs(total - truth) < 1e-5 and abs(shard_norm - truth) > 0.1
for rank, (local, total) in enumerate(launch(fsdp1_grad_norms, output="none")):
    print(f"FSDP1 rank {rank}: torch.nn.utils.clip_grad_norm_ {local:.6f}, "
          f"model.clip_grad_norm_ {total:.6f}")
    assert abs(total - truth) < 1e-5 and abs(local - truth) > 0.1

# %% [markdown]
# With FSDP2, `torch.nn.utils.clip_grad_norm_` is right (it returns the norm as a
# `DTensor`; `.full_tensor()` makes it a number). With FSDP1, call the module's own
# `clip_grad_norm_`: the generic function only sees this rank's flat shard.
#
# ## 2. Build the optimizer after sharding
#
# Sharding replaces each parameter with a new one (a `DTensor` shard). An optimizer built
# before holds the old tensors, which no longer receive gradients: it steps nothing, and
# the loss never moves.

# %%
def train_three_steps(optimizer_first):
    model = make_model()
    if optimizer_first:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    shard(model)
    if not optimizer_first:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = batch()
    losses = []
    for _ in range(3):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(round(loss.item(), 5))
    return losses


for first, label in ((True, "optimizer built before sharding"),
                     (False, "optimizer built after sharding ")):
    losses = launch(train_three_steps, first, output="none")[0]
    print(f"{label}: losses {losses}")

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
    model = fully_shard(Generator())
    if register:
        register_fsdp_forward_method(model, "generate")
    try:
        return model.generate(torch.ones(2, 4)).tolist()
    except RuntimeError as err:
        return f"RuntimeError: {str(err).splitlines()[0][:96]}..."


print("unregistered:", launch(call_generate, False, output="none")[0])
print("registered:  ", launch(call_generate, True, output="none")[0])
print("one process: ", Generator().generate(torch.ones(2, 4)).tolist())

# %% [markdown]
# ## 4. Editing weights outside forward and backward
#
# After its first forward, FSDP2 holds its own references to each unit's sharded
# parameters and registers them on the module at every forward. Assigning a new
# `nn.Parameter` to `layer.bias` is therefore undone by the next forward: the edit is
# lost, silently. (FSDP1 is worse: outside forward its `layer.weight` is a view whose
# storage has been freed, as the {ref}`state tutorial <tutorial-state-attributes>`
# shows.) `summon_full_params` edits the full tensor and writes it back into the shards.

# %%
def edit_bias(use_summon):
    model = shard(make_model())
    model(torch.ones(2, 8))  # a first forward: FSDP2 has initialised itself
    if use_summon:
        with summon_full_params(model), torch.no_grad():
            model[0].bias.fill_(1.0)
    else:
        model[0].bias = nn.Parameter(torch.ones(16))  # a full new parameter
    seen = []

    def record_bias(module, args):
        seen.append(module.bias[:4].tolist())

    model[0].register_forward_pre_hook(record_bias)
    model(torch.ones(2, 8))
    return seen[0]


print("new Parameter assigned: the next forward sees",
      [round(v, 4) for v in launch(edit_bias, False, output="none")[0]])
print("summon_full_params:     the next forward sees",
      launch(edit_bias, True, output="none")[0])

# %% [markdown]
# (pitfalls-tips)=
# ## The tips behind these
#
# 1. {ref}`tip-clip-grad-norm`
# 2. {ref}`tip-optimizer-after-sharding`
# 3. {ref}`tip-fsdp-forward-method`
# 4. {ref}`tip-edit-weights-summon`
#
# Why a rank holds only part of each tensor: {ref}`fsdp-how-it-works`.
