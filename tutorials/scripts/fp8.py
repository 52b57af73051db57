"""FP8 training as a torchrun script: torchao's float8 Linears, sharded with FSDP2, follow float32.

    torchrun --nproc-per-node=2 fp8.py

torchao's ``convert_to_float8_training`` swaps each ``nn.Linear`` for a ``Float8Linear`` with float8
all-gather on, *before* ``fully_shard``: FSDP2 keeps float32 shards (the master weights), gathers
them in float8, and each matmul runs in float8 with dynamic scales. After every optimizer step,
``precompute_float8_dynamic_scale_for_fsdp`` computes every weight's scale with one all-reduce.
Rank 0 prints the Linears' type and that of the weights they compute with (torchao's float8 tensor
where FSDP2 gathered them in float8), then trains the same model in float32, alone, and prints the
largest relative difference between the losses of the two runs. Needs torch and torchao; each
rank computes on its accelerator (GPU) where there is one, else on the CPU (over gloo). Float8
matmuls need a GPU of compute capability 8.9 or newer, or the CPU (where torch runs them). On a
CPU-only torch, torchao logs that its CUDA kernels failed to load.
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torchao.float8 import (
    Float8LinearConfig,
    convert_to_float8_training,
    precompute_float8_dynamic_scale_for_fsdp,
)
from torchao.float8.float8_linear import Float8Linear

WIDTH, GLOBAL_BATCH, STEPS, LR = 128, 64, 12, 1e-2


def make_model():
    torch.manual_seed(0)  # the same weights on every rank
    linears = [nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(3)]  # sizes: multiples of 16
    return nn.Sequential(linears[0], nn.ReLU(), linears[1], nn.ReLU(), linears[2])


def batch(step):
    """The global batch of a step, the same on every rank: the page's, two blocks of 32 rows."""
    blocks = [torch.Generator().manual_seed(1000 * step + block) for block in range(2)]
    x = torch.cat([torch.randn(GLOBAL_BATCH // 2, WIDTH, generator=g) for g in blocks])
    target = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(7)) / WIDTH**0.5
    return x, torch.tanh(x @ target)


class BytesAllGather:
    """gloo all-gathers no float8 tensor: gather the same bytes as uint8 (set_custom_all_gather)."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        # all_gather_single where torch has it (all_gather_into_tensor, its old name, is deprecated)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        as_bytes = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
        return gather(*as_bytes, group=group, async_op=async_op)


def train(model, device, rows=slice(None)):
    """AdamW on the rows ``rows`` of each global batch; the loss of each step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)  # on the float32 shards
    losses = []
    for step in range(STEPS):
        x, y = (t.to(device)[rows] for t in batch(step))
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        if isinstance(model[0], Float8Linear):
            # every weight's scale from its new amax, all at once: no all-reduce per all-gather
            precompute_float8_dynamic_scale_for_fsdp(model)
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


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

    model = make_model().to(device)
    # Convert first: once sharded, the weights are DTensors and the swap fails.
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    model = convert_to_float8_training(model, config=config)
    seen = set()  # the type of the weights the Linears compute with, as FSDP2 gathered them
    for linear in model[::2]:
        linear.register_forward_pre_hook(lambda m, args: seen.add(type(m.weight).__name__))
    for unit in [*model[::2], model]:  # each Linear a unit, then the root
        fully_shard(unit)
        if backend == "gloo":
            unit.set_custom_all_gather(BytesAllGather())
    per_rank = GLOBAL_BATCH // world_size
    losses = train(model, device, rows=slice(rank * per_rank, (rank + 1) * per_rank))
    dist.all_reduce(losses)  # the mean over the ranks is the loss of the whole batch
    losses /= world_size

    if rank == 0:
        float8 = sum(isinstance(m, Float8Linear) for m in model[::2])
        print(
            f"{float8} of 3 Linears are Float8Linear, computing with gathered {', '.join(sorted(seen))}"
        )
        alone = train(make_model().to(device), device)  # float32, one process, the whole batch
        relative = ((losses - alone).abs() / alone.abs()).max().item()
        print(
            f"float8 FSDP2 on {world_size} ranks vs float32 in 1 process, {STEPS} steps: "
            f"max relative loss difference = {relative:.2e}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
