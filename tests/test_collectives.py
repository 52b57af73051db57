"""fsdp_guide.collectives.count_collectives on gloo ranks.

FSDP's and tensor parallelism's collectives, per mesh dimension, with their bytes (and record_dtypes', from the same
table)."""

from __future__ import annotations

import torch
import torch.nn as nn

from fsdp_guide import launch


def _fsdp_x_tp_step(meshes: int):
    """One forward and backward of a column-wise then row-wise pair (TP over tp), sharded over dp."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from fsdp_guide.collectives import count_collectives

    for _ in range(meshes):  # DTensor may run a later, equal mesh's collectives on the first one's groups
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 8, bias=False))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"], reshard_after_forward=True)
        with count_collectives(mesh) as seen:
            model(torch.ones(3, 8, requires_grad=True)).sum().backward()  # an input gradient: TP reduces it
            dist.all_reduce(torch.ones(5))  # the world: no mesh dimension
    return seen.rows()


def test_fsdp_and_tensor_parallel_collectives_are_counted_per_mesh_dimension_with_their_bytes():
    for meshes in (1, 2):
        rows = launch(_fsdp_x_tp_step, meshes, world_size=4, output="none")[0]
        assert rows == [
            # FSDP over dp: one unit gathered for forward and again for backward (each rank's
            # TP halves of both weights, 2 x 64 floats), its gradients reduce-scattered once
            ("dp", "all-gather", 2, 2 * 2 * 64 * 4),
            ("dp", "reduce-scatter", 1, 2 * 64 * 4),
            ("other", "all-reduce", 1, 5 * 4),
            # TP over tp: the row-wise layer's partial sums in forward (3 x 8 floats), the
            # column-wise layer's input gradient in backward (3 x 8 floats)
            ("tp", "all-reduce", 2, 2 * 3 * 8 * 4),
        ], f"with {meshes} mesh(es)"


def _gathered_bytes(api: str):
    """The bytes one forward all-gathers, as record_dtypes and count_collectives each see them."""
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    from fsdp_guide.collectives import count_collectives
    from fsdp_guide.precision import record_dtypes

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))  # 808 parameters: one unit, 3232 bytes
    if api == "fsdp2":
        model = fully_shard(model)
    else:
        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)  # cpu-only: gloo
    with record_dtypes() as dtypes, count_collectives() as seen:
        model(torch.ones(2, 16))
    return dtypes.nbytes[("forward", "all-gather")], seen.nbytes[("other", "all-gather")]


def test_record_dtypes_and_count_collectives_count_the_whole_gathered_unit_for_fsdp1_and_fsdp2():
    for api in ("fsdp2", "fsdp1"):
        recorded, counted = launch(_gathered_bytes, api, world_size=2, output="none")[0]
        # FSDP1 on gloo gathers into a list of per-rank chunks: all of them count, not the first
        assert recorded == counted == 808 * 4, api


def _on_two_meshes():
    """An all-reduce over a 1-D mesh of all ranks, an all-to-all and a broadcast on a second, 2-D mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_guide.collectives import count_collectives

    dense = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    experts = init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp", "ep"))
    with count_collectives(dense, experts) as seen:
        dist.all_reduce(torch.ones(3), group=dense.get_group("dp"))
        dist.all_to_all_single(torch.empty(4), torch.ones(4), group=experts.get_group("ep"))
        dist.broadcast(torch.ones(2), group_src=0, group=experts.get_group("edp"))
    with count_collectives(experts) as only_experts:
        dist.all_reduce(torch.ones(3), group=dense.get_group("dp"))
    return seen.rows(), only_experts.rows()


def test_several_meshes_name_their_dimensions_and_a_group_of_none_is_other():
    rows, only_experts = launch(_on_two_meshes, world_size=4, output="none")[0]
    assert rows == [("dp", "all-reduce", 1, 3 * 4), ("edp", "broadcast", 1, 2 * 4), ("ep", "all-to-all", 1, 4 * 4)]
    assert only_experts == [("other", "all-reduce", 1, 3 * 4)]
