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
# (tutorial-summon-full-params)=
# # Custom weight init on a sharded model with `summon_full_params`
#
# **What you will learn**
#
# - how to run your own initialisation code (scaled by depth, orthogonal, tied
#   embeddings) on a model that is already sharded, with
#   {func}`fsdp_guide.summon_full_params`: one context manager for FSDP2
#   (`fully_shard`, DTensor parameters) and FSDP1 (`FullyShardedDataParallel`);
# - why every rank must use the same seed inside the context;
# - how to check the result against a single process, bit for bit.
#
# **What you need**: a CPU; 2 processes on gloo; about 5 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The code
# is written to run unchanged with one GPU per rank (NCCL). The tips it demonstrates are
# listed {ref}`at the end <summon-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`summon-script` ({download}`download <scripts/summon_full_params.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# ## A model with an init recipe of its own
#
# A small GPT-like stack: an embedding whose matrix is also the output head
# (tied weights), and blocks of two linear layers. Its recipe: embeddings
# normal(0, 0.02), the first layer of each block orthogonal, the second normal with
# standard deviation 0.02 / sqrt(2 (d + 1)) for the block at index d, so smaller in
# deeper blocks; biases zero.
#
# The reference is what one process computes. torch's Reproducibility notes warn that
# results may not be reproducible between CPU and GPU executions, even with identical
# seeds, so the reference initialises where the sharded models below do: on
# {func}`fsdp_guide.device` (the rank's GPU, `cuda:LOCAL_RANK`, where each rank has one,
# else the CPU, as here). Rank 0 of a launch computes it alone, with no collective, and
# returns CPU tensors.

# %%
import math

import fsdp_guide
import torch.nn as nn
from fsdp_guide import launch
from fsdp_guide.compare import largest_difference

VOCAB, DIM, DEPTH = 32, 16, 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied: one Parameter, two names

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@torch.no_grad()
def init_weights(model):
    nn.init.normal_(model.embed.weight, std=0.02)
    for depth, block in enumerate(model.blocks):
        nn.init.orthogonal_(block.up.weight)
        std = 0.02 / math.sqrt(2 * (depth + 1))
        nn.init.normal_(block.down.weight, std=std)
        nn.init.zeros_(block.up.bias)
        nn.init.zeros_(block.down.bias)


INIT_SEED = 1234


def reference_model(device):
    """One process's model, built with seed 0 and initialised by the recipe on `device`."""
    torch.manual_seed(0)
    model = TinyLM().to(device)
    torch.manual_seed(INIT_SEED)
    init_weights(model)
    return model


def reference_weights():
    model = reference_model(fsdp_guide.device())
    return {name: p.detach().cpu() for name, p in model.named_parameters()}


reference = launch(reference_weights, world_size=2, output="none")[0]  # rank 0's
print(
    f"{len(reference)} parameters (the tied one counted once), "
    f"{sum(p.numel() for p in reference.values())} numbers"
)

# %% [markdown]
# `init_weights` needs whole matrices: an orthogonal matrix is not a
# collection of independently drawn entries, and a shard of rows is not an
# orthogonal matrix. After `fully_shard`, each rank only holds half of the rows.
# Inside `summon_full_params`, every parameter is the full plain tensor again,
# under its usual name:

# %%
import torch.distributed as dist
from fsdp_guide import describe_sharding, summon_full_params
from torch.distributed.fsdp import fully_shard


def shard_fsdp2(model):
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)  # the root unit holds the tied embedding/head
    return model


def init_on_fsdp2(seed_per_rank=False):
    torch.manual_seed(0)
    model = shard_fsdp2(TinyLM())
    outside = describe_sharding(model)
    torch.manual_seed(INIT_SEED + (dist.get_rank() if seed_per_rank else 0))
    with summon_full_params(model):
        inside = describe_sharding(model)
        tied = model.head.weight is model.embed.weight
        init_weights(model)
    # Gather the result to compare it with one process (writeback=False:
    # we only look), as CPU tensors for the notebook.
    with summon_full_params(model, writeback=False):
        full = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    return {
        "outside": outside,
        "inside": inside,
        "tied_inside": tied,
        "full": full,
        "dtensor_after": type(model.head.weight).__name__,
        "tied_after": model.head.weight is model.embed.weight,
    }


fsdp2 = launch(init_on_fsdp2, world_size=2, output="none")
print("rank 0, outside the context:")
print("\n".join(str(fsdp2[0]["outside"]).splitlines()[:4]))
print("rank 0, inside the context:")
print("\n".join(str(fsdp2[0]["inside"]).splitlines()[:4]))

# %% [markdown]
# Outside, each rank holds a `Shard(dim=0)` half of every matrix; inside, the
# full plain tensors. The tied embedding and head stay one parameter inside, and
# after the context they are again the same (sharded) object:

# %%
print("tied inside the context:", fsdp2[0]["tied_inside"])
print("after the context:", fsdp2[0]["dtensor_after"], "| still tied:", fsdp2[0]["tied_after"])

# %% [markdown]
# ## Bit for bit what one process computes
#
# Each rank initialised its full copy with the same seed and kept its own slice.
# Together the slices are exactly the single-process initialisation:


# %%
def max_difference(weights):
    return largest_difference((weights[n], reference[n]) for n in reference)


for rank, result in enumerate(fsdp2):
    exact = all(torch.equal(result["full"][n], reference[n]) for n in reference)
    print(
        f"rank {rank}: FSDP2 init equals single process exactly: {exact}, "
        f"max |difference| = {max_difference(result['full']):.1e}"
    )
    assert exact

# %% [markdown]
# ## Why the seed must be the same on every rank
#
# Each rank draws its own full tensors and writes back its own slice. With a
# different seed per rank, rank 0's rows come from one draw and rank 1's from
# another: each half is a fine sample, but the matrix is no longer orthogonal.


# %%
def orthogonality_error(w):
    return (w @ w.T - torch.eye(w.shape[0])).abs().max().item()


mixed = launch(init_on_fsdp2, seed_per_rank=True, world_size=2, output="none")
w_same = fsdp2[0]["full"]["blocks.0.up.weight"].T  # up.weight is (2*DIM, DIM)
w_mixed = mixed[0]["full"]["blocks.0.up.weight"].T
print(f"same seed on every rank:  |W W^T - I| max = {orthogonality_error(w_same):.1e}")
print(f"seed differs per rank:    |W W^T - I| max = {orthogonality_error(w_mixed):.1e}")
assert orthogonality_error(w_same) < 1e-5 < orthogonality_error(w_mixed)

# %% [markdown]
# ## The same helper on FSDP1
#
# For a model wrapped in `FullyShardedDataParallel`, `summon_full_params` is
# FSDP1's own `FullyShardedDataParallel.summon_full_params`. The init code does not change:

# %%
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


def init_on_fsdp1():
    device = fsdp_guide.device()
    torch.manual_seed(0)
    model = FSDP(
        TinyLM(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=device, use_orig_params=True
    )
    torch.manual_seed(INIT_SEED)
    with summon_full_params(model):
        init_weights(model.module)
    with summon_full_params(model, writeback=False):
        full = {
            n.replace("_fsdp_wrapped_module.", ""): p.detach().cpu().clone()
            for n, p in model.module.named_parameters()
        }
    return full


fsdp1 = launch(init_on_fsdp1, world_size=2, output="none")
exact = all(torch.equal(fsdp1[0][n], reference[n]) for n in reference)
print(f"FSDP1 init equals single process exactly: {exact}")
assert exact

# %% [markdown]
# (summon-outside-forward)=
# The context is also what a call that skips the root's `forward` needs: `generate`, an
# evaluation helper, or a submodule called directly. After a training step (forward and
# backward) FSDP1 has resharded every unit, and a parameter in the root unit (here the embedding) is a view into
# storage it freed (`use_orig_params=False`), or a 1-D slice of the flat shard
# (`use_orig_params=True`):

# %%
import traceback


def embed_outside_forward():
    device = fsdp_guide.device()
    tokens = torch.arange(4, device=device).view(1, 4)
    said = {}
    for use_orig_params in (False, True):
        torch.manual_seed(0)
        model = FSDP(
            TinyLM(),
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            device_id=device,
            use_orig_params=use_orig_params,
        )
        # a training step's forward and backward: every unit resharded
        model(tokens).sum().backward()
        try:
            # the embedding, called as generate() would, not through FSDP's forward
            out = model.module.embed(tokens)
            said[f"use_orig_params={use_orig_params}"] = f"ran: {tuple(out.shape)}"
        except RuntimeError as error:
            said[f"use_orig_params={use_orig_params}"] = "".join(
                traceback.format_exception_only(error)
            ).strip()
        # the root unit gathered
        with FSDP.summon_full_params(model, recurse=False, writeback=False):
            said[f"use_orig_params={use_orig_params}, in summon_full_params"] = tuple(
                model.module.embed(tokens).shape
            )
    return said


for case, result in launch(embed_outside_forward, world_size=2, output="none")[0].items():
    print(f"{case}: {result}")

# %% [markdown]
# Run such calls inside `summon_full_params` (with `recurse=False` only the root unit
# is gathered, and the blocks gather themselves when their own forward runs). FSDP2's
# answer for a method other than `forward` is `register_fsdp_forward_method`
# ({ref}`register_fsdp_forward_method <fsdp2-register-fsdp-forward-method>`).

# %% [markdown]
# ## Training goes on from the new weights
#
# `summon_full_params` writes into the shards FSDP2 trains, in place, and puts back the
# very same parameter objects, so an optimizer built before the context still updates
# them. Below, the optimizer is built *before* the initialisation; the worker checks that
# the parameters after the context are the objects the optimizer holds, then trains a few
# steps and compares with one process starting from the reference initialisation (rank 0
# alone, on the rank's device). Were the optimizer's tensors stale, its steps would miss
# the model and the losses would part ways. Inputs and targets are built on the CPU and
# moved to the device:

# %%
import torch.nn.functional as F

STEPS = 15


def tokens(step, batch=8, length=12):
    # Sequences with a rule to learn: each token is (3 * previous + 1) mod VOCAB.
    g = torch.Generator().manual_seed(step)
    seq = [torch.randint(0, VOCAB, (batch,), generator=g)]
    for _ in range(length):
        seq.append((3 * seq[-1] + 1) % VOCAB)
    seq = torch.stack(seq, dim=1)
    return seq[:, :-1], seq[:, 1:]


def train(model, device, sharded, optimizer=None):
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        x, y = tokens(step)
        x, y = x.to(device), y.to(device)
        if sharded:
            x = x.chunk(dist.get_world_size())[dist.get_rank()]
            y = y.chunk(dist.get_world_size())[dist.get_rank()]
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if sharded:
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        losses.append(loss.item())
    return losses


def init_then_train():
    device = fsdp_guide.device()
    torch.manual_seed(0)
    model = shard_fsdp2(TinyLM())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # before the context
    torch.manual_seed(INIT_SEED)
    with summon_full_params(model):
        init_weights(model)
    held = [p for group in optimizer.param_groups for p in group["params"]]
    same_objects = all(a is b for a, b in zip(held, model.parameters(), strict=True))
    return same_objects, train(model, device, sharded=True, optimizer=optimizer)


def single_process():
    device = fsdp_guide.device()
    return train(reference_model(device), device, sharded=False)


same_objects, sharded_losses = launch(init_then_train, world_size=2, output="none")[0]
single_losses = launch(single_process, world_size=2, output="none")[0]  # rank 0's, alone
gap = largest_difference(zip(sharded_losses, single_losses, strict=True))
print("the optimizer built before the context holds the model's parameters after it:", same_objects)
print(
    f"loss {single_losses[0]:.4f} -> {single_losses[-1]:.4f} in {STEPS} steps; "
    f"max |sharded - single| = {gap:.1e}"
)
assert same_objects and gap < 1e-5

# %% [markdown]
# ## `writeback=False` discards what the block changed
#
# The cells above passed `writeback=False` where they only looked at the full weights.
# When the parameters are actually sharded (more than one rank), a change made inside
# such a context is thrown away on exit; with the default (`writeback=True`) it is kept.
# With one rank (or FSDP1's `NO_SHARD`) the edits persist either way: FSDP1's
# `FullyShardedDataParallel.summon_full_params` docstring says so, and for DTensors
# `redistribute_local_tensor` (`torch/distributed/tensor/_redistribute.py`) returns the
# local tensor itself on a mesh dimension of size 1, so the "full" tensor is the shard.
# Zero every weight inside each kind of context, on 2 ranks, and look at the shards:


# %%
def zero_inside(writeback):
    torch.manual_seed(0)
    model = shard_fsdp2(TinyLM())
    with summon_full_params(model, writeback=writeback), torch.no_grad():
        for param in model.parameters():
            param.zero_()
    return all(bool((p.to_local() == 0).all()) for p in model.parameters())


for writeback in (False, True):
    zeroed = launch(zero_inside, writeback, world_size=2, output="none")
    print(
        f"writeback={writeback!s:5}: every shard zero after the context, rank 0 / rank 1: {zeroed}"
    )

# %% [markdown]
# (summon-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/summon_full_params.py`.
# `torchrun --nproc-per-node=2 summon_full_params.py` shards a small model, then runs an
# orthogonal init recipe inside a torch-only `summon_full_params` for FSDP2 (`full_tensor()` in,
# each rank's slice copied back into its shard on exit); rank 0 prints the shapes it saw and the
# largest difference from the same recipe in one process. The tests run this file under torchrun
# on 2 CPU ranks and check that the difference is exactly 0 (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/summon_full_params.py
# :language: python
# ```

# %% [markdown]
# (summon-tips)=
# ## What this showed, and the tips behind it
#
# - Initialisation that needs whole tensors runs inside `summon_full_params`,
#   for FSDP2 and FSDP1 alike: {ref}`tip-custom-init-summon`.
# - Inside, every rank draws its own full tensor and keeps its own slice: seed
#   every rank the same, or the slices come from different draws:
#   {ref}`tip-same-seed-inside-summon`.
# - Tied parameters stay tied, inside and after: {ref}`tip-tied-weights-summon`.
# - When the parameters are actually sharded (more than one rank), changes made inside
#   `summon_full_params(..., writeback=False)` are discarded on exit; with one rank (or
#   FSDP1's `NO_SHARD`) the edits persist (FSDP1's docstring says so). Use it only to look.
# - The result equals single-process initialisation exactly, and training from it
#   matches too: {ref}`tip-check-against-one-process`.
#
# How FSDP1 and FSDP2 shard parameters is explained in {ref}`fsdp1-vs-fsdp2`;
# the API is in {ref}`fsdp-api`.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("summon_full_params")
