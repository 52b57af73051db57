"""The weight-sync tutorial as a torchrun script: an FSDP2 trainer's weights to an inference copy.

    torchrun --nproc-per-node=3 weight_sync.py

Ranks 0 and 1 train a model sharded by FSDP2 over a group of their own; rank 2 stands for the
inference engine, a plain copy of the model that never trains. After an optimizer step the trainer
gathers each parameter (full_tensor) and rank 0 broadcasts it to rank 2, one at a time: a trainer
rank holds its shards and one gathered parameter, never the whole model. Rank 2 sends back its
weights and its output, and rank 0 prints their largest differences from the trainer's (in fp32
both: none), and how far the step moved the weights. Needs torch alone; each rank computes on its
accelerator (GPU) where there is one, else on the CPU (over gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard


class MLP(nn.Module):
    def __init__(self, dim=16, hidden=64, out=4):
        super().__init__()
        sizes = [dim, hidden, hidden, out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = F.gelu(layer(x))
        return self.layers[-1](x)


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
    rank = dist.get_rank()
    # new_group is collective over all ranks: every rank makes both, in this order.
    trainers, link = dist.new_group([0, 1]), dist.new_group([0, 2])
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0)).to(device)

    torch.manual_seed(0)  # the same weights on every rank: the engine starts from the old ones
    model = MLP().to(device)
    if rank == 2:  # the engine: receives each parameter into its own storage, in the same order
        with torch.no_grad():
            for p in model.parameters():
                dist.broadcast(p, src=0, group=link)
            for t in [*model.parameters(), model(x)]:
                dist.broadcast(t, src=2, group=link)  # back to rank 0, for the check
    else:  # the trainer: sharded over a mesh of ranks 0 and 1 alone
        old = [p.detach().clone() for p in model.parameters()]  # the old weights, for the check
        mesh = DeviceMesh.from_group(trainers, device.type)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1 + rank)  # each trainer rank its own batch
        inputs, targets = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
        F.mse_loss(model(inputs.to(device)), targets.to(device)).backward()
        optimizer.step()

        # The sync: one parameter gathered at a time, sent, and freed before the next.
        for p in model.parameters():
            full = p.full_tensor()  # both trainer ranks: the all-gather of one parameter
            if rank == 0:
                dist.broadcast(full, src=0, group=link)  # straight into the engine's parameter
            del full

        # The check: the engine sends back what it now holds, one parameter at a time.
        gaps, moved = [], []
        for p, before in zip(model.parameters(), old):
            full = p.full_tensor()
            if rank == 0:
                theirs = torch.empty_like(full)
                dist.broadcast(theirs, src=2, group=link)
                gaps.append((theirs - full).abs().max())
                moved.append((full - before).abs().max())
        with torch.no_grad():
            out = model(x)  # the trainer's own forward, sharded
        if rank == 0:
            theirs = torch.empty_like(out)
            dist.broadcast(theirs, src=2, group=link)
            # torch's max keeps a NaN, where Python's max() may skip it
            weight_gap, moved = torch.stack(gaps).max().item(), torch.stack(moved).max().item()
            out_gap = (theirs - out).abs().max().item()
            print(
                f"FSDP2 trainer on ranks 0-1 -> engine on rank 2, {len(gaps)} parameters: "
                f"max |weight difference| = {weight_gap:.2e}, max |output difference| = "
                f"{out_gap:.2e}; the step moved the weights by up to {moved:.2e}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
