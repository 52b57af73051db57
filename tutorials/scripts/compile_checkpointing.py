"""Activation checkpointing with torch.compile and FSDP2, as a torchrun script: checkpoint, compile, shard.

    torchrun --nproc-per-node=2 compile_checkpointing.py

Each block is wrapped with checkpoint_wrapper, then compiled, then sharded (torchtitan's order):
dynamo captures the checkpointed block whole, and AOTAutograd recomputes it inside the compiled
backward. It trains beside eager checkpointing and no checkpointing; rank 0 prints the graphs
compiled, the bytes one forward leaves saved for the backward each way, and the largest loss
difference. Needs torch alone; each rank computes on its accelerator (GPU) where there is one,
else on the CPU (over gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import fully_shard

STEPS, DIM = 3, 32
# aot_eager: dynamo's graphs and AOTAutograd's backward (with its recomputation), run by eager
# kernels. It compiles in a moment on a CPU, and computes what eager computes; a training script
# leaves backend= out, for inductor, which fuses kernels (C++ on a CPU: a C++ compiler, and a while).
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

    def forward(self, x, y):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(self.head(x), y)  # the loss: the root returns no view of its output


class CountGraphs:
    """A torch.compile backend that counts the graphs dynamo hands it, and compiles them with BACKEND."""

    def __init__(self):
        self.graphs, self.backend = 0, torch._dynamo.lookup_backend(BACKEND)

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1
        return self.backend(graph_module, example_inputs)


def batch(step, device):
    """This rank's 4 sequences of 64 tokens."""
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x, y = torch.randn(4, 64, DIM, generator=g), torch.randn(4, 64, 1, generator=g)
    return x.to(device), y.to(device)


def saved_bytes(model, x, y):
    """Bytes one forward leaves saved for the backward: each saved storage once, as it is at the end."""
    storages = {}

    def pack(t):
        storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, y)
    held = sum(s.nbytes() for s in storages.values())  # FSDP resized the gathered weights' to 0
    loss.backward()
    model.zero_grad()
    return held


def train(order, device):
    torch.manual_seed(0)  # the same weights on every rank, and in every run
    model = Model().to(device)
    counter = CountGraphs()
    for i, block in enumerate(model.blocks):
        if order != "no checkpointing":
            block = checkpoint_wrapper(block)
        if order == "checkpoint, compile, shard":
            block.compile(backend=counter)  # the wrapper: dynamo captures its checkpoint whole
        model.blocks[i] = block
        fully_shard(block)  # last
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = model(*batch(step, device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, counter.graphs, saved_bytes(model, *batch(STEPS, device))


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

    runs = {
        order: train(order, device)
        for order in ("no checkpointing", "eager checkpointing", "checkpoint, compile, shard")
    }
    if dist.get_rank() == 0:
        for order, (_, graphs, saved) in runs.items():
            print(f"{order}: {graphs} graph(s) compiled, {saved} bytes saved for the backward")
        losses, eager = runs["checkpoint, compile, shard"][0], runs["eager checkpointing"][0]
        difference = max(abs(a - b) for a, b in zip(losses, eager))
        print(
            f"checkpoint, compile ({BACKEND}), shard vs eager checkpointing on {dist.get_world_size()} "
            f"ranks, {STEPS} steps: max |loss difference| = {difference:.1e}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
