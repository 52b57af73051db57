"""A unit called on some ranks only, as a torchrun script: the fix, then the hang, named by DETAIL.

    torchrun --nproc-per-node=2 hang_branch.py

An "expert" layer runs only where the data says so (here: on rank 0's batch, not on rank 1's).
Every FSDP unit's forward all-gathers its parameters, so the rank that calls the expert waits in
an all-gather the other never joins. The fix runs first: every rank calls the expert and
`torch.where` selects its output; the expert's gradient, reduced over the ranks, must equal the
mean of the ranks' gradients computed in one process. Then the branch itself, with the debug
level DETAIL (`TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun ...` does the same): every collective
first compares the ranks' collectives, so both ranks raise an error, and each prints the
collective it was about to run. A short `timeout` in `init_process_group` is the backstop: a wait the check misses
fails in seconds, not after 10 or 30 minutes. Needs torch alone; each rank computes on its
accelerator (GPU) where there is one, else on the CPU (over gloo).
"""

import copy
import datetime
import os
import re

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard


def batch(rank, device):
    """Rank `rank`'s batch: rank 0's data takes the branch, rank 1's does not."""
    g = torch.Generator().manual_seed(rank)
    return (torch.randn(4, 16, generator=g) + (1 if rank == 0 else -1)).to(device)


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
    rank, ranks = dist.get_rank(), dist.get_world_size()

    def build():
        torch.manual_seed(0)  # the same weights on every rank
        body = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)).to(device)
        return body, nn.Linear(16, 16).to(device)

    def shard(body, expert):
        for layer in body:
            fully_shard(layer)  # one unit per layer: every forward all-gathers each
        fully_shard(body)
        fully_shard(expert)

    # The fix: every rank calls every unit; the data decides what the expert's output counts for.
    def loss(body, expert, x):
        y = body(x)
        return torch.where(y.mean() > 0, expert(y), y).sum()  # the expert runs on every rank

    body, expert = build()
    alone_body, alone_expert = copy.deepcopy((body, expert))  # unsharded, for one process
    shard(body, expert)
    loss(body, expert, batch(rank, device)).backward()
    reduced = expert.weight.grad.full_tensor()  # the reduced gradient, gathered
    # one process, each rank's batch: FSDP averages the gradients over the ranks
    per_rank = [
        torch.autograd.grad(loss(alone_body, alone_expert, batch(r, device)), alone_expert.weight)[
            0
        ]
        for r in range(ranks)
    ]
    difference = (reduced - torch.stack(per_rank).mean(0)).abs().max().item()
    if rank == 0:
        print(
            f"every unit on every rank: expert gradient vs 1 process: max |difference| = {difference:.1e}"
        )

    # The hang: the expert called only where the data says so.
    body, expert = build()
    shard(body, expert)
    try:
        y = body(batch(rank, device))
        if y.mean() > 0:  # data-dependent: true on rank 0's data only
            y = expert(y)  # rank 0 all-gathers the expert; rank 1 goes on to backward
        y.sum().backward()
    except RuntimeError as error:  # raised on every rank, before its own collective
        # Each rank's message names its own collective reliably (the other rank's fingerprint in
        # it is not), so each rank prints its own: by number (counted from 0) and operation.
        own = re.search(
            rf"Rank {rank} is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+), "
            r"OpType=(\w+), TensorShape=\[(\d+)\]",
            str(error),
        )
        mine = f"#{own[1]} {own[2]} of [{own[3]}]" if own else str(error)[:300]
        # one write of the whole line: every rank prints here, and a line written in two parts
        # (its text, then its newline) can interleave with another rank's in torchrun's output
        print(
            f"branch caught on rank {rank} as {type(error).__name__}, before its collective {mine}\n",
            end="",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
