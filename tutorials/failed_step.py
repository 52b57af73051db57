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
# (tutorial-failed-step)=
# # Recovering from a failed step
#
# **What you will learn**
#
# - what an exception in the middle of backward leaves behind in FSDP2: a unit still
#   gathered, and gradients on its gathered parameters;
# - what `reset_iter_state()` repairs and what it does not on torch 2.13;
# - how to make the steps after a caught exception equal one process's.
#
# **What you need**: a CPU; 2 processes on gloo; about 5 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The same code
# is written to run unchanged with one GPU per rank (NCCL). The tips it demonstrates are listed
# {ref}`at the end <failed-step-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`failed-step-script` ({download}`download <scripts/failed_step.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# ## A small model, one unit per layer
#
# An embedding, three linear layers and an output layer, each its own FSDP unit, and the
# whole model the root. The same seed builds the same model on every rank. The failed step
# below trains the linear layers alone, whose inputs are activations.

# %%
import fsdp_guide
import torch.nn as nn
from fsdp_guide import launch
from fsdp_guide.compare import largest_difference

WIDTH, VOCAB, LAYERS, BATCH = 32, 64, 3, 8


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(VOCAB, WIDTH),
        *[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)],
        nn.Linear(WIDTH, VOCAB),
    )


def shard(model):
    from torch.distributed.fsdp import fully_shard

    for unit in model:
        fully_shard(unit)
    return fully_shard(model)


def my_half(batch):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    return batch[rank * len(batch) // world : (rank + 1) * len(batch) // world]


# %% [markdown]
# ## A step that raised in the middle of backward
#
# A training loop may catch an exception and go on with the next batch: a check that
# refuses a non-finite gradient, as below, or, on a GPU, an out-of-memory error on one
# oversized batch. When it is raised in the middle of backward, FSDP is left in the
# middle of the step: units whose backward never ran are still gathered. Below, a tensor
# hook on the input of the third linear layer raises when its gradient is not finite, and
# the second batch carries an `inf`, on every rank. Three ways to go on after catching it:
# nothing, the root's `reset_iter_state()`, and `reset_iter_state()` followed by dropping
# the failed step's gradients (`drop_stale_gradients`). One process skips the same batch.
#
# (fsdp2-fsdpmodule-reset-iter-state)=


# %%
class Refuse(nn.Linear):
    """A linear layer that raises in backward when the gradient reaching its input is not finite."""

    def forward(self, x):
        if x.requires_grad:
            x.register_hook(self.check)
        return super().forward(x)

    @staticmethod
    def check(grad):
        if not torch.isfinite(grad).all():
            raise FloatingPointError("a non-finite gradient")


def model_with_a_check():
    model = make_model()
    torch.manual_seed(1)
    model[3] = Refuse(WIDTH, WIDTH)
    return model


def batches():
    inputs = [
        torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(step))
        for step in range(4)
    ]
    inputs[1][:, 0] = float("inf")  # every rank's half of the second batch
    return inputs


def drop_stale_gradients(model):
    """Gather each unit, drop the gradients its gathered parameters still hold, and free it again."""
    from torch.distributed.fsdp import FSDPModule

    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.unshard()
            unit.zero_grad(set_to_none=True)
            unit.reshard()


def left_behind(model):
    """Whether every parameter is a DTensor (sharded), and how many gradients the gathered parameters still hold."""
    import torch.distributed.tensor as dt

    sharded = all(isinstance(p, dt.DTensor) for p in model.parameters())
    stale = 0
    for unit in model:
        unit.unshard()
        stale += sum(p.grad is not None for p in unit.parameters())
        unit.reshard()
    return sharded, stale


def train_through_a_failure(recovery, sharded=True):
    import torch.distributed.tensor as dt

    device = fsdp_guide.device()
    model = model_with_a_check()[1:].to(device)  # the linear layers: inputs are activations
    if sharded:
        model = shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    caught, sharded_after, not_finite_from = [], None, None
    for step, batch in enumerate(batches()):
        batch = (my_half(batch) if sharded else batch).to(device)
        try:
            model(batch).square().mean().backward()
            optimizer.step()
        except FloatingPointError as error:
            caught.append(f"step {step}: {error}")
            if recovery in ("reset_iter_state()", "reset_iter_state() + drop_stale_gradients"):
                model.reset_iter_state()
            if recovery.endswith("drop_stale_gradients"):
                drop_stale_gradients(model)
            if sharded and sharded_after is None:
                sharded_after = all(isinstance(p, dt.DTensor) for p in model.parameters())
        optimizer.zero_grad()
        weights = [
            p.full_tensor() if isinstance(p, dt.DTensor) else p.detach() for p in model.parameters()
        ]
        if not_finite_from is None and not all(torch.isfinite(w).all() for w in weights):
            not_finite_from = step  # the first step after which some weight is inf or NaN
    return caught, sharded_after, not_finite_from, [w.cpu() for w in weights]


def stale_after_reset():
    device = fsdp_guide.device()
    model = shard(model_with_a_check()[1:].to(device))
    try:
        model(my_half(batches()[1]).to(device)).square().mean().backward()
    except FloatingPointError:
        model.reset_iter_state()
    return left_behind(model)


one_process = launch(train_through_a_failure, "skip", False, world_size=1, output="none")[0][3]
print(
    "after reset_iter_state(): parameters sharded, gathered gradients left:",
    launch(stale_after_reset, world_size=2, output="none")[0],
)
for recovery in ("nothing", "reset_iter_state()", "reset_iter_state() + drop_stale_gradients"):
    try:
        caught, sharded, not_finite_from, weights = launch(
            train_through_a_failure, recovery, world_size=2, output="none"
        )[0]
        error = largest_difference(zip(weights, one_process))
        print(
            f"{recovery:42} caught {caught}; then sharded: {sharded}; weights not finite after step: "
            f"{not_finite_from}; max |weights - one process| after 4 steps = {error:.1e}"
        )
    except fsdp_guide.LaunchError as failure:
        print(f"{recovery:42} {str(failure).splitlines()[0][:100]}")

# %% [markdown]
# Doing nothing leaves a unit gathered, and the steps after it do not train what one
# process trains. `reset_iter_state()` puts every unit back in its sharded state, as its
# docstring promises ("reshards every parameter group, and clears iteration trackers"),
# but on torch 2.13 the gathered parameters keep the gradients the failed backward wrote
# into them: the next backward adds its own to them, and the `inf` reaches the weights in
# step 2 (the output's "weights not finite after step: 2"). From then on every
# activation is not finite, so step 3's gradient is refused too: that is the second
# exception, and the difference from one process is NaN. The docstring says "the failed
# iteration's gradients are lost"; torch 2.15's `FSDPParamGroup._reset_iter_state` sets
# each gathered parameter's `grad` to `None`, and 2.13's does not (read in both releases'
# `_fsdp_param_group.py`, and run on each: `tests/test_sharp_edges.py`, which `.ci/run`
# runs on the pinned torch and on the newest, finds 2 gradients left on 2.13 and none on
# 2.15). Gathering each unit, dropping its gradients and freeing it again
# (`drop_stale_gradients`, one all-gather per unit) makes the following steps equal one
# process's on 2.13; where torch drops them itself it finds none to drop.
#
# The exception must reach every rank: had only one rank refused its gradient, the
# others would have gone on to the next reduce-scatter alone, and the ranks would hang or
# abort on a collective mismatch ({ref}`tutorial-debugging-hangs`).

# %% [markdown]
# (failed-step-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/failed_step.py`.
# `torchrun --nproc-per-node=2 failed_step.py` trains a sharded model for 4 steps whose second batch
# carries an `inf` on every rank; a hook refuses the non-finite gradient in the middle of backward,
# and the loop catches it, calls `reset_iter_state()` and drops the gradients the failed backward
# left on the gathered parameters. Rank 0 prints whether every parameter is sharded again and the
# largest difference of the weights from one process that skips the same batch. The tests run it
# under torchrun on 2 CPU ranks and check that the step was caught once, the parameters are
# sharded again, and the difference is at most 1e-5 (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/failed_step.py
# :language: python
# ```

# %% [markdown]
# (failed-step-tips)=
# ## The tips behind this
#
# - After catching an exception in the middle of a step, call `reset_iter_state()` on the
#   root, and on torch 2.13 drop the failed step's gradients too:
#   {ref}`tip-reset-iter-state`.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("failed_step")
