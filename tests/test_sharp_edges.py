"""torch behaviours the pages state for the whole supported range, checked on each torch `.ci/run` covers."""

from __future__ import annotations

import torch
import torch.nn as nn

from fsdp_guide import launch


def _steps_after_a_forward(reshard_first):
    import torch.distributed.tensor as dt
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    before = model.weight.detach().clone()
    fully_shard(model)  # the root holds the parameters
    x = torch.randn(4, 8)
    with torch.no_grad():
        model(x)
    if reshard_first:
        model.reshard()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(2):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    held = {type(p) for group in optimizer.param_groups for p in group["params"]}
    return held == {dt.DTensor}, torch.equal(model.weight.full_tensor(), before)


def test_an_optimizer_built_after_a_forward_holds_the_gathered_root_and_steps_nothing():
    # pytorch/pytorch#149205, stated on the pitfalls page for torch 2.9.1 to newest
    shards, unchanged = launch(_steps_after_a_forward, False, world_size=2, output="none")[0]
    assert not shards and unchanged
    shards, unchanged = launch(_steps_after_a_forward, True, world_size=2, output="none")[0]
    assert shards and not unchanged  # reshard() first: the optimizer holds the shards and trains
