"""Rounding or a real divergence? One FSDP2 step against one process, whole and in micro-batches.

    torchrun --nproc-per-node=2 world_sizes.py

Every rank takes its rows of the same global batch and runs one forward and backward of FSDP2;
rank 0 then runs the same step in one process, on the whole batch and in as many micro-batches as
there are ranks (each micro-batch's loss divided by their number, the gradients accumulated). It
prints whether the sharded gradients are bit-equal to the micro-batched ones (on 2 CPU ranks they
are: halving is exact and adding two gradients has no order; with 3 or more, only close), the largest difference of
each from the whole batch's (rounding: summing 16 rows in one product differs from two of 8), and
the same for a deliberate bug (each rank on the first rows): far above the rounding. Needs torch
alone; each rank computes on its accelerator (GPU) where there is one, else on the CPU (over gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

GLOBAL_BATCH = 16


def build(device):
    torch.manual_seed(0)  # the same weights on every rank
    return nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4)
    ).to(device)


def batch(device):
    g = torch.Generator().manual_seed(100)  # the same global batch on every rank
    return torch.randn(GLOBAL_BATCH, 32, generator=g).to(device), torch.randn(
        GLOBAL_BATCH, 4, generator=g
    ).to(device)


def gradients(model):
    """Every gradient, whole (a DTensor's gathered: a collective on every rank), as one vector."""
    return torch.cat(
        [getattr(p.grad, "full_tensor", p.grad.detach)().flatten() for p in model.parameters()]
    )


def sharded_gradients(device, rows_of_rank):
    model = build(device)
    for layer in model[::2]:
        fully_shard(layer)
    fully_shard(model)
    x, y = (t.chunk(dist.get_world_size())[rows_of_rank] for t in batch(device))
    F.mse_loss(model(x), y).backward()  # the mean over this rank's rows; FSDP2 averages over ranks
    return gradients(model)


def one_process_gradients(device, micro_batches):
    model = build(device)
    x, y = batch(device)
    for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
        (
            F.mse_loss(model(xs), ys) / micro_batches
        ).backward()  # accumulated: the mean over the batch
    return gradients(model)


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
    dist.init_process_group(
        dist.get_default_backend_for_device(device)
    )  # NCCL on GPUs, gloo on the CPU
    rank, world = dist.get_rank(), dist.get_world_size()
    sharded = sharded_gradients(device, rows_of_rank=rank)
    bug = sharded_gradients(
        device, rows_of_rank=0
    )  # every rank on the first rows: a data-split bug
    if rank == 0:
        split, whole = one_process_gradients(device, world), one_process_gradients(device, 1)

        def apart(a, b):  # torch's max: a NaN is the result
            return float((a - b).abs().max())

        print(
            f"FSDP2 on {world} ranks vs one process in {world} micro-batches: bit-equal {torch.equal(sharded, split)}"
        )
        print(
            f"largest gradient difference from the whole batch at once: {world} micro-batches "
            f"{apart(split, whole):.1e}, FSDP2 {apart(sharded, whole):.1e}, the bug {apart(bug, whole):.1e}"
        )
    dist.destroy_process_group()  # after collectives on every rank (full_tensor): no rank still joining


if __name__ == "__main__":
    main()
