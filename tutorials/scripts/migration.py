"""From FSDP1 to FSDP2 as a torchrun script: the same training both ways gives the same losses.

    torchrun --nproc-per-node=2 migration.py

The same model is trained twice on the same batches: sharded the FSDP1 way, with one
FullyShardedDataParallel call whose auto_wrap_policy chooses the units, then the FSDP2 way, with
fully_shard on each unit and then on the root; both gather the weights in bfloat16 and reduce the
gradients in float32. Rank 0 prints the first and last losses of each and the largest difference
between them. Needs torch alone; each rank computes on its accelerator (GPU) where there is one,
else on the CPU (over gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

WIDTH, GLOBAL_BATCH, STEPS, LR = 32, 16, 20, 1e-2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + F.gelu(self.fc(self.norm(x)))


def make_model():
    torch.manual_seed(0)  # the same weights on every rank, and for both APIs
    return nn.Sequential(*(Block() for _ in range(3)), nn.Linear(WIDTH, 1))


def fsdp1(model, device):
    """The FSDP1 setup to migrate: one call, a policy choosing the units."""
    return FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        use_orig_params=True,
        device_id=device,  # the rank's device, the CPU included: FSDP1 moves the model there
    )


def fsdp2(model):
    """Its FSDP2 equivalent: fully_shard on each unit, bottom-up, then on the root."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model[:-1]:
        fully_shard(block, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)  # the root also takes the head


def train(model, device, rows):
    """AdamW on the rows ``rows`` of each global batch; the loss of the whole batch, each step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)  # after sharding: it steps the shards
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)  # on the CPU: the same numbers on any device
        x = torch.randn(GLOBAL_BATCH, WIDTH, generator=g)
        y = x[:, :8].sum(1, keepdim=True).tanh()
        x, y = x.to(device)[rows], y.to(device)[rows]
        loss = F.mse_loss(model(x).float(), y)  # the output is bfloat16 under both policies
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    losses = torch.stack(losses)
    dist.all_reduce(losses)  # the mean over the ranks is the loss of the whole batch
    return losses / dist.get_world_size()


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

    per_rank = GLOBAL_BATCH // world_size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    before = train(fsdp1(make_model(), device), device, rows)
    after = train(fsdp2(make_model()), device, rows)

    if rank == 0:
        for name, losses in (("FSDP1", before), ("FSDP2", after)):
            print(
                f"{name}: loss {losses[0].item():.4f} at step 0, {losses[-1].item():.4f} at the end"
            )
        difference = (before - after).abs().max().item()
        print(
            f"FSDP2 vs FSDP1 on {world_size} ranks, {STEPS} steps: "
            f"max |loss difference| = {difference:.2e}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
