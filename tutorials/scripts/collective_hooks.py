"""Your own reduce-scatter for FSDP2: it sums the ranks' gradients instead of averaging them.

    torchrun --nproc-per-node=2 collective_hooks.py

``set_custom_reduce_scatter`` takes an object with two methods: ``allocate``, where FSDP gets
the collective's buffers, and ``__call__``, the collective. This one ignores the averaging FSDP
asks for (``ReduceOp.AVG``) and sums, so each gradient becomes the gradient of the sum of the
ranks' losses rather than their mean. Rank 0 checks every unit's gradient against one process's
gradient of that sum. Then the mistake a pool of buffers invites: ``allocate`` handing the same
output buffer out again. FSDP's gradient shards are views of that buffer, so every unit ends up
with the gradient of the last unit reduced, with no error. Needs torch alone; each rank computes
on its accelerator (GPU) where there is one, else on the CPU (over gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import (
    ReduceScatter,
)  # the protocol (private path)

WIDTH, LAYERS = 64, 4
# torch 2.13's name for the tensor reduce-scatter; reduce_scatter_tensor before it
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class SummingReduceScatter(ReduceScatter):
    """A reduce-scatter that sums, whatever FSDP asks; ``reuse`` makes the pool's mistake."""

    def __init__(self, reuse=False):
        self.reuse, self.pool, self.calls = reuse, {}, 0

    def allocate(self, size, *, dtype, device):
        if not self.reuse:
            return torch.empty(*size, dtype=dtype, device=device)  # a fresh buffer each call
        key = (tuple(size), dtype)  # the mistake: one buffer per size, handed out again
        if key not in self.pool:
            self.pool[key] = torch.empty(*size, dtype=dtype, device=device)
        return self.pool[key]

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        return reduce_scatter(
            output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op
        )


def make_model():
    torch.manual_seed(0)  # the same weights on every rank, and in the one process
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)))


def batch_of(rank, device):
    return torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(rank)).to(device)


def sharded_gradients(device, reuse):
    model = make_model()
    comm = SummingReduceScatter(reuse)
    for layer in model:
        fully_shard(layer)  # one unit per layer
        layer.set_custom_reduce_scatter(comm)  # per unit: it does not recurse
    fully_shard(model)  # the root: no parameters of its own
    model(batch_of(dist.get_rank(), device)).square().mean().backward()
    # each whole gradient, gathered from the ranks' shards
    return [p.grad.full_tensor() for p in model.parameters()], comm.calls


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

    # one process, on every rank's batch: the gradients of the sum of the ranks' losses
    alone = make_model().to(device)
    sum(alone(batch_of(r, device)).square().mean() for r in range(world_size)).backward()
    expected = [p.grad for p in alone.parameters()]

    for how, reuse in (("a fresh buffer each call", False), ("one buffer handed out again", True)):
        grads, calls = sharded_gradients(device, reuse)
        # which unit's expected gradient each unit's gradient is closest to
        closest = [
            min(range(LAYERS), key=lambda j: (g - expected[j]).abs().max().item()) for g in grads
        ]
        error = max((g - e).abs().max().item() for g, e in zip(grads, expected))
        if rank == 0:
            print(
                f"summing reduce-scatter on {world_size} ranks, {how}: {calls} calls; "
                f"unit i's gradient is the one-process sum's of unit {closest}, "
                f"max |gradient - one-process sum| = {error:.1e}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
