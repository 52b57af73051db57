"""fsdp_guide.fp8: torchao float8 training under FSDP2 on 2 real gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fsdp_guide import launch
from fsdp_guide.fp8 import regression_batch, shard_in_precision, three_linears
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


def test_the_fp8_pages_model_and_batches_are_the_same_on_every_call():
    first, second = three_linears(), three_linears()
    assert [type(m).__name__ for m in first] == ["Linear", "ReLU", "Linear", "ReLU", "Linear"]
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters()))  # seeded
    x, y = regression_batch(3, 1, "cpu")
    assert x.shape == y.shape == (32, 128) and torch.equal(x, regression_batch(3, 1, "cpu")[0])
    assert not torch.equal(x, regression_batch(3, 0, "cpu")[0])  # each rank its own batch
    assert y.abs().max() < 1  # tanh of the fixed map


def test_shard_in_precision_names_the_precisions_it_takes():
    with pytest.raises(ValueError, match=r"precision='fp16': expected one of fp32, bf16, fp8, fp8\+bf16"):
        shard_in_precision("fp16")
