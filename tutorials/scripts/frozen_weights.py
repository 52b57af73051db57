"""Frozen weights under FSDP2 as a torchrun script: the dtype rule, and the all-gathers they still cost.

    torchrun --nproc-per-node=2 frozen_weights.py

Each block of the model is a frozen weight (the "pretrained" base), a norm weight, and two small
trainable fp32 matrices beside them, LoRA's A and B; each block is one FSDP2 unit. FSDP2 reduces
a unit's gradients in one dtype, so it checks at the first forward that the unit's *trainable*
parameters share one: rank 0 prints that a frozen bf16 base with fp32 adapters runs, and the
error when a bf16 norm is trained beside them. Then, on fp32 blocks, 4 micro-batches of gradient
accumulation: rank 0 prints the bytes FSDP's all-gathers fill per micro-batch, in sizes of the
frozen weights, with reshard_after_forward=True (gathered for forward, and again for backward)
and False (once), and the gradient reductions per step. Needs torch alone; each rank computes on
its accelerator (GPU) where there is one, else on the CPU (over gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

WIDTH, RANK, BLOCKS, MICRO = 512, 4, 4, 4
# the operators FSDP2's collectives run as; argument 0 is an all-gather's output, 1 a
# reduce-scatter's input
GATHERS = {"c10d::_allgather_base_", "c10d::allgather_into_tensor_coalesced_"}
REDUCTIONS = {"c10d::_reduce_scatter_base_", "c10d::reduce_scatter_tensor_coalesced_"}


class Block(nn.Module):
    """A frozen weight and a norm in ``dtype``; LoRA's trainable A and B beside them, in fp32."""

    def __init__(self, dtype):
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH, bias=False, dtype=dtype).requires_grad_(False)
        self.norm = nn.Parameter(torch.ones(WIDTH, dtype=dtype), requires_grad=False)
        self.A = nn.Parameter(torch.randn(RANK, WIDTH) / WIDTH**0.5)  # fp32, as peft keeps them
        self.B = nn.Parameter(torch.zeros(WIDTH, RANK))

    def forward(self, x):
        h = x * self.norm
        return h + self.base(h) + (h.float() @ self.A.T @ self.B.T).to(h.dtype)


def sharded(dtype, device, train_norms=False, reshard_after_forward=True):
    torch.manual_seed(0)  # the same weights on every rank
    model = nn.Sequential(*(Block(dtype) for _ in range(BLOCKS))).to(device)
    for block in model:
        block.norm.requires_grad_(train_norms)
        fully_shard(block, reshard_after_forward=reshard_after_forward)  # one unit per block
    return fully_shard(model, reshard_after_forward=reshard_after_forward)


class Collectives(TorchDispatchMode):
    """Counts FSDP's all-gathers (and the bytes of the buffers they fill) and reduce-scatters."""

    def __init__(self):
        super().__init__()
        self.gathered, self.reductions = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in GATHERS:
            out = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.gathered += sum(t.numel() * t.element_size() for t in out)
        self.reductions += name in REDUCTIONS
        return func(*args, **(kwargs or {}))


def first_forward(device, train_norms):
    model = sharded(torch.bfloat16, device, train_norms=train_norms)
    x = torch.randn(8, WIDTH, device=device, dtype=torch.bfloat16)
    try:  # FSDP2 checks each unit's dtypes at the root's first forward (its lazy initialisation)
        model(x).float().pow(2).mean().backward()
    except Exception as error:  # shown, not handled
        return f"{type(error).__name__}: {str(error).splitlines()[0]}"
    return "runs"


def accumulation(device, reshard_after_forward):
    model = sharded(torch.float32, device, reshard_after_forward=reshard_after_forward)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    x = torch.randn(MICRO, 8, WIDTH, generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(2):  # the second step is the one counted: the first sets FSDP up
        per_micro, counted = [], Collectives()
        for micro in range(MICRO):
            # the adapters' gradients: reduced once per step, at the last micro-batch
            model.set_requires_gradient_sync(micro == MICRO - 1)
            before = counted.gathered
            with counted:
                model(x[micro].to(device)).pow(2).mean().backward()
            per_micro.append(counted.gathered - before)
        optimizer.step()
        optimizer.zero_grad()
    # a DTensor's numel is the whole parameter's: the bytes of the whole frozen base
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    return [b / frozen for b in per_micro], counted.reductions


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

    for train_norms, what in ((False, "frozen bf16 base"), (True, "bf16 norms trained too")):
        outcome = first_forward(device, train_norms)
        if rank == 0:
            print(f"fp32 adapters, {what}: {outcome}")
    for reshard in (True, False):
        per_micro, reductions = accumulation(device, reshard)
        if rank == 0:
            print(
                f"reshard_after_forward={reshard}: all-gathered per micro-batch, in frozen-base sizes: "
                f"{' '.join(f'{x:.2f}' for x in per_micro)}; reduce-scatters per step: {reductions}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
