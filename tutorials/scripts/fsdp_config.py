"""A trainer-style fsdp_config as a torchrun script: the dictionary, applied with fully_shard.

    torchrun --nproc-per-node=2 fsdp_config.py

FSDP_CONFIG, the dictionary trainer libraries take (MosaicML Composer's keys), becomes fully_shard's
arguments. Each rank trains on its slice of every global batch; rank 0 prints what the config did,
then trains in float32, alone, and prints the largest relative difference between the losses. Needs
torch alone; each rank computes on its accelerator (GPU) where there is one, else on the CPU.
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

GLOBAL_BATCH, STEPS, LR = 64, 40, 1e-2
FSDP_CONFIG = {
    "sharding_strategy": "FULL_SHARD",  # or SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD
    "mixed_precision": "DEFAULT",  # or FULL (all float32), PURE (reduces in bfloat16 too)
    "cpu_offload": False,  # True: the shards, their gradients and the optimizer step on the CPU
}


def fully_shard_kwargs(config, device):
    """fully_shard's arguments for an fsdp_config, with Composer's meanings of its values."""
    strategy = config["sharding_strategy"]
    # FULL_SHARD (ZeRO-3) frees the gathered weights after forward and gathers them again for
    # backward; SHARD_GRAD_OP (ZeRO-2) keeps them until backward: less traffic, more memory.
    kwargs = {"reshard_after_forward": strategy in ("FULL_SHARD", "HYBRID_SHARD")}
    if strategy in ("NO_SHARD", "HYBRID_SHARD"):  # replicated across groups, sharded within one
        shard = 1 if strategy == "NO_SHARD" else int(os.environ["LOCAL_WORLD_SIZE"])  # a node
        shape = (dist.get_world_size() // shard, shard)
        kwargs["mesh"] = init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))
    low = torch.bfloat16  # float16 would also need torch.amp.GradScaler
    presets = {"FULL": (None, None), "DEFAULT": (low, torch.float32), "PURE": (low, low)}
    param_dtype, reduce_dtype = presets[config["mixed_precision"]]  # None: the weights' float32
    kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if config["cpu_offload"]:  # pinned host memory makes copies to an accelerator asynchronous
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type != "cpu")
    return kwargs


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 4)])

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = F.gelu(layer(x))
        return self.layers[-1](x)


def train(model, device, rows=slice(None)):
    """AdamW on the rows ``rows`` of each global batch; the losses, and what the policies did."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)  # after sharding: it steps the shards
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)  # on the CPU: the same numbers on any device
        x = torch.randn(GLOBAL_BATCH, 16, generator=g)
        y = x[:, :4] * x[:, 4:8] + x[:, 8:12].sin()
        x, y = x.to(device)[rows], y.to(device)[rows]
        out = model(x)
        freed = isinstance(model.layers[0].weight, DTensor)  # or still the gathered weight
        loss = F.mse_loss(out.float(), y)  # in float32, whatever the policy
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), out.dtype, freed


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

    kwargs = fully_shard_kwargs(FSDP_CONFIG, device)
    torch.manual_seed(0)  # the same weights on every rank
    model = MLP()
    for layer in model.layers:
        fully_shard(layer, **kwargs)  # one unit per layer
    fully_shard(model, **{**kwargs, "reshard_after_forward": False})  # the root: backward is next
    rows = slice(rank * GLOBAL_BATCH // world_size, (rank + 1) * GLOBAL_BATCH // world_size)
    losses, out_dtype, freed = train(model, device, rows)
    dist.all_reduce(losses)  # the mean over the ranks is the loss of the whole batch
    losses /= world_size

    if rank == 0:
        print(f"fsdp_config {FSDP_CONFIG}: computes in {out_dtype}, freed after forward: {freed}")
        torch.manual_seed(0)
        alone, *_ = train(MLP().to(device), device)  # float32, one process, the whole batch
        relative = ((losses - alone).abs() / alone.abs()).max().item()
        print(
            f"fsdp_config on {world_size} ranks vs float32 in 1 process, {STEPS} steps: "
            f"max relative loss difference = {relative:.2e}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
