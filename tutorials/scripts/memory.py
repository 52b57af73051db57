"""Memory per rank as a torchrun script: FSDP2's model states measured against ZeRO-3's estimate.

    torchrun --nproc-per-node=2 memory.py

Training keeps, for every parameter, the parameter, its gradient and the optimizer's state (AdamW:
two moments). ZeRO stage 3, which fully_shard implements, divides all three by the number of ranks.
After one training step each rank counts the bytes of the tensors it really holds, and rank 0
prints them as fractions of that estimate: 1, as every parameter's rows split evenly over 2 ranks
(where they do not, the first ranks hold a row more, and the padding FSDP2 adds is memory too).
Needs torch alone; each rank computes on its accelerator (GPU) where there is one, else on the CPU
(over gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard


class MLP(nn.Module):
    def __init__(self, dim=16, hidden=64, out=4):
        super().__init__()
        sizes = [dim, hidden, hidden, out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = F.gelu(layer(x))
        return self.layers[-1](x)


def held(tensors, seen):
    """Bytes of the storages behind this rank's part of ``tensors``; a shared buffer counts once."""
    total = 0
    for t in tensors:
        storage = t.to_local().untyped_storage()  # its memory, padding included
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


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
    model = MLP()
    for layer in model.layers:
        fully_shard(layer)  # one unit per layer: gathered for its forward and backward
    fully_shard(model)  # the root
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # after sharding: over the shards
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own batch
    x, y = torch.randn(8, 16, generator=g).to(device), torch.randn(8, 4, generator=g).to(device)
    F.mse_loss(model(x), y).backward()
    optimizer.step()  # now all three states exist: measure before zero_grad frees the gradients

    params = list(model.parameters())
    seen = set()  # storages already counted
    measured = {
        "params": held(params, seen),
        "grads": held((p.grad for p in params), seen),
        # the moments; the step counters are scalars, not per-parameter state
        "AdamW state": held(
            (t for p in params for t in optimizer.state[p].values() if t.dim()), seen
        ),
    }
    numel = sum(p.numel() for p in params)  # a DTensor's numel is the whole parameter's
    per_element = {"params": 4, "grads": 4, "AdamW state": 8}  # float32: 4 bytes, 2 moments
    estimate = {k: numel * n / world_size for k, n in per_element.items()}  # ZeRO-3: total / N

    if rank == 0:
        ratios = ", ".join(f"{k} {measured[k] / estimate[k]:.4f}" for k in measured)
        print(
            f"{numel} parameters, AdamW, rank 0 of {world_size}: holds {sum(measured.values())} "
            f"bytes of model states; measured / ZeRO-3 estimate (total / {world_size}): {ratios}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
