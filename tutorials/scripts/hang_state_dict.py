"""A full state dict gathered on rank 0 only, as a torchrun script: the fix, then the hang, named.

    torchrun --nproc-per-node=2 hang_state_dict.py

Gathering a sharded model's full state dict is a collective (an all-gather per parameter), so
every rank must call `get_model_state_dict`; only the writing is rank 0's. The fix runs first:
every rank gathers, rank 0 saves the file, and the file is checked against the unsharded model
as one process holds it. Then the mistake, the gather on rank 0 only while rank 1 goes on to a
barrier: each rank waits for the other until the short collective `timeout` given to
`init_process_group`, and each prints the line of this script it waited on. On gloo (CPU) the
timeout raises on that line; with NCCL (GPUs), by torch's source (not run here), its watchdog
aborts the job at the timeout instead, with no line printed. Needs torch alone; each rank
computes on its accelerator (GPU) where there is one, else on the CPU (over gloo).
"""

import copy
import datetime
import os
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on the CPU


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
    # A short collective timeout: the hang below ends in seconds, not after 10 or 30 minutes.
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=10))
    rank = dist.get_rank()

    torch.manual_seed(0)  # the same weights on every rank
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)]).to(device)
    alone = copy.deepcopy(model).cpu()  # the whole model, as one process holds it
    for layer in model:
        fully_shard(layer)  # one unit per layer: each parameter a shard on every rank
    fully_shard(model)

    # The fix: every rank gathers; only rank 0 writes.
    full = get_model_state_dict(model, options=FULL)
    if rank == 0:
        torch.save(full, "model.pt")
    dist.barrier()  # the file exists before any rank reads it
    saved = torch.load("model.pt")
    difference = max((saved[k] - v).abs().max().item() for k, v in alone.state_dict().items())
    if rank == 0:
        print(
            f"full state dict gathered on every rank, written by rank 0: {len(saved)} tensors; "
            f"vs 1 process: max |difference| = {difference:.1e}"
        )

    # The hang: the gather on rank 0 only; rank 1 goes on to the barrier. Each waits for the
    # other until the collective timeout, then raises where it waits.
    try:
        if rank == 0:
            full = get_model_state_dict(model, options=FULL)  # all-gathers rank 1 never joins
        dist.barrier()
    except RuntimeError as error:
        # The line of this script each rank waited on: the last frame of this file in the error's
        # traceback.
        line = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == __file__][-1]
        # one write of the whole line: both ranks print here, and a line written in two parts
        # (its text, then its newline) can interleave with the other rank's in torchrun's output
        print(
            f"save timed out on rank {rank} ({type(error).__name__}), waiting at line "
            f"{line.lineno}: {line.line}\n",
            end="",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
