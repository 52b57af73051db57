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
# (tutorial-fsdp2-controls)=
# # FSDP2's controls: prefetching, skipped gathers, a failed step, unused experts, placements, tied weights, ignored parameters
#
# **What you will learn**
#
# - in which order FSDP2 starts its all-gathers, and how `set_modules_to_forward_prefetch`
#   and `unshard(async_op=True)` with its `UnshardHandle` start them earlier;
# - how `set_unshard_in_backward(False)` saves the all-gather of a unit whose parameters
#   backward does not need (an embedding), with the gradients unchanged;
# - what an exception in the middle of backward leaves behind, what `reset_iter_state()`
#   repairs and what it does not on torch 2.13, and how to make the next steps equal one
#   process's;
# - why experts that get no tokens on a rank break the gradient reduction, silently or not,
#   and how `set_reduce_scatter_unused_params(True)` fixes it;
# - how `shard_placement_fn` splits a parameter along another dimension (stacked experts);
# - why a tied embedding and output layer belong in one unit, what torch 2.13 and 2.9.1 do
#   otherwise, and the fix;
# - what `ignored_params` leaves to you.
#
# **What you need**: a CPU; 2 processes on gloo; about 10 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The code
# is written to run unchanged with one GPU per rank (NCCL). Every public FSDP2 name, and
# the page that executes it, is in {ref}`fsdp2-map`. The tips it demonstrates are listed
# {ref}`at the end <fsdp2-controls-tips>`.

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# ## A small model, one unit per layer
#
# An embedding, three linear layers and an output layer, each its own FSDP unit, and the
# whole model the root. The same seed builds the same model on every rank.

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


def tokens(step):
    """The step's batch, the same on every rank; each rank takes its half with `my_half`."""
    return torch.randint(0, VOCAB, (BATCH, 6), generator=torch.Generator().manual_seed(step))


def my_half(batch):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    return batch[rank * len(batch) // world : (rank + 1) * len(batch) // world]


def loss_of(model, batch):
    # flat ids: every unit returns a new tensor
    logits = model(batch.reshape(-1)).view(*batch.shape, VOCAB)
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


# %% [markdown]
# ## When each all-gather starts
#
# FSDP2 marks what it does with the profiler's labels: `FSDP::pre_forward (i)` when unit
# `i`'s forward begins, `FSDP::all_gather (i)` when its all-gather is issued. Sorted by start
# time on the host they give the order of issue. Three ways to run the same forward:
#
# - by default, each unit gathers its parameters when its forward begins;
# - `set_modules_to_forward_prefetch([next unit])` on each unit issues the next unit's
#   all-gather right after its own;
# - `unshard(async_op=True)` issues a unit's all-gather by hand and returns an
#   `UnshardHandle`; `handle.wait()` waits for it. Called before the forward (here, before
#   the batch is moved to the device), the first unit's gather no longer waits for the step.
#
# (fsdp2-fsdpmodule-set-modules-to-forward-prefetch)=
# (fsdp2-fsdpmodule-unshard)=
# (fsdp2-unshardhandle)=
# (fsdp2-unshardhandle-wait)=


# %%
def forward_issue_order(how):
    from torch.profiler import ProfilerActivity, profile

    device = fsdp_guide.device()
    model = shard(make_model().to(device))
    if how == "forward prefetch":
        for i in range(len(model) - 1):
            model[i].set_modules_to_forward_prefetch([model[i + 1]])
    batch = my_half(tokens(0))
    model(batch.reshape(-1).to(device))  # lazy initialisation out of the way
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        if how == "unshard(async_op=True)":
            handle = model[0].unshard(async_op=True)  # an UnshardHandle
            on_device = batch.reshape(-1).to(device)  # work done while the gather is in flight
            handle.wait()
        else:
            on_device = batch.reshape(-1).to(device)
        model(on_device)
    events = sorted(
        (e.time_range.start, e.name)
        for e in prof.events()
        if e.name.startswith(("FSDP::pre_forward (", "FSDP::all_gather ("))
        and not e.name.endswith("()")
    )
    short = {"FSDP::pre_forward": "F", "FSDP::all_gather": "AG"}
    return " ".join(
        short[name.split(" (")[0]] + name.split(" (")[1].rstrip(")") for _, name in events
    )


ORDERS = {
    how: launch(forward_issue_order, how, world_size=2, output="none")[0]
    for how in ("default", "forward prefetch", "unshard(async_op=True)")
}
for how, order in ORDERS.items():
    print(f"{how:24} {order}")

# %% [markdown]
# `F`*i*: unit *i*'s forward begins; `AG`*i*: its all-gather is issued (both as the host
# records them).
# By default every `AG`*i* follows its own `F`*i*. With forward prefetching each unit
# issues the next one's gather before the next forward begins (`AG1` before `F1`). With
# `unshard(async_op=True)`, `AG0` is issued before the forward begins at all, and unit
# 0's forward does not gather again.
#
# This is the order of issue, not overlap, which this page does not measure: here gloo's
# collectives run on the same CPU cores as the compute. What to expect on a GPU, from
# torch's source rather than a run: the default already overlaps, because the host runs
# ahead of the device's kernels and issues unit 1's gather (on its own stream) while unit
# 0's kernels still run. `set_modules_to_forward_prefetch`'s docstring says so: a list of
# the next unit alone "gives the same all-gather overlap behavior as the default overlap
# behavior, except the prefetched all-gather is issued earlier from the CPU"; a list of
# two or more overlaps more, with more memory reserved. Issuing earlier pays when the host
# would otherwise reach the next unit late, because a unit blocks it until the device
# catches up (a `.item()` or `.tolist()` on a device result): torchtitan's `apply_fsdp`
# prefetches explicitly only with expert parallelism, "as D2H syncs in EP could
# interfere with implicit prefetching in FSDP".
#
# Backward prefetching (`set_modules_to_backward_prefetch`) is measured on the
# {ref}`communication page <tutorial-communication>`, one and two units ahead.
#
# ## A gather backward does not need
#
# The gradient of an embedding's weight needs the token ids and the gradient of its output,
# not the weight itself; yet FSDP gathers every unit again for its backward. Counted with
# {func}`fsdp_guide.collectives.count_collectives` over one step, with and without
# `set_unshard_in_backward(False)` on the embedding, and the gradients compared with one
# process that trains on the whole batch:
#
# (fsdp2-fsdpmodule-set-unshard-in-backward)=


# %%
def gradients(unshard_embedding_in_backward):
    from fsdp_guide.collectives import count_collectives

    device = fsdp_guide.device()
    model = shard(make_model().to(device))
    model[0].set_unshard_in_backward(unshard_embedding_in_backward)
    with count_collectives() as seen:
        loss_of(model, my_half(tokens(0)).to(device)).backward()
    gathers = sum(n for (_, kind), n in seen.count.items() if kind == "all-gather")
    return gathers, [p.grad.full_tensor().cpu() for p in model.parameters()]


def one_process_gradients():
    model = make_model().to(fsdp_guide.device())
    loss_of(model, tokens(0).to(fsdp_guide.device())).backward()
    return [p.grad.cpu() for p in model.parameters()]


reference = launch(one_process_gradients, world_size=1, output="none")[0]
for setting in (True, False):
    gathers, grads = launch(gradients, setting, world_size=2, output="none")[0]
    error = largest_difference(zip(grads, reference))
    print(
        f"set_unshard_in_backward({setting!s:5}) on the embedding: {gathers} all-gathers in the step, "
        f"max |gradient - one process| = {error:.1e}"
    )

# %% [markdown]
# One all-gather fewer per step, and the same gradients: the embedding's gradient is
# computed from the ids alone and reduce-scattered as before. It pays when the embedding
# is large, as an LLM's with a large vocabulary is. It is wrong
# for a unit whose backward needs its weights (a linear layer's input gradient is the
# output gradient times the weight), and an embedding tied to the output layer shares its
# weight with a unit that does need it.
#
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
#
# ## Experts that get no tokens on a rank
#
# A mixture-of-experts layer sends each row to one expert, so on some rank an expert may
# get no rows, and its parameters no gradient. The layer is one FSDP unit, called on every
# rank, so the all-gathers match; the reduce-scatter after backward does not: each rank
# reduces the gradients it has. Two experts, a router by the sign of each row's mean, and two
# ways the data can fall: rank 1 routes every row to expert 0 while rank 0 uses both, or
# each rank routes every row to a different expert. The reference is one process
# averaging the two ranks' losses, as FSDP does; each rank compares its own shard of
# each gradient with the reference's.
#
# (fsdp2-fsdpmodule-set-reduce-scatter-unused-params)=

# %%
import re
import signal


class TwoExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))

    def forward(self, x):
        route = (x.mean(-1) > 0).long()  # expert 1 for the rows whose mean is positive
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows = (route == i).nonzero().squeeze(-1)
            if len(rows):  # an expert with no rows is not called
                out = out.index_add(0, rows, expert(x[rows]))
        return out


def make_moe():
    torch.manual_seed(0)
    return nn.Sequential(TwoExperts(), nn.Linear(WIDTH, 4))


SHIFTS = {
    "rank 1: every row to expert 0": (0, -1),
    "each rank: every row to another expert": (1, -1),
}


def rows_of(rank, shifts):
    return torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rank)) + shifts[rank]


def one_process_moe(shifts):
    model = make_moe().to(fsdp_guide.device())
    (
        sum(model(rows_of(r, shifts).to(fsdp_guide.device())).square().mean() for r in range(2)) / 2
    ).backward()
    return {name: p.grad.cpu() for name, p in model.named_parameters()}


def moe_step(shifts, unused_params, reference):
    import torch.distributed as dist

    device, rank = fsdp_guide.device(), dist.get_rank()
    model = shard(make_moe().to(device))
    model.set_reduce_scatter_unused_params(unused_params)  # every unit below the root too
    x = rows_of(rank, shifts).to(device)
    model(x).square().mean().backward()
    missing, pairs = [], []
    for name, p in model.named_parameters():
        if p.grad is None:
            missing.append(name)
        else:  # this rank's shard of the gradient: its chunk of dim 0
            pairs.append(
                (p.grad.to_local(), reference[name].to(device).chunk(dist.get_world_size())[rank])
            )
    return missing, largest_difference(pairs)


for case, shifts in SHIFTS.items():
    rows = [
        [int(((rows_of(r, shifts).mean(-1) > 0).long() == i).sum()) for i in range(2)]
        for r in range(2)
    ]
    print(f"{case}: rows per expert, rank 0 {rows[0]}, rank 1 {rows[1]}")
    reference = launch(one_process_moe, shifts, world_size=1, output="none")[0]
    for unused_params in (False, True):
        try:
            ranks = launch(
                moe_step, shifts, unused_params, reference, world_size=2, output="none", timeout=30
            )
            result = "; ".join(
                f"rank {r}: no gradient for {missing or 'none'}, max |shard - one process| "
                f"= {error:.1e}"
                for r, (missing, error) in enumerate(ranks)
            )
        # which ranks failed on their own, and gloo's words for why
        except fsdp_guide.LaunchError as failure:
            aborted = [rank for rank, code in failure.failed.items() if code == -signal.SIGABRT]
            result = (
                f"{type(failure).__name__}: ranks killed by SIGABRT: {aborted}; "
                f"{re.search(r'Received data size[^.]*[.]', str(failure))[0]}"
            )
        print(f"{case}; set_reduce_scatter_unused_params({unused_params!s:5}): {result}")

# %% [markdown]
# In the first case the ranks hand gloo reduce-scatters of different sizes (rank 0 has four
# gradients, rank 1 two), and gloo aborts the process ("Received data size doesn't match
# expected size", printed above). What NCCL does with it is not run here; a collective
# whose sizes differ across ranks is the kind of mismatch the
# {ref}`hangs page <tutorial-debugging-hangs>` shows hanging. In the second case the sizes
# happen to match, and
# nothing fails: the two ranks reduce different experts' gradients into each other, the
# optimizer would skip the parameters without a gradient, and every gradient it steps
# with is wrong. `set_reduce_scatter_unused_params(True)` (torch 2.13 and later) makes
# each rank reduce zeros for the parameters it did not use, as DDP's `find_unused_parameters` does, and both cases
# then match one process. On older torch, call every expert on every rank (on zero rows if
# none are routed to it), as the hangs page does with `torch.where`.

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
    if not sharded:
        return [], weights
    # the header, the experts' weight, the total
    table = str(fsdp_guide.describe_sharding(model)).splitlines()
    return [table[0], *(line for line in table if line.startswith(("weight ", "total")))], weights


_, one = launch(train_experts, False, False, world_size=1, output="none")[0]
for split_rows in (False, True):
    ranks = launch(train_experts, split_rows, world_size=2, output="none")
    error = largest_difference((ranks[0][1][name], one[name]) for name in one)
    how = "Shard(1) for the experts' weight" if split_rows else "none (dim 0 for all)"
    print(f"shard_placement_fn: {how}; max |weights - one process| after 3 steps = {error:.1e}")
    for rank, (held, _) in enumerate(ranks):
        print(f"  rank {rank}: " + "\n          ".join(held if rank == 0 else held[1:]))

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
# (fsdp2-controls-tips)=
# ## What this showed, and the tips behind it
#
# - FSDP2 issues a unit's all-gather when its forward begins; prefetch the next unit
#   explicitly, or start the first gather before the step: {ref}`tip-fsdp2-forward-prefetch`.
# - A unit whose backward needs no weights (an embedding that is not tied) can skip its
#   backward gather: {ref}`tip-unshard-in-backward`.
# - After catching an exception in the middle of a step, call `reset_iter_state()` on the
#   root, and on torch 2.13 drop the failed step's gradients too:
#   {ref}`tip-reset-iter-state`.
# - Layers whose parameters some ranks leave unused (experts) need
#   `set_reduce_scatter_unused_params(True)`, or every expert called on every rank:
#   {ref}`tip-reduce-scatter-unused-params`.
# - Stacked experts split unevenly along dim 0; `shard_placement_fn` can split them along
#   another dimension that divides evenly: {ref}`tip-shard-placement-fn`.
# - A weight shared by two modules (a tied embedding and output layer) goes in one unit,
#   `fully_shard([embedding, output])` or the root: {ref}`tip-tied-weights-one-unit`.
# - A parameter in `ignored_params` is yours to reduce: {ref}`tip-ignored-params`.
#
# Every public FSDP2 name, and where it is executed: {ref}`fsdp2-map`.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("fsdp2_controls")
