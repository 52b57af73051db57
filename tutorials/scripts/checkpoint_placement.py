"""Activation checkpointing inside each FSDP2 unit, as a torchrun script.

    torchrun --nproc-per-node=2 checkpoint_placement.py

Each block is wrapped for checkpointing first and sharded second, fully_shard(checkpoint_wrapper(
block)), so the recomputation in backward runs while FSDP has the block's parameters gathered for
its backward anyway. Rank 0 prints the all-gathers of one step with and without checkpointing
(inside the unit the recomputation adds none), then trains the checkpointed model and compares its
losses with one process's, on an input that needs no gradient: the non-reentrant implementation
(use_reentrant=False) trains on it, where the reentrant one would record no graph. Needs torch
alone; each rank computes on its accelerator (GPU) where there is one, else on the CPU (gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.debug import CommDebugMode

GLOBAL_BATCH, STEPS, LR, BLOCKS = 32, 20, 1e-2, 4


def make_model():
    torch.manual_seed(0)  # the same weights on every rank
    blocks = [nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(BLOCKS)]
    return nn.Sequential(*blocks, nn.Linear(32, 4))


def shard(model, checkpoint):
    for i in range(BLOCKS):
        if checkpoint:  # inside the unit: wrap first, shard second
            model[i] = checkpoint_wrapper(model[i], checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        model[i] = fully_shard(model[i])
    return fully_shard(model)  # the root: the head


def batch(step):
    """The global batch of a step: the same on every rank, whatever its device."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 32, generator=g)  # needs no gradient: a frozen input
    return x, torch.stack(
        [x[:, :8].sum(1), x[:, 8:16].prod(1), x[:, 16:].sin().sum(1), x.norm(dim=1)], 1
    )


def train(model, device, rows=slice(None)):
    """AdamW on the rows ``rows`` of each global batch; the loss of each step."""
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


def all_gathers_in_one_step(model, device):
    x, y = (t.to(device) for t in batch(0))
    # CommDebugMode's module hooks make FSDP2 warn that a unit returned a view: harmless here.
    with CommDebugMode() as comm:
        F.mse_loss(model(x), y).backward()
    model.zero_grad()
    return sum(
        n
        for op, n in comm.get_comm_counts().items()
        if "all_gather" in str(op) or "allgather" in str(op)
    )


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

    plain, checkpointed = (
        all_gathers_in_one_step(shard(make_model().to(device), c), device) for c in (False, True)
    )
    model = shard(make_model().to(device), checkpoint=True)
    per_rank = GLOBAL_BATCH // world_size
    losses = train(model, device, rows=slice(rank * per_rank, (rank + 1) * per_rank))
    dist.all_reduce(losses)  # the mean over the ranks is the loss of the whole batch
    losses /= world_size

    if rank == 0:
        print(
            f"all-gathers in one step: {plain} without checkpointing, {checkpointed} checkpointed inside each unit"
        )
        alone = train(make_model().to(device), device)  # one process, the whole batch
        difference = (losses - alone).abs().max().item()
        print(
            f"checkpointed inside each unit, FSDP2 on {world_size} ranks vs 1 process, {STEPS} steps, loss "
            f"{losses[0].item():.4f} -> {losses[-1].item():.4f}: max |loss difference| = {difference:.2e}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
