"""An exponential moving average (EMA) of a sharded model, kept on the shards, as a torchrun script.

    torchrun --nproc-per-node=2 ema_and_teacher.py

An EMA is elementwise (ema = decay * ema + (1 - decay) * param), so it can live on the shards: a
second model, built and sharded as the trained one, frozen, started from a copy of its shards and
updated after every optimizer step with no communication. Each rank trains on its half of every
global batch; rank 0 then gathers the EMA whole and compares it with the EMA one process computes
for the same steps on the whole batches. Needs torch alone; each rank computes on its accelerator
(GPU) where there is one, else on the CPU (over gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.optim.swa_utils import get_ema_multi_avg_fn

VOCAB, LENGTH, BATCH, STEPS, DECAY = 32, 8, 4, 8, 0.9


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


def build(shard):
    torch.manual_seed(0)  # the same weights on every rank, and in the one process
    model = TinyLM()
    if shard:
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    return model


@torch.no_grad()
def copy_of(model, ema_model):
    """ema_model, frozen, holding a copy of model's parameters (shard by shard when sharded)."""
    ema_model.requires_grad_(False)
    for ema, param in zip(ema_model.parameters(), model.parameters()):
        ema.copy_(param.detach())
    return ema_model


def train_with_ema(model, ema_model, device, rows=slice(None)):
    """STEPS steps on the global batches' rows, the EMA updated after each; its collectives."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    update = get_ema_multi_avg_fn(DECAY)  # AveragedModel's update: a _foreach_lerp_ over the lists
    collectives = 0
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)  # the same global batch everywhere
        batch = torch.randint(VOCAB, (BATCH, LENGTH + 1), generator=g)[rows].to(device)
        logits = model(batch[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
        with CommDebugMode() as comm:  # counts any collective, a DTensor op's included
            update(list(ema_model.parameters()), list(model.parameters()), step)
        collectives += comm.get_total_counts()
    return collectives


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

    model = build(shard=True)
    ema_model = copy_of(model, build(shard=True))  # the same layout as the model, its values
    per_rank = BATCH // world_size  # this rank's rows of each global batch
    collectives = train_with_ema(
        model, ema_model, device, slice(rank * per_rank, (rank + 1) * per_rank)
    )
    ema_whole = [p.full_tensor() for p in ema_model.parameters()]  # every rank joins the gathers

    if rank == 0:
        alone = build(shard=False).to(device)  # one process, the whole batches
        alone_ema = copy_of(alone, build(shard=False).to(device))
        train_with_ema(alone, alone_ema, device)
        difference = max(
            (a - b).abs().max().item() for a, b in zip(ema_whole, alone_ema.parameters())
        )
        moved = max(
            (a - b).abs().max().item() for a, b in zip(alone_ema.parameters(), alone.parameters())
        )
        print(
            f"EMA on the shards of {world_size} ranks, {STEPS} steps: {collectives} collectives in the "
            f"updates; vs 1 process's EMA: max |difference| = {difference:.2e} "
            f"(the EMA is {moved:.2e} from the trained weights)"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
