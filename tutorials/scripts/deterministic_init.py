"""Deterministic init as a torchrun script: a model built on meta and sharded starts as one process's.

    torchrun --nproc-per-node=2 deterministic_init.py

Each rank builds the model on the meta device (no memory), shards it with FSDP2, allocates its
shards with to_empty, then initialises one layer at a time: it draws the layer's full tensors with
the seed every rank shares, in the order one process draws them, and keeps its own slice. Drawing
into the shards instead would give every rank the same numbers: N identical shards. Rank 0 also
builds the model in one process with the same seed and prints the largest difference between the
two. Needs torch alone; each rank computes on its accelerator (GPU) where there is one, else on the
CPU (over gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

SEED = 0


def make_model():
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))


@torch.no_grad()
def init_like_one_process(model, device):
    """Fill the shards so that together they are the model one process builds with SEED."""
    torch.manual_seed(SEED)  # the same on every rank: every rank draws the same full tensors
    for layer in model:
        if isinstance(layer, nn.Linear):
            # One full layer at a time, drawn as the one process draws it (weight, then bias).
            full = nn.Linear(layer.in_features, layer.out_features, device=device)
            for name, shard in layer.named_parameters():
                # This rank's slice of the full tensor, cut locally (src_data_rank=None: no
                # collective, every rank holds the same full tensor), into its shard in place.
                mine = distribute_tensor(
                    getattr(full, name), shard.device_mesh, shard.placements, src_data_rank=None
                )
                shard.to_local().copy_(mine.to_local())


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

    with torch.device("meta"):
        model = make_model()  # shapes only: a model too big for one rank costs nothing here
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)  # one unit per layer
    fully_shard(model)  # the root
    model.to_empty(device=device)  # allocates the shards, uninitialised
    init_like_one_process(model, device)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}  # all-gathers: every rank

    if rank == 0:
        torch.manual_seed(SEED)
        with device:  # drawn where the shards were drawn: CPU and GPU numbers differ
            alone = make_model()  # one process, the whole model
        gaps = [(full[n] - p).abs().max() for n, p in alone.named_parameters()]
        difference = torch.stack(gaps).max().item()  # torch's max keeps a NaN
        print(
            f"meta + fully_shard + to_empty + init on {world_size} ranks vs 1 process: "
            f"max |weight difference| = {difference:.2e}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
