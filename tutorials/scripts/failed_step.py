"""Recovering from a failed step as a torchrun script: reset_iter_state() and the failed step's gradients.

    torchrun --nproc-per-node=2 failed_step.py

A training loop that catches an exception raised in the middle of backward (here a hook that
refuses a non-finite gradient; on a GPU it could be an out-of-memory error) and goes on with the
next batch. FSDP2 is then left in the middle of the step, some units still gathered. The root's
``reset_iter_state()`` (torch 2.13 or later) reshards them; on torch 2.13 the gathered parameters
still hold the gradients the failed backward wrote, so each unit is gathered once more to drop
them. Rank 0 prints the steps caught, whether every parameter is sharded again, and the largest
difference from one process that skips the same batch. Needs torch alone; each rank computes on
its accelerator (GPU) where there is one, else on the CPU (over gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.distributed.tensor as dt
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, fully_shard

WIDTH, BATCH, STEPS = 32, 8, 4


class Refuse(nn.Linear):
    """A linear layer that raises in backward when the gradient reaching its input is not finite."""

    def forward(self, x):
        if x.requires_grad:
            x.register_hook(self.check)
        return super().forward(x)

    @staticmethod
    def check(grad):
        if not torch.isfinite(grad).all():
            raise FloatingPointError("a non-finite gradient")


def make_model():
    torch.manual_seed(0)  # the same model on every rank and in the one-process run
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), Refuse(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))


def drop_stale_gradients(model):
    """Gather each unit, drop the gradients its gathered parameters still hold, and free it again."""
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.unshard()
            unit.zero_grad(set_to_none=True)
            unit.reshard()


def train(model, batches, device, sharded):
    optimizer, caught = torch.optim.SGD(model.parameters(), lr=0.1), []
    for step, batch in enumerate(batches):
        try:
            model(batch.to(device)).square().mean().backward()
            optimizer.step()
        except FloatingPointError:  # every rank raises it: each rank's part holds an inf
            caught.append(step)
            if sharded:
                model.reset_iter_state()  # reshard every unit, clear the step's state
                drop_stale_gradients(model)  # what reset_iter_state leaves on torch 2.13
        optimizer.zero_grad()
    return caught


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

    generator = torch.Generator().manual_seed(0)
    batches = [torch.randn(BATCH, WIDTH, generator=generator) for _ in range(STEPS)]
    batches[1][:, 0] = float("inf")  # the second batch: an inf in every rank's part

    model = make_model().to(device)
    for unit in model:
        fully_shard(unit)
    fully_shard(model)
    caught = train(
        model, [batch.chunk(world_size)[rank] for batch in batches], device, sharded=True
    )
    sharded = all(isinstance(p, dt.DTensor) for p in model.parameters())
    weights = [p.full_tensor() for p in model.parameters()]  # collective: every rank

    if rank == 0:
        print(
            f"caught a non-finite gradient in steps {caught}; then every parameter sharded: {sharded}"
        )
        one = make_model().to(device)  # one process, the whole batches, the same batch refused
        one_caught = train(one, batches, device, sharded=False)
        difference = max((w - p).abs().max().item() for w, p in zip(weights, one.parameters()))
        ok = all(w.isfinite().all() for w in weights)  # a NaN would hide in max()
        print(
            f"FSDP2 on {world_size} ranks vs 1 process (which caught steps {one_caught}), {STEPS} steps: "
            f"max |weight difference| = {difference if ok else float('nan'):.1e}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
