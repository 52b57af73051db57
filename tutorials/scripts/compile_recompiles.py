"""What recompiles FSDP2's compiled blocks, as a torchrun script: no_grad, and a new length once.

    torchrun --nproc-per-node=2 compile_recompiles.py

Each block of a small model is an FSDP unit, compiled in place after fully_shard. Dynamo guards
each graph on what its code reads, and compiles a new graph when no guard passes. The script
trains on 32 tokens, runs a forward under no_grad, trains on 32 tokens again, then on 16, 24 and
8, and rank 0 prints how many graphs were compiled so far after each (a backend counts them).
no_grad changes the grad mode every graph is guarded on: one graph more, and training again
reuses the first. The first new length recompiles once, with that dimension made dynamic, and
the later lengths reuse that graph. Each recompilation's reason (the guard that failed) is
logged on stderr: torch._logging.set_logs(recompiles=True) does what TORCH_LOGS=recompiles in
the environment does. Needs torch alone; each rank computes on its accelerator (GPU) where there
is one, else on the CPU (over gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

DIM = 32
# aot_eager: dynamo's graphs and AOTAutograd's backward, run by eager kernels. What recompiles
# is decided by dynamo's guards, whatever the backend; aot_eager compiles in a moment on a CPU,
# where inductor generates C++ (a C++ compiler, and a while). A training script leaves it out.
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


def batch(tokens, device):
    """This rank's 4 sequences of `tokens` tokens."""
    g = torch.Generator().manual_seed(1000 * tokens + dist.get_rank())
    x, y = torch.randn(4, tokens, DIM, generator=g), torch.randn(4, tokens, 1, generator=g)
    return x.to(device), y.to(device)


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
    torch._logging.set_logs(recompiles=True)  # each recompilation and its failed guard, on stderr

    torch.manual_seed(0)  # the same weights on every rank
    model = Model().to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    counter = CountGraphs()
    for block in model.blocks:
        block.compile(backend=counter)  # in place, after fully_shard
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(tokens):
        model(*batch(tokens, device)).backward()
        optimizer.step()
        optimizer.zero_grad()
        return counter.graphs

    graphs = {"a step on 32 tokens": step(32), "another": step(32)}
    with torch.no_grad():  # how to evaluate; a new grad mode, so a new graph
        model(*batch(32, device))
    graphs["a forward under no_grad"] = counter.graphs
    graphs["a step on 32 tokens again"] = step(32)  # the first graph's guards pass again: reused
    for tokens in (16, 24, 8):
        graphs[f"a step on {tokens} tokens"] = step(tokens)
    if dist.get_rank() == 0:
        print("graphs compiled so far, after " + "; ".join(f"{k}: {n}" for k, n in graphs.items()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
