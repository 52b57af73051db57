"""The pipeline bubble as a torchrun script: GPipe on 2 stages, timed with 1 and 4 micro-batches.

    torchrun --nproc-per-node=2 pipeline_bubble.py

Each rank is one stage of a small model. A PipelineStage that notes when each of its forward and
backward chunks starts and ends runs a few steps of ScheduleGPipe; rank 0 prints, for 1 and for 4
micro-batches, the order each stage ran its chunks in and each stage's idle fraction of the steps
(the time outside its chunks: the bubble), beside the formula (p - 1) / (m + p - 1). Needs torch
alone; each rank computes on its accelerator (GPU) where there is one, else on the CPU (over gloo).
"""

import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

WIDTH, MICRO_BATCH, STEPS = 1024, 128, 3


class TimedStage(PipelineStage):
    """A PipelineStage that records (kind, micro-batch, start, end) per chunk."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.spans = []

    def _timed(self, kind, compute, chunk, *args, **kwargs):
        sync = torch.get_device_module(self.device).synchronize  # a no-op on the CPU
        sync()
        start = time.perf_counter()
        out = compute(chunk, *args, **kwargs)
        sync()  # on a GPU this also waits for posted sends: CUDA events would time compute alone
        self.spans.append((kind, chunk, start, time.perf_counter()))
        return out

    def forward_one_chunk(self, chunk, *args, **kwargs):
        return self._timed("F", super().forward_one_chunk, chunk, *args, **kwargs)

    def backward_one_chunk(self, chunk, *args, **kwargs):
        return self._timed("B", super().backward_one_chunk, chunk, *args, **kwargs)


def make_stage(index):
    """One of the 2 equal stages: enough compute per micro-batch that it, not messaging, dominates."""
    torch.manual_seed(index)
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(4)))


def timed(rank, stages, device, n_microbatches):
    """This rank's idle fraction over STEPS steps (after one that learns the shapes), and its chunks' order."""
    stage = TimedStage(make_stage(rank).to(device), rank, num_stages=stages, device=device)
    schedule = ScheduleGPipe(stage, n_microbatches=n_microbatches, loss_fn=F.mse_loss)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_microbatches * MICRO_BATCH, WIDTH, generator=g).to(device)
    y = torch.randn(n_microbatches * MICRO_BATCH, WIDTH, generator=g).to(device)
    busy = total = 0.0
    for step in range(1 + STEPS):
        stage.spans = []
        dist.barrier()  # both stages start the step together
        start = time.perf_counter()
        if rank == 0:
            schedule.step(x)  # the first stage takes the inputs
        else:
            schedule.step(target=y, losses=[])  # the last computes the loss
        seconds = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(
            seconds, op=dist.ReduceOp.MAX
        )  # the step lasts as long as its slowest stage
        if step:  # the first step also ran a forward and a backward to learn the shapes
            busy += sum(end - begin for _, _, begin, end in stage.spans)
            total += seconds.item()
    order = " ".join(
        f"{kind}{chunk}" for kind, chunk, *_ in sorted(stage.spans, key=lambda s: s[2])
    )
    return 1 - busy / total, order


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
    rank, stages = dist.get_rank(), dist.get_world_size()  # one stage per rank

    for m in (1, 4):
        idle, order = timed(rank, stages, device, m)
        found = [None] * stages
        dist.all_gather_object(found, (idle, order))  # every stage's, to rank 0's print
        if rank == 0:
            formula = (stages - 1) / (m + stages - 1)
            for index, (idle, order) in enumerate(found):
                print(
                    f"GPipe, {m} micro-batches, stage {index}: ran {order}; "
                    f"idle fraction {idle:.2f} (formula {formula:.2f})"
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
