"""fsdp_guide.compare: a difference that is NaN is reported as NaN, wherever it is."""

from __future__ import annotations

import math

import pytest
import torch

from fsdp_guide import launch
from fsdp_guide.compare import largest_difference


@pytest.mark.parametrize("where", [0, 1, 2])
def test_a_nan_in_any_pair_makes_the_largest_difference_nan(where):
    pairs = [(torch.ones(3), torch.ones(3) + 0.25) for _ in range(3)]
    pairs[where][0][1] = float("nan")
    assert math.isnan(largest_difference(pairs))
    assert math.isnan(largest_difference(pairs, relative=True))
    # what the pages wrote before: Python's max keeps the NaN only when it comes first
    assert math.isnan(max((a - b).abs().max().item() for a, b in pairs)) == (where == 0)


def test_numbers_infinities_and_the_relative_form():
    assert largest_difference([(1.0, 1.5), (2.0, 2.0)]) == 0.5
    assert largest_difference([(torch.tensor([1.0, -3.0]), torch.tensor([1.0, 1.0]))]) == 4.0
    assert largest_difference([(torch.tensor([1.0, 4.0]), torch.tensor([2.0, 2.0]))], relative=True) == 1.0
    assert largest_difference([(torch.tensor([float("inf")]), torch.tensor([1.0]))]) == math.inf
    assert math.isnan(largest_difference([(torch.tensor([float("inf")]), torch.tensor([float("inf")]))]))
    assert largest_difference([(torch.ones(2, dtype=torch.bfloat16), torch.ones(2))]) == 0.0
    # against a reference of zeros: a match is 0, a difference infinite (never NaN, which would read as broken)
    assert largest_difference([(torch.zeros(3), torch.zeros(3))], relative=True) == 0.0
    assert largest_difference([(torch.ones(3), torch.zeros(3))], relative=True) == math.inf
    assert largest_difference([(torch.ones(0), torch.ones(0))], relative=True) == 0.0  # an empty parameter


def test_pairs_of_other_shapes_and_no_pairs_are_refused():
    with pytest.raises(ValueError, match=r"pair 1: shapes \(3,\) and \(1,\) differ"):
        largest_difference([(torch.ones(3), torch.ones(3)), (torch.ones(3), torch.ones(1))])
    with pytest.raises(ValueError, match="no pairs to compare"):
        largest_difference([])


def _sharded_with_a_nan_on_rank_1():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import fsdp_guide

    mesh = init_device_mesh(fsdp_guide.device().type, (2,))
    full = torch.arange(8, dtype=torch.float32, device=fsdp_guide.device())
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    same = largest_difference([(sharded, full)])
    if dist.get_rank() == 1:
        sharded.to_local()[0] = float("nan")
    return same, largest_difference([(sharded, full)])


def test_a_dtensor_is_compared_whole_so_a_nan_in_another_ranks_shard_shows_on_every_rank():
    for same, after in launch(_sharded_with_a_nan_on_rank_1, world_size=2, output="none"):
        assert same == 0.0 and math.isnan(after)
