"""Mixed precision as a torchrun script: FSDP2 computes in bfloat16 and keeps float32 weights.

    torchrun --nproc-per-node=2 mixed_precision.py

Each unit is sharded with a MixedPrecisionPolicy: FSDP2 gathers its weights in bfloat16 for the
forward and backward, reduces the gradients in float32, and the shards, their gradients and the
optimizer step stay float32. Rank 0 prints the dtypes it saw, then trains the same model in float32,
alone, and prints the largest relative difference between the losses of the two runs. Needs torch
alone; each rank computes on its accelerator (GPU) where there is one, else on the CPU (over gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

GLOBAL_BATCH, STEPS, LR = 64, 40, 1e-2


class MLP(nn.Module):
    def __init__(self, dim=16, hidden=64, out=4):
        super().__init__()
        sizes = [dim, hidden, hidden, out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = F.gelu(layer(x))
        return self.layers[-1](x)


def batch(step):
    """The global batch of a step: the same on every rank, whatever its device."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 16, generator=g)
    y = torch.stack(
        [x[:, :4].sum(1), x[:, 4:8].prod(1), x[:, 8:].sin().sum(1), x.norm(dim=1)], dim=1
    )
    return x, y


def train(model, device, rows=slice(None)):
    """AdamW on the rows ``rows`` of each global batch; the losses, the output's and grads' dtype."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)  # float32, on the float32 shards
    losses = []
    for step in range(STEPS):
        x, y = (t.to(device)[rows] for t in batch(step))
        out = model(x)  # bfloat16 under the policy: the loss is taken in float32
        loss = F.mse_loss(out.float(), y)
        loss.backward()
        grad = model.layers[0].weight.grad.dtype  # what the optimizer steps with
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), out.dtype, grad


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

    # Gather and compute in bfloat16; reduce the gradients in float32, so that summing the
    # ranks' gradients loses nothing more. (float16 would also need torch.amp.GradScaler.)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(0)  # the same weights on every rank
    model = MLP()
    seen = set()  # the dtypes of the weights the layers' forwards compute with
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda m, args: seen.add(m.weight.dtype))
        fully_shard(layer, mp_policy=policy)  # each unit casts when it gathers
    fully_shard(model, mp_policy=policy)  # the root: casts the float32 input to bfloat16
    per_rank = GLOBAL_BATCH // world_size
    losses, out_dtype, grad_dtype = train(
        model, device, rows=slice(rank * per_rank, (rank + 1) * per_rank)
    )
    dist.all_reduce(losses)  # the mean over the ranks is the loss of the whole batch
    losses /= world_size

    if rank == 0:
        print(
            f"forward weights {', '.join(map(str, seen))}, output {out_dtype}; "
            f"sharded weights {model.layers[0].weight.dtype}, gradients {grad_dtype}"
        )
        torch.manual_seed(0)
        alone, *_ = train(MLP().to(device), device)  # float32, one process, the whole batch
        relative = ((losses - alone).abs() / alone.abs()).max().item()
        print(
            f"bfloat16 FSDP2 on {world_size} ranks vs float32 in 1 process, {STEPS} steps: "
            f"max relative loss difference = {relative:.2e}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
