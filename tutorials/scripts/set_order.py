"""Collectives in the order of a set, as a torchrun script: wrong sums with no error.

    torchrun --nproc-per-node=2 set_order.py

Python orders a set of strings by their hashes, and every interpreter hashes strings with a
random seed of its own (unless PYTHONHASHSEED is set). torchrun starts each rank as a new
interpreter, so two ranks iterating the same set of parameter names visit them in different
orders, and collectives issued in that order are paired by position: name against name. Here,
after one training step of a sharded model, each rank all-reduces the squared norm of its shard
of each parameter's gradient, one collective per name, to log each parameter's gradient norm:
once in the order of a set, once sorted. Every collective has the same size, so nothing errors
or hangs: the set's order just pairs the wrong norms. Rank 0 prints, for each order, whether
the ranks shared it and how many norms differ from those of the gathered gradients. Needs
torch alone; each rank computes on its accelerator (GPU) where there is one, else on the CPU
(over gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard


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

    torch.manual_seed(0)  # the same weights on every rank
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)]).to(device)  # 16 parameters
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    g = torch.Generator().manual_seed(rank)  # each rank its own batch
    model(torch.randn(4, 16, generator=g).to(device)).pow(2).mean().backward()

    grads = {name: p.grad for name, p in model.named_parameters()}  # DTensor shards
    # The right norms: each gradient gathered whole (an order every rank shares: named_parameters).
    right = {name: grad.full_tensor().pow(2).sum().item() for name, grad in grads.items()}

    for how, order in (("set", list(set(grads))), ("sorted", sorted(grads))):
        norms = {}
        for name in order:  # one all-reduce per name, in this rank's order
            squared = grads[name].to_local().pow(2).sum()  # this rank's shard's share
            dist.all_reduce(squared)  # paired with the other rank's collective at the same position
            norms[name] = squared.item()
        orders = [None] * dist.get_world_size()
        dist.all_gather_object(orders, order)
        # wrong unless within rounding (a NaN is wrong too)
        wrong = sum(not abs(norms[n] - right[n]) <= 1e-5 * (1 + right[n]) for n in grads)
        if rank == 0:
            print(
                f"{len(grads)} gradient norms in {how} order on {len(orders)} ranks: same order on "
                f"every rank {all(o == order for o in orders)}, wrong norms {wrong} of {len(grads)}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
