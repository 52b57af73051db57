"""Evaluation of a sharded model as a torchrun script: an eval set that does not split evenly.

    torchrun --nproc-per-node=2 beyond_the_step.py

Nine examples on 2 ranks: each rank evaluates every example of its own once, so one rank has a
batch fewer. Every forward all-gathers the units, so every rank runs as many forwards as the rank
with the most batches, a rank out of data forwarding an empty batch; the summed losses and token
counts are all-reduced once at the end. Rank 0 then evaluates the whole set in one process and
prints the difference between the two losses. Needs torch alone; each rank computes on its
accelerator (GPU) where there is one, else on the CPU (over gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

VOCAB, LENGTH, EXAMPLES, BATCH = 32, 8, 9, 2


class TinyLM(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens):
        x = self.embedding(tokens)
        for layer in self.layers:
            x = x + F.gelu(layer(x))
        return self.head(x)


def eval_set():
    """The eval set's inputs and next-token targets: the same on every rank, whatever its device."""
    g = torch.Generator().manual_seed(2)
    rows = torch.randint(VOCAB, (EXAMPLES, LENGTH + 1), generator=g)
    return rows[:, :-1], rows[:, 1:]


def summed_loss(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")


def evaluate(model, batches, device):
    """Mean loss per token over every rank's batches, examples counted; and each rank's count."""
    counts = torch.zeros(dist.get_world_size(), device=device)
    counts[dist.get_rank()] = len(batches)
    dist.all_reduce(counts)  # every rank's batch count
    empty = (torch.zeros(0, LENGTH, dtype=torch.long, device=device),) * 2  # no rows: the forward
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # summed loss, tokens, examples
    model.eval()
    with torch.no_grad():
        for i in range(int(counts.max())):  # the same number of forwards, all-gathers, everywhere
            x, y = batches[i] if i < len(batches) else empty
            totals[0] += summed_loss(model, x, y).double()  # stays on the device: no sync
            totals[1] += y.numel()
            totals[2] += len(x)
    dist.all_reduce(totals)  # once, at the end: sums, never the mean of the ranks' means
    return (totals[0] / totals[1]).item(), int(totals[2]), counts.int().tolist()


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
    model = TinyLM()
    for layer in model.layers:
        fully_shard(layer)  # one unit per layer: gathered for each forward
    fully_shard(model)  # the root: the embedding and the head
    x, y = (t.to(device) for t in eval_set())
    mine = torch.arange(rank, EXAMPLES, world_size)  # every example once, no padding: uneven
    batches = [(x[i], y[i]) for i in mine.split(BATCH)]
    loss, examples, counts = evaluate(model, batches, device)

    if rank == 0:
        torch.manual_seed(0)
        alone = TinyLM().to(device).eval()  # one process, the whole set
        with torch.no_grad():
            reference = (summed_loss(alone, x, y) / y.numel()).item()
        difference = abs(loss - reference)  # NaN stays NaN
        print(
            f"sharded eval on {world_size} ranks, batches per rank {counts}, {examples} of "
            f"{EXAMPLES} examples, vs 1 process: |loss difference| = {difference:.2e}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
