"""Gradient clipping under FSDP x TP as a torchrun script: the parameters live on two meshes.

    torchrun --nproc-per-node=4 tp_gradients.py

Four ranks as a 2 x 2 mesh named ("dp", "tp"). The feed-forward blocks are split by tensor
parallelism over "tp" and sharded over "dp": their gradients are DTensors on the 2-D mesh. The
output head is left out of the TP plan and sharded over "dp" alone: its gradients live on the 1-D
mesh. torch.nn.utils.clip_grad_norm_ stacks every gradient's norm into one tensor and fails on the
two meshes; grouping the parameters by mesh works: each group's norm over all its ranks, the norm of
those norms, and each group scaled by the same factor. Rank 0 prints the error, then computes the
same clipping in one process on the whole batch and prints the largest differences in the total
norm and the clipped gradients. Needs torch alone; each rank computes on its accelerator (GPU)
where there is one, else on the CPU (over gloo).
"""

import os
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

GLOBAL_BATCH, MAX_NORM = 8, 0.1


class FeedForward(nn.Module):
    def __init__(self, dim=16, hidden=64):
        super().__init__()
        self.fc, self.proj = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(x)))


class Model(nn.Module):
    def __init__(self, dim=16, out=4):
        super().__init__()
        self.blocks = nn.ModuleList(FeedForward(dim) for _ in range(2))
        self.head = nn.Linear(dim, out)  # left out of the TP plan: on the dp mesh alone

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batch():
    g = torch.Generator().manual_seed(1000)
    x = torch.randn(GLOBAL_BATCH, 16, generator=g)
    return x, torch.stack(
        [x[:, :4].sum(1), x[:, 4:8].prod(1), x[:, 8:].sin().sum(1), x.norm(dim=1)], 1
    )


def clip_grad_norm_across_meshes(parameters, max_norm):
    """clip_grad_norm_ for DTensor parameters on several meshes: one norm per mesh, combined."""
    by_mesh = defaultdict(list)
    for p in parameters:
        if p.grad is not None:
            by_mesh[p.grad.device_mesh].append(
                p
            )  # torch's stack and _foreach_mul_: one mesh a call
    norms = [
        torch.nn.utils.get_total_norm([p.grad for p in group]).full_tensor()  # over all its ranks
        for group in by_mesh.values()
    ]
    total = torch.linalg.vector_norm(torch.stack(norms))
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


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
    mesh = init_device_mesh(
        device.type, (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp")
    )

    torch.manual_seed(0)  # the same weights on every rank
    model = Model().to(device)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    half = GLOBAL_BATCH // mesh["dp"].size()  # a TP group shares its dp coordinate's half
    rows = slice(mesh["dp"].get_local_rank() * half, (mesh["dp"].get_local_rank() + 1) * half)
    x, y = (t.to(device)[rows] for t in batch())
    F.mse_loss(model(x), y).backward()

    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        error = "runs"
    except RuntimeError as e:
        error = f"RuntimeError: {str(e).splitlines()[0]}"
    meshes = sorted({str(p.device_mesh.mesh_dim_names) for p in model.parameters()})
    total = clip_grad_norm_across_meshes(model.parameters(), MAX_NORM).item()
    grads = [p.grad.full_tensor() for p in model.parameters()]  # a collective: every rank calls it

    if dist.get_rank() == 0:
        print(f"the parameters' meshes: {', '.join(meshes)}")
        print(f"clip_grad_norm_ on every parameter: {error}")
        torch.manual_seed(0)
        alone = Model().to(device)  # one process, the whole batch
        x, y = (t.to(device) for t in batch())
        F.mse_loss(alone(x), y).backward()
        one_total = torch.nn.utils.clip_grad_norm_(alone.parameters(), MAX_NORM).item()
        gaps = [(g - a.grad).abs().max() for g, a in zip(grads, alone.parameters())]
        gap = torch.stack(gaps).max().item()  # torch's max keeps a NaN; Python's may not
        print(
            f"clipped per mesh: total norm {total:.6f}, 1 process {one_total:.6f}; "
            f"max |clipped gradient difference| = {gap:.2e}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
