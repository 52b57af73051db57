"""fsdp_guide.muon.ShardedMuon on gloo ranks: torch's Muon, each matrix orthogonalised whole at one rank.

Against torch.optim.Muon on one process given the same whole gradients: the same weights, bit for bit,
with matrices whose rows do not divide among the ranks (a rank holding none), ranks owning no matrix,
a matrix without a gradient, a plain parameter group and torch's other options; two all-to-alls a
step whatever the number of matrices; its state a DTensor that DCP saves and loads into a fresh
optimizer; bad placements refused, also in a group added later."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fsdp_guide import launch

SHAPES = [(7, 5), (3, 4), (16, 8), (5, 9)]  # on 4 ranks: 7 rows as 2,2,2,1; 3 rows as 1,1,1,0


def _steps_against_one_process(steps: int, shapes, unused=(), plain=False, **muon):
    """Each step: the sharded matrices' gradients (each rank its own noise), given whole to a
    one-process copy; both optimizers step (with ``muon``'s arguments). Whether the weights are
    equal after each step, and the collectives of the last step. ``unused``: matrices the
    forward never uses (no gradient on any rank); ``plain``: a second parameter group holding a
    parameter that is not sharded (its gradient averaged by hand) at half the learning rate."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from fsdp_guide.collectives import count_collectives
    from fsdp_guide.muon import ShardedMuon

    class Matrices(nn.Module):  # a forward that uses the matrices: FSDP2 gathers them for it
        def __init__(self):
            super().__init__()
            self.weights = nn.ParameterList([nn.Parameter(torch.randn(shape)) for shape in shapes])

        def forward(self, noises):
            used = [i for i in range(len(shapes)) if i not in unused]
            return sum((self.weights[i] * noises[i]).sin().sum() for i in used)

    torch.manual_seed(0)
    sharded, extra = Matrices(), nn.Parameter(torch.randn(6, 3))
    alone = nn.ParameterList([nn.Parameter(p.detach().clone()) for p in [*sharded.parameters(), extra]])
    fully_shard(sharded)
    groups = [list(sharded.parameters())] + ([[extra]] if plain else [])
    their_groups = [list(alone)[: len(shapes)]] + ([[alone[-1]]] if plain else [])
    half = float(torch.as_tensor(muon.get("lr", 1e-3))) / 2
    # the first group as a generator (model.parameters()), as optimizers are often given it
    mine = ShardedMuon(
        [{"params": iter(g)} for g in groups[:1]] + [{"params": g, "lr": half} for g in groups[1:]], **muon
    )
    theirs = torch.optim.Muon(
        [{"params": g} for g in their_groups[:1]] + [{"params": g, "lr": half} for g in their_groups[1:]], **muon
    )
    g = torch.Generator().manual_seed(dist.get_rank())
    equal = []
    for _ in range(steps):
        noises = [torch.randn(shape, generator=g) for shape in shapes]
        (sharded(noises) + (extra * torch.randn(6, 3, generator=g)).sin().sum()).backward()
        dist.all_reduce(extra.grad)
        extra.grad /= dist.get_world_size()  # by hand: the extra parameter is no FSDP2 parameter
        for p, q in zip([*sharded.parameters(), extra], alone):
            q.grad = None if p.grad is None else getattr(p.grad, "full_tensor", p.grad.clone)()
        with count_collectives() as seen:
            mine.step()
        theirs.step()
        mine.zero_grad(), theirs.zero_grad()
        now = [
            torch.equal(getattr(p, "full_tensor", p.detach)(), q) for p, q in zip([*sharded.parameters(), extra], alone)
        ]
        equal.append(all(now))  # every comparison made (each full_tensor a collective) before all()
    return equal, seen.rows()


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_same_weights_as_torch_muon_on_one_process_bit_for_bit_with_two_all_to_alls(world_size):
    runs = launch(_steps_against_one_process, 3, SHAPES, lr=0.05, world_size=world_size, output="none")
    for equal, collectives in runs:
        assert equal == [True, True, True]  # every step, every matrix, every rank
        assert [(kind, count) for _, kind, count, _ in collectives] == [("all-to-all", 2)], collectives


def test_ranks_owning_no_matrix_unused_matrices_a_plain_group_and_torchs_other_options_bit_for_bit():
    # 2 used matrices on 4 ranks: two ranks own none; one matrix never gets a gradient; without
    # nesterov, with weight decay and the "match_rms_adamw" rule, the learning rate a tensor
    options = dict(lr=torch.tensor([0.05]), weight_decay=0.2, nesterov=False, adjust_lr_fn="match_rms_adamw")
    shapes = [(9, 4), (2, 6), (5, 5)]
    runs = launch(_steps_against_one_process, 3, shapes, (1,), True, **options, world_size=4, output="none")
    for equal, collectives in runs:
        assert equal == [True, True, True]
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
    model.zero_grad(
        set_to_none=True
    )  # as after a restart: DCP steps the fresh optimizer once at lr 0 to make its state
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
    rows = nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)]))
    columns = nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh, [Shard(1)]))
    messages = []
    for build in (lambda: ShardedMuon([columns]), lambda: ShardedMuon([rows]).add_param_group({"params": [columns]})):
        try:
            build()
            messages.append("accepted")
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_parameters_sharded_otherwise_than_fully_shard_does_are_refused_with_what_would_work():
    for message in launch(_refused_placement, world_size=2, output="none")[0]:  # at once, and in a later group
        assert "placements (Shard(dim=1),)" in message and "fully_shard" in message and "torch.optim.Muon" in message
