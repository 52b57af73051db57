"""float16 needs a gradient scaler as a torchrun script: FSDP2 in float16, without and with GradScaler.

    torchrun --nproc-per-node=2 fp16_scaler.py

Each unit is sharded with a MixedPrecisionPolicy that computes in float16. The loss is scaled by
1e-7, standing for the small gradients of late layers or long sequences: float16 rounds them to
zero, and without a scaler the weights never move. torch.amp.GradScaler multiplies the loss before
backward and divides the gradients before the step, and the same run follows float32; bfloat16
needs no scaler. Rank 0 prints each run's losses and share of zero gradients, against float32 in
one process. Then only rank 0's gradient shard is made infinite: FSDP2's gradients are DTensors,
whose found-inf check the scaler reduces across the ranks, so every rank skips the step. Needs
torch alone; each rank computes on its accelerator (GPU) where there is one, else on the CPU.
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

GLOBAL_BATCH, STEPS, SMALL = 32, 10, 1e-7


def mlp():
    torch.manual_seed(0)  # the same weights on every rank, and in the float32 run
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))


def shard(model, low):
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
    fully_shard(model[0], mp_policy=policy)
    fully_shard(model[2], mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


def train(model, device, scaler=None, rows=slice(None)):
    """SGD on a loss scaled by SMALL; the losses and the share of zeros in the last gradients."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 / SMALL)  # undoes SMALL for the update
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)
    x, y = x.to(device)[rows], y.to(device)[rows]
    losses = []
    for _ in range(STEPS):
        loss = F.mse_loss(model(x).float(), y)
        small = loss * SMALL
        (
            scaler.scale(small) if scaler else small
        ).backward()  # float16 gradients: SMALL rounds to 0
        grads = [
            p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in model.parameters()
        ]
        zeros = sum((g == 0).sum().item() for g in grads) / sum(g.numel() for g in grads)
        if scaler:
            scaler.step(optimizer)  # unscales, and skips the step if a gradient is inf or NaN
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), zeros


def overflow_on_rank_0_only(device):
    model = shard(mlp().to(device), torch.float16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device.type, init_scale=1.0)  # nothing overflows by itself
    scaler.scale(model(torch.ones(2, 16, device=device)).float().sum()).backward()
    if dist.get_rank() == 0:
        model[0].weight.grad.to_local()[0, 0] = float("inf")  # in rank 0's shard only
    own_finite = all(p.grad.to_local().isfinite().all().item() for p in model.parameters())
    before = [p.full_tensor() for p in model.parameters()]
    scaler.step(optimizer)
    scaler.update()
    skipped = all(torch.equal(a, p.full_tensor()) for a, p in zip(before, model.parameters()))
    return own_finite, skipped, scaler.get_scale()


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
    per_rank = GLOBAL_BATCH // world_size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)

    runs = {}
    for name, low, scaler in [
        ("float16, no scaler", torch.float16, None),
        ("float16, GradScaler", torch.float16, torch.amp.GradScaler(device.type)),
        ("bfloat16, no scaler", torch.bfloat16, None),
    ]:
        losses, zeros = train(shard(mlp().to(device), low), device, scaler, rows)
        dist.all_reduce(losses)  # the mean over the ranks is the loss of the whole batch
        runs[name] = losses / world_size, zeros
    overflow = [None] * world_size
    dist.all_gather_object(overflow, overflow_on_rank_0_only(device))

    if rank == 0:
        alone, _ = train(mlp().to(device), device)  # float32, one process, the whole batch
        for name, (losses, zeros) in runs.items():
            relative = ((losses - alone).abs() / alone.abs()).max().item()
            print(
                f"{name}: loss {losses[0]:.5f} -> {losses[-1]:.5f} in {STEPS} steps, "
                f"zero gradients {zeros:.0%}, max relative difference from float32 = {relative:.2e}"
            )
        finite = ", ".join(f"rank {r}: {o[0]}" for r, o in enumerate(overflow))
        skipped = ", ".join(f"rank {r}: {o[1]}" for r, o in enumerate(overflow))
        print(f"inf in rank 0's gradient shard only; own shards finite: {finite}")
        print(f"step skipped: {skipped}; scale 1 -> {', '.join(f'{o[2]:g}' for o in overflow)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
