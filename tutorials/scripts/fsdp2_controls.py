"""Prefetching and unsharding by hand as a torchrun script: forward prefetch, and no backward gather for an embedding.

    torchrun --nproc-per-node=2 fsdp2_controls.py

A model of five units (an embedding, three linear layers, an output layer). Each unit prefetches
the next one's parameters in forward (``set_modules_to_forward_prefetch``), so the next all-gather
is issued before the next forward begins, and the embedding is not gathered again for backward
(``set_unshard_in_backward(False)``): its weight's gradient needs the token ids, not the weight.
The profiler's ``FSDP::`` labels show both: rank 0 prints the order of issue in forward and the
all-gathers of one step with and without the embedding's backward gather, then the largest
difference from the same training in one process. Needs torch alone; each rank computes on its
accelerator (GPU) where there is one, else on the CPU (over gloo).
"""

import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.profiler import ProfilerActivity, profile

WIDTH, VOCAB, LAYERS, BATCH, STEPS = 32, 64, 3, 8, 5


def make_model():
    torch.manual_seed(0)  # the same model on every rank and in the one-process run
    return nn.Sequential(
        nn.Embedding(VOCAB, WIDTH),
        *[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)],
        nn.Linear(WIDTH, VOCAB),
    )


def loss_of(model, batch):
    logits = model(batch.reshape(-1)).view(*batch.shape, VOCAB)
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


def shard(model, gather_embedding_in_backward):
    for unit in model:
        fully_shard(unit)
    fully_shard(model)
    for unit, following in zip(model, model[1:]):
        unit.set_modules_to_forward_prefetch([following])  # issue the next unit's gather early
    model[0].set_unshard_in_backward(gather_embedding_in_backward)
    return model


def train(model, batches, device):
    """SGD on ``batches``; returns the FSDP labels of step 1 (step 0 initialises lazily) in order of issue."""
    optimizer, labels = torch.optim.SGD(model.parameters(), lr=0.1), []
    for step, batch in enumerate(batches):
        prof = profile(activities=[ProfilerActivity.CPU])
        with prof if step == 1 else contextlib.nullcontext():
            loss_of(model, batch.to(device)).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 1:
            labels = sorted(
                (
                    e.time_range.start,
                    e.name.replace("FSDP::pre_forward (", "F").replace("FSDP::all_gather (", "AG"),
                )
                for e in prof.events()
                if e.name.startswith(("FSDP::pre_forward (", "FSDP::all_gather ("))
                and not e.name.endswith("()")
            )
    return [name.rstrip(")") for _, name in labels]


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
    batches = [torch.randint(0, VOCAB, (BATCH, 6), generator=generator) for _ in range(STEPS)]
    mine = [batch.chunk(world_size)[rank] for batch in batches]  # each rank its part of each batch

    labels = {}
    for gather_embedding in (True, False):
        model = shard(make_model().to(device), gather_embedding)
        labels[gather_embedding] = train(model, mine, device)
    forward = labels[False][
        : labels[False].index(f"F{LAYERS + 1}") + 1
    ]  # up to the last unit's forward
    weights = [p.full_tensor() for p in model.parameters()]  # collective: every rank

    if rank == 0:
        print(
            f"forward, in order of issue (F: a unit's forward, AG: its all-gather): {' '.join(forward)}"
        )
        gathers = {how: sum(n.startswith("AG") for n in names) for how, names in labels.items()}
        print(
            f"all-gathers in one step: {gathers[True]} with the embedding gathered in backward, "
            f"{gathers[False]} with set_unshard_in_backward(False)"
        )
        one = make_model().to(device)  # one process, the whole batches
        train(one, batches, device)
        difference = max((w - p).abs().max().item() for w, p in zip(weights, one.parameters()))
        ok = all(w.isfinite().all() for w in weights)  # a NaN would hide in max()
        print(
            f"FSDP2 with prefetching on {world_size} ranks vs 1 process, {STEPS} steps: "
            f"max |weight difference| = {difference if ok else float('nan'):.1e}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
