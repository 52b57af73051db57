"""fsdp_guide.collectives.count_collectives on 4 gloo ranks: FSDP's and tensor parallelism's collectives, per mesh dimension."""

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
