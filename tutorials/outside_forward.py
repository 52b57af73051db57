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
# (tutorial-outside-forward)=
# # Outside forward: other methods, edited weights, DTensor operations
#
# **What you will learn**: FSDP2 gathers a unit's parameters only in hooks around its
# `forward` and its backward; everywhere else they are `DTensor` shards. Three mistakes
# follow from forgetting it, each shown failing and then fixed against one process:
#
# 1. calling a method other than `forward` on an FSDP2 module;
# 2. editing weights outside forward and backward;
# 3. running code on DTensors that DTensor has no sharding strategy for.
#
# What the optimizer step gets wrong on shards is {ref}`its own page <tutorial-pitfalls>`.
#
# **What you need**: a CPU; 1 and 2 processes on gloo; about 5 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The code
# is written to run unchanged with one GPU per rank (NCCL): each rank computes on
# {func}`fsdp_guide.device`, its own GPU (`cuda:LOCAL_RANK`) where each rank has one, else
# the CPU (as on the machine that executed this page). Batches are built on the CPU from
# seeded generators, so their numbers do not depend on the device, and moved there with
# `.to(device)`, inputs and targets alike. The tips are listed {ref}`at the end <outside-forward-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`outside-forward-script` ({download}`download <scripts/outside_forward.py>`).

# %%
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


# %% [markdown]
# (outside-forward-methods)=
# ## 1. Methods other than `forward` on FSDP2 modules
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
# (outside-forward-edit-weights)=
# ## 2. Editing weights outside forward and backward
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
# (outside-forward-no-sharding-strategy)=
# ## 3. Code on DTensors with no sharding strategy
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
# operation that mixes rows (a norm over the whole matrix, as {ref}`clipping <pitfalls-clip>`
# shows) would compute on the shard alone. `register_sharding` says so once for
# DTensor, which then runs the operation on each rank's shard when the placements match
# and redistributes when they do not. The function it registers must be true for the
# operation: DTensor uses the placements it returns as given (`_register_sharding.py`), so
# a strategy that accepts a placement the operation cannot work on gives wrong numbers
# without an error. `register_sharding` is experimental in torch 2.13 (its
# docstring).


# %% [markdown]
# (outside-forward-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/outside_forward.py`.
# It shards a small model with a `generate` method and trains it with a max-norm constraint on
# each weight's rows, applied after every step to the rank's own rows (`to_local()`); registers
# `generate` with `register_fsdp_forward_method`; then edits a bias twice, once by assigning a new
# `Parameter` and once by copying the new values into the shard in place (`distribute_tensor`
# gives each rank its slice: torch alone has no `summon_full_params` for FSDP2). Rank 0 prints the
# largest row norm and the largest weight difference from one process, whether `generate` gives
# one process's tokens, and which edit the next forward kept. The tests run it on 2 CPU ranks and
# check that the row norms are at most 0.5, the weights within 1e-5 of one process's, the tokens
# the same, and that only the in-place edit is kept (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/outside_forward.py
# :language: python
# ```

# %% [markdown]
# (outside-forward-tips)=
# ## The tips behind this
#
# 1. {ref}`tip-fsdp-forward-method`
# 2. {ref}`tip-edit-weights-summon`
# 3. {ref}`tip-no-sharding-strategy`
#
# Why a rank holds only part of each tensor: {ref}`fsdp-how-it-works`.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("outside_forward")
