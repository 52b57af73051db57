"""Muon on parameters sharded by fully_shard, as a torchrun script: each matrix orthogonalised whole.

    torchrun --nproc-per-node=2 muon.py

Muon's momentum is elementwise, but its Newton-Schulz iteration needs the whole matrix, and
fully_shard gives each rank rows of it. GatheredMuon below gathers each matrix's update on every
rank (full_tensor(), one all-gather per matrix), runs torch's own iteration on it and keeps the
rank's rows: the simplest correct way (every rank computes every matrix; sending each matrix to
one rank instead, as fsdp_guide.muon.ShardedMuon does, computes each once). Every rank trains the
sharded model 5 steps with Muon on the hidden matrices and AdamW on the rest, and hands the averaged
gradients, whole, to an unsharded copy trained with torch.optim.Muon. Rank 0 prints whether the
weights are equal, for GatheredMuon and for torch's Muon given each rank's shards (the wrong way).
Needs torch 2.9 or later alone; each rank computes on its accelerator (GPU) where there is one,
else on the CPU (over gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

# torch's Newton-Schulz iteration and learning-rate rule (private in torch.optim._muon, 2.9 to 2.15),
# used as they are so that the result is what torch.optim.Muon computes.
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz


class GatheredMuon(torch.optim.Muon):
    """torch.optim.Muon for FSDP2's sharded matrices: each update orthogonalised whole, on every rank."""

    @torch.no_grad()
    def step(self, closure=None):  # DCP's loading steps a fresh optimizer, with closure=None
        loss = None
        if closure is not None:  # as torch's optimizers do: the closure recomputes the loss
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, buffers = [], [], []
            self._init_group(group, params, grads, buffers)  # torch's: the momentum buffers
            for p, grad, buffer in zip(params, grads, buffers):
                # Elementwise DTensor operations on equal placements: each rank's rows, no communication.
                buffer.lerp_(grad, 1 - group["momentum"])
                update = grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer
                iterate = (group["ns_coefficients"], group["ns_steps"], group["eps"])
                # The whole update on every rank (one all-gather), orthogonalised by torch's iteration.
                whole = _zeropower_via_newtonschulz(update.full_tensor(), *iterate)
                # This rank's rows of the result, sliced locally (src_data_rank=None: nothing sent).
                mine = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(mine, alpha=-_adjust_lr(group["lr"], group["adjust_lr_fn"], p.shape))
        return loss


def build(device):
    torch.manual_seed(0)  # the same weights on every rank
    sizes = [32, 64, 64, 48]
    layers = [m for a, b in zip(sizes, sizes[1:]) for m in (nn.Linear(a, b), nn.Tanh())]
    return nn.Sequential(*layers, nn.Linear(48, 8)).to(device)


def optimizers(model, muon):
    """Muon on the hidden matrices, AdamW on the rest (biases, the output layer)."""
    hidden = [model[i].weight for i in (0, 2, 4)]
    rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
    return muon(hidden), torch.optim.AdamW(rest, lr=1e-2)


class MuonOnEachShard:
    """The wrong way: torch's Muon over each rank's rows alone (its shards, as plain tensors)."""

    def __init__(self, hidden):
        with torch.no_grad():
            self.shards = [p.to_local() for p in hidden]  # views of the rows this rank holds
        self.hidden, self.muon = hidden, torch.optim.Muon(self.shards, lr=1e-2)

    def step(self):
        for shard, p in zip(self.shards, self.hidden):
            shard.grad = p.grad.to_local()  # the rows of the sharded gradient
        self.muon.step()

    def zero_grad(self):
        self.muon.zero_grad()
        for p in self.hidden:
            p.grad = None


def largest_difference(make_muon, device):
    """5 steps sharded and, on the same whole gradients, unsharded with torch.optim.Muon."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, copy = build(device), build(device)
    for layer in model[::2]:
        fully_shard(layer)
    fully_shard(model)
    sharded, whole = (
        optimizers(model, make_muon),
        optimizers(copy, lambda ps: torch.optim.Muon(ps, lr=1e-2)),
    )
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x, y = (
            torch.randn(16, 32, generator=g).to(device),
            torch.randn(16, 8, generator=g).to(device),
        )
        F.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        for p, q in zip(model.parameters(), copy.parameters()):
            q.grad = p.grad.full_tensor()  # the gradient averaged over the ranks, whole
        for optimizer in (*sharded, *whole):
            optimizer.step()
            optimizer.zero_grad()
    pairs = zip(model.parameters(), copy.parameters())
    # torch's max over every parameter's largest difference: a NaN anywhere is the result
    return float(
        torch.stack([(p.detach().full_tensor() - q.detach()).abs().max() for p, q in pairs]).max()
    )


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
    dist.init_process_group(
        dist.get_default_backend_for_device(device)
    )  # NCCL on GPUs, gloo on the CPU
    gathered = largest_difference(lambda ps: GatheredMuon(ps, lr=1e-2), device)
    local = largest_difference(MuonOnEachShard, device)
    if dist.get_rank() == 0:
        print(
            f"GatheredMuon: equal to torch.optim.Muon on the whole gradients: {gathered == 0} ({gathered:.1e})"
        )
        print(f"Muon on each shard: equal: {local == 0}, max |weight difference| = {local:.1e}")
    dist.destroy_process_group()  # after collectives on every rank (full_tensor): no rank still joining


if __name__ == "__main__":
    main()
