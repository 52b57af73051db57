"""FSDP x TP as a torchrun script: tensor parallelism over one mesh dimension, FSDP over the other.

    torchrun --nproc-per-node=4 tensor_parallel.py

Four ranks as a 2 x 2 device mesh named ("dp", "tp"). Each feed-forward block is split by tensor
parallelism over "tp" (its first Linear by output features, column-wise; its second by input
features, row-wise, so the two ranks' partial sums meet in one all-reduce), then fully_shard over
"dp" shards what each rank holds again. The ranks of a TP group take the same half of every global
batch; the dp groups split it. Rank 0 prints what it holds of each weight and its placements, then
trains the unsharded model on the whole batch, alone, and prints the largest differences between
the two runs' losses and final weights. Needs torch alone; each rank computes on its accelerator
(GPU) where there is one, else on the CPU (over gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

GLOBAL_BATCH, STEPS, LR = 8, 10, 1e-2


class FeedForward(nn.Module):
    def __init__(self, dim=16, hidden=64):
        super().__init__()
        self.fc, self.proj = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(x)))


class Model(nn.Module):
    def __init__(self, dim=16, out=4):
        super().__init__()
        self.blocks = nn.ModuleList(FeedForward(dim) for _ in range(2))
        self.head = nn.Linear(dim, out)  # left out of the TP plan: FSDP alone shards it

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batch(step):
    """The global batch of a step: the same on every rank, whatever its device."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 16, generator=g)
    return x, torch.stack(
        [x[:, :4].sum(1), x[:, 4:8].prod(1), x[:, 8:].sin().sum(1), x.norm(dim=1)], 1
    )


def train(model, device, rows=slice(None)):
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)  # after sharding: on the shards
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

    # Row by row: a TP group is adjacent ranks (0, 1), on one node's fast link on a cluster.
    mesh = init_device_mesh(
        device.type, (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp")
    )
    torch.manual_seed(0)  # the same weights on every rank
    model = Model().to(device)
    plan = {"fc": ColwiseParallel(), "proj": RowwiseParallel()}
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], plan)  # TP first ...
        fully_shard(block, mesh=mesh["dp"])  # ... then FSDP, over the other dimension
    fully_shard(model, mesh=mesh["dp"])
    # The data by the dp coordinate: the two ranks of a TP group compute one layer on one batch.
    per_dp = GLOBAL_BATCH // mesh["dp"].size()
    start = mesh["dp"].get_local_rank() * per_dp
    losses = train(model, device, rows=slice(start, start + per_dp))
    dist.all_reduce(losses, group=mesh.get_group("dp"))  # each dp rank's half: their mean
    losses /= mesh["dp"].size()
    weights = [p.full_tensor() for p in model.parameters()]  # a collective: every rank calls it

    if dist.get_rank() == 0:
        for name, p in model.named_parameters():
            if name.endswith("weight") and not name.startswith("blocks.1"):
                print(
                    f"rank 0 holds {tuple(p.to_local().shape)} of {name} {tuple(p.shape)}: "
                    f"{p.placements} over {p.device_mesh.mesh_dim_names}"
                )
        torch.manual_seed(0)
        alone = Model().to(device)
        alone_losses = train(alone, device)  # one process, the whole batch
        loss_gap = (losses - alone_losses).abs().max().item()
        gaps = [(w - a).abs().max() for w, a in zip(weights, alone.parameters())]
        weight_gap = torch.stack(gaps).max().item()  # torch's max keeps a NaN; Python's may not
        print(
            f"FSDP x TP on a 2 x 2 mesh vs 1 process, {STEPS} steps: "
            f"max |loss difference| = {loss_gap:.2e}, max |weight difference| = {weight_gap:.2e}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
