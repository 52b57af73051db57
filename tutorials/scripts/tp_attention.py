"""Grouped-query attention under tensor parallelism as a torchrun script: heads must divide.

    torchrun --nproc-per-node=2 tp_attention.py

A grouped-query attention (GQA: fewer key/value heads than query heads, each shared by a group of
them) split over 2 ranks: q, k and v column-wise, so each rank computes a block of output features,
and the output projection row-wise. The split ignores heads: it falls between heads only where the
number of query heads and the number of key/value heads both divide by the number of ranks. For
each pair of head counts rank 0 prints what it holds of k's weight and either the largest
difference from the unsharded attention's output or the error the forward raises. Needs torch
alone; each rank computes on its accelerator (GPU) where there is one, else on the CPU (over gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

DIM, HEAD_DIM = 32, 8


class GroupedQueryAttention(nn.Module):
    def __init__(self, n_head, n_kv_head):
        super().__init__()
        self.q = nn.Linear(DIM, n_head * HEAD_DIM, bias=False)
        self.k = nn.Linear(DIM, n_kv_head * HEAD_DIM, bias=False)
        self.v = nn.Linear(DIM, n_kv_head * HEAD_DIM, bias=False)
        self.proj = nn.Linear(n_head * HEAD_DIM, DIM, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        # -1: all the heads, or this rank's share under tensor parallelism
        q, k, v = (t(x).view(B, T, -1, HEAD_DIM).transpose(1, 2) for t in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


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
    tp = dist.get_world_size()
    tp_mesh = init_device_mesh(device.type, (tp,), mesh_dim_names=("tp",))
    x = torch.randn(2, 8, DIM, generator=torch.Generator().manual_seed(0)).to(device)

    for n_head, n_kv_head in ((4, 2), (6, 2), (4, 1), (6, 3)):
        torch.manual_seed(0)  # the same weights on every rank
        attention = GroupedQueryAttention(n_head, n_kv_head).to(device)
        whole = attention(x)  # unsharded, on every rank
        plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel()}
        parallelize_module(attention, tp_mesh, plan | {"proj": RowwiseParallel()})
        try:  # every rank raises alike: the check is local, no collective is left waiting
            gap = (attention(x) - whole).abs().max().item()
            outcome = f"runs, max |output difference| = {gap:.2e}"
        except RuntimeError as e:
            outcome = f"RuntimeError: {str(e).splitlines()[0]}"
        if dist.get_rank() == 0:
            divides = n_head % tp == 0 and n_kv_head % tp == 0
            print(
                f"{n_head} heads, {n_kv_head} KV heads on {tp} ranks (both divide: {divides}): "
                f"k.weight {tuple(attention.k.weight.to_local().shape)} of "
                f"{tuple(attention.k.weight.shape)}; {outcome}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
