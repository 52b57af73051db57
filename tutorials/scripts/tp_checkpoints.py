"""A 2-D checkpoint on another mesh as a torchrun script: saved by FSDP x TP, loaded by FSDP alone.

    torchrun --nproc-per-node=4 tp_checkpoints.py

Four ranks as a 2 x 2 mesh named ("dp", "tp"): tensor parallelism over "tp", fully_shard over "dp",
two AdamW steps, then a distributed checkpoint (DCP) of the model and the optimizer, each rank
writing its own shards with their place in each global tensor. A second model, sharded by FSDP
alone over all 4 ranks (a 1-D mesh, other shards), loads it: DCP reads the slices each new shard
needs. Then the 1-D model is exported to one file of whole tensors, as a plain model loads it.
Rank 0 prints whether the parameters and AdamW's moments came across bit for bit, and the export.
Written in ./checkpoint-2d and ./model.pt. Needs torch alone; each rank computes on its accelerator
(GPU) where there is one, else on the CPU (over gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

GLOBAL_BATCH, STEPS, LR = 8, 2, 1e-2


class FeedForward(nn.Module):
    def __init__(self, dim=16, hidden=64):
        super().__init__()
        self.fc, self.proj = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(x)))


class Model(nn.Module):
    def __init__(self, dim=16, out=4):
        super().__init__()
        self.blocks = nn.ModuleList(FeedForward(dim) for _ in range(2))
        self.head = nn.Linear(dim, out)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def whole(model, optimizer):
    """Every parameter and AdamW first moment, gathered whole (a collective: every rank calls it)."""
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    moments = {n: optimizer.state[p]["exp_avg"].full_tensor() for n, p in model.named_parameters()}
    return params, moments


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
    world_size = dist.get_world_size()

    # FSDP x TP on 2 x 2: train, save
    mesh = init_device_mesh(device.type, (2, world_size // 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = Model().to(device)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    half = GLOBAL_BATCH // mesh["dp"].size()
    for step in range(STEPS):
        x = torch.randn(GLOBAL_BATCH, 16, generator=torch.Generator().manual_seed(step)).to(device)
        x = x[mesh["dp"].get_local_rank() * half :][:half]  # the dp coordinate's half
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id="checkpoint-2d")
    saved_params, saved_moments = whole(model, optimizer)

    # FSDP alone over all 4 ranks: another layout, the same checkpoint
    mesh_1d = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
    torch.manual_seed(1)  # other weights: what matches below came from the checkpoint
    loaded = Model().to(device)
    for block in loaded.blocks:
        fully_shard(block, mesh=mesh_1d)
    fully_shard(loaded, mesh=mesh_1d)
    loaded_optimizer = torch.optim.AdamW(loaded.parameters(), lr=LR)
    model_state, optim_state = get_state_dict(loaded, loaded_optimizer)  # what to fill, and where
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id="checkpoint-2d")  # each rank reads the slices its shards need
    set_state_dict(
        loaded, loaded_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    loaded_params, loaded_moments = whole(loaded, loaded_optimizer)
    # one file of whole tensors: gathered over the mesh, on rank 0's CPU
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    exported = get_model_state_dict(loaded, options=options)

    if dist.get_rank() == 0:
        torch.save(exported, "model.pt")
        plain = Model()
        print(
            "model.pt into a plain model:",
            plain.load_state_dict(torch.load("model.pt", weights_only=True)),
        )
        same = all(torch.equal(loaded_params[n], p) for n, p in saved_params.items())
        print(
            f"2 x 2 FSDP x TP checkpoint loaded on a 1-D mesh of {world_size}: parameters equal exactly: {same}"
        )
        same = all(torch.equal(loaded_moments[n], m) for n, m in saved_moments.items())
        print(f"AdamW's first moments equal exactly: {same}")
        same = all(torch.equal(plain.state_dict()[n], p.cpu()) for n, p in saved_params.items())
        print(f"model.pt equals the 2-D run's parameters exactly: {same}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
