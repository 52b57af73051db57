"""FSDP x TP trains as one process, if a TP group shares its batch; a 2-D mesh alone is HSDP.

    torchrun --nproc-per-node=4 tp_exactness.py

Four ranks as a 2 x 2 mesh named ("dp", "tp"): tensor parallelism over "tp", then fully_shard over
"dp". Trained three ways, each against the unsharded model trained on the whole batch by one
process: (1) each rank takes its dp coordinate's half of every batch, the same on both ranks of a
TP group: the weights match; (2) each rank takes a quarter by its global rank, as plain data
parallelism would: no error, and the weights drift away; (3) the 2-D mesh itself passed to
fully_shard, without TP: that is HSDP (replicate over "dp", shard over "tp"), data parallel over
all 4 ranks. Rank 0 prints each comparison. Needs torch alone; each rank computes on its
accelerator (GPU) where there is one, else on the CPU (over gloo).
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
        self.head = nn.Linear(dim, out)

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
    """AdamW on the rows ``rows`` of each global batch; the final weights, whole on every rank."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = (t.to(device)[rows] for t in batch(step))
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [
        p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()
    ]


def fsdp_x_tp(mesh, device):
    torch.manual_seed(0)  # the same weights on every rank
    model = Model().to(device)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


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
    mesh = init_device_mesh(device.type, (2, world_size // 2), mesh_dim_names=("dp", "tp"))

    half, quarter = GLOBAL_BATCH // mesh["dp"].size(), GLOBAL_BATCH // world_size
    by_dp = slice(mesh["dp"].get_local_rank() * half, (mesh["dp"].get_local_rank() + 1) * half)
    by_rank = slice(rank * quarter, (rank + 1) * quarter)  # wrong under TP: a TP pair differs
    right = train(fsdp_x_tp(mesh, device), device, rows=by_dp)
    wrong = train(fsdp_x_tp(mesh, device), device, rows=by_rank)  # runs all the same

    torch.manual_seed(0)
    hsdp = Model().to(device)
    for block in hsdp.blocks:
        fully_shard(block, mesh=mesh)  # the 2-D mesh itself: replicate over dim 0, shard over dim 1
    fully_shard(hsdp, mesh=mesh)
    placements = hsdp.blocks[0].fc.weight.placements
    hsdp_weights = train(hsdp, device, rows=by_rank)  # HSDP is data parallel over all 4 ranks

    if rank == 0:
        torch.manual_seed(0)
        alone = train(Model().to(device), device)  # one process, the whole batch

        def gap(weights):  # torch's max keeps a NaN; Python's may not
            return torch.stack([(w - a).abs().max() for w, a in zip(weights, alone)]).max().item()

        print(f"vs 1 process after {STEPS} steps, max |weight difference|:")
        print(f"FSDP x TP, data by the dp coordinate: {gap(right):.2e}")
        print(f"FSDP x TP, data by the global rank: {gap(wrong):.2e} (no error raised)")
        print(f"fully_shard(mesh=2-D mesh): {gap(hsdp_weights):.2e}, placements {placements}: HSDP")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
