"""Choosing FSDP units as a torchrun script: wrap each block as it is built, then the root.

    torchrun --nproc-per-node=2 enable_wrap.py

Inside enable_wrap(wrapper_cls=fully_shard, ...), wrap(block) calls fully_shard(block, ...) with
the context's arguments, so every unit gets the same ones unless a wrap call overrides them. Each
block is sharded as soon as it is built, so a rank never holds more than its shards so far plus
one full block, where building the whole model first holds all of it on every rank. Rank 0 prints
the most parameter bytes a rank held while building, both ways, as a fraction of the model, and
checks that both ways compute the same output. Needs torch alone; each rank computes on its
accelerator (GPU) where there is one, else on the CPU (over gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.wrap import enable_wrap, wrap
from torch.distributed.tensor import DTensor

BLOCKS, WIDTH = 16, 512


class Stack(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.blocks:
            x = F.gelu(block(x))
        return x


def held(modules):
    """Bytes of parameter storage these modules hold on this rank (a shard: its local part)."""
    storages = {}
    for module in modules:
        for p in module.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


def build_then_shard(device):
    torch.manual_seed(0)  # the same weights on every rank, and both ways
    blocks, peak = [], 0
    for _ in range(BLOCKS):
        blocks.append(nn.Linear(WIDTH, WIDTH, device=device))  # on the device that runs out
        peak = max(peak, held(blocks))
    for block in blocks:
        fully_shard(block)  # one unit per block ...
    return fully_shard(Stack(blocks)), peak  # ... then the root


def wrap_as_you_build(device):
    torch.manual_seed(0)
    blocks, peak = [], 0
    # Every wrap() below calls fully_shard(block, reshard_after_forward=True) ...
    with enable_wrap(wrapper_cls=fully_shard, reshard_after_forward=True):
        for i in range(BLOCKS):
            blocks.append(nn.Linear(WIDTH, WIDTH, device=device))  # one full block ...
            peak = max(peak, held(blocks))
            # ... sharded at once; the last overrides: backward starts with it, so keep it whole.
            blocks[-1] = wrap(blocks[-1], reshard_after_forward=i < BLOCKS - 1)
    return fully_shard(Stack(blocks)), peak  # the root, outside the context


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

    first, first_peak = build_then_shard(device)
    wrapped, wrapped_peak = wrap_as_you_build(device)
    peaks = torch.tensor([first_peak, wrapped_peak], device=device)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)  # the rank that held the most
    after = held([wrapped])  # before a forward gathers the last block, which then stays whole
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(1)).to(device)
    difference = (first(x) - wrapped(x)).abs().max().item()  # the same model either way

    if rank == 0:
        model = BLOCKS * (WIDTH * WIDTH + WIDTH) * 4  # bytes of float32 parameters
        first_part, wrapped_part = (p / model for p in peaks.tolist())
        print(f"the same model either way: max |output difference| = {difference:.2e}")
        print(
            f"{BLOCKS} blocks on {world_size} ranks, most parameter bytes a rank held while "
            f"building: wrap as you build {wrapped_part:.2f} of the model, "
            f"build then shard {first_part:.2f}; after sharding {after / model:.2f}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
