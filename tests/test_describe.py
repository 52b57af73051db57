"""fsdp_guide.describe_sharding for FSDP2, FSDP1 and plain modules, on 2 gloo ranks."""

from __future__ import annotations

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
    assert rows0[0] == ParamShard("0.weight", (3, 5), (2, 5), "Shard(dim=0) over mesh 2", 40, "float32")
    assert rows1[0] == ParamShard("0.weight", (3, 5), (1, 5), "Shard(dim=0) over mesh 2", 20, "float32")
    assert [r.name for r in rows0] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert bytes0 == sum(r.local_bytes for r in rows0) == 4 * (10 + 2 + 3 + 1)
    assert text0.splitlines()[0].split() == ["name", "full", "shape", "local", "shape", "placement", "local", "bytes", "dtype"]
    assert html0.startswith("<table>") and "<td>0.weight</td>" in html0


def test_fsdp1_rows_show_each_parameters_slice_of_the_flat_parameter():
    results = launch(_describe, "fsdp1", world_size=2, output="none")
    by_rank = [{r.name: r for r in rows} for rows, *_ in results]
    # unit 0 flattens weight (15) + bias (3) = 18 numbers: 9 per rank
    assert by_rank[0]["0.weight"].local_shape == (9,) and by_rank[0]["0.bias"].local_shape == (0,)
    assert by_rank[1]["0.weight"].local_shape == (6,) and by_rank[1]["0.bias"].local_shape == (3,)
    assert by_rank[0]["0.bias"].placement == "none on this rank"
    assert by_rank[1]["0.weight"].placement == "elements [9:15] of the parameter, at [0:6] of this rank's flat shard"
    for name, full in (("0.weight", 15), ("0.bias", 3), ("2.weight", 6), ("2.bias", 2)):
        assert by_rank[0][name].local_shape[0] + by_rank[1][name].local_shape[0] == full


def test_a_plain_module_is_described_as_not_sharded():
    table = describe_sharding(_model())
    assert table[0] == ParamShard("0.weight", (3, 5), (3, 5), "not sharded", 60, "float32")
    assert table.local_bytes == 4 * (15 + 3 + 6 + 2)
