"""What FSDP2 keeps on each parameter, and when, as a torchrun script.

    torchrun --nproc-per-node=2 state_attributes.py

After fully_shard, each parameter is a DTensor: the global shape, its placements (Shard(dim=0):
each rank holds a block of rows) and the rank's local shard. Hooks record, for the first layer's
weight, what the module holds between steps and inside its forward, what the gradient is after
backward, what the optimizer keeps for it, and whether the step updated the shard in place. Rank 0
prints the timeline in one line. Needs torch alone; each rank computes on its accelerator (GPU)
where there is one, else on the CPU (over gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor


class MLP(nn.Module):
    def __init__(self, dim=16, hidden=64, out=4):
        super().__init__()
        sizes = [dim, hidden, hidden, out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = F.gelu(layer(x))
        return self.layers[-1](x)


def state(t):
    """A DTensor: its placements and this rank's local shape; a plain tensor: its shape."""
    if isinstance(t, DTensor):
        return f"DTensor {t.placements} local {tuple(t.to_local().shape)}"
    return f"{type(t).__name__} {tuple(t.shape)}"


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
    layer = model.layers[0]
    seen = {"between steps": state(layer.weight)}

    def in_forward(module, args):  # runs after FSDP2's own hook: sees what the layer computes with
        seen["in forward"] = state(module.weight)

    layer.register_forward_pre_hook(in_forward)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # after sharding: over the shards

    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own batch
    x, y = torch.randn(8, 16, generator=g).to(device), torch.randn(8, 4, generator=g).to(device)
    F.mse_loss(model(x), y).backward()
    seen["grad after backward"] = state(layer.weight.grad)  # reduce-scattered: this rank's rows
    shard = layer.weight.to_local()
    ptr, before = shard.data_ptr(), shard.detach().clone()
    optimizer.step()
    seen["AdamW exp_avg"] = state(optimizer.state[layer.weight]["exp_avg"])  # sharded alike
    shard = layer.weight.to_local()
    in_place = shard.data_ptr() == ptr and not torch.equal(shard, before)
    seen["after the step"] = f"{state(layer.weight)}, updated in place {in_place}"

    if rank == 0:
        timeline = "; ".join(f"{when}: {what}" for when, what in seen.items())
        print(f"layers.0.weight {tuple(layer.weight.shape)} on rank 0 of {world_size}: {timeline}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
