"""fsdp_guide.muon.ShardedMuon on gloo ranks: torch's Muon, each matrix orthogonalised whole at one rank.

Against torch.optim.Muon on one process given the same whole gradients: the same weights, bit for bit,
with matrices whose rows do not divide among the ranks (a rank holding none); two all-to-alls a step
whatever the number of matrices; its state a DTensor that DCP saves; bad placements refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fsdp_guide import launch

SHAPES = [(7, 5), (3, 4), (16, 8), (5, 9)]  # on 4 ranks: 7 rows as 2,2,2,1; 3 rows as 1,1,1,0


def _steps_against_one_process(steps: int):
    """Each step: the sharded model's gradients (each rank its own batch), given whole to a
    one-process copy; both optimizers step. What differs, and the collectives of the last step."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from fsdp_guide.collectives import count_collectives
    from fsdp_guide.muon import ShardedMuon

    class Matrices(nn.Module):  # a forward that uses each matrix: FSDP2 gathers them for it
        def __init__(self):
            super().__init__()
            self.weights = nn.ParameterList([nn.Parameter(torch.randn(shape)) for shape in SHAPES])

        def forward(self, noises):
            return sum((w * n).sin().sum() for w, n in zip(self.weights, noises))

    torch.manual_seed(0)
    sharded = Matrices()
    alone = nn.ParameterList([nn.Parameter(p.detach().clone()) for p in sharded.parameters()])
    fully_shard(sharded)
    mine = ShardedMuon(sharded.parameters(), lr=0.05, weight_decay=0.1)
    theirs = torch.optim.Muon(alone.parameters(), lr=0.05, weight_decay=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    equal = []
    for _ in range(steps):
        sharded([torch.randn(shape, generator=g) for shape in SHAPES]).backward()
        for p, q in zip(sharded.parameters(), alone.parameters()):
            q.grad = p.grad.full_tensor()  # the gradient averaged over the ranks, whole
        with count_collectives() as seen:
            mine.step()
        theirs.step()
        mine.zero_grad(), theirs.zero_grad()
        equal.append(all(torch.equal(p.full_tensor(), q) for p, q in zip(sharded.parameters(), alone.parameters())))
    return equal, seen.rows()


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_same_weights_as_torch_muon_on_one_process_bit_for_bit_with_two_all_to_alls(world_size):
    for equal, collectives in launch(_steps_against_one_process, 3, world_size=world_size, output="none"):
        assert equal == [True, True, True]  # every step, every matrix, every rank
        assert [(kind, count) for _, kind, count, _ in collectives] == [("all-to-all", 2)], collectives


def _moved_from_the_start():
    """The weights after a step differ from the initial ones (the comparison above is not of two idle models)."""
    from torch.distributed.fsdp import fully_shard

    from fsdp_guide.muon import ShardedMuon

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(i, o, bias=False) for o, i in SHAPES[:1] + [(5, 7), (9, 5)]))
    start = [p.detach().clone() for p in model.parameters()]
    fully_shard(model)
    optimizer = ShardedMuon(model.parameters(), lr=0.05)
    model(torch.randn(4, 5)).square().mean().backward()
    optimizer.step()
    return [float((p.detach().full_tensor() - s).abs().max()) for p, s in zip(model.parameters(), start)]


def test_a_step_moves_every_matrix():
    for moved in launch(_moved_from_the_start, world_size=2, output="none"):
        assert all(m > 1e-3 for m in moved), moved  # NaN fails this too


def _state_through_dcp():
    """The momentum buffers as DCP's optimizer state dict holds them, and loaded into a fresh optimizer."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    from fsdp_guide.muon import ShardedMuon

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10, bias=False), nn.Linear(10, 3, bias=False))
    fully_shard(model)
    optimizer = ShardedMuon(model.parameters(), lr=0.05)
    model(torch.randn(4, 6)).square().mean().backward()
    optimizer.step()
    state = get_optimizer_state_dict(model, optimizer)
    buffers = {name: s["momentum_buffer"] for name, s in state["state"].items()}
    kinds = {name: (type(b).__name__, b.placements == model[0].weight.placements) for name, b in buffers.items()}
    saved = {name: b.full_tensor().clone() for name, b in buffers.items()}
    fresh = ShardedMuon(model.parameters(), lr=0.05)
    set_optimizer_state_dict(model, fresh, state)
    restored = {
        name: torch.equal(fresh.state[p]["momentum_buffer"].full_tensor(), saved[name])
        for name, p in model.named_parameters()
    }
    return kinds, restored, all(float(b.abs().max()) > 0 for b in saved.values())


def test_the_momentum_is_a_dtensor_sharded_like_its_parameter_that_dcp_saves_and_loads():
    kinds, restored, nonzero = launch(_state_through_dcp, world_size=2, output="none")[0]
    assert kinds == {"0.weight": ("DTensor", True), "1.weight": ("DTensor", True)}, kinds
    assert restored == {"0.weight": True, "1.weight": True} and nonzero, restored


def _refused_placement():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fsdp_guide.muon import ShardedMuon

    mesh = init_device_mesh("cpu", (2,))
    weight = nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh, [Shard(1)]))
    try:
        ShardedMuon([weight])
    except ValueError as error:
        return str(error)
    return "accepted"


def test_parameters_sharded_otherwise_than_fully_shard_does_are_refused_with_what_would_work():
    message = launch(_refused_placement, world_size=2, output="none")[0]
    assert "placements (Shard(dim=1),)" in message and "fully_shard" in message and "torch.optim.Muon" in message
