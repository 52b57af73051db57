"""torch.compile with FSDP2 as a torchrun script: each block compiled in place, after fully_shard.

    torchrun --nproc-per-node=2 compile.py

Each block is an FSDP unit, and each is compiled with block.compile(fullgraph=True): the hooks
FSDP2 adds to a block run eagerly around its graph, so the block compiles whole (fullgraph=True
would raise on a graph break), and its all-gathers and reduce-scatters are FSDP's own, as in
eager. The compiled model trains beside the same model eager; rank 0 prints the number of graphs
compiled, the collectives of one step each way (counted with the profiler, which sees compiled
code run; a TorchDispatchMode would not) and the largest difference between the losses. Needs
torch alone; each rank computes on its accelerator (GPU) where there is one, else on the CPU
(over gloo).
"""

import os
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

STEPS, DIM = 3, 32
# aot_eager: dynamo's graphs and AOTAutograd's backward, run by eager kernels. It compiles in a
# moment on a CPU, and computes what eager computes; a training script leaves backend= out, for
# inductor, which generates fused kernels (C++ on a CPU, which takes a C++ compiler and a while).
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
        self.embed = nn.Linear(DIM, DIM)  # every block's input needs a gradient: one graph for all
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class CountGraphs:
    """A torch.compile backend that counts the graphs dynamo hands it, and compiles them with BACKEND."""

    def __init__(self):
        self.graphs, self.backend = 0, torch._dynamo.lookup_backend(BACKEND)

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1
        return self.backend(graph_module, example_inputs)


def batch(step, device):
    """This rank's part of a step's global batch."""
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(32, DIM, generator=g).to(device), torch.randn(32, 1, generator=g).to(device)


def collectives(step_fn):
    """The c10d collectives a step runs, by name, as the profiler records them."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        step_fn()
    return Counter(e.name for e in profile.events() if e.name.startswith("c10d::"))


def train(compiled, device):
    torch.manual_seed(0)  # the same weights on every rank, and in both runs
    model = Model().to(device)
    for block in model.blocks:
        fully_shard(block)  # each block a unit
    fully_shard(model)  # the root: embed and head
    counter = CountGraphs()
    if compiled:
        for block in model.blocks:
            # in place (names unchanged, unlike torch.compile(block)); after fully_shard
            block.compile(backend=counter, fullgraph=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, device)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    x, y = batch(STEPS, device)
    ran = collectives(lambda: F.mse_loss(model(x), y).backward())  # one more step, profiled
    return losses, counter.graphs, ran


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

    eager_losses, _, eager_ran = train(compiled=False, device=device)
    losses, graphs, ran = train(compiled=True, device=device)
    if dist.get_rank() == 0:
        difference = max(abs(a - b) for a, b in zip(losses, eager_losses))
        print(f"each of 2 blocks compiled after fully_shard, fullgraph=True: {graphs} graph(s)")
        print(f"collectives in a step: eager {dict(eager_ran)}, compiled {dict(ran)}")
        print(
            f"compiled ({BACKEND}) vs eager FSDP2 on {dist.get_world_size()} ranks, {STEPS} steps: "
            f"max |loss difference| = {difference:.1e}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
