"""Experts that get no tokens on a rank, as a torchrun script: set_reduce_scatter_unused_params(True).

    torchrun --nproc-per-node=2 uneven_experts.py

A mixture-of-experts layer routes each row to one of two experts and calls only the experts that
got rows. On rank 1 every row goes to expert 0, so expert 1 is not called there and its
parameters get no gradient. The layer is one FSDP unit: without more, rank 1 reduce-scatters
fewer gradients than rank 0 (gloo aborts on the size mismatch; with equal sizes the ranks would
silently reduce different experts into each other). ``set_reduce_scatter_unused_params(True)``
(torch 2.13 or later) makes each rank reduce zeros for what it did not use, as DDP's
``find_unused_parameters`` does. Rank 0 prints the rows each rank routed to each expert and the
largest difference from one process that trains on both ranks' rows. Needs torch alone; each
rank computes on its accelerator (GPU) where there is one, else on the CPU (over gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

WIDTH, ROWS, STEPS = 32, 8, 5
SHIFT = (0.0, -1.0)  # rank 1's rows have negative means: every one routed to expert 0


class TwoExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))

    def forward(self, x):
        route = (x.mean(-1) > 0).long()  # expert 1 for the rows whose mean is positive
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows = (route == i).nonzero().squeeze(-1)
            if len(rows):  # an expert with no rows is not called: no gradient for it
                out = out.index_add(0, rows, expert(x[rows]))
        return out


def make_model():
    torch.manual_seed(0)  # the same model on every rank and in the one-process run
    return nn.Sequential(TwoExperts(), nn.Linear(WIDTH, 4))


def rows_of(step, rank):
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(ROWS, WIDTH, generator=generator) + SHIFT[rank]


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
    assert world_size == 2, "the routing is written for 2 ranks"

    model = make_model().to(device)
    for unit in model:
        fully_shard(unit)
    fully_shard(model)
    model.set_reduce_scatter_unused_params(True)  # on the root and every unit below it
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        model(rows_of(step, rank).to(device)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    weights = [p.full_tensor() for p in model.parameters()]  # collective: every rank

    if rank == 0:
        routed = [
            [int(((rows_of(0, r).mean(-1) > 0).long() == i).sum()) for i in range(2)]
            for r in range(2)
        ]
        print(f"rows per expert in step 0: rank 0 {routed[0]}, rank 1 {routed[1]}")
        one = make_model().to(
            device
        )  # one process: the mean of the two ranks' losses, as FSDP averages
        optimizer = torch.optim.SGD(one.parameters(), lr=0.1)
        for step in range(STEPS):
            (sum(one(rows_of(step, r).to(device)).square().mean() for r in range(2)) / 2).backward()
            optimizer.step()
            optimizer.zero_grad()
        difference = max((w - p).abs().max().item() for w, p in zip(weights, one.parameters()))
        ok = all(w.isfinite().all() for w in weights)  # a NaN would hide in max()
        print(
            f"FSDP2 with experts unused on a rank, on {world_size} ranks vs 1 process, {STEPS} steps: "
            f"max |weight difference| = {difference if ok else float('nan'):.1e}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
