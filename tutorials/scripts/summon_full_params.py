"""Custom init of a sharded model as a torchrun script: whole-tensor init code on FSDP2 shards.

    torchrun --nproc-per-node=2 summon_full_params.py

An init recipe that needs whole matrices (orthogonal weights) cannot run on a rank's rows of them.
Inside ``summon_full_params`` below, every parameter of the FSDP2 model is its full plain tensor
again; on exit each rank keeps its own slice, in place, in the shards FSDP2 trains. Rank 0 then
runs the same recipe on the unsharded model, alone, and prints the largest difference between the
two models' weights. Needs torch alone; each rank computes on its accelerator (GPU) where there is
one, else on the CPU (over gloo).
"""

import contextlib
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

INIT_SEED = 1234


class MLP(nn.Module):
    def __init__(self, dim=16, hidden=64, out=4):
        super().__init__()
        sizes = [dim, hidden, hidden, out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = F.gelu(layer(x))
        return self.layers[-1](x)


@torch.no_grad()
def init_weights(model):
    """The recipe: orthogonal weights, smaller in deeper layers; zero biases."""
    for depth, layer in enumerate(model.layers):
        nn.init.orthogonal_(layer.weight, gain=1 / math.sqrt(depth + 1))  # needs the whole matrix
        nn.init.zeros_(layer.bias)


@contextlib.contextmanager
def summon_full_params(model):
    """Inside, each DTensor parameter is a full plain one, under its name; on exit, shards again."""
    params = ((m, n, p) for m in model.modules() for n, p in m.named_parameters(recurse=False))
    slots = [(m, n, p) for m, n, p in params if isinstance(p, DTensor)]
    full = {}  # every rank gathers, in the same order; a tied parameter once
    for m, n, p in slots:
        if id(p) not in full:
            full[id(p)] = nn.Parameter(p.full_tensor())
        setattr(m, n, full[id(p)])
    try:
        yield
    finally:
        with torch.no_grad():
            for m, n, p in slots:
                # This rank's slice of its own full tensor (src_data_rank=None: no communication),
                # copied into the storage FSDP2 gathers from; then the same object goes back, so
                # FSDP2 and an optimizer built before still hold it.
                mine = distribute_tensor(
                    full[id(p)], p.device_mesh, p.placements, src_data_rank=None
                )
                p.to_local().copy_(mine.to_local())
                setattr(m, n, p)


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

    torch.manual_seed(0)
    model = MLP()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)  # the model is sharded: each rank holds half of every matrix's rows
    torch.manual_seed(INIT_SEED)  # the same on every rank: each keeps its slice of the same draw
    with summon_full_params(model):
        inside = tuple(model.layers[0].weight.shape)
        init_weights(model)
    full = {name: p.full_tensor() for name, p in model.named_parameters()}  # every rank gathers

    if rank == 0:
        local = tuple(model.layers[0].weight.to_local().shape)
        print(f"rank 0 holds {local} of layers.0.weight, {inside} inside summon_full_params")
        torch.manual_seed(0)
        alone = MLP().to(device)  # one process: the recipe on the whole model
        torch.manual_seed(INIT_SEED)
        init_weights(alone)
        differences = [(full[n] - p).abs().max() for n, p in alone.named_parameters()]
        difference = torch.stack(differences).max().item()  # a NaN anywhere shows as NaN
        print(
            f"custom init on {world_size} sharded ranks vs 1 process: "
            f"max |weight difference| = {difference:.2e}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
