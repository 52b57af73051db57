"""Compiling past the blocks with FSDP2, as a torchrun script: the optimizer step, not the backward.

    torchrun --nproc-per-node=2 compiled_autograd.py

What a training script compiles with FSDP2 in torch 2.13: each block, in place, after fully_shard,
and the optimizer step, torch.compile(optimizer.step), whose parameters, gradients and AdamW
moments are DTensors: an elementwise update of each rank's own shard, with no collective. The
backward stays with the autograd engine: under compiled autograd, the callback FSDP2's root queues
for the end of the backward never runs, and the root's parameters get no reduced gradient. The
model trains beside the same model eager; after each backward the script counts the sharded
parameters that have their gradient, and the collectives the forwards and backwards ran and the
compiled steps ran (the profiler), and rank 0 prints them and the largest difference between the
parameters (not 0: the compiled step takes AdamW's paths for compiling, which round differently). Needs torch alone; each
rank computes on its accelerator (GPU) where there is one, else on the CPU (over gloo).
"""

import os
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

STEPS, DIM = 3, 32
# aot_eager: dynamo's graphs and AOTAutograd, run by eager kernels. It compiles in a moment on a
# CPU; a training script leaves backend= out, for inductor, which fuses kernels (C++ on a CPU:
# a C++ compiler, and a while).
BACKEND = "aot_eager"


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = (
            nn.LayerNorm(DIM),
            nn.Linear(DIM, 4 * DIM),
            nn.Linear(4 * DIM, DIM),
        )

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, blocks=2):
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x, y):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(self.head(x), y)  # the loss: the root returns no view of its output


def batch(step, device):
    """This rank's part of a step's global batch."""
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x, y = torch.randn(4, 16, DIM, generator=g), torch.randn(4, 16, 1, generator=g)
    return x.to(device), y.to(device)


def collectives(fn):
    """The c10d collectives `fn` runs, eager or in a graph, by name, as the profiler records them."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        fn()
    return Counter(e.name for e in profile.events() if "c10d" in e.name.split("::")[0])


def train(compiled, device):
    torch.manual_seed(0)  # the same weights on every rank, and in both runs
    model = Model().to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    # foreach: AdamW's default for DTensors on GPUs (a loop over parameters on the CPU), set here
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    step = optimizer.step
    if compiled:
        for block in model.blocks:
            block.compile(backend=BACKEND)
        step = torch.compile(optimizer.step, backend=BACKEND)
    with_grad, in_backward, in_step = [], Counter(), Counter()
    for i in range(STEPS):
        x, y = batch(i, device)
        # the autograd engine's backward: FSDP2's hooks and its root's final callback run
        in_backward += collectives(lambda: model(x, y).backward())  # noqa: B023 (called at once)
        with_grad.append(sum(p.grad is not None for p in model.parameters()))
        in_step += collectives(step)
        optimizer.zero_grad()
    params = {name: p.full_tensor() for name, p in model.named_parameters()}
    return params, with_grad, in_backward, in_step


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

    eager, *_ = train(compiled=False, device=device)
    params, with_grad, in_backward, in_step = train(compiled=True, device=device)
    if dist.get_rank() == 0:
        difference = max((params[name] - p).abs().max().item() for name, p in eager.items())
        print(
            f"sharded parameters with a gradient after each backward: {with_grad} (of {len(params)})"
        )
        # the same count sees FSDP's all-gathers and reduce-scatters in the forward and backward
        print(f"collectives in the forwards and backwards: {dict(in_backward)}")
        print(f"collectives in the compiled optimizer steps: {dict(in_step) or 'none'}")
        print(
            f"compiled blocks and optimizer.step ({BACKEND}) vs eager on {dist.get_world_size()} ranks, "
            f"{STEPS} steps: max |parameter difference| = {difference:.1e}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
