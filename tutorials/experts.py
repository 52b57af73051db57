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
# (tutorial-experts)=
# # Experts with FSDP2
#
# **What you will learn**
#
# - how a {term}`mixture-of-experts <expert parallelism>` layer routes each token to one
#   expert, and how expert parallelism spreads the experts over ranks and sends each token
#   to its expert's rank and back with all-to-alls;
# - how to shard such a model with FSDP2: the experts on a mesh of their own, the rest of
#   the model over every rank;
# - why the experts' gradients then come out twice too large, found by comparing one step
#   with one process, and two fixes: the experts' gradient divide factor, or no averaging
#   at all and a loss divided by the global token count (torchtitan's way today).
#
# The load over experts and ranks, experts some ranks do not call, and fewer experts than
# ranks are the {ref}`uneven experts page <tutorial-uneven-experts>`.
#
# **What you need**: a CPU; 4 processes on gloo; about 5 seconds on 2 CPU cores ({ref}`measured <measured-times>`).
# The worker code is written to run unchanged with one GPU per rank (NCCL): every tensor
# and mesh is on {func}`fsdp_guide.device`.
# The tips it demonstrates are listed {ref}`at the end <experts-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`experts-script` ({download}`download <scripts/experts.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# ## A mixture-of-experts layer
#
# The experts are 8 small MLPs, stacked in two 3-D weights (expert *e* is `w1[e]` and
# `w2[e]`), as torchtitan's `GroupedExperts` stacks its experts' weights (three of them,
# for SwiGLU). A router scores each token, the token goes to its best-scoring expert
# (top-1), and the expert's output is scaled by that score. Tokens are sorted by expert so
# that each expert computes on one contiguous run:

# %%
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HIDDEN, EXPERTS = 64, 32, 64, 8


class Experts(nn.Module):
    """``n`` MLPs in two 3-D weights; computes each expert on its own run of the sorted tokens."""

    def __init__(self, n: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, DIM, HIDDEN))
        self.w2 = nn.Parameter(torch.empty(n, HIDDEN, DIM))

    def forward(self, tokens, counts: list[int]):
        # An expert given no tokens computes on an empty run: its gradient is zeros, not missing.
        runs = tokens.split(counts)
        return torch.cat([F.gelu(run @ self.w1[e]) @ self.w2[e] for e, run in enumerate(runs)])


class MoE(nn.Module):
    """Top-1 routing over ``n_experts`` experts; with ``ep`` set, this rank holds only its share of them."""

    def __init__(self, n_experts: int):
        super().__init__()
        self.n_experts = n_experts
        self.router = nn.Linear(DIM, n_experts, bias=False)
        self.experts = Experts(n_experts)
        self.ep = None  # the expert-parallel group, or None: every expert is here

    def forward(self, x):
        tokens = x.reshape(-1, DIM)
        score, expert = self.router(tokens).softmax(-1).max(-1)
        order = expert.argsort(stable=True)  # the tokens grouped by expert
        # tokens per expert, from this rank
        self.sent = torch.bincount(expert, minlength=self.n_experts)
        if self.ep is None:
            out = self.experts(tokens[order], self.sent.tolist())
        else:
            out = self.exchange(tokens[order], self.sent)
        return (score[:, None] * out[order.argsort()]).reshape(x.shape)  # back in the tokens' order

    def exchange(self, tokens, sent):
        """Send each token to its expert's rank, compute there, and bring the outputs back."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        ranks = dist.get_world_size(self.ep)
        local = self.n_experts // ranks  # rank r holds experts r*local ... (r+1)*local - 1
        received = torch.empty_like(sent)  # from each rank, how many tokens for each of my experts
        dist.all_to_all_single(received, sent, group=self.ep)
        # The split sizes must be Python ints: one copy to the host (on a GPU, a sync).
        sent_host, received_host = torch.stack([sent, received]).view(2, ranks, local).tolist()
        send_splits, recv_splits = (
            [sum(row) for row in sent_host],
            [sum(row) for row in received_host],
        )
        arrived = all_to_all_single_autograd(tokens, recv_splits, send_splits, self.ep)
        # arrived: by source rank, then by expert; the experts want them by expert
        runs = arrived.split([n for row in received_host for n in row])
        by_expert = [source * local + e for e in range(local) for source in range(ranks)]
        # per local expert
        self.computed = [sum(row[e] for row in received_host) for e in range(local)]
        out = self.experts(torch.cat([runs[i] for i in by_expert]), self.computed)
        out_runs = dict(zip(by_expert, out.split([runs[i].shape[0] for i in by_expert])))
        back = torch.cat([out_runs[i] for i in range(ranks * local)])  # by source rank again
        return all_to_all_single_autograd(back, send_splits, recv_splits, self.ep)


class Model(nn.Module):
    """An embedding, one residual MoE layer, and an output head: small enough to check exactly."""

    def __init__(self, n_experts: int = EXPERTS):
        super().__init__()
        self.emb, self.norm = nn.Embedding(VOCAB, DIM), nn.LayerNorm(DIM)
        self.moe, self.head = MoE(n_experts), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx):
        x = self.emb(idx)
        return self.head(x + self.moe(self.norm(x)))


def make_model(ep_group=None, n_experts=EXPERTS):
    """The seeded model; with ``ep_group``, keeping only this rank's share of the experts."""
    torch.manual_seed(0)
    model = Model(n_experts)
    nn.init.normal_(model.moe.experts.w1, std=0.1)
    nn.init.normal_(model.moe.experts.w2, std=0.1)
    if ep_group is not None:
        local = n_experts // dist.get_world_size(ep_group)
        mine = slice(dist.get_rank(ep_group) * local, (dist.get_rank(ep_group) + 1) * local)
        experts = Experts(local)
        with torch.no_grad():
            experts.w1.copy_(model.moe.experts.w1[mine])
            experts.w2.copy_(model.moe.experts.w2[mine])
        model.moe.experts, model.moe.ep = experts, ep_group
    return model


# 4 ranks x 2 sequences
BATCH = torch.randint(0, VOCAB, (8, 17), generator=torch.Generator().manual_seed(11))


def loss_of(model, batch):
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


# %% [markdown]
# Sorting, splitting into runs and putting the outputs back in order is where a routing bug
# would hide, and the one-process reference below runs the same code. So first, the layer
# against the plainest computation there is: every expert on every token, then each
# token's own expert's output picked and scaled:


# %%
def every_expert_on_every_token(moe, x):
    tokens = x.reshape(-1, DIM)
    score, expert = moe.router(tokens).softmax(-1).max(-1)
    w1, w2 = moe.experts.w1, moe.experts.w2
    # tokens, experts, dim
    all_outputs = torch.stack([F.gelu(tokens @ w1[e]) @ w2[e] for e in range(moe.n_experts)], 1)
    picked = (F.one_hot(expert, moe.n_experts)[:, :, None] * all_outputs).sum(1)
    return (score[:, None] * picked).reshape(x.shape)


with torch.no_grad():
    moe, x = make_model().moe, torch.randn(4, 16, DIM, generator=torch.Generator().manual_seed(0))
    difference = (moe(x) - every_expert_on_every_token(moe, x)).abs().max()
    print(f"max |MoE layer - every expert on every token| = {difference:.1e}")

# %% [markdown]
# In `exchange`, `all_to_all_single_autograd` (torch's functional collective, the one
# torchtitan's `ExpertParallel` calls, in
# [`torchtitan/distributed/expert_parallel.py`](https://github.com/pytorch/torchtitan/blob/81f5a5a9f9a59f0bbf47d015166a8d24e98e1c46/torchtitan/distributed/expert_parallel.py#L102-L181)
# as of January 2026) is an all-to-all that autograd can go back through: in backward, the
# outputs' gradients travel the opposite way. The first, `dist.all_to_all_single`, only
# tells each rank how many tokens to expect, and needs no gradient. The split sizes are
# Python integers, so on a GPU the counts are copied to the host each forward, a sync
# (torchtitan's code notes the same: "this would incur a device-to-host sync"); the layer
# copies once.
#
# ## Two meshes: the experts' and everyone's
#
# Four ranks, and the experts split over pairs of them: ranks 0 and 1 form an
# expert-parallel group (`ep`), rank 0 holding experts 0 to 3 and rank 1 experts 4 to 7;
# ranks 2 and 3 form another, with the same split. So each expert has two copies, on ranks
# 0 and 2 (experts 0 to 3) or 1 and 3, and FSDP shards each pair of copies over the
# expert-data-parallel dimension (`edp`). Everything else (embedding, router, norm, head)
# is sharded over all four ranks (`dp`). torchtitan wrapped the experts the same way, as a
# unit of their own on their mesh, before the block around them (`apply_fsdp` in
# [`torchtitan/models/llama4/infra/parallelize.py`](https://github.com/pytorch/torchtitan/blob/81f5a5a9f9a59f0bbf47d015166a8d24e98e1c46/torchtitan/models/llama4/infra/parallelize.py#L321-L413),
# January 2026); today it puts them in the block's unit with a mesh of their own per
# parameter, through `shard_placement_fn` returning a `ShardPlacementResult`
# ([`torchtitan/distributed/fsdp.py`](https://github.com/pytorch/torchtitan/blob/b5bcd76c66d0acb1a08b176d9639425bc55e0b2a/torchtitan/distributed/fsdp.py#L285-L366)).
#
# Each rank's loss is the mean over its own tokens, so the step's loss is the mean over
# ranks; FSDP's reduce-scatter averages each gradient over the ranks of its mesh. The
# worker takes how the gradients are to be reduced:
#
# - `"average"`: FSDP's default, averaging over each unit's mesh;
# - `"divide factor"`: the experts' unit divides by all 4 data ranks instead of its 2;
# - `"sum, global tokens"`: no division by FSDP anywhere (factor 1 on every unit), and each
#   rank's loss summed over its tokens and divided by the tokens of all ranks.

# %%
import fsdp_guide
from fsdp_guide import launch
from fsdp_guide.collectives import count_collectives
from fsdp_guide.compare import largest_difference
from fsdp_guide.table import Table
from IPython.display import display


def sharded(reduction, n_experts=EXPERTS, experts_on_dim=0):
    """The model with expert parallelism over ``ep`` and FSDP2 over ``edp`` (experts) and ``dp`` (the rest)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    device = fsdp_guide.device()
    experts_mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("edp", "ep"))
    dense_mesh = init_device_mesh(device.type, (4,), mesh_dim_names=("dp",))
    model = make_model(experts_mesh.get_group("ep"), n_experts).to(device)
    fully_shard(
        model.moe.experts,
        mesh=experts_mesh["edp"],
        shard_placement_fn=lambda p: Shard(experts_on_dim),
    )
    # the rest: the experts are already sharded, and left to their mesh
    fully_shard(model, mesh=dense_mesh)
    factors = {
        "average": {},
        "divide factor": {model.moe.experts: dense_mesh.size()},
        "sum, global tokens": {model: 1.0, model.moe.experts: 1.0},
    }[reduction]
    for unit, factor in factors.items():
        unit.set_gradient_divide_factor(factor)
        # A factor other than the group's size asks for ReduceOp.PREMUL_SUM, which gloo lacks:
        # a plain SUM, then the division, works on every backend.
        unit.set_force_sum_reduction_for_comms(True)
    return model, experts_mesh, dense_mesh


def one_step(reduction, n_experts=EXPERTS, experts_on_dim=0):
    model, experts_mesh, dense_mesh = sharded(reduction, n_experts, experts_on_dim)
    batch = BATCH.chunk(4)[dist.get_rank()].to(fsdp_guide.device())  # this rank's 2 sequences
    tokens = torch.tensor(batch[:, 1:].numel(), device=batch.device)
    all_tokens = tokens.clone()
    dist.all_reduce(all_tokens, group=dense_mesh.get_group())
    with count_collectives(dense_mesh, experts_mesh) as seen:
        loss = loss_of(model, batch)
        if reduction == "sum, global tokens":
            # this rank's summed token losses over every rank's tokens
            loss = loss * tokens / all_tokens
        loss.backward()
    return {
        "loss": loss.item(),
        "ep": experts_mesh["ep"].get_local_rank(),
        "grads": {name: p.grad.full_tensor().cpu() for name, p in model.named_parameters()},
        "shapes": {name: tuple(p.to_local().shape) for name, p in model.named_parameters()},
        "sharding": fsdp_guide.describe_sharding(model),  # for the figure
        "sent": model.moe.sent.tolist(),
        "computed": model.moe.computed,
        "collectives": seen.rows(),
    }


REDUCTIONS = ("average", "divide factor", "sum, global tokens")
runs = {
    reduction: launch(one_step, reduction, world_size=4, output="none") for reduction in REDUCTIONS
}
print("what rank 0 holds of each parameter (its local shard's shape):")
display(Table(["parameter", "shape on rank 0"], runs["average"][0]["shapes"].items()))

# %% tags=["hide-input"] mystnb={"image": {"alt": "Which rank holds each of the 8 experts' weights, and each quarter of the embedding: ranks 0 and 2 hold experts 0 to 3, two each, ranks 1 and 3 experts 4 to 7, two each; every rank holds a quarter of the embedding's rows."}}
import matplotlib.pyplot as plt
from fsdp_guide.describe import draw_sharding

fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 3.2), height_ratios=(1, 1.4))
colours = plt.get_cmap("Pastel1").colors
for rank, r in enumerate(runs["average"]):
    w1 = next(row for row in r["sharding"] if row.name == "moe.experts.w1")
    start, stop = map(
        int, w1.holds.strip("[").split(",")[0].split(":")
    )  # of this ep rank's experts
    for local in range(start, stop):
        expert = r["ep"] * w1.full_shape[0] + local  # ep rank e holds experts e*4 ... e*4+3
        top.add_patch(plt.Rectangle((expert, 0), 1, 1, facecolor=colours[rank], edgecolor="0.3"))
        top.text(expert + 0.5, 0.5, f"e{expert}\nrank {rank}", ha="center", va="center", fontsize=8)
top.set(xlim=(0, EXPERTS), ylim=(0, 1), xticks=[], yticks=[])
top.set_title("the experts' weights (w1, w2): one rank each, over ep and edp")
tables = [r["sharding"] for r in runs["average"]]
draw_sharding(tables, "emb.weight", ax=bottom)
bottom.set_title("the embedding (and every other dense parameter): a quarter on each rank, over dp")
fig.tight_layout()

# %% [markdown]
# Rank 0 holds a quarter of every dense parameter (16 of the embedding's 64 rows, 2 of the
# router's 8) and, of the experts' weights, half of its 4 experts: FSDP's default
# placement, `Shard(0)`, splits the local experts between ranks 0 and 2.
#
# ## One step against one process
#
# The reference is one process with all 8 experts on the whole batch. Each rank's
# gradients, gathered with `full_tensor()` (over `edp`: a rank's experts are plain local
# tensors as far as `ep` goes), are compared with it, an expert's with its own slice of the
# reference:


# %%
def one_process(n_experts=EXPERTS):
    model = make_model(n_experts=n_experts)
    loss = loss_of(model, BATCH)
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


def expected(reference, name, rank, n_experts=EXPERTS):
    if not name.startswith("moe.experts."):
        return reference[name]
    local = n_experts // 2
    return reference[name][rank["ep"] * local : (rank["ep"] + 1) * local]  # this rank's experts


def gap(ranks, reference, name, n_experts=EXPERTS, times=1):
    """The largest |gradient - times x reference| over the ranks, relative to the reference's largest."""
    return times * largest_difference(
        ((r["grads"][name] / times, expected(reference, name, r, n_experts)) for r in ranks),
        relative=True,
    )


reference_loss, reference = one_process()
print(
    f"loss: one process {reference_loss:.7f}; 4 ranks, the sum of the ranks' losses over 4: "
    + ", ".join(
        f"{reduction} {sum(r['loss'] for r in runs[reduction]) / 4:.7f}"
        for reduction in REDUCTIONS[:2]
    )
    + f"; the sum of the ranks' losses: sum, global tokens {sum(r['loss'] for r in runs[REDUCTIONS[2]]):.7f}"
)
print("largest |gradient - one process|, relative to the largest gradient:")
rows = [
    [name, *(f"{gap(runs[reduction], reference, name):.1e}" for reduction in REDUCTIONS)]
    for name in reference
]
display(Table(["parameter", *REDUCTIONS], rows))
# torch's max, not Python's: it keeps a NaN wherever it is (fsdp_guide.compare)
twice = (
    torch.tensor(
        [
            gap(runs["average"], reference, name, times=2)
            for name in reference
            if name.startswith("moe.experts.")
        ]
    )
    .max()
    .item()
)
print(f"averaged: the experts' gradients against twice one process's: {twice:.1e}")

# %% [markdown]
# The loss is the one process's, to float32's rounding, whichever way the gradients are
# reduced: it is computed before any gradient is. The gradients are not:
#
# - **Averaged** (FSDP's default), the dense parameters are right and every expert's
#   gradient is twice the reference, to float32's rounding (the last line). A copy of an expert
#   receives the tokens of both ranks of its `ep` group, so its gradient already sums two
#   ranks' losses; its unit then averages over `edp`, dividing by 2 where the data were
#   split over 4. With no factor set, FSDP reduce-scatters with `ReduceOp.AVG` over the
#   unit's own mesh (`_get_gradient_divide_factors` in
#   [`torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py`](https://github.com/pytorch/pytorch/blob/main/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py)).
# - **Divide factor**: `set_gradient_divide_factor(4)` on the experts' unit divides by
#   every rank that holds data, and the experts match like the rest. torchtitan did this
#   in January 2026: "the gradient division factor should be consistent with data" (the
#   comment beside that call, in the `apply_fsdp` cited above).
# - **Sum, global tokens**: FSDP divides nothing, and each rank's loss is its tokens'
#   summed loss over the tokens of every rank, so the gradients sum to the mean over all
#   tokens wherever they were reduced. It also stays right when ranks hold different
#   numbers of tokens, where dividing by the number of ranks does not
#   ({ref}`tutorial-loss-and-accumulation`). torchtitan does this today
#   (`disable_fsdp_gradient_division` in the `fsdp.py` cited above sets a factor of 1.0 on
#   every unit, "We handle gradient scaling ourselves in the training loop with global
#   token count").
#
# Training on with averaged experts, SGD would take steps twice too long for them; Adam
# divides each gradient by its own running size, so the doubling mostly cancels in its
# update (`_single_tensor_adam` in `torch/optim/adam.py`; no step is run here) but still
# inflates the global gradient norm that clipping and logging read. Only a check of the
# gradients shows it.
#
# ## What this page leaves out
#
# - **Checkpoints.** A rank's experts are plain tensors as far as `ep` goes: the two ranks
#   of an `ep` group hold different experts under the same names, which a DCP checkpoint
#   cannot tell apart. torchtitan's `ExpertParallel` makes them DTensors sharded over `ep`
#   (`distribute_tensor(..., [Shard(0)])` in its `_partition_fn`, in the
#   `expert_parallel.py` cited above); this page does not checkpoint.
# - **Top-k routing** (each token to k experts): the tokens are repeated k times before
#   the dispatch and the outputs summed with their scores after, so the all-to-alls carry
#   k times the bytes. This page routes top-1.

# %% [markdown]
# (experts-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/experts.py`.
# `torchrun --nproc-per-node=4 experts.py` shards the experts over `edp` and routes the tokens
# over `ep` with the all-to-alls above, divides the experts' gradients by all 4 data ranks,
# trains 10 SGD steps (SGD, where a gradient twice too large shows in the loss), and rank 0
# prints the largest difference from the same training in one process with every expert. The
# tests run this file under torchrun on 4 CPU ranks and check that the difference is at most
# 1e-5 (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/experts.py
# :language: python
# ```

# %% [markdown]
# (experts-tips)=
# ## The tips behind this
#
# - {ref}`tip-experts-divide-factor`: experts on their own mesh need every data rank's
#   division, or none and a loss over the global token count.
# - {ref}`tip-check-against-one-process`: the check that found the factor of 2.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("experts")
