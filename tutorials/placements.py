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
# (tutorial-placements)=
# # Choosing how each parameter is sharded
#
# **What you will learn**
#
# - how `shard_placement_fn` splits a parameter along another dimension than 0 (stacked
#   experts);
# - why a tied embedding and output layer belong in one unit, what torch 2.13 and 2.9.1 do
#   otherwise, and the fix;
# - what `ignored_params` leaves to you: the reduction, and gradient clipping.
#
# **What you need**: a CPU; 2 processes on gloo; about 5 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The same code
# is written to run unchanged with one GPU per rank (NCCL). Every public FSDP2 name, and
# the page that executes it, is in {ref}`fsdp2-map`. The tips it demonstrates are listed
# {ref}`at the end <placements-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`placements-script` ({download}`download <scripts/placements.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# FSDP2 shards each parameter of a unit along dim 0 over the unit's mesh, one owner per
# parameter, every parameter of the unit. Each section below changes one of the three: the
# dimension, the owner, and whether FSDP shards it at all. Each trains against one process
# on both ranks' batches.

# %%
import fsdp_guide
import torch.nn as nn
from fsdp_guide import launch
from fsdp_guide.compare import largest_difference

WIDTH, BATCH = 32, 8


# %% [markdown]
# ## Where each parameter is split: `shard_placement_fn`
#
# FSDP2 splits every parameter along dim 0 unless `shard_placement_fn` says otherwise: it
# is called with each parameter and returns a `Shard(dim)` placement, or `None` for the
# default. Mixture-of-experts layers stack their experts' weights in one parameter,
# `[experts, out, in]`; with 3 experts on 2 ranks, dim 0 splits them 2 and 1. Below, the
# same layer with the default and with `Shard(1)` for the experts' weight (every rank then
# holds half the rows of every expert), each trained for 3 steps against one process on
# both ranks' batches; {func}`fsdp_guide.describe_sharding` shows what each rank holds:
#
# (fsdp2-fully-shard-shard-placement-fn)=

# %%
EXPERTS = 3


class StackedExperts(nn.Module):
    """Three experts' weights in one parameter, [experts, out, in], mixed by a router."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(EXPERTS, WIDTH, WIDTH) / WIDTH**0.5)
        self.router = nn.Linear(WIDTH, EXPERTS)

    def forward(self, x):
        gates = self.router(x).softmax(-1)  # [rows, experts]
        per_expert = torch.einsum("ri,eoi->reo", x, self.weight)  # every expert on every row
        return (gates.unsqueeze(-1) * per_expert).sum(1)


def train_experts(split_rows, sharded=True):
    import torch.distributed as dist
    import torch.distributed.tensor as dt
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    device = fsdp_guide.device()
    model = StackedExperts().to(device)
    if sharded:
        fully_shard(
            model,
            shard_placement_fn=lambda p: Shard(1) if split_rows and p is model.weight else None,
        )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ranks = [dist.get_rank()] if sharded else range(2)
    for step in range(3):
        losses = [
            model(
                torch.randn(
                    BATCH, WIDTH, generator=torch.Generator().manual_seed(10 * step + r)
                ).to(device)
            )
            .square()
            .mean()
            for r in ranks
        ]
        (sum(losses) / len(losses)).backward()
        optimizer.step()
        optimizer.zero_grad()
    weights = {
        name: (p.full_tensor() if isinstance(p, dt.DTensor) else p.detach()).cpu()
        for name, p in model.named_parameters()
    }
    return fsdp_guide.describe_sharding(model) if sharded else None, weights


def experts_weight_rows(table):
    """The header, the experts' weight and the total of a describe_sharding table's text."""
    lines = str(table).splitlines()
    return [lines[0], *(line for line in lines if line.startswith(("weight ", "total")))]


_, one = launch(train_experts, False, False, world_size=1, output="none")[0]
tables = {}
for split_rows in (False, True):
    ranks = launch(train_experts, split_rows, world_size=2, output="none")
    error = largest_difference((ranks[0][1][name], one[name]) for name in one)
    how = "Shard(1) for the experts' weight" if split_rows else "none (dim 0 for all)"
    print(f"shard_placement_fn: {how}; max |weights - one process| after 3 steps = {error:.1e}")
    tables[how] = [table for table, _ in ranks]
    for rank, table in enumerate(tables[how]):
        held = experts_weight_rows(table)
        print(f"  rank {rank}: " + "\n          ".join(held if rank == 0 else held[1:]))

# %% tags=["hide-input"] mystnb={"image": {"alt": "The experts' weight, three 32 by 32 slices side by side, coloured by the rank that holds each part: with the default, rank 0 holds slices 0 and 1 and rank 1 slice 2; with Shard(1) for the weight, each rank holds half the rows of all three slices."}}
import matplotlib.pyplot as plt
from fsdp_guide.describe import draw_sharding

fig, axes = plt.subplots(2, 1, figsize=(8, 5))
for ax, (how, ranks_tables) in zip(axes, tables.items()):
    draw_sharding(ranks_tables, "weight", ax=ax)
    ax.set_title(f"the experts' weight, shard_placement_fn: {how}")
fig.tight_layout()

# %% [markdown]
# By default rank 0 holds experts 0 and 1, rank 1 expert 2: twice the bytes on rank 0 (the
# router's 3 rows split 2 and 1 the same way). With `Shard(1)` each rank holds rows 0-15
# or 16-31 of all three experts, the same bytes of the experts' weight on both (the bytes above), and the training is the same as one
# process's either way. Sharding along dim 1 needs that dimension to divide evenly by the
# number of ranks it is sharded over: FSDP pads only dim 0, and `fully_shard` refuses an
# uneven split of another ("FSDP does not support uneven sharding on dim 1",
# `FSDPParam._init_sharded_param` in `_fsdp_param.py`).


# %% [markdown]
# (fsdp2-controls-tied-weights)=
# ## Tied weights: one unit for both users
#
# A language model often ties its output layer to its embedding: one weight, used twice.
# FSDP2 shards a weight in the unit that owns it, so an embedding and an output layer each
# given its own `fully_shard` would give the shared weight two owners. Below, a model whose
# embedding and output layer share one weight of 41 rows (21 and 20 on the 2 ranks: uneven,
# where a reported bug lived, pytorch/pytorch#176076), sharded with a unit for each, with
# one unit for both (`fully_shard([model.emb, model.head])`), and with the root holding
# both, each trained 3 steps against one process:

# %%
TIED_VOCAB = 41


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.body = nn.Embedding(TIED_VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, TIED_VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied: one Parameter, two users

    def forward(self, ids):
        return self.head(torch.tanh(self.body(self.emb(ids))))


def train_tied(units):
    import torch.distributed as dist
    import torch.distributed.tensor as dt
    from torch.distributed.fsdp import fully_shard

    device = fsdp_guide.device()
    model = TiedLM().to(device)
    if units == "a unit each":
        fully_shard(model.emb)
        fully_shard(model.head)
    elif units == "one unit for both":
        fully_shard([model.emb, model.head])
    if units != "one process":
        fully_shard(model)
    world, rank = (1, 0) if units == "one process" else (dist.get_world_size(), dist.get_rank())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(3):
        ids = torch.randint(
            0, TIED_VOCAB, (BATCH, 6), generator=torch.Generator().manual_seed(step)
        )
        ids = ids.chunk(world)[rank].to(device)
        logits = model(ids[:, :-1])
        nn.functional.cross_entropy(
            logits.reshape(-1, TIED_VOCAB), ids[:, 1:].reshape(-1)
        ).backward()
        optimizer.step()
        optimizer.zero_grad()
    weight = model.emb.weight
    return model.head.weight is weight, (
        weight.full_tensor() if isinstance(weight, dt.DTensor) else weight
    ).detach().cpu()


_, alone = launch(train_tied, "one process", world_size=1, output="none")[0]
for units in ("a unit each", "one unit for both", "the root holds both"):
    try:
        tied, weight = launch(train_tied, units, world_size=2, output="none")[0]
        print(
            f"{units:20} still tied: {tied}; max |weight - one process| after 3 steps = "
            f"{(weight - alone).abs().max():.1e}"
        )
    # every rank raised it: the one that exited first is chance
    except fsdp_guide.LaunchError as failure:
        print(
            f"{units:20} ranks {sorted(failure.failed)} raised {str(failure).splitlines()[0].split(' raised ', 1)[1]}"
        )

# %% [markdown]
# On torch 2.13 a unit each is refused at the first forward (`_validate_no_duplicate_params`
# in `_fsdp_state.py`), with the fix in the message; one unit for both, or
# leaving both to the root, trains every row of both ranks' uneven shards as one process
# does. Older torch does not refuse: on torch 2.9.1, the oldest this guide supports, the
# same two calls run without an error and untie the weight. The second `fully_shard`
# shards the output layer's reference to the original weight into a second parameter, and
# the embedding and the output layer then train apart, the shared weight off from one
# process by more than 1e-2 (`test_tied_weights_in_separate_units_are_refused_on_2_13_and_later_and_silently_untied_before`
# in `tests/test_wrap.py` checks both behaviours, run by `nox -s "torch(oldest)"` and
# `nox -s tests`). The report in pytorch/pytorch#176076, where only the last rank's rows
# stopped updating, is not what 2.9.1 does with these calls; the versions between 2.9.1 and
# 2.13 were not run here (huggingface/accelerate#4171 dates the refusal to torch 2.13).
# Everything in `fsdp_guide` that shards a model keeps a tied weight in one unit: `shard`
# and `auto_wrap` never make a unit of a module that shares a parameter with one outside it,
# and the LLM recipe and `hf.from_pretrained` leave the embedding and the output layer to the root.


# %% [markdown]
# ## A parameter FSDP leaves alone
#
# `fully_shard(..., ignored_params={p})` leaves `p` out of FSDP: it is not sharded (a
# plain tensor, whole on every rank), not gathered, and its gradient is not reduced. It is
# for a parameter you replicate and handle yourself (one kept outside the unit's mixed
# precision, or updated by its own rule). What it owes you then is the reduction: below, a
# learned output scale trained for three steps, with and without an `all_reduce` of its
# gradient, against one process that trains on both ranks' batches.
#
# (fsdp2-fully-shard-ignored-params)=


# %%
def train_with_an_ignored_scale(reduce_it, sharded=True):
    import torch.distributed as dist
    import torch.distributed.tensor as dt
    from torch.distributed.fsdp import fully_shard

    device = fsdp_guide.device()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 4)).to(device)
    model.register_parameter("scale", nn.Parameter(torch.ones(4, device=device)))
    if sharded:
        fully_shard(model, ignored_params={model.scale})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ranks = range(dist.get_rank(), dist.get_rank() + 1) if sharded else range(2)
    for step in range(3):
        losses = [
            (
                model(
                    torch.randn(
                        BATCH, WIDTH, generator=torch.Generator().manual_seed(10 * step + r)
                    ).to(device)
                )
                * model.scale
            )
            .square()
            .mean()
            for r in ranks
        ]
        (sum(losses) / len(losses)).backward()
        if reduce_it:  # what FSDP does for the others: the mean over the ranks
            dist.all_reduce(model.scale.grad, op=dist.ReduceOp.AVG)
        optimizer.step()
        optimizer.zero_grad()
    kinds = {type(model.scale).__name__, type(model[0].weight).__name__}
    return kinds, {
        name: (p.full_tensor() if isinstance(p, dt.DTensor) else p.detach()).cpu()
        for name, p in model.named_parameters()
    }


_, alone = launch(train_with_an_ignored_scale, False, False, world_size=1, output="none")[0]
for reduce_it in (False, True):
    (kinds, rank0), (_, rank1) = launch(
        train_with_an_ignored_scale, reduce_it, world_size=2, output="none"
    )
    apart = (rank0["scale"] - rank1["scale"]).abs().max().item()
    error = largest_difference((rank0[name], alone[name]) for name in alone)
    print(
        f"scale's gradient all-reduced: {reduce_it!s:5} types {sorted(kinds)}; the two ranks' scales differ "
        f"by {apart:.1e}; max |weights - one process| = {error:.1e}"
    )

# %% [markdown]
# The sharded weights are DTensors and the ignored scale a plain `Parameter`. Without the
# `all_reduce` each rank's scale follows its own batches and the ranks drift apart (the
# sharded weights are one DTensor across the ranks, reduced by FSDP, and cannot). With it, both ranks hold the same
# scale, and every weight equals one process's.
#
# The reduction is not all it leaves to you. `fully_shard`'s docstring says ignored
# parameters "will not be sharded, nor moved to the device during init": build them on
# the rank's device, as above (on this CPU run there is nothing to move, so it shows no
# difference here). And a plain tensor beside DTensors breaks what takes every parameter
# at once, such as gradient clipping:
#
# (fsdp2-ignored-params-clipping)=


# %%
def clip_with_an_ignored_scale(sharded=True):
    import torch.distributed as dist
    import torch.distributed.tensor as dt
    from torch.distributed.fsdp import fully_shard

    device = fsdp_guide.device()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 4)).to(device)
    model.register_parameter("scale", nn.Parameter(torch.ones(4, device=device)))
    if sharded:
        fully_shard(model, ignored_params={model.scale})
    ranks = range(dist.get_rank(), dist.get_rank() + 1) if sharded else range(2)
    losses = [
        (
            model(torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(r)).to(device))
            * model.scale
        )
        .square()
        .mean()
        for r in ranks
    ]
    (sum(losses) / len(losses)).backward()
    if not sharded:
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        return (
            "one process",
            total.item(),
            {name: p.grad.cpu() for name, p in model.named_parameters()},
        )
    dist.all_reduce(model.scale.grad, op=dist.ReduceOp.AVG)
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        whole = "runs"
    except RuntimeError as error:
        whole = f"{type(error).__name__}: {str(error).splitlines()[0]}"
    # one norm per kind, combined as the norm of norms; then each group scaled by the same factor
    groups = [
        [p for p in model.parameters() if isinstance(p, dt.DTensor)],
        [p for p in model.parameters() if not isinstance(p, dt.DTensor)],
    ]
    norms = [torch.nn.utils.get_total_norm([p.grad for p in group]) for group in groups]
    total = torch.linalg.vector_norm(
        torch.stack([n.full_tensor() if isinstance(n, dt.DTensor) else n for n in norms])
    )
    for group in groups:
        torch.nn.utils.clip_grads_with_norm_(group, MAX_NORM, total)
    grads = {
        name: (p.grad.full_tensor() if isinstance(p.grad, dt.DTensor) else p.grad).cpu()
        for name, p in model.named_parameters()
    }
    return whole, total.item(), grads


MAX_NORM = 0.1  # below the gradients' norm: the clip scales them
_, one_norm, one_grads = launch(clip_with_an_ignored_scale, False, world_size=1, output="none")[0]
whole, total, grads = launch(clip_with_an_ignored_scale, world_size=2, output="none")[0]
print(f"clip_grad_norm_ over every parameter: {whole}")
print(
    f"clipped in two groups (DTensors, plain): total norm {total:.7f}; one process's {one_norm:.7f}; "
    f"clipped gradients vs one process's: {largest_difference((grads[n], g) for n, g in one_grads.items()):.1e}"
)


# %% [markdown]
# `clip_grad_norm_` takes one norm over every gradient with one foreach operation, and
# DTensor refuses plain tensors among its operands. Grouping the parameters, a norm per
# group, combined, and each group scaled by it, gives one process's norm and one process's
# clipped gradients. (The package's
# `fsdp_guide.recipes.replicas.apply` clips over `model.parameters()` in one call: fine for
# its models, which FSDP shards whole, and it would fail the same way on one with ignored
# parameters.)
#
# (placements-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/placements.py`.
# `torchrun --nproc-per-node=2 placements.py` builds a model with all three: a tied embedding and
# output layer left to the root unit, three stacked experts sharded along dim 1 by
# `shard_placement_fn`, and a learned scale in `ignored_params` whose gradient it all-reduces itself.
# It trains 3 SGD steps with the gradients clipped in two groups, and rank 0 prints the shard each
# rank holds of the experts' weight, whether the weights are still tied, and the largest difference
# from one process. The tests run it under torchrun on 2 CPU ranks and check the shards, the tie, and
# that the difference is at most 1e-5 (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/placements.py
# :language: python
# ```

# %% [markdown]
# (placements-tips)=
# ## The tips behind this
#
# - Stacked experts split unevenly along dim 0; `shard_placement_fn` can split them along
#   another dimension that divides evenly: {ref}`tip-shard-placement-fn`.
# - A weight shared by two modules (a tied embedding and output layer) goes in one unit,
#   `fully_shard([embedding, output])` or the root: {ref}`tip-tied-weights-one-unit`.
# - A parameter in `ignored_params` is yours to reduce: {ref}`tip-ignored-params`.
#
# Every public FSDP2 name, and where it is executed: {ref}`fsdp2-map`.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("placements")
