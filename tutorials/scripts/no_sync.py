"""Gradient accumulation without the gradient sync, as a torchrun script, checked against one process.

    torchrun --nproc-per-node=2 no_sync.py

Each rank runs its rows of every batch as 4 micro-batches. Trained twice: FSDP2 reducing the
gradients after every micro-batch (its default), then with set_requires_gradient_sync(False) on all
but the last micro-batch, so that it reduces once per step. torch's profiler counts the
reduce-scatters of each run's first step; rank 0 also trains the unsharded model on the whole
batches, alone, and prints the reduce-scatters per step and the largest difference between each
run's weights and its. Needs torch alone; each rank computes on its accelerator (GPU) where there is one, else on the
CPU (over gloo).
"""

import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.profiler import ProfilerActivity, profile

ROWS, DIM, MICRO, STEPS, LR = 16, 16, 4, 10, 1e-2


def build(device):
    torch.manual_seed(0)  # the same weights on every rank
    return nn.Sequential(
        nn.Linear(DIM, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1)
    ).to(device)


def batch(step, device):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(ROWS, DIM, generator=g)
    return x.to(device), x.sin().sum(1, keepdim=True).to(device)


def train(sync_every_micro_batch, device, rank, world_size):
    model = build(device)
    for layer in model[::2]:
        fully_shard(layer)  # one unit per Linear: 3 units with gradients to reduce
    fully_shard(model)  # the root, with no parameters of its own
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    per_rank = ROWS // world_size
    # the profiler records every op the rank runs, FSDP's collectives among them: one step's
    ops = profile(activities=[ProfilerActivity.CPU])
    for step in range(STEPS):
        with ops if step == 0 else contextlib.nullcontext():
            x, y = (t[rank * per_rank : (rank + 1) * per_rank] for t in batch(step, device))
            for i, (xm, ym) in enumerate(zip(x.chunk(MICRO), y.chunk(MICRO))):
                if not sync_every_micro_batch:  # keep unsharded gradients until the last one
                    model.set_requires_gradient_sync(i == MICRO - 1)
                # equal micro-batches: their mean over MICRO is the rank's mean, and FSDP
                # averages over the ranks
                (nn.functional.mse_loss(model(xm), ym) / MICRO).backward()
            optimizer.step()
            optimizer.zero_grad()
    scatters = sum(  # c10d's reduce-scatter ops, whichever backend runs them
        op.count for op in ops.key_averages() if op.key.startswith("c10d::") and "scatter" in op.key
    )
    return scatters, [p.full_tensor() for p in model.parameters()]


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

    runs = {sync: train(sync, device, rank, world_size) for sync in (True, False)}

    if rank == 0:
        alone = build(device)  # one process, the whole batches, one backward per step
        optimizer = torch.optim.AdamW(alone.parameters(), lr=LR)
        for step in range(STEPS):
            x, y = batch(step, device)
            nn.functional.mse_loss(alone(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        for sync, (scatters, weights) in runs.items():
            # torch's max keeps a NaN, which the test's comparison then fails
            difference = max((w - a).abs().max() for w, a in zip(weights, alone.parameters()))
            print(
                f"{'sync every micro-batch' if sync else 'no sync until the last'}: "
                f"{scatters:g} reduce-scatters per step of {MICRO} micro-batches on {world_size} "
                f"ranks; max |weight difference| vs 1 process = {difference.item():.2e}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
