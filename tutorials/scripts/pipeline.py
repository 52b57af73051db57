"""Pipeline stages with FSDP2 as a torchrun script: a 2 x 2 mesh (pp, dp) trains as one process.

    torchrun --nproc-per-node=4 pipeline.py

The model is cut into 2 stages. Along the mesh's `pp` dimension each stage is a PipelineStage, and
Schedule1F1B runs every rank's batch as micro-batches through them; along `dp` each stage is
sharded by fully_shard over its pair of ranks, which take halves of each global batch. Every rank
also trains the uncut model on the whole batch, alone, and compares its own stage's weights with
it; rank 0 prints the largest differences in losses and weights. Needs torch alone; each rank
computes on its accelerator (GPU) where there is one, else on the CPU (over gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

GLOBAL_BATCH, MICRO_BATCHES, STEPS, LR = 64, 4, 20, 1e-2


def make_stages():
    """The seeded model, cut into its 2 stages of 2 layers each."""
    torch.manual_seed(0)  # the same weights on every rank
    first = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU())
    last = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
    return [first, last]


def batch(step):
    """The global batch of a step: the same on every rank, whatever its device."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 16, generator=g)
    y = torch.stack(
        [x[:, :4].sum(1), x[:, 4:8].prod(1), x[:, 8:].sin().sum(1), x.norm(dim=1)], dim=1
    )
    return x, y


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

    # Ranks 0, 1 hold stage 0 and ranks 2, 3 stage 1; ranks 0 and 2 (1 and 3) form a pipeline.
    mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    module = make_stages()[pp].to(device)
    for layer in module:
        if isinstance(layer, nn.Linear):  # kept gathered: no all-gather per micro-batch
            fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=False)
    fully_shard(module, mesh=mesh["dp"], reshard_after_forward=False)
    stage = PipelineStage(module, pp, num_stages=2, device=device, group=mesh.get_group("pp"))
    # scale_grads (default): the micro-batches' gradients are averaged, as for one mean loss
    schedule = Schedule1F1B(stage, n_microbatches=MICRO_BATCHES, loss_fn=F.mse_loss)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR)  # after sharding: on the shards

    per_rank = GLOBAL_BATCH // 2  # the dp rank's half of each global batch
    losses = torch.zeros(STEPS, device=device)
    for step in range(STEPS):
        x, y = (t.to(device)[dp * per_rank : (dp + 1) * per_rank] for t in batch(step))
        if pp == 0:
            schedule.step(x)  # the first stage takes the inputs
        else:
            micro = []
            schedule.step(target=y, losses=micro)  # the last one computes the losses
            # equal micro-batches: the batch's mean (detached: the schedule's losses keep their graph)
            losses[step] = torch.stack(micro).mean().detach()
        optimizer.step()
        optimizer.zero_grad()
    dist.all_reduce(losses)  # the last stage's 2 dp ranks: their mean is the whole batch's loss
    losses /= 2
    weights = [p.full_tensor() for p in module.parameters()]  # a collective over dp

    # One process, the uncut model on the whole batch; each rank checks its own stage.
    alone = nn.Sequential(*make_stages()).to(device)
    optimizer = torch.optim.AdamW(alone.parameters(), lr=LR)
    alone_losses = []
    for step in range(STEPS):
        x, y = (t.to(device) for t in batch(step))
        loss = F.mse_loss(alone(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        alone_losses.append(loss.detach())
    gaps = torch.zeros(world_size, device=device)  # each rank's weight gap, in its own slot
    gaps[rank] = torch.stack(
        [(w - a).abs().max() for w, a in zip(weights, alone[pp].parameters())]
    ).max()
    dist.all_reduce(gaps)  # a sum: a NaN anywhere stays a NaN

    if rank == 0:
        loss_gap = (losses - torch.stack(alone_losses)).abs().max().item()
        print(
            f"Schedule1F1B, 2 stages x FSDP2 on 2 ranks, {MICRO_BATCHES} micro-batches, vs 1 process, "
            f"{STEPS} steps: max |loss difference| = {loss_gap:.2e}, "
            f"max |weight difference| = {gaps.max().item():.2e}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
