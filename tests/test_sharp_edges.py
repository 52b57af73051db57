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


def _reset_after_a_failed_backward():
    """failed_step's failed step, small: a hook refuses a non-finite gradient mid-backward; reset_iter_state()."""
    import torch.distributed.tensor as dt
    from torch.distributed.fsdp import fully_shard

    class Refuse(nn.Linear):
        def forward(self, x):
            if x.requires_grad:
                x.register_hook(self.check)
            return super().forward(x)

        @staticmethod
        def check(grad):
            if not torch.isfinite(grad).all():
                raise FloatingPointError("a non-finite gradient")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), Refuse(8, 8), nn.Linear(8, 8))
    for unit in model:
        fully_shard(unit)
    fully_shard(model)
    x = torch.randn(4, 8)
    x[:, 0] = float("inf")
    try:
        model(x).square().mean().backward()
    except FloatingPointError:
        if not hasattr(model, "reset_iter_state"):
            return None, None
        model.reset_iter_state()
    stale = 0
    for unit in model:  # the gradients the gathered parameters still hold
        unit.unshard()
        stale += sum(p.grad is not None for p in unit.parameters())
        unit.reshard()
    return all(isinstance(p, dt.DTensor) for p in model.parameters()), stale


def test_reset_iter_state_keeps_the_failed_steps_gathered_gradients_on_2_13_and_drops_them_from_2_15():
    # failed_step states it for 2.13 (its own output) and 2.15 (this test, on torch(newest)).
    # Seen: 2.9.1 has no reset_iter_state; 2.13.0 keeps 2 (the two units whose backward ran
    # gathered); 2.15.0 keeps none. Versions between were not run.
    sharded, stale = launch(_reset_after_a_failed_backward, world_size=2, output="none")[0]
    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if version < (2, 13):
        assert (sharded, stale) == (None, None)  # no reset_iter_state yet
    elif version < (2, 15):
        assert (sharded, stale) == (True, 2)
    else:
        assert (sharded, stale) == (True, 0)


def _shard_a_uint8_parameter():
    from torch.distributed.fsdp import fully_shard

    model = nn.Linear(8, 4)
    model.weight = nn.Parameter(torch.zeros(32, 1, dtype=torch.uint8), requires_grad=False)  # packed codes
    try:
        fully_shard(model)
    except RuntimeError as error:
        return str(error)
    local = model.weight.to_local()
    return (str(model.weight.dtype), tuple(local.shape), model.weight.requires_grad)


def test_fully_shard_refuses_a_uint8_parameter_on_2_9_and_shards_it_on_2_13_and_later():
    # qlora states it (4-bit codes stored as uint8): seen refused on 2.9.1, sharded on 2.13.0 and
    # 2.15.0 (pytorch#177844: FSDPParam made its nn.Parameter without requires_grad). Versions
    # between were not run.
    result = launch(_shard_a_uint8_parameter, world_size=2, output="none")[0]
    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if version < (2, 13):
        assert result == "only Tensors of floating point dtype can require gradients"
    else:
        assert result == ("torch.uint8", (16, 1), False)  # half the column, still frozen
