"""The quickstart as a torchrun script: a model sharded with FSDP2 trains as one process does.

    torchrun --nproc-per-node=2 quickstart.py

Each rank trains the sharded model on its slice of every global batch. Rank 0 also trains the
unsharded model on the whole batch, alone, and prints the largest difference between the losses
of the two runs. Needs torch alone; each rank computes on its accelerator (GPU) where there is one,
else on the CPU (over gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
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
    # after sharding: it updates the shards
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = (t.to(device)[rows] for t in batch(step))
        loss = F.mse_loss(model(x), y)
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

    torch.manual_seed(0)  # the same weights on every rank
    model = MLP()
    for layer in model.layers:
        fully_shard(layer)  # one unit per layer: gathered for its forward and backward
    fully_shard(model)  # the root
    per_rank = GLOBAL_BATCH // world_size
    losses = train(model, device, rows=slice(rank * per_rank, (rank + 1) * per_rank))
    dist.all_reduce(losses)  # the mean over the ranks is the loss of the whole batch
    losses /= world_size

    if rank == 0:
        print(
            f"rank 0 holds {tuple(model.layers[0].weight.to_local().shape)} of layers.0.weight "
            f"{tuple(model.layers[0].weight.shape)}"
        )
        torch.manual_seed(0)
        alone = train(MLP().to(device), device)  # one process, the whole batch
        difference = (losses - alone).abs().max().item()
        print(
            f"FSDP2 on {world_size} ranks vs 1 process, {STEPS} steps: max |loss difference| = {difference:.2e}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
