"""Debugging a hang as a torchrun script: TORCH_DISTRIBUTED_DEBUG=DETAIL turns it into an error.

    torchrun --nproc-per-node=2 debugging_hangs.py

Rank 1 has one evaluation batch more than rank 0: its third forward waits in FSDP's all-gather,
while rank 0 waits in the all_reduce after its loop, a hang with no error. With the debug level
DETAIL (set here in the script; `TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun ...` does the same), every
collective first compares the ranks' collectives, and both ranks raise an error naming each rank's
collective; rank 0 prints them and both exit. A short `timeout` in `init_process_group` is the
backstop: a wait the check misses fails in seconds, not after 10 or 30 minutes. Needs torch alone;
each rank computes on its accelerator (GPU) where there is one, else on the CPU (over gloo).
"""

import datetime
import os
import re

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard


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
    # Before the process group exists: DETAIL wraps it in a checker (a debug run: it slows
    # every collective). The short timeout ends any wait it does not catch.
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=10))
    rank = dist.get_rank()

    torch.manual_seed(0)  # the same weights on every rank
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])
    for layer in model:
        fully_shard(layer)  # one unit per layer: every forward all-gathers each
    fully_shard(model)  # the root

    g = torch.Generator().manual_seed(rank)
    batches = [torch.randn(4, 16, generator=g).to(device) for _ in range(2 + rank)]  # uneven
    total = torch.zeros(1, device=device)
    try:
        with torch.no_grad():
            for x in batches:
                total += model(x).sum()  # rank 1's third forward: an all-gather rank 0 never joins
        dist.all_reduce(total)
    except RuntimeError as error:  # raised on every rank, in its own collective
        found = re.findall(
            r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+), "
            r"OpType=(\w+)",
            str(error),
        )
        if rank == 0:  # each rank's collective, by number (counted from 0) and operation
            ops = ", ".join(f"rank {r} in #{n} {op}" for r, n, op in sorted(set(found)))
            print(f"hang caught as {type(error).__name__}: {ops or str(error)[:300]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
