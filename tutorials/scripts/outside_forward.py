"""Outside forward and backward, FSDP2's parameters are shards, as a torchrun script.

    torchrun --nproc-per-node=2 outside_forward.py

FSDP2 gathers a unit's parameters only in hooks around its forward (and its backward). Everywhere
else they are DTensor shards, so three things need care, each checked here against one process:
a method other than forward (register_fsdp_forward_method gives it the hooks); a max-norm
constraint on each weight's rows after every step (on the rank's own rows, to_local(), since FSDP
shards dimension 0 and renorm works row by row); and editing a weight (in place, into the shard: a
newly assigned Parameter is silently replaced by FSDP2's shard at the next forward). Needs torch
alone; each rank computes on its accelerator (GPU) where there is one, else on the CPU (gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import distribute_tensor

GLOBAL_BATCH, STEPS, LR, MAX_ROW_NORM = 32, 20, 0.1, 0.5


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden, self.out = nn.Linear(16, 64), nn.Linear(64, 4)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x)))

    def generate(self, x):  # calls the submodules itself: FSDP2's root hooks do not see it
        return self.out(torch.tanh(self.hidden(x))).argmax(-1)


def batch(step):
    """The global batch of a step: the same on every rank, whatever its device."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 16, generator=g)
    return x, x[:, :4] * x[:, 4:8]


def train(model, device, rows=slice(None), own_rows=lambda w: w):
    """SGD on ``rows`` of each batch, each weight's rows renormed after every step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = (t.to(device)[rows] for t in batch(step))
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():  # renorm has no DTensor sharding strategy: run it on the rank's rows
            for weight in (model.hidden.weight, model.out.weight):
                own_rows(weight).copy_(own_rows(weight).renorm(2, 0, MAX_ROW_NORM))


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
    model = Classifier().to(device)
    fully_shard(model.hidden)
    fully_shard(model.out)
    fully_shard(model)  # the root
    register_fsdp_forward_method(model, "generate")  # the root's hooks around generate too
    per_rank = GLOBAL_BATCH // world_size
    train(model, device, slice(rank * per_rank, (rank + 1) * per_rank), lambda w: w.to_local())
    x = batch(STEPS)[0][:8].to(device)
    tokens = model.generate(x)
    weights = [p.full_tensor() for p in model.parameters()]  # collectives: on every rank

    # An edit: a new Parameter is lost at the next forward; one copied into the shard is kept.
    model.out.bias = nn.Parameter(torch.full((4,), 5.0, device=device))
    assigned = model(x)
    with torch.no_grad():
        full = torch.full((4,), 5.0, device=device)  # the same full tensor on every rank
        model.out.bias.copy_(
            distribute_tensor(full, model.out.bias.device_mesh, [*model.out.bias.placements])
        )
    copied = model(x)

    if rank == 0:
        torch.manual_seed(0)
        one = Classifier().to(device)  # one process, the whole batch
        train(one, device)
        row_norm = max(w.norm(dim=1).max().item() for w in weights if w.dim() == 2)
        error = max((a - b).abs().max().item() for a, b in zip(weights, one.parameters()))
        print(
            f"FSDP2 on {world_size} ranks vs 1 process, {STEPS} steps, rows renormed on to_local(): "
            f"largest row norm {row_norm:.4f}, max |weight difference| = {error:.2e}"
        )
        same = torch.equal(tokens, one.generate(x))
        print(f"registered generate: the same tokens as one process: {same}")
        with torch.no_grad():
            one.out.bias.fill_(5.0)
            expected = one(x)
        kept = [(out - expected).abs().max().item() < 1e-5 for out in (assigned, copied)]
        print(
            f"bias edit kept at the next forward: new Parameter {kept[0]}, copy_ into the shard {kept[1]}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
