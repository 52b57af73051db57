"""fsdp_guide.describe_sharding for FSDP2, FSDP1 and plain modules, on 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from fsdp_guide import describe_sharding, launch
from fsdp_guide.describe import ParamShard


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 2))


def _describe(api):
    model = _model()
    if api == "fsdp2":
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
    else:
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=torch.device("cpu"))
    table = describe_sharding(model)
    return list(table), table.local_bytes, str(table), table._repr_html_()


def test_fsdp2_rows_are_dtensor_shards():
    (rows0, bytes0, text0, html0), (rows1, _, _, _) = launch(_describe, "fsdp2", world_size=2, output="none")
    assert rows0[0] == ParamShard("0.weight", (3, 5), (2, 5), "Shard(dim=0) over mesh 2", "[0:2, :]", 40, "float32")
    assert rows1[0] == ParamShard("0.weight", (3, 5), (1, 5), "Shard(dim=0) over mesh 2", "[2:3, :]", 20, "float32")
    assert [r.name for r in rows0] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert bytes0 == sum(r.local_bytes for r in rows0) == 4 * (10 + 2 + 3 + 1)
    assert text0.splitlines()[0].split() == [
        "name",
        "full",
        "shape",
        "local",
        "shape",
        "placement",
        "holds",
        "local",
        "bytes",
        "dtype",
    ]
    assert html0.startswith('<table class="fsdp-guide-table">') and "<td>0.weight</td>" in html0
    assert f"total local bytes: {bytes0}</td></tr></tfoot>" in html0


def test_fsdp1_rows_show_each_parameters_slice_of_the_flat_parameter():
    results = launch(_describe, "fsdp1", world_size=2, output="none")
    by_rank = [{r.name: r for r in rows} for rows, *_ in results]
    # unit 0 flattens weight (15) + bias (3) = 18 numbers: 9 per rank
    assert by_rank[0]["0.weight"].local_shape == (9,) and by_rank[0]["0.bias"].local_shape == (0,)
    assert by_rank[1]["0.weight"].local_shape == (6,) and by_rank[1]["0.bias"].local_shape == (3,)
    assert by_rank[0]["0.bias"].placement == "none on this rank"
    assert by_rank[1]["0.weight"].placement == "at [0:6] of this rank's flat shard"
    assert by_rank[1]["0.weight"].holds == "elements 9:15 (flattened)" and by_rank[0]["0.bias"].holds == "none"
    for name, full in (("0.weight", 15), ("0.bias", 3), ("2.weight", 6), ("2.bias", 2)):
        assert by_rank[0][name].local_shape[0] + by_rank[1][name].local_shape[0] == full


def test_a_plain_module_is_described_as_not_sharded():
    table = describe_sharding(_model())
    assert table[0] == ParamShard("0.weight", (3, 5), (3, 5), "not sharded", "all", 60, "float32")
    assert table.local_bytes == 4 * (15 + 3 + 6 + 2)


def _describe_2d():
    """Tensor parallel over tp (a column-wise and a row-wise Linear), then FSDP over dp, on a 2x2 mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    rows = {row.name: row for row in describe_sharding(model)}
    # the held slices, read back out of the full parameter, are this rank's shard
    held_is_local = {
        name: torch.equal(_take(p.full_tensor(), rows[name].holds), p.to_local())
        for name, p in model.named_parameters()
    }
    return dist.get_rank(), rows, held_is_local


def _take(full: torch.Tensor, holds: str) -> torch.Tensor:
    """full[holds] for a string like "[0:2+4:6, :]"."""
    for dim, ranges in enumerate(holds.strip("[]").split(", ")):
        if ranges != ":":
            index = [i for r in ranges.split("+") for i in range(*map(int, r.split(":")))]
            full = full.index_select(dim, torch.tensor(index))
    return full


def test_a_2d_mesh_shows_named_dims_the_strided_shard_and_the_rows_each_rank_holds():
    results = launch(_describe_2d, world_size=4, output="none")
    holds = {rank: {name: row.holds for name, row in rows.items()} for rank, rows, _ in results}
    _, rows, _ = results[0]
    # column-wise TP splits the weight's rows over tp; FSDP then splits each TP shard's rows over dp
    assert rows["0.weight"].placement == "_StridedShard(dim=0, sf=2) over dp=2, Shard(dim=0) over tp=2"
    assert rows["2.weight"].placement == "Shard(dim=0) over dp=2, Shard(dim=1) over tp=2"
    assert rows["2.bias"].placement == "Shard(dim=0) over dp=2, Replicate() over tp=2"
    # ranks are (dp, tp) = (0, 0), (0, 1), (1, 0), (1, 1): a TP group shares rows 0:4 of 8
    assert [holds[r]["0.weight"] for r in range(4)] == ["[0:2, :]", "[4:6, :]", "[2:4, :]", "[6:8, :]"]
    assert [holds[r]["2.weight"] for r in range(4)] == ["[0:3, 0:4]", "[0:3, 4:8]", "[3:6, 0:4]", "[3:6, 4:8]"]
    assert all(all(same.values()) for _, _, same in results)


def test_draw_sharding_puts_each_ranks_block_where_its_rows_are_and_names_every_rank_of_a_replica():
    from fsdp_guide.describe import ShardingTable, draw_sharding

    results = launch(_describe_2d, world_size=4, output="none")
    tables = [ShardingTable(rows.values()) for _, rows, _ in results]
    ax = draw_sharding(tables, "0.weight", label=lambda rank: f"rank {rank} (dp {rank // 2}, tp {rank % 2})")
    # (text, top row) of each block: the strided shard interleaves the dp ranks within each TP shard
    placed = sorted((patch.get_y(), text.get_text()) for patch, text in zip(ax.patches, ax.texts))
    assert [label for _, label in placed] == [
        "rank 0 (dp 0, tp 0)",
        "rank 2 (dp 1, tp 0)",
        "rank 1 (dp 0, tp 1)",
        "rank 3 (dp 1, tp 1)",
    ]
    assert [top for top, _ in placed] == [0, 2, 4, 6]
    assert sum(patch.get_width() * patch.get_height() for patch in ax.patches) == 8 * 4  # every element, once
    # the bias is replicated over tp: each block names both ranks of a TP group
    ax = draw_sharding(tables, "2.bias")
    assert sorted(text.get_text() for text in ax.texts) == ["rank 0, rank 1", "rank 2, rank 3"]
    assert ax.get_ylim() == (1, 0) and ax.get_xlim() == (0, 6)  # one row of 6


def test_draw_sharding_names_what_is_wrong_with_a_name_it_cannot_find_or_an_fsdp1_table():
    from fsdp_guide.describe import ShardingTable, draw_sharding

    tables = [ShardingTable(rows) for rows, *_ in launch(_describe, "fsdp2", world_size=2, output="none")]
    with pytest.raises(ValueError, match=r"rank 0's table has no parameter named 'weight'; it has: 0.weight, 0.bias"):
        draw_sharding(tables, "weight")
    tables = [ShardingTable(rows) for rows, *_ in launch(_describe, "fsdp1", world_size=2, output="none")]
    with pytest.raises(ValueError, match="part of FSDP1's flattened parameter, not blocks of the tensor"):
        draw_sharding(tables, "0.weight")
