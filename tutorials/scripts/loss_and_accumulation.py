"""Loss normalisation and gradient accumulation as a torchrun script, checked against one process.

    torchrun --nproc-per-node=2 loss_and_accumulation.py

Each rank runs its rows of every global batch of padded sequences as 2 micro-batches, FSDP2
reducing the gradients after the last one only. Each micro-batch's loss is summed over its real
tokens and divided by the real tokens of the whole step, over every rank and micro-batch, counted
first: the gradients are those of one process's mean loss over the whole batch. Rank 0 also trains
the unsharded model on the whole batch, alone, and prints the largest difference between the losses
of the two runs. Needs torch alone; each rank computes on its accelerator (GPU) where there is one,
else on the CPU (over gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

ROWS, LENGTH, VOCAB, MICRO, STEPS, LR, IGNORE = 8, 16, 32, 2, 20, 1e-2, -100


class TokenMLP(nn.Module):
    def __init__(self, dim=32, hidden=64):
        super().__init__()
        self.layers = nn.ModuleList(
            [nn.Embedding(VOCAB, dim), nn.Linear(dim, hidden), nn.Linear(hidden, VOCAB)]
        )

    def forward(self, tokens):
        return self.layers[2](F.gelu(self.layers[1](self.layers[0](tokens))))


def batch(step):
    """The global batch of a step: rows of random lengths, padding's targets IGNORE (no loss)."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(VOCAB, (ROWS, LENGTH), generator=g)
    lengths = torch.randint(2, LENGTH + 1, (ROWS, 1), generator=g)
    targets = torch.where(torch.arange(LENGTH) < lengths, (3 * tokens + 1) % VOCAB, IGNORE)
    return tokens, targets


def summed_loss(model, x, y):
    return F.cross_entropy(
        model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum"
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

    torch.manual_seed(0)  # the same weights on every rank
    model = TokenMLP().to(device)
    for layer in model.layers:
        fully_shard(layer)  # one unit per layer
    fully_shard(model)  # the root
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    per_rank = ROWS // world_size
    losses = []
    for step in range(STEPS):
        x, y = (t.to(device)[rank * per_rank : (rank + 1) * per_rank] for t in batch(step))
        micro_batches = list(zip(x.chunk(MICRO), y.chunk(MICRO)))
        count = (y != IGNORE).sum()  # the step's real tokens, counted before the first backward
        dist.all_reduce(count)  # over every rank: the global token count
        step_loss = torch.zeros((), device=device)
        for i, (xm, ym) in enumerate(micro_batches):
            model.set_requires_gradient_sync(i == MICRO - 1)  # reduce after the last one only
            loss = summed_loss(model, xm, ym) / count
            (loss * world_size).backward()  # times the ranks: FSDP averages over them
            step_loss += loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(step_loss)  # the sum over the ranks is the loss of the whole batch
        losses.append(step_loss)

    if rank == 0:
        torch.manual_seed(0)
        alone = TokenMLP().to(device)  # one process, the whole batch, the mean over real tokens
        optimizer = torch.optim.AdamW(alone.parameters(), lr=LR)
        difference = torch.zeros((), device=device)
        for step in range(STEPS):
            x, y = (t.to(device) for t in batch(step))
            loss = F.cross_entropy(alone(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            difference = torch.maximum(difference, (loss.detach() - losses[step]).abs())
        print(
            f"FSDP2 on {world_size} ranks x {MICRO} micro-batches vs 1 process, {STEPS} steps: "
            f"max |loss difference| = {difference.item():.2e}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
