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
# (tutorial-uneven-experts)=
# # Uneven experts: idle experts and too few to split
#
# **What you will learn**
#
# - how unevenly a router spreads the tokens over experts and ranks, and the bytes the
#   all-to-alls then move; why an expert copy that receives no token is harmless;
# - why an expert that is not called at all on a rank breaks the gradient reduction,
#   silently or not, and how `set_reduce_scatter_unused_params(True)` fixes it;
# - why `shard_placement_fn` shards experts along dim 1 when a rank holds fewer experts
#   than ranks share them: the padding, counted.
#
# **What you need**: a CPU; 4 and 2 processes on gloo; about 5 seconds on 2 CPU cores ({ref}`measured <measured-times>`).
# The worker code is written to run unchanged with one GPU per rank (NCCL): every tensor
# and mesh is on {func}`fsdp_guide.device`. It builds on the {ref}`experts page <tutorial-experts>`:
# its model, expert parallelism over `ep` and FSDP2 over `edp` and `dp`, imported here from
# `fsdp_guide.moe`.
# The tips it demonstrates are listed {ref}`at the end <uneven-experts-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`uneven-experts-script` ({download}`download <scripts/uneven_experts.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# ## The experts page's step
#
# The experts page's model: 8 experts, top-1 routing, 4 ranks, the experts split over pairs
# of ranks (`ep`) and each pair of copies sharded over `edp`, the rest over all 4 ranks
# (`dp`), the experts' gradients divided by all 4 data ranks. One step, whose gradients
# match one process's (`fsdp_guide.moe.one_step` returns what each rank sent,
# computed and communicated):

# %%
import fsdp_guide
from fsdp_guide import launch
from fsdp_guide.compare import largest_difference
from fsdp_guide.moe import DIM, EXPERTS, gap, one_process, one_step
from fsdp_guide.table import Table
from IPython.display import display

runs = {"divide factor": launch(one_step, "divide factor", world_size=4, output="none")}
_, reference = one_process()
print(
    "largest |gradient - one process|, relative: "
    f"{max(gap(runs['divide factor'], reference, name) for name in reference):.1e}"
)

# %% [markdown]
# ## Where the tokens go
#
# How many tokens each rank sends to each expert, and how many each expert copy then
# computes:

# %%
ranks = runs["divide factor"]
total = [sum(column) for column in zip(*(r["sent"] for r in ranks))]
rows = [[f"rank {rank}", *r["sent"]] for rank, r in enumerate(ranks)] + [["all ranks", *total]]
header = ["tokens from", *(f"e{e}" for e in range(EXPERTS))]
display(Table(header, rows))  # an HTML table on the site, aligned text elsewhere
print(f"tokens per expert: mean {sum(total) / EXPERTS:.1f}, most {max(total)}, fewest {min(total)}")
print("tokens each rank's expert copies compute:")
for rank, r in enumerate(ranks):
    first = r["ep"] * 4
    print(
        f"  rank {rank}: "
        + ", ".join(f"e{first + e} {n}" for e, n in enumerate(r["computed"]))
        + f"; {sum(r['computed'])} in all"
    )
per_rank = [sum(r["computed"]) for r in ranks]
print(
    f"the busiest rank computes {max(per_rank) / (sum(per_rank) / 4):.2f}x the mean, "
    f"the busiest expert {max(total) / (sum(total) / EXPERTS):.2f}x"
)

# %% tags=["hide-input"] mystnb={"image": {"alt": "Two heat maps over 4 ranks and 8 experts: the tokens each rank sends to each expert, and the tokens each rank's expert copies compute, blank where a rank holds no copy of that expert; the busiest expert stands out, and a copy that receives no token shows a zero."}}
import matplotlib.pyplot as plt
import numpy as np

sent = np.array([r["sent"] for r in ranks])
computed = np.full(sent.shape, np.nan)  # blank where the rank holds no copy of the expert
for rank, r in enumerate(ranks):
    first = r["ep"] * len(r["computed"])
    computed[rank, first : first + len(r["computed"])] = r["computed"]
fig, axes = plt.subplots(1, 2, figsize=(9, 2.8))
for ax, grid, title in zip(
    axes, (sent, computed), ("tokens each rank sends", "tokens each rank's copies compute")
):
    ax.imshow(grid, cmap="Blues", vmin=0, vmax=np.nanmax(computed) * 1.2)
    for (rank, expert), n in np.ndenumerate(grid):
        if not np.isnan(n):
            ax.text(expert, rank, int(n), ha="center", va="center", fontsize=8)
    ax.set(title=title, xlabel="expert", ylabel="rank")
    ax.set_xticks(range(EXPERTS), [f"e{e}" for e in range(EXPERTS)])
    ax.set_yticks(range(len(ranks)))
fig.tight_layout()

# %% [markdown]
# With a router that has learned nothing yet, the busiest expert gets several times the
# tokens of the idlest, over only 128 tokens; the ranks, 4
# experts each, differ less. Nothing here is timed. On a GPU run (not measured here), one
# would expect the busiest rank to set the step's time: an all-to-all ends on a rank only
# once every rank has sent to it, so the others wait for it at the next one. Ranks 0 and 1 send expert 3 no token, so its
# copy on rank 0 computes on an empty run, and its gradient there is zeros; FSDP's
# reduce-scatter over `edp` adds rank 2's copy's, and the step above matched one process
# with it. Nothing had to be special-cased.
#
# Routers are trained to spread the tokens. torchtitan's MoE, for one, keeps a bias per
# expert, updated outside the loss from the tokens each expert received ("auxiliary-loss-free
# load balancing", `load_balance_coeff` in
# [`torchtitan/models/common/moe.py`](https://github.com/pytorch/torchtitan/blob/b5bcd76c66d0acb1a08b176d9639425bc55e0b2a/torchtitan/models/common/moe.py#L375-L397));
# this page trains nothing.
#
# The collectives of that step on rank 0, per mesh dimension, with their bytes:

# %%
display(Table(["mesh dim", "collective", "count", "bytes"], ranks[0]["collectives"]))
sent0, computed0 = sum(ranks[0]["sent"]), sum(ranks[0]["computed"])
print(
    f"ep bytes from the routing: {EXPERTS} counts x 8 bytes + 2 (forward, backward) x "
    f"({sent0} tokens sent + {computed0} returned) x {DIM * 4} bytes = "
    f"{EXPERTS * 8 + 2 * (sent0 + computed0) * DIM * 4}"
)

# %% [markdown]
# - **`ep`, all-to-all**: one to exchange the counts, then in forward one to send the
#   tokens to their experts and one to bring the outputs back, and the same two again in
#   backward for their gradients. The bytes are what rank 0 sends (its own share to itself
#   included), and follow the routing exactly: the line under the table derives them from
#   the tokens table above.
# - **`edp`**: the experts' unit, gathered for forward and again for backward (it is not
#   the root, so it reshards after forward), and its gradients reduce-scattered once.
# - **`dp`**: the root unit (everything but the experts), gathered once: `fully_shard`
#   keeps the root gathered after forward when `reshard_after_forward` is left to its
#   default (`_lazy_init` in
#   [`torch/distributed/fsdp/_fully_shard/_fsdp_state.py`](https://github.com/pytorch/pytorch/blob/main/torch/distributed/fsdp/_fully_shard/_fsdp_state.py)).

# %% [markdown]
# ## An expert not called on a rank
#
# The layer above calls every expert, on an empty run when it gets no token. A layer that
# skips an expert with no rows leaves its parameters with no gradient on that rank. The
# layer is one FSDP unit, called on every rank, so the all-gathers match; the reduce-scatter after backward does not: each rank
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

import torch.nn as nn

ROWS = 8


def shard(model):
    from torch.distributed.fsdp import fully_shard

    for unit in model:
        fully_shard(unit)
    return fully_shard(model)


class TwoExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))

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
    return nn.Sequential(TwoExperts(), nn.Linear(DIM, 4))


SHIFTS = {
    "rank 1: every row to expert 0": (0, -1),
    "each rank: every row to another expert": (1, -1),
}


def rows_of(rank, shifts):
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(rank)) + shifts[rank]


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
# {ref}`hang pages <tutorial-hang-branch>` show hanging. In the second case the sizes
# happen to match, and
# nothing fails: the two ranks reduce different experts' gradients into each other, the
# optimizer would skip the parameters without a gradient, and every gradient it steps
# with is wrong. `set_reduce_scatter_unused_params(True)` (torch 2.13 and later) makes
# each rank reduce zeros for the parameters it did not use, as DDP's `find_unused_parameters` does, and both cases
# then match one process. On older torch, call every expert on every rank (on zero rows if
# none are routed to it), as {ref}`the fix of hang 2 <debugging-hangs-branch-fix>` does with `torch.where`.

# %% [markdown]
# (experts-placement)=
# ## Fewer local experts than ranks: `shard_placement_fn`
#
# FSDP shards a parameter along dim 0 by default, and for the experts' weights dim 0 is
# the experts. That splits evenly only when the ranks sharing them (`edp`) divide a rank's
# number of experts. Below, 8 experts and 2, sharded along dim 0 and along dim 1, each
# trained one step against one process with the same number of experts, with the bytes
# the experts' all-gathers filled on rank 0:

# %%
rows = []
for n, dim in [(8, 0), (8, 1), (2, 0), (2, 1)]:
    per_rank = (
        runs["divide factor"]
        if (n, dim) == (8, 0)
        else launch(one_step, "divide factor", n, dim, world_size=4, output="none")
    )
    _, reference_n = one_process(n)
    gathered = dict(((d, k), b) for d, k, _, b in per_rank[0]["collectives"])[("edp", "all-gather")]
    worst = torch.tensor([gap(per_rank, reference_n, name, n) for name in reference_n]).max().item()
    shards = [str(per_rank[r]["shapes"]["moe.experts.w1"]) for r in (0, 2)]
    rows.append([n, f"Shard({dim})", *shards, gathered, f"{worst:.1e}"])
header = ["experts", "placement", "w1 shard, rank 0", "rank 2", "edp all-gather bytes"]
display(Table([*header, "largest relative grad gap"], rows))

# %% [markdown]
# With 2 experts, each `ep` rank holds 1, and `Shard(0)` cannot split 1 expert over 2
# ranks: rank 0's shard is the whole expert and rank 2's is empty. Rank 2 is not spared
# the memory, though: FSDP pads every rank's shard to the size of the first
# (`_fsdp_param.py`, "0th always padded"), so it stores an expert's worth of padding, and
# each all-gather fills two experts' worth of bytes for one expert, twice what `Shard(1)`
# gathers (the bytes column). `shard_placement_fn=lambda p: Shard(1)` splits every
# expert's weights along their next dimension instead, and each rank holds half. Both
# train correctly. torchtitan picks `Shard(1)` exactly when the `edp` size times the `ep`
# size exceeds the number of experts (`apply_fsdp` in torchtitan's llama4 `parallelize.py`, cited on the experts page, then and now). With 8
# experts both placements are even.
#
# (uneven-experts-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/uneven_experts.py`.
# `torchrun --nproc-per-node=2 uneven_experts.py` routes every row of rank 1 to one of two experts,
# so the other expert is not called there, sets `set_reduce_scatter_unused_params(True)` (torch 2.13
# or later), trains 5 SGD steps, and rank 0 prints the rows each rank routed to each expert and the
# largest difference of the weights from one process that trains on both ranks' rows. The tests run
# it under torchrun on 2 CPU ranks and check that an expert got no rows on a rank and that the
# difference is at most 1e-5 (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/uneven_experts.py
# :language: python
# ```

# %% [markdown]
# (uneven-experts-tips)=
# ## The tips behind this
#
# - {ref}`tip-reduce-scatter-unused-params`: experts some ranks do not call need
#   `set_reduce_scatter_unused_params(True)`, or every expert called on every rank.
# - {ref}`tip-shard-placement-fn`: sharding along another dimension than 0.
# - {ref}`tip-check-against-one-process`: the check each section runs.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("uneven_experts")
