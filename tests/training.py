"""The small training loop the tests compare between sharded ranks and one process."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def my_slice(t: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a global batch."""
    return t.chunk(dist.get_world_size())[dist.get_rank()]


def train(model, optimizer, batches, *, sharded: bool) -> list[float]:
    """MSE training; sharded: each rank on its slice, the loss averaged over ranks."""
    losses = []
    for x, y in batches:
        if sharded:
            x, y = my_slice(x), my_slice(y)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if sharded:
            loss = loss.detach().clone()
            dist.all_reduce(loss)  # gloo has no AVG
            loss /= dist.get_world_size()
        losses.append(loss.item())
    return losses
