"""What FSDP2 sends in one training step, counted with torch's own tools, against the model's size.

    torchrun --nproc-per-node=2 communication.py

Four Linear layers, each its own FSDP2 unit. One training step runs under torch's
``CommDebugMode``, which counts the collectives, and its profiler, which records each
collective's tensor shapes. Rank 0 prints, for ``reshard_after_forward=True`` (FULL_SHARD) and
``False`` (SHARD_GRAD_OP), how many all-gathers and reduce-scatters ran and the size of the full
tensors they gathered and reduced, as multiples of the parameters' bytes P: FULL_SHARD gathers
every layer twice (forward and backward), 2 P, SHARD_GRAD_OP once, P; both reduce-scatter every
gradient once, P. What a rank sends on the wire is a fraction of these (a ring all-gather sends
(N - 1) / N of its output). Needs torch alone; each rank computes on its accelerator (GPU) where
there is one, else on the CPU (over gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.profiler import ProfilerActivity, profile

WIDTH, LAYERS = 256, 4
# the operators FSDP2's collectives run as, and the argument that is the full tensor:
# an all-gather's output, a reduce-scatter's input
FULL_TENSOR = {"c10d::_allgather_base_": 0, "c10d::_reduce_scatter_base_": 1}


def one_step(reshard_after_forward, device):
    torch.manual_seed(0)  # the same weights on every rank
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)))
    for layer in model:
        fully_shard(layer, reshard_after_forward=reshard_after_forward)  # one unit per layer
    # the root: no parameters of its own, so no collectives of its own
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(dist.get_rank())).to(device)

    def step():
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # the first step initialises FSDP's state: count the next ones, the same each time
    with CommDebugMode() as comm:  # counts the collectives by operator
        step()
    counts = comm.get_comm_counts()  # by operator
    counted = counts[torch.ops.c10d._allgather_base_], counts[torch.ops.c10d._reduce_scatter_base_]
    # the profiler records each operator with its arguments' shapes (a step of its own: under
    # CommDebugMode it would record each collective twice, once through the mode)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    calls, elements = dict.fromkeys(FULL_TENSOR, 0), dict.fromkeys(FULL_TENSOR, 0)
    for e in prof.events():
        if e.name in FULL_TENSOR:
            calls[e.name] += 1
            elements[e.name] += torch.Size(e.input_shapes[FULL_TENSOR[e.name]]).numel()
    element_size = next(model.parameters()).element_size()  # float32: no mixed precision
    # a DTensor's numel is the whole parameter's
    param_bytes = sum(p.numel() for p in model.parameters()) * element_size
    full = [elements[op] * element_size / param_bytes for op in FULL_TENSOR]
    return counted, list(calls.values()), full


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

    for strategy, reshard in (("FULL_SHARD", True), ("SHARD_GRAD_OP", False)):
        counted, calls, (gathered, reduced) = one_step(reshard, device)
        if dist.get_rank() == 0:
            print(
                f"{strategy}, {LAYERS} units on {dist.get_world_size()} ranks, one step: "
                f"{calls[0]} all-gathers of {gathered:.2f} P in all, {calls[1]} reduce-scatters of "
                f"{reduced:.2f} P in all (P: the parameters' bytes); CommDebugMode counted {counted[0]} and {counted[1]}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
