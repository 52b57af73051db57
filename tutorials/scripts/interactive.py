"""What each rank holds of a sharded model, around a forward and backward, as a torchrun script.

    torchrun --nproc-per-node=2 interactive.py

The exploration of the interactive page, printed by rank 0 for every rank: each parameter's
placement and each rank's shard of it, the gradients' placements after a forward and backward,
the full tensor each rank gathers, and what a forward leaves behind with
``reshard_after_forward=False`` on the layers.
Needs torch alone; each rank computes on its accelerator (GPU) where there is one, else on the
CPU (over gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard


def rank_device():
    """An accelerator of this rank's own where every local rank has one, else the CPU."""
    local_rank, local_ranks = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    accelerator = (
        torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    )
    if accelerator and torch.accelerator.device_count() >= local_ranks:
        torch.accelerator.set_device_index(local_rank)
        return torch.device(accelerator.type, local_rank)
    return torch.device("cpu")


def build(device):
    torch.manual_seed(0)  # the same weights on every rank
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2)).to(device)


def on_rank0(text):
    """Every rank's text, printed by rank 0 in rank order (torchrun interleaves the ranks' own prints)."""
    texts = [None] * dist.get_world_size()
    dist.all_gather_object(texts, text)
    if dist.get_rank() == 0:
        for rank, text in enumerate(texts):
            print(f"rank {rank}: {text}")


def main():
    device = rank_device()
    dist.init_process_group(dist.get_default_backend_for_device(device))
    rank = dist.get_rank()

    model = build(device)
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    weight = model[0].weight
    on_rank0(
        f"0.weight {tuple(weight.shape)} {weight.placements}, "
        f"shard {tuple(weight.to_local().shape)}"
    )

    torch.manual_seed(rank)  # each rank its own batch
    x = torch.randn(4, 6, device=device)
    model(x).sum().backward()
    grad = model[0].weight.grad
    on_rank0(f"0.weight.grad {type(grad).__name__} {grad.placements}")

    full = model[0].weight.full_tensor()  # a collective: every rank gathers the whole weight
    whole = build(device)[0].weight
    on_rank0(f"full 0.weight equals the unsharded model's: {torch.equal(full, whole)}")

    kept = build(device)  # the same model, its layers keeping their weights gathered after forward
    for layer in (kept[0], kept[2]):
        fully_shard(layer, reshard_after_forward=False)
    fully_shard(kept)
    after = {}
    for name, m in (("by default", model), ("with reshard_after_forward=False", kept)):
        out = m(x)
        after[name] = type(m[0].weight).__name__
        out.sum().backward()
    on_rank0(
        ", ".join(f"0.weight after forward {name}: {kind}" for name, kind in after.items())
        + f"; after backward: {type(kept[0].weight).__name__}"
    )
    dist.barrier()  # every rank done with its collectives before any tears the group down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
