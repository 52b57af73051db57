"""Experts with FSDP2 as a torchrun script: expert parallelism and FSDP2 train as one process does.

    torchrun --nproc-per-node=4 experts.py

A mixture-of-experts layer (8 experts, top-1 routing) on a 2-D mesh of the ranks. Over ``ep`` (2
ranks) each rank holds half of the experts, and all-to-alls send each token to its expert's rank
and back; over ``edp`` FSDP2 shards the copies of the same experts; the rest of the model is sharded
over every rank. An expert's copy sums the losses of its ``ep`` group's tokens, so its gradients are
divided by every data rank, not by its mesh's. Rank 0 also trains the unsharded model on the whole
batch, alone, and prints the largest difference between the losses of the two runs. Needs torch
alone; each rank computes on its accelerator (GPU) where there is one, else on the CPU (over gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

VOCAB, DIM, HIDDEN, EXPERTS, STEPS, LR = 64, 32, 64, 8, 10, 1.0


class Experts(nn.Module):
    """Experts ``mine`` of 8 MLPs in two 3-D weights (expert e: ``w1[e]``, ``w2[e]``)."""

    def __init__(self, mine):
        super().__init__()
        # every rank draws all the experts (the same seed: the same draws) and keeps its own
        self.w1 = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN)[mine] * 0.1)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM)[mine] * 0.1)

    def forward(self, runs, experts):
        # each run of tokens through its expert; an empty run still gives a (zero) gradient
        return torch.cat([F.gelu(r @ self.w1[e]) @ self.w2[e] for r, e in zip(runs, experts)])


class Model(nn.Module):
    """An embedding, a residual top-1 MoE layer, a head; with the group ``ep``, some experts."""

    def __init__(self, ep=None):
        super().__init__()
        ranks, rank = (dist.get_world_size(ep), dist.get_rank(ep)) if ep is not None else (1, 0)
        self.ep, self.local = ep, EXPERTS // ranks
        self.emb, self.norm = nn.Embedding(VOCAB, DIM), nn.LayerNorm(DIM)
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = Experts(slice(rank * self.local, (rank + 1) * self.local))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx):
        x = self.emb(idx)
        tokens = self.norm(x).flatten(0, 1)
        score, expert = self.router(tokens).softmax(-1).max(-1)  # top-1
        order = expert.argsort(stable=True)  # the tokens grouped by expert
        counts = torch.bincount(expert, minlength=EXPERTS)
        if self.ep is None:  # every expert is here
            out = self.experts(tokens[order].split(counts.tolist()), range(EXPERTS))
        else:
            out = self.dispatch(tokens[order], counts)
        return self.head(x + (score[:, None] * out[order.argsort()]).view(x.shape))

    def dispatch(self, tokens, counts):
        """Send each token to its expert's rank, compute it there, and send the output back."""
        received = torch.empty_like(counts)  # from each rank: its tokens for each of my experts
        dist.all_to_all_single(received, counts, group=self.ep)
        # The split sizes must be Python ints: one copy to the host (on a GPU, a sync).
        sent, received = torch.stack([counts, received]).view(2, -1, self.local).tolist()
        send, recv = [sum(row) for row in sent], [sum(row) for row in received]
        # an all-to-all that autograd goes back through: the gradients travel the other way
        arrived = all_to_all_single_autograd(tokens, recv, send, self.ep)
        runs = arrived.split([n for row in received for n in row])  # by source rank, then expert
        out = self.experts(runs, [i % self.local for i in range(len(runs))])
        return all_to_all_single_autograd(out, send, recv, self.ep)  # in the order it came


def train(model, device, rows=slice(None)):
    """SGD on the sequences ``rows`` of each global batch; the loss of each step."""
    # SGD, not Adam: a gradient off by a constant factor shows in the losses
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        # the global batch: 8 sequences of 17 tokens, each token the one before plus 7
        first = torch.randint(0, VOCAB, (8, 1), generator=torch.Generator().manual_seed(step))
        seqs = ((first + 7 * torch.arange(17)) % VOCAB).to(device)[rows]
        logits = model(seqs[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), seqs[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


def main():
    # The rank's device: an accelerator of its own where each rank on this machine has one, else
    # the CPU (is_available: a CUDA build of torch on a machine without a GPU has none).
    local_rank, local_ranks = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    accelerator = (
        torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    )
    if accelerator and torch.accelerator.device_count() >= local_ranks:
        device = torch.device(accelerator.type, local_rank)
        torch.accelerator.set_device_index(local_rank)
    else:
        device = torch.device("cpu")
    backend = dist.get_default_backend_for_device(device)  # NCCL on GPUs, gloo on the CPU
    dist.init_process_group(backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()

    # ep: the ranks that split the experts; edp: the ranks that hold the same experts (2 or more:
    # on a mesh of 1, torch 2.13 divides the gradients twice when forced to sum, below)
    assert world_size in (4, 8), "run on 4 or 8 ranks: 8 sequences, 2 or more per expert copy"
    mesh = init_device_mesh(device.type, (world_size // 2, 2), mesh_dim_names=("edp", "ep"))
    torch.manual_seed(0)  # the same weights on every rank
    model = Model(mesh.get_group("ep")).to(device)
    fully_shard(model.experts, mesh=mesh["edp"])  # the experts: a unit on their own mesh
    fully_shard(model)  # the rest, over every rank
    # An expert's copy already sums the losses of its ep group: FSDP's average over edp alone
    # would leave its gradients ep times too large. Divide by every data rank instead; a factor
    # other than the mesh's size asks for PREMUL_SUM, which gloo lacks: sum, then divide.
    model.experts.set_gradient_divide_factor(world_size)
    model.experts.set_force_sum_reduction_for_comms(True)
    per_rank = 8 // world_size
    losses = train(model, device, rows=slice(rank * per_rank, (rank + 1) * per_rank))
    dist.all_reduce(losses)  # the mean over the ranks is the loss of the whole batch
    losses /= world_size

    if rank == 0:
        w1 = model.experts.w1
        print(
            f"rank 0 holds {tuple(w1.to_local().shape)} of its experts' w1 {tuple(w1.shape)}, "
            f"{EXPERTS} experts in all"
        )
        torch.manual_seed(0)
        alone = train(Model().to(device), device)  # one process, every expert, the whole batch
        difference = (losses - alone).abs().max().item()
        print(
            f"FSDP2 + expert parallelism on {world_size} ranks vs 1 process, {STEPS} steps, "
            f"loss {losses[0]:.3f} -> {losses[-1]:.3f}: max |loss difference| = {difference:.2e}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
