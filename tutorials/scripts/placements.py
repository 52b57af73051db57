"""Choosing how each parameter is sharded, as a torchrun script: shard_placement_fn, a tied weight, an ignored one.

    torchrun --nproc-per-node=2 placements.py

FSDP2 shards each parameter of a unit along dim 0, one unit owning each parameter. This model
changes all three: three experts stacked in one weight, [experts, out, in], are split along dim 1
(``shard_placement_fn``), where dim 0 would split them 2 and 1; the embedding and the output layer
share one weight, so both are left to one unit (the root); and a learned output scale is left
out of FSDP (``ignored_params``), so each rank all-reduces its gradient itself, and the gradients
are clipped in two groups (DTensors, plain tensors) because one norm over both is refused. Rank 0
prints what each rank holds of the experts' weight, whether the weights are still tied, and the
largest difference from the same training in one process. Needs torch alone; each rank computes
on its accelerator (GPU) where there is one, else on the CPU (over gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.distributed.tensor as dt
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

WIDTH, VOCAB, EXPERTS, BATCH, STEPS, MAX_NORM = 32, 41, 3, 8, 3, 0.5


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # the same model on every rank and in the one-process run
        self.emb, self.router = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, EXPERTS)
        self.experts = nn.Parameter(torch.randn(EXPERTS, WIDTH, WIDTH) / WIDTH**0.5)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied: one Parameter, two users
        self.scale = nn.Parameter(torch.ones(VOCAB))

    def forward(self, ids):
        x = self.emb(ids)
        gates = self.router(x).softmax(-1)  # every expert on every token, mixed by the router
        x = x + torch.einsum("bte,eoi,bti->bto", gates, self.experts, x)
        return self.head(torch.tanh(x)) * self.scale


def clip(parameters, max_norm):
    """clip_grad_norm_ over DTensors and plain tensors: a norm per group, combined, one factor for all."""
    groups = [
        [p for p in parameters if isinstance(p, dt.DTensor) == kind] for kind in (True, False)
    ]
    norms = [torch.nn.utils.get_total_norm([p.grad for p in group]) for group in groups if group]
    norms = [n.full_tensor() if isinstance(n, dt.DTensor) else n for n in norms]
    total = torch.linalg.vector_norm(torch.stack(norms))
    for group in groups:
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)


def train(model, batches, device, sharded):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for ids in batches:
        ids = ids.to(device)
        logits = model(ids[:, :-1])
        nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
        if sharded:  # FSDP averages the gradients it shards; the ignored scale's is ours to average
            dist.all_reduce(model.scale.grad, op=dist.ReduceOp.AVG)
        clip(list(model.parameters()), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()


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
    batches = [torch.randint(0, VOCAB, (BATCH, 7), generator=generator) for _ in range(STEPS)]

    model = Model().to(device)  # ignored parameters are not moved by fully_shard: build on device
    # One unit, the root: it owns the tied weight (a unit each for emb and head is refused, or on
    # older torch unties them), splits the experts by rows, and leaves the scale alone.
    fully_shard(
        model,
        shard_placement_fn=lambda p: Shard(1) if p is model.experts else None,
        ignored_params={model.scale},
    )
    train(model, [ids.chunk(world_size)[rank] for ids in batches], device, sharded=True)
    held = [None] * world_size
    dist.all_gather_object(held, tuple(model.experts.to_local().shape))
    tied = model.head.weight is model.emb.weight
    weights = {
        name: p.full_tensor() if isinstance(p, dt.DTensor) else p.detach()  # collective: every rank
        for name, p in model.named_parameters()
    }

    if rank == 0:
        print(
            f"experts' weight {tuple(model.experts.shape)}, {model.experts.placements}: "
            f"the ranks hold {held}; scale a {type(model.scale).__name__}; still tied: {tied}"
        )
        one = Model().to(device)  # one process, the whole batches
        train(one, batches, device, sharded=False)
        difference = max((weights[n] - p).abs().max().item() for n, p in one.named_parameters())
        ok = all(w.isfinite().all() for w in weights.values())  # a NaN would hide in max()
        print(
            f"FSDP2 on {world_size} ranks vs 1 process, {STEPS} steps: "
            f"max |weight difference| = {difference if ok else float('nan'):.1e}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
