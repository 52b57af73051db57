"""The mixture-of-experts model of the experts page, for the page that builds on it.

``tutorials/experts.py`` writes this code out and explains it: a top-1 MoE layer whose experts
are stacked in two 3-D weights, expert parallelism over ``ep`` with all-to-alls, FSDP2 over
``edp`` for the experts and over ``dp`` for the rest (:func:`sharded`), one step on 4 ranks
(:func:`one_step`) and its one-process reference (:func:`one_process`, :func:`gap`).
``tutorials/uneven_experts.py`` imports it from here; keep the two copies in step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fsdp_guide
from fsdp_guide.collectives import count_collectives
from fsdp_guide.compare import largest_difference

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
