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
# (tutorial-muon)=
# # Muon on sharded parameters
#
# **What you will learn**: why Muon, unlike AdamW, cannot update a shard by itself; what
# `torch.optim.Muon` does with FSDP2's sharded parameters (the right numbers, through dozens
# of collectives a step); that orthogonalising each rank's shard alone is silently another
# optimizer; and Muon done the sharded way, `fsdp_guide.muon.ShardedMuon`: each matrix sent
# whole to one rank, orthogonalised there by torch's own code, its rows sent back, in two
# all-to-alls a step, with the same weights as one process bit for bit.
#
# **What you need**: a CPU; 2 processes on gloo; torch 2.9 or later (`torch.optim.Muon`);
# about 10 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The code is
# written to run unchanged with one GPU per rank (NCCL), but no GPU run of it is recorded.
# The tips are listed {ref}`at the end <muon-tips>`. Its idea as a plain torchrun script to
# copy: {ref}`muon-script` ({download}`download <scripts/muon.py>`).

# %%
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# Muon's step for a weight matrix: momentum, elementwise, then a Newton–Schulz iteration
# that orthogonalises the whole update (products of the matrix with its transpose), then
# the step. The iteration is torch's `_zeropower_via_newtonschulz`; on the rows of a matrix
# it is not the rows of the result:

# %%
from torch.optim._muon import _zeropower_via_newtonschulz

torch.manual_seed(0)
update = torch.randn(8, 6)
ns = dict(ns_coefficients=(3.4445, -4.775, 2.0315), ns_steps=5, eps=1e-7)
whole = _zeropower_via_newtonschulz(update, **ns)
halves = torch.cat([_zeropower_via_newtonschulz(half, **ns) for half in update.chunk(2)])
print(
    f"rows 0-3 of the whole matrix's result vs the result for rows 0-3 alone: max |difference| = "
    f"{(whole[:4] - halves[:4]).abs().max().float():.2f}"
)

# %% [markdown]
# FSDP2 gives each rank rows of each weight (`Shard(0)`), so a sharded Muon must bring each
# matrix together somewhere. Three Muons on 2 ranks, 5 steps, Muon on the hidden matrices
# and AdamW on the rest (biases, the output layer), as Muon's authors use it, and AdamW
# alone for comparison. At each step every rank also hands the averaged gradients, whole,
# to a one-process copy with torch's optimizers: the copy is what the optimizer should
# compute from those gradients.


# %%
def build():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64),
        nn.Tanh(),
        nn.Linear(64, 64),
        nn.Tanh(),
        nn.Linear(64, 48),
        nn.Tanh(),
        nn.Linear(48, 8),
    )


def split(model):
    """Muon's parameters (the hidden matrices) and AdamW's (biases, the output layer)."""
    hidden = [model[i].weight for i in (0, 2, 4)]
    return hidden, [p for p in model.parameters() if all(p is not h for h in hidden)]


class MuonOnEachShard:
    """The wrong way: torch's Muon over each rank's rows alone (its shards, as plain tensors)."""

    def __init__(self, hidden):
        with torch.no_grad():
            self.shards = [p.to_local() for p in hidden]  # views of the rows this rank holds
        self.hidden, self.muon = hidden, torch.optim.Muon(self.shards, lr=1e-2)

    def step(self):
        for shard, p in zip(self.shards, self.hidden):
            shard.grad = p.grad.to_local()  # the rows of the sharded gradient
        self.muon.step()

    def zero_grad(self):
        self.muon.zero_grad()
        for p in self.hidden:
            p.grad = None


def five_steps(way, float32=False):
    import contextlib
    from unittest import mock

    import fsdp_guide
    import torch.distributed as dist
    from fsdp_guide.collectives import count_collectives
    from fsdp_guide.muon import ShardedMuon
    from torch.distributed.fsdp import fully_shard

    device, rank, world = fsdp_guide.device(), dist.get_rank(), dist.get_world_size()
    model, copy = build().to(device), build().to(device)
    for layer in model[::2]:
        fully_shard(layer)
    fully_shard(model)
    hidden, rest = split(model)
    alone = torch.optim.AdamW if way == "AdamW" else torch.optim.Muon  # the one-process copy's
    if way in ("torch.optim.Muon", "AdamW"):
        muon = alone(hidden, lr=1e-2)
    elif way == "Muon on each shard":
        muon = MuonOnEachShard(hidden)
    else:
        muon = ShardedMuon(hidden, lr=1e-2)
    adamw = torch.optim.AdamW(rest, lr=1e-2)
    copy_hidden, copy_rest = split(copy)
    copy_muon, copy_adamw = alone(copy_hidden, lr=1e-2), torch.optim.AdamW(copy_rest, lr=1e-2)
    g = torch.Generator().manual_seed(1)
    traffic = {}
    # An experiment, not a recipe: torch 2.13's iteration casts with `.bfloat16()`; made a
    # float32 cast, the iteration computes in float32, and its rounding shrinks accordingly.
    in_float32 = (
        mock.patch.object(torch.Tensor, "bfloat16", torch.Tensor.float)
        if float32
        else contextlib.nullcontext()
    )
    for _ in range(5):
        x, y = (
            torch.randn(16, 32, generator=g).to(device),
            torch.randn(16, 8, generator=g).to(device),
        )
        with count_collectives() as seen:
            F.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        traffic["forward and backward"] = seen.rows()
        for p, q in zip(model.parameters(), copy.parameters()):
            q.grad = p.grad.full_tensor()  # the averaged gradient, whole
        with count_collectives() as seen, in_float32:
            muon.step()
        traffic["optimizer"] = seen.rows()
        with in_float32:
            adamw.step(), copy_muon.step(), copy_adamw.step()
        for optimizer in (muon, adamw, copy_muon, copy_adamw):
            optimizer.zero_grad()
    pairs = zip(model.parameters(), copy.parameters())
    gap = torch.stack([(p.detach().full_tensor() - q.detach()).abs().max() for p, q in pairs]).max()
    return float(gap), traffic  # torch's max: a NaN anywhere is the result


# %%
from unittest import mock

from fsdp_guide import launch
from fsdp_guide.table import Table
from myst_nb import glue

WAYS = ["torch.optim.Muon", "Muon on each shard", "ShardedMuon", "AdamW"]
runs = {way: launch(five_steps, way, world_size=2, output="none")[0] for way in WAYS}
with mock.patch.object(
    torch.Tensor, "bfloat16", torch.Tensor.float
):  # does the experiment apply here?
    applies = _zeropower_via_newtonschulz(torch.ones(2, 2), **ns).dtype == torch.float32
in_float32 = {way: float("nan") for way in WAYS}
if applies:
    in_float32 = {
        way: launch(five_steps, way, True, world_size=2, output="none")[0][0] for way in WAYS
    }
else:
    print(f"torch {torch.__version__} casts otherwise: the float32 column does not apply")
fsdp = runs["ShardedMuon"][1]["forward and backward"]
fsdp_bytes = sum(b for *_, b in fsdp)
same = all(traffic["forward and backward"] == fsdp for _, traffic in runs.values())


def collectives(rows):
    return ", ".join(f"{count} {kind}" for _, kind, count, _ in rows) or "none"


table = []
for i, (way, (gap, traffic)) in enumerate(runs.items()):
    sent = sum(b for *_, b in traffic["optimizer"])
    ratio = f"{sent / fsdp_bytes:.2f}"
    table.append(
        [
            way,
            f"{gap:.1e}",
            f"{in_float32[way]:.1e}",
            collectives(traffic["optimizer"]),
            f"{sent:,}",
            ratio,
        ]
    )
    glue(f"gap_{i}", f"{gap:.1e}", display=False)
    glue(f"float32_{i}", f"{in_float32[way]:.1e}", display=False)
    glue(f"ratio_{i}", ratio, display=False)
print(
    f"FSDP2's forward and backward: {collectives(fsdp)}, {fsdp_bytes:,} bytes (the same in every run: {same})"
)
columns = [
    "optimizer",
    "max |weight - one process|",
    "iterating in float32",
    "collectives in its step",
]
Table([*columns, "bytes", "/ FSDP's"], table)

# %% [markdown]
# - **`torch.optim.Muon`** runs on the `DTensor` parameters because every operation of the
#   iteration is a `DTensor` operation: each product of a sharded matrix gathers or reduces
#   what it needs, so the numbers are right up to the order of its bf16 sums
#   ({glue:text}`gap_0`; {glue:text}`float32_0` when an experiment makes the iteration
#   compute in float32), at the price of dozens of collectives a step, moving
#   {glue:text}`ratio_0` times the bytes of FSDP's own forward and backward.
# - **Muon on each shard** (a Muon given `to_local()` views, or any code that orthogonalises
#   `p.grad.to_local()`) runs without a collective and without an error, and computes another
#   optimizer ({glue:text}`gap_1`, and {glue:text}`float32_1` in float32): the rows of an
#   orthogonalised matrix are not the orthogonalised rows, and torch's learning-rate rule
#   sees the shard's shape, not the matrix's.
# - **`ShardedMuon`** gives the same weights bit for bit ({glue:text}`gap_2`): each matrix's
#   update reaches one rank whole (the largest first, each to the least loaded rank),
#   torch's iteration runs there on exactly the numbers the one-process copy has, and each
#   rank gets its rows back: two all-to-alls a step for a parameter group, sent in bf16 (the
#   dtype the iteration casts to first), {glue:text}`ratio_2` times FSDP's bytes.
# - **AdamW** is pointwise: each rank updates its rows from its rows, bit for bit, with no
#   collective in its step ({ref}`tip-pointwise-optimizers`). Muon's extra traffic is what
#   the other rows cost: for `ShardedMuon`, about twice each rank's shard of the hidden
#   matrices in bf16 (counted, like FSDP's, at full size: what a rank sends itself
#   included).
#
# The code: `ShardedMuon.step`, and the routing it calls, from `src/fsdp_guide/muon.py`:

# %%
import inspect

from fsdp_guide.muon import ShardedMuon, _route_and_orthogonalise

print(inspect.getsource(ShardedMuon.step))
print(inspect.getsource(_route_and_orthogonalise))

# %% [markdown]
# (muon-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script with torch alone: {download}`scripts/muon.py`.
# It shards the same model with `fully_shard`, trains it with a sharded Muon written out in
# the script (each matrix's update gathered whole on every rank with `full_tensor()`,
# torch's iteration, each rank keeping its rows: the simplest correct way, one all-gather
# per matrix and every rank computing every iteration) and with Muon on each shard; rank 0
# prints, for each, whether its weights equal those of `torch.optim.Muon` given the same
# whole gradients. The tests run this file under torchrun on 2 CPU ranks and check those
# lines (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/muon.py
# :language: python
# ```

# %% [markdown]
# (muon-tips)=
# ## The tips behind this
#
# - {ref}`tip-muon-sharded`
# - {ref}`tip-pointwise-optimizers`: which optimizers need none of this.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("muon")
