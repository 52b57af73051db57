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
# (tutorial-fp16-scaler)=
# # float16 needs a gradient scaler; bfloat16 does not
#
# **What you will learn**
#
# - why float16 turns small gradients to zero and bfloat16 does not, from the two dtypes'
#   limits;
# - a float16 run without a gradient scaler that stops learning, and the same run with
#   one (`torch.amp.GradScaler` with FSDP2, `ShardedGradScaler` with FSDP1);
# - that a step skipped for an overflow on one rank's shard is skipped on every rank.
#
# **What you need**: a CPU; 2 processes on gloo; about 5 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The same code is
# written to run unchanged with one GPU per rank (NCCL): each rank computes on
# {func}`fsdp_guide.device`, its GPU `cuda:LOCAL_RANK` where it has one, else the CPU.
# It follows {ref}`tutorial-mixed-precision`, which shows in which dtype each operation,
# gradient and reduction runs under FSDP's `MixedPrecisionPolicy` and autocast.
# The tips are listed {ref}`at the end <fp16-scaler-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`fp16-scaler-script` ({download}`download <scripts/fp16_scaler.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# ## How small a float16 can be
#
# bfloat16 has float32's range; float16 has more mantissa bits but a far smaller range:
# it loses precision below its smallest normal number and has nothing below its smallest
# subnormal one. `torch.finfo` gives the limits (the smallest subnormal is the smallest
# normal times `eps`), and a cast shows what float16 does with values below them:

# %%
from fsdp_guide.table import Table
from IPython.display import display
from myst_nb import glue

rows = []
for dtype in (torch.float16, torch.bfloat16, torch.float32):
    info = torch.finfo(dtype)
    subnormal = info.smallest_normal * info.eps  # the smallest positive number: 2**-24 for float16
    name = str(dtype).removeprefix("torch.")
    rows.append([name, f"{info.max:.5g}", f"{info.smallest_normal:.4g}", f"{subnormal:.4g}"])
header = ["dtype", "largest", "smallest normal", "smallest subnormal"]
display(Table(header, rows))  # an HTML table on the site, aligned text elsewhere
print(
    "cast to float16:",
    ", ".join(
        f"{v:.3g} -> {torch.tensor(v).half().item():.3g}" for v in (2**-24, 1.01 * 2**-25, 2**-25)
    ),
)
# the figures the text quotes, from this run (JupyterLab shows glue's roles unrendered)
glue("fp16_smallest_normal", f"{torch.finfo(torch.float16).smallest_normal:.2g}", display=False)
glue("fp16_to_zero", f"{2**-25:.2g}", display=False)  # half the smallest subnormal: rounds to 0

# %% [markdown]
# The model and its sharding are the previous page's (hidden; click to show): a matmul, a
# softmax and a second matmul, each linear layer an FSDP unit, sharded with FSDP2's
# `MixedPrecisionPolicy` or FSDP1's `MixedPrecision`, `param_dtype` the low dtype and
# `reduce_dtype` float32.

# %% tags=["hide-input"]
import fsdp_guide
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from fsdp_guide import launch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy, fully_shard


class Attentionish(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        torch.manual_seed(0)
        self.scores = nn.Linear(width, width, bias=False)
        self.values = nn.Linear(width, 4, bias=False)

    def forward(self, x):
        return self.values(torch.softmax(self.scores(x), dim=-1))


def shard_with_policy(model, api, low, device):
    """FSDP with param_dtype=low and reduce_dtype=float32, or without mixed precision (low=None)."""
    if api == "fsdp1":
        policy = MixedPrecision(param_dtype=low, reduce_dtype=torch.float32) if low else None
        return FSDP(model, device_id=device, mixed_precision=policy)
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low else None)
    for layer in (model.scores, model.values):
        fully_shard(layer, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


# %% [markdown]
# (mixed-precision-fp16-scaler)=
# ## A float16 run without a scaler, and with one
#
# Small gradients are normal (late layers, long sequences, a loss averaged over many
# tokens). float16 keeps fewer significant bits below {glue:text}`fp16_smallest_normal`
# and rounds values at or below 2<sup>-25</sup> (about {glue:text}`fp16_to_zero`) to zero
# (the table above): the parameters stop moving.
# Here the loss is scaled by 1e-6 to make every gradient that small, and the model
# trains 8 steps with FSDP computing in float16 or bfloat16, with and without a scaler.
# `torch.amp.GradScaler` multiplies the loss before backward and divides the gradients
# before the step, skipping steps whose gradients overflowed. With FSDP1 this page uses
# torch's `ShardedGradScaler` (`torch/distributed/fsdp/sharded_grad_scaler.py`): an
# FSDP1 rank's gradients are plain tensors holding only its shard of each flat
# parameter, and `ShardedGradScaler.unscale_` all-reduces the found-infinity flag across
# the ranks, where `GradScaler.unscale_` checks only the tensors it is given; it also
# accepts float16 gradients, which `GradScaler.unscale_` refuses ("Attempting to unscale
# FP16 gradients.", `torch/amp/grad_scaler.py`). A plain `GradScaler` with FSDP1 is not
# run here.

# %%
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


def train_small_gradients(api, low, use_scaler, device, steps=8):
    model = shard_with_policy(Attentionish(), api, low, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=2e5)  # undoes the 1e-6 for the update
    scaler = None
    if use_scaler:
        scaler = (
            ShardedGradScaler(device.type) if api == "fsdp1" else torch.amp.GradScaler(device.type)
        )
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)
    x, y = x.to(device), y.to(device)
    losses, zero_fraction = [], []
    for _ in range(steps):
        loss = F.mse_loss(model(x).float(), y)
        small = loss * 1e-6
        (scaler.scale(small) if scaler else small).backward()
        grads = [
            p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in model.parameters()
        ]
        zeros = sum((g == 0).sum().item() for g in grads)
        zero_fraction.append(zeros / sum(g.numel() for g in grads))
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, zero_fraction


def scaler_runs():
    device = fsdp_guide.device()
    runs = [
        ("fp16, no scaler", "fsdp2", torch.float16, False),
        ("fp16, GradScaler", "fsdp2", torch.float16, True),
        ("bf16, no scaler", "fsdp2", torch.bfloat16, False),
        ("FSDP1 fp16, no scaler", "fsdp1", torch.float16, False),
        ("FSDP1 fp16, ShardedGradScaler", "fsdp1", torch.float16, True),
    ]
    return {
        name: train_small_gradients(api, low, scaler, device) for name, api, low, scaler in runs
    }


runs = launch(scaler_runs, output="none")[0]
rows = [
    [name, f"{losses[0]:.5f}", f"{losses[-1]:.5f}", f"{zeros[-1]:.0%}"]
    for name, (losses, zeros) in runs.items()
]
display(Table(["run", "loss at step 0", "loss at step 7", "zero gradients"], rows))

# %% [markdown]
# Without a scaler, float16 turns every gradient to zero and the loss does not move at
# all, with FSDP2 and FSDP1 alike; with one, the same run learns as bfloat16 does.
# bfloat16 reaches down as far as float32 (the same smallest normal number, in the table
# above), so its gradients survive without a scaler.

# %% [markdown]
# ## An overflow on one rank's shard skips the step on every rank
#
# A skipped step must be skipped on *every* rank, or the ranks' weights diverge. A
# rank holds only a shard of the gradients, so an overflow may be seen by one rank only.
# With FSDP2's DTensor gradients, `torch.amp.GradScaler`'s check covers the whole
# gradient: below, only rank 0's shard gets an infinity (the scale starts at 1, so that
# nothing else overflows: rank 1's own shards stay finite). Each rank then compares the full
# parameters (`full_tensor()`, gathered from both ranks' shards) before and after
# `scaler.step`, so "step skipped: True" means that neither rank's shard changed; and
# each rank's scaler halved its scale. Rank 1 skipped a step its own gradients allowed:
# DTensor reduces the scaler's found-inf flag across the ranks
# (`found_inf_reduce_handler` in `torch/distributed/tensor/_dispatch.py`, registered for
# `aten._amp_foreach_non_finite_check_and_unscale_`).


# %%
def overflow_on_rank_0_only():
    device = fsdp_guide.device()
    model = shard_with_policy(Attentionish(), "fsdp2", torch.float16, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # A scale of 1: the default 65536 would overflow float16 gradients on every rank by itself
    scaler = torch.amp.GradScaler(device.type, init_scale=1.0)
    scaler.scale(model(torch.ones(2, 32, device=device)).float().sum()).backward()
    if dist.get_rank() == 0:
        next(model.parameters()).grad.to_local()[0, 0] = float("inf")
    # this rank's shards
    own_finite = all(p.grad.to_local().isfinite().all().item() for p in model.parameters())
    before = [p.full_tensor() for p in model.parameters()]
    scale_before = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    unchanged = all(torch.equal(a, p.full_tensor()) for a, p in zip(before, model.parameters()))
    return own_finite, unchanged, scale_before, scaler.get_scale()


for rank, (own_finite, unchanged, old, new) in enumerate(
    launch(overflow_on_rank_0_only, output="none")
):
    print(
        f"rank {rank}: its own gradient shards finite: {own_finite}; step skipped: {unchanged}, "
        f"scale {old:g} -> {new:g}"
    )


# %% [markdown]
# (fp16-scaler-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/fp16_scaler.py`.
# `torchrun --nproc-per-node=2 fp16_scaler.py` shards a small model with
# `MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)` on each unit
# and trains it on a loss scaled by 1e-6, without a scaler, with `torch.amp.GradScaler`, and in
# bfloat16 without one; rank 0 prints each run's first and last loss, the share of its gradients
# that are zero, and the largest relative difference of each run's losses from the same training
# in float32 in one process. Then only rank 0's gradient shard is made infinite, and rank 0
# prints whether each rank skipped the step and the scale after it. The tests run this file
# under torchrun on 2 CPU ranks and check that float16 without a scaler has only zero gradients
# and a loss that does not move, that float16 with the scaler and bfloat16 without one have none
# and follow float32 (below 2e-2), and that both ranks skipped the step and halved the scale
# (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/fp16_scaler.py
# :language: python
# ```

# %% [markdown]
# (fp16-scaler-tips)=
# ## The tips behind this
#
# - {ref}`tip-mixed-precision-dtypes`: use bfloat16 where the hardware supports it; with
#   float16, small gradients underflow to zero unless you use a gradient scaler.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("fp16_scaler")
