"""fsdp_guide.fp8: torchao float8 training under FSDP2 on 2 real gloo ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fsdp_guide import launch
from fsdp_guide.memory import measure
from fsdp_guide.precision import record_dtypes


def _train_float8():
    from fsdp_guide.fp8 import float8_fully_shard, quiet_torchao

    quiet_torchao()
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    torch.manual_seed(0)
    model = float8_fully_shard(nn.Sequential(nn.Linear(64, 64, bias=False), nn.ReLU(), nn.Linear(64, 10)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(32, 64, generator=g), torch.randn(32, 10, generator=g)
    losses, amax_all_reduces = [], []
    for _ in range(8):
        with record_dtypes() as seen:
            loss = F.mse_loss(model(x), y)
            loss.backward()
        optimizer.step()
        precompute_float8_dynamic_scale_for_fsdp(model)  # the first step ran without precomputed scales
        optimizer.zero_grad()
        losses.append(loss.item())
        amax_all_reduces.append(seen.count.get(("forward", "all-reduce"), 0))
    return dict(
        kinds=[type(m).__name__ for m in model],
        losses=losses,
        gathered=(seen.get("forward", "all-gather"), seen.nbytes[("forward", "all-gather")]),
        operands=seen.get("forward", "matmul"),
        amax_all_reduces=amax_all_reduces,
        params=measure(model).params,
    )


def test_float8_fully_shard_trains_and_gathers_one_byte_per_weight_element():
    result = launch(_train_float8, output="none")[0]
    # 64x64 converts and is a unit; 64->10 is not a multiple of 16: a high-precision Linear in the root unit
    assert result["kinds"] == ["FSDPFloat8Linear", "ReLU", "Linear"]
    assert result["losses"][-1] < 0.9 * result["losses"][0]
    dtypes, gathered = result["gathered"]
    # gloo: float8 bytes as uint8; the root gathers the 64->10 layer's 650 elements in float32
    assert dtypes == "float32/uint8" and gathered == 64 * 64 * 1 + 650 * 4
    assert "float8_e4m3fn" in result["operands"]
    # step 0: one amax all-reduce for the float8 weight; then none, the scales were precomputed
    assert result["amax_all_reduces"] == [1] + [0] * 7
    assert result["params"] == (64 * 64 + 650) * 4 // 2  # float32 shards: the master weights, once
