"""HSDP as a torchrun script: shard within a node, replicate across nodes, train as one process.

    torchrun --nproc-per-node=4 cluster.py

Four ranks stand for 2 nodes of 2: a 2-D device mesh (replicate, shard) of shape (2, 2), and
fully_shard(mesh=...) shards each weight within a row (all-gathers, reduce-scatters) and keeps a
replica of the shards in each column (gradients all-reduced across it). Each rank trains on its
slice of every global batch; rank 0 also trains the unsharded model on the whole batch, alone, and
prints the largest differences between the losses and the final weights of the two runs. On a
cluster the mesh is (nodes, GPUs per node). Needs torch alone; each rank computes on its
accelerator (GPU) where there is one, else on the CPU (over gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

GLOBAL_BATCH, STEPS, LR = 64, 40, 1e-2


class MLP(nn.Module):
    def __init__(self, dim=16, hidden=64, out=4):
        super().__init__()
        sizes = [dim, hidden, hidden, out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = F.gelu(layer(x))
        return self.layers[-1](x)


def batch(step):
    """The global batch of a step: the same on every rank, whatever its device."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 16, generator=g)
    y = torch.stack(
        [x[:, :4].sum(1), x[:, 4:8].prod(1), x[:, 8:].sin().sum(1), x.norm(dim=1)], dim=1
    )
    return x, y


def train(model, device, rows=slice(None)):
    """AdamW on the rows ``rows`` of each global batch; the loss of each step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)  # after sharding: on the shards
    losses = []
    for step in range(STEPS):
        x, y = (t.to(device)[rows] for t in batch(step))
        loss = F.mse_loss(model(x), y)
        loss.backward()  # reduce-scatter in the shard group, then all-reduce across replicas
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

    # (nodes, ranks per node): shard within a node, replicate across nodes. On one machine, as
    # here, its ranks stand for 2 nodes.
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    nodes = world_size // per_node
    shape = (nodes, per_node) if nodes > 1 else (2, world_size // 2)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)  # the same weights on every rank
    model = MLP()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)  # a 2-D mesh: HSDP, (Replicate(), Shard(0))
    fully_shard(model, mesh=mesh)
    per_rank = GLOBAL_BATCH // world_size  # data parallel over all 4 ranks, both dimensions
    losses = train(model, device, rows=slice(rank * per_rank, (rank + 1) * per_rank))
    dist.all_reduce(losses)  # the mean over the ranks is the loss of the whole batch
    losses /= world_size
    weights = [p.full_tensor() for p in model.parameters()]  # a collective: every rank calls it

    if rank == 0:
        weight = model.layers[0].weight
        print(
            f"rank 0: shard group {dist.get_process_group_ranks(mesh.get_group('shard'))}, "
            f"replicate group {dist.get_process_group_ranks(mesh.get_group('replicate'))}, "
            f"holds {tuple(weight.to_local().shape)} of layers.0.weight {tuple(weight.shape)}"
        )
        torch.manual_seed(0)
        alone = MLP().to(device)
        alone_losses = train(alone, device)  # one process, the whole batch
        loss_gap = (losses - alone_losses).abs().max().item()
        gaps = [(w - a).abs().max() for w, a in zip(weights, alone.parameters())]
        weight_gap = torch.stack(gaps).max().item()  # torch's max keeps a NaN; Python's may not
        print(
            f"HSDP on a {shape[0]} x {shape[1]} mesh vs 1 process, {STEPS} steps: "
            f"max |loss difference| = {loss_gap:.2e}, max |weight difference| = {weight_gap:.2e}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
