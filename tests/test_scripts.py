"""Each page's script, run as a reader runs it: `torchrun --nproc-per-node=N script.py`, torch alone, gloo ranks.

A page shows its idea as a plain torchrun script, ``tutorials/scripts/<page>.py``: the page includes
the file (highlighted, and as a download) and these tests run that same file, each checking that it
prints what its page says it does. torchrun's store listens on every interface, so each run is in a
network namespace of its own (``fsdp_guide.isolation.loopback_only``).
"""

from __future__ import annotations

import ast
import contextlib
import math
import os
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from conftest import NOTEBOOKS, ROOT, machine_share

from fsdp_guide.isolation import loopback_only

SCRIPTS = ROOT / "tutorials" / "scripts"


def _loss_difference(out: str) -> None:
    found = re.search(r"FSDP2 on 2 ranks vs 1 process, \d+ steps: max \|loss difference\| = (\S+)", out)
    assert found and float(found[1]) <= 1e-5, out  # NaN fails the comparison
    assert "rank 0 holds (32, 16) of layers.0.weight (64, 16)" in out


def _mixed_precision(out: str) -> None:
    dtypes = (
        "forward weights torch.bfloat16, output torch.bfloat16; sharded weights torch.float32, gradients torch.float32"
    )
    assert dtypes in out, out
    found = re.search(
        r"bfloat16 FSDP2 on 2 ranks vs float32 in 1 process, \d+ steps: max relative loss difference = (\S+)", out
    )
    assert found and float(found[1]) < 2e-2, out  # bfloat16 follows float32; NaN fails the comparison


def _float16_needs_the_scaler(out: str) -> None:
    runs = {
        name: (float(first), float(last), int(zeros), float(relative))
        for name, first, last, zeros, relative in re.findall(
            r"^(\w+, [\w ]+): loss (\S+) -> (\S+) in \d+ steps, zero gradients (\d+)%, "
            r"max relative difference from float32 = (\S+)$",
            out,
            re.M,
        )
    }
    first, last, zeros, _ = runs["float16, no scaler"]
    assert math.isfinite(first) and first == last and zeros == 100, out  # every gradient 0: no step moved
    for name in ("float16, GradScaler", "bfloat16, no scaler"):
        first, last, zeros, relative = runs[name]
        assert last < first and zeros == 0 and relative < 2e-2, out  # learns, as float32; NaN fails
    # only rank 0's shard held the inf, and both ranks skipped the step (the found-inf flag is reduced)
    assert "inf in rank 0's gradient shard only; own shards finite: rank 0: False, rank 1: True" in out, out
    assert "step skipped: rank 0: True, rank 1: True; scale 1 -> 0.5, 0.5" in out, out


def _full_params_init(out: str) -> None:
    assert "rank 0 holds (32, 16) of layers.0.weight, (64, 16) inside summon_full_params" in out, out
    found = re.search(r"custom init on 2 sharded ranks vs 1 process: max \|weight difference\| = (\S+)", out)
    assert found and float(found[1]) == 0, out  # bit for bit; NaN fails the comparison


def _weight_difference(out: str) -> None:
    found = re.search(
        r"meta \+ fully_shard \+ to_empty \+ init on 2 ranks vs 1 process: max \|weight difference\| = (\S+)", out
    )
    assert found and float(found[1]) == 0, out  # the same draws: exact; NaN fails the comparison


def _accumulated_loss_difference(out: str) -> None:
    found = re.search(
        r"FSDP2 on 2 ranks x 2 micro-batches vs 1 process, \d+ steps: max \|loss difference\| = (\S+)", out
    )
    assert found and float(found[1]) <= 1e-5, out  # NaN fails the comparison


def _no_sync_reduces_once(out: str) -> None:
    found = {
        m[1]: (int(m[2]), float(m[3]))
        for m in re.finditer(
            r"(sync every micro-batch|no sync until the last): (\d+) reduce-scatters per step of 4 "
            r"micro-batches on 2 ranks; max \|weight difference\| vs 1 process = (\S+)",
            out,
        )
    }
    assert found.keys() == {"sync every micro-batch", "no sync until the last"}, out
    # 3 units: one reduce-scatter each per micro-batch, or per step with the sync off until the last
    assert found["sync every micro-batch"][0] == 12 and found["no sync until the last"][0] == 3, out
    assert all(difference <= 1e-5 for _, difference in found.values()), out  # NaN fails the comparison


def _same_model_less_memory(out: str) -> None:
    found = re.search(r"max \|output difference\| = (\S+)", out)
    assert found and float(found[1]) <= 1e-6, out  # NaN fails the comparison
    found = re.search(
        r"16 blocks on 2 ranks, most parameter bytes a rank held while building: "
        r"wrap as you build (\S+) of the model, build then shard (\S+); after sharding (\S+)",
        out,
    )
    assert found, out
    wrapped, first, after = map(float, found.groups())
    assert wrapped < 0.6 and first >= 0.99 and after <= 0.51, out  # NaN fails every comparison


def _fsdp1_fsdp2_losses(out: str) -> None:
    found = re.search(r"FSDP2 vs FSDP1 on 2 ranks, \d+ steps: max \|loss difference\| = (\S+)", out)
    assert found and float(found[1]) <= 1e-6, out  # NaN fails the comparison


def _state_timeline(out: str) -> None:
    shard = "DTensor (Shard(dim=0),) local (32, 16)"
    timeline = (
        f"layers.0.weight (64, 16) on rank 0 of 2: between steps: {shard}; in forward: Parameter (64, 16); "
        f"grad after backward: {shard}; AdamW exp_avg: {shard}; after the step: {shard}, updated in place True"
    )
    assert timeline in out, out  # shapes, placements and types: none of it varies run to run


def _states_against_zero3(out: str) -> None:
    found = re.search(
        r"rank 0 of 2: holds \d+ bytes of model states; measured / ZeRO-3 estimate \(total / 2\): "
        r"params (\S+), grads (\S+), AdamW state (\S+)",
        out,
    )
    assert found and all(float(r) == 1 for r in found.groups()), out  # even shards: exact; NaN fails


def _digits_accuracy(out: str) -> None:
    found = re.search(
        r"FSDP2 on 2 ranks, \d+ epochs: test accuracy summed over ranks (\d+)/(\d+), "
        r"gathered model in 1 process (\d+)/(\d+)",
        out,
    )
    assert found, out
    right, total, alone, total_alone = map(int, found.groups())
    assert total == total_alone == 360 and right / total >= 0.97 and right == alone, out  # the page's 97%


def _engine_holds_trainer_weights(out: str) -> None:
    found = re.search(
        r"FSDP2 trainer on ranks 0-1 -> engine on rank 2, \d+ parameters: max \|weight difference\| = (\S+), "
        r"max \|output difference\| = (\S+); the step moved the weights by up to (\S+)",
        out,
    )
    assert found, out
    weights, outputs, moved = map(float, found.groups())
    assert weights == 0 and outputs == 0 and moved > 0, out  # fp32: exact, and a real update; NaN fails


def _config_applied(out: str) -> None:
    applied = (
        "'mixed_precision': 'DEFAULT', 'cpu_offload': False}: computes in torch.bfloat16, freed after forward: True"
    )
    assert applied in out, out
    found = re.search(
        r"fsdp_config on 2 ranks vs float32 in 1 process, \d+ steps: max relative loss difference = (\S+)", out
    )
    assert found and float(found[1]) < 2e-2, out  # bfloat16 follows float32; NaN fails the comparison


def _optimizer_after_sharding(out: str) -> None:
    found = re.search(r"optimizer built after fully_shard: (\d+) of its (\d+) parameters are DTensor shards", out)
    assert found and found[1] == found[2] != "0", out  # every parameter it steps is a shard
    found = re.search(
        r"FSDP2 on 2 ranks vs 1 process, \d+ steps, loss \S+ -> \S+: max \|loss difference\| = (\S+)", out
    )
    assert found and float(found[1]) <= 1e-5, out  # NaN fails the comparison


def _outside_forward_like_one_process(out: str) -> None:
    found = re.search(
        r"FSDP2 on 2 ranks vs 1 process, \d+ steps, rows renormed on to_local\(\): "
        r"largest row norm (\S+), max \|weight difference\| = (\S+)",
        out,
    )
    assert found and float(found[1]) <= 0.5 + 1e-6 and float(found[2]) <= 1e-5, out  # NaN fails the comparisons
    assert "registered generate: the same tokens as one process: True" in out, out
    # the assigned Parameter is lost at the next forward, the in-place copy into the shard kept
    assert "bias edit kept at the next forward: new Parameter False, copy_ into the shard True" in out, out


def _checkpoint_inside_like_one_process(out: str) -> None:
    found = re.search(r"all-gathers in one step: (\d+) without checkpointing, (\d+) checkpointed inside each unit", out)
    assert found and found[1] == found[2] != "0", out  # the recomputation inside the unit gathers nothing more
    found = re.search(
        r"checkpointed inside each unit, FSDP2 on 2 ranks vs 1 process, \d+ steps, loss (\S+) -> (\S+): "
        r"max \|loss difference\| = (\S+)",
        out,
    )
    assert found and float(found[2]) < float(found[1]) and float(found[3]) <= 1e-5, out  # it trained; NaN fails


def _lora_like_one_process(out: str) -> None:
    found = re.search(r"LoRA: [\d,]+ of [\d,]+ parameters trainable, every one a shard: (\w+)", out)
    assert found and found[1] == "True", out  # the adapters train as shards, reduced across ranks
    found = re.search(
        r"LoRA with FSDP2 on 2 ranks vs 1 process, \d+ steps, loss \S+ -> \S+: max relative loss difference = (\S+)",
        out,
    )
    assert found and float(found[1]) <= 1e-5, out  # the page's "fp32 rounding"; NaN fails the comparison


def _qlora_like_one_process(out: str) -> None:
    found = re.search(r"4-bit weights per rank: \[(\d+), (\d+)\] bytes, of (\d+) in one process", out)
    assert found and int(found[1]) == int(found[2]) == int(found[3]) / 2, out  # each rank holds half the bytes
    found = re.search(
        r"QLoRA with FSDP2 on 2 ranks vs 1 process, \d+ steps, loss (\S+) -> (\S+): "
        r"max relative loss difference = (\S+)",
        out,
    )
    # it trained, as one process does: fp32 rounding, which AdamW's normalised steps amplify (4e-5 at its
    # third step when written); NaN fails the comparison
    assert found and float(found[2]) < float(found[1]) and float(found[3]) <= 1e-4, out


def _adapters_whole_and_merged_dequantised(out: str) -> None:
    found = re.search(
        r"adapters saved from 2 ranks, loaded in one process: largest logit difference from the trained model = (\S+)",
        out,
    )
    assert found and float(found[1]) <= 1e-5, out  # every rank's slice saved: the trained model, fp32 rounding
    lost = dict(
        re.findall(
            r"merged into the (4-bit base|base dequantised to fp32): q_proj's error as a part of its update = (\S+)",
            out,
        )
    )
    assert lost.keys() == {"4-bit base", "base dequantised to fp32"}, out
    # re-quantising rounds a large part of the update away; into fp32, only rounding (NaN fails both)
    assert float(lost["4-bit base"]) > 0.05 and float(lost["base dequantised to fp32"]) < 1e-5, out


def _trainer_fell_back_to_ddp(out: str) -> None:
    # on CPU ranks the FSDP2 config is dropped, said before training; DDP trains, no FSDP unit
    found = re.search(r"accelerate's distributed type (\S+), is_fsdp_enabled=(\w+)", out)
    assert found and found.groups() == ("MULTI_CPU", "False"), out
    assert "WARNING: the fsdp_config was not applied" in out, out
    assert out.index("WARNING: the fsdp_config") < out.index("trained a DistributedDataParallel with 0 FSDP units"), out


def _sharded_as_accelerate_like_one_process(out: str) -> None:
    found = re.search(r"FSDP units: (\[.*\])", out)
    assert found and found[1] == str(
        ["FSDPEmbedding", "FSDPLinear", "FSDPLlamaDecoderLayer", "FSDPLlamaDecoderLayer", "FSDPLlamaForCausalLM",
         "FSDPLlamaRMSNorm"]
    ), out  # fmt: skip
    found = re.search(r"max relative loss difference = (\S+)", out)
    assert found and float(found[1]) <= 1e-5, out  # fp32 rounding; NaN fails


def _pitfalls_reproduced_and_fixed(out: str) -> None:
    assert "Linear4bit sharded, then moved: AssertionError (no message)" in out, out
    assert "Linear4bit quantised, then sharded: runs, output (1, 128)" in out, out
    assert re.search(r"bf16 codes, param_dtype=float32: RuntimeError: shape '\[\d+, \d+\]' is invalid", out), out
    found = re.search(r"bf16 codes, param_dtype=bfloat16: runs, loss (\S+)", out)
    assert found and math.isfinite(float(found[1])), out
    found = re.search(r"on the cpu: (\d+) of (\d+) code words are NaN patterns; gathered, the same bits: (\w+)", out)
    assert found and 0 < int(found[1]) < int(found[2]) / 100 and found[3] == "True", out


def _repack_off_evaluates_and_trains(out: str) -> None:
    cases = {
        repack: (float(a), float(b), int(got), int(of))
        for repack, a, b, got, of in re.findall(
            r"repack=(True|False): evaluations (\S+) then (\S+); (\d+) of (\d+) adapters got a gradient", out
        )
    }
    assert cases.keys() == {"True", "False"}, out
    off = cases["False"]
    assert off[0] == off[1] and off[2] == off[3] > 0, out  # switched off: the same loss twice, every adapter learns
    if "AVX512-BF16 on this CPU: True" in out:  # converted: another second loss, and no gradient (the page's claim)
        on = cases["True"]
        assert abs(on[0] - off[0]) < 1e-3 and math.isfinite(on[1]) and on[1] != on[0] and on[2] == 0, out
    else:  # nothing is converted: both cases are the same
        assert "AVX512-BF16 on this CPU: False" in out and cases["True"] == off, out


def _frozen_dtype_rule_and_traffic(out: str) -> None:
    assert "fp32 adapters, frozen bf16 base: runs" in out, out  # frozen parameters are out of the check
    found = re.search(r"fp32 adapters, bf16 norms trained too: (.*)", out)
    assert found and "FSDP expects uniform original parameter dtype" in found[1], out
    gathered = dict(
        re.findall(
            r"reshard_after_forward=(True|False): all-gathered per micro-batch, in frozen-base sizes: "
            r"([^;]+); reduce-scatters per step: 4$",
            out,
            re.M,
        )
    )
    assert gathered.keys() == {"True", "False"}, out  # and the adapters reduced once per step, per block
    twice, once = ([float(x) for x in gathered[k].split()] for k in ("True", "False"))
    assert len(twice) == len(once) == 4, out
    # the frozen base: gathered for forward and again for backward, or once; NaN fails the comparisons
    assert all(1.9 < x < 2.1 for x in twice) and all(0.95 < x < 1.1 for x in once), out


def _save_pretrained_round_trip(out: str) -> None:
    found = re.search(
        r"FSDP2 on 2 ranks, \d+ steps, loss (\S+) -> (\S+); save_pretrained \+ from_pretrained: "
        r"max \|weight difference\| = (\S+), max \|logit difference\| = (\S+)",
        out,
    )
    assert found, out
    first, last, weights, logits = map(float, found.groups())
    assert last < first and weights == 0 and logits == 0, out  # it trained; the round trip is exact; NaN fails


def _written_by_every_rank_round_trip(out: str) -> None:
    files = "['config.json', 'model-00001-of-00001.safetensors', 'model.safetensors.index.json']"
    assert f"2 per-rank files consolidated into {files}" in out, out  # every rank wrote its own file
    found = re.search(
        r"FSDP2 on 2 ranks, \d+ steps, loss (\S+) -> (\S+); written by every rank \+ from_pretrained: "
        r"max \|weight difference\| = (\S+), max \|logit difference\| = (\S+)",
        out,
    )
    assert found, out
    first, last, weights, logits = map(float, found.groups())
    assert last < first and weights == 0 and logits == 0, out  # it trained; the trained weights came back; NaN fails


def _experts_loss_difference(out: str) -> None:
    assert "rank 0 holds (2, 32, 64) of its experts' w1 (4, 32, 64), 8 experts in all" in out, out
    found = re.search(
        r"FSDP2 \+ expert parallelism on 4 ranks vs 1 process, \d+ steps, loss \S+ -> \S+: "
        r"max \|loss difference\| = (\S+)",
        out,
    )
    assert found and float(found[1]) <= 1e-5, out  # NaN fails the comparison


def _float8_follows_float32(out: str) -> None:
    found = re.search(r"^(\d) of 3 Linears are Float8Linear, computing with gathered (.+)$", out, re.M)
    assert found and found[1] == "3" and found[2] == "Float8TrainingTensor", out  # every Linear, every weight
    found = re.search(
        r"float8 FSDP2 on 2 ranks vs float32 in 1 process, \d+ steps: max relative loss difference = (\S+)", out
    )
    assert found and float(found[1]) <= 1e-2, out  # the page's 1%; NaN fails the comparison


def _one_float32_copy(out: str) -> None:
    per_param = {
        name: float(n)
        for name, n in re.findall(r"^float8 \+ bf16, (.+): (\S+) bytes of model states per parameter$", out, re.M)
    }
    assert per_param == {  # NaN fails the comparison
        "AdamW on FSDP's float32 shards": 16,
        "master-weight AdamW beside FSDP's float32 shards": 20,  # the weights in float32 twice
        "master-weight AdamW on bfloat16 shards": 16,  # ZeRO's 2 + 2 + 12
    }, out
    found = re.search(
        r"master-weight AdamW vs AdamW on float32 shards: max \|loss difference\| = (\S+) \(loss (\S+)\)", out
    )
    # the second copy changes memory, not training; a finite loss (NaN - NaN is NaN, not 0)
    assert found and float(found[1]) == 0 and math.isfinite(float(found[2])), out


def _hsdp(out: str) -> None:
    assert "rank 0: shard group [0, 1], replicate group [0, 2], holds (32, 16) of layers.0.weight (64, 16)" in out, out
    found = re.search(
        r"HSDP on a 2 x 2 mesh vs 1 process, \d+ steps: "
        r"max \|loss difference\| = (\S+), max \|weight difference\| = (\S+)",
        out,
    )
    assert found and float(found[1]) <= 1e-5 and float(found[2]) <= 1e-5, out  # NaN fails the comparison


def _pipeline(out: str) -> None:
    found = re.search(
        r"Schedule1F1B, 2 stages x FSDP2 on 2 ranks, 4 micro-batches, vs 1 process, \d+ steps: "
        r"max \|loss difference\| = (\S+), max \|weight difference\| = (\S+)",
        out,
    )
    assert found and float(found[1]) <= 1e-5 and float(found[2]) <= 1e-5, out  # NaN fails the comparison


def _gpipe_order_and_idle_fractions(out: str) -> None:
    found = re.findall(
        r"^GPipe, (\d) micro-batches, stage (\d): ran ([FB0-9 ]+); idle fraction (\S+) \(formula (\S+)\)$", out, re.M
    )
    # what timing cannot change: every forward, then every backward, on both stages, once each
    expected = {"1": "F0 B0", "4": "F0 F1 F2 F3 B0 B1 B2 B3"}
    assert [(m, stage, order) for m, stage, order, *_ in found] == [
        (m, stage, expected[m]) for m in ("1", "4") for stage in ("0", "1")
    ], out
    assert all(0 <= float(idle) < 1 for *_, idle, _ in found), out  # a fraction of the step; NaN fails
    assert [formula for *_, formula in found] == ["0.50", "0.50", "0.20", "0.20"], out  # (p - 1) / (m + p - 1)


def _uneven_eval_like_one_process(out: str) -> None:
    found = re.search(
        r"sharded eval on 2 ranks, batches per rank \[3, 2\], 9 of 9 examples, vs 1 process: "
        r"\|loss difference\| = (\S+)",
        out,
    )
    assert found and float(found[1]) <= 1e-5, out  # every example once; NaN fails the comparison


def _ema_on_shards_like_one_process(out: str) -> None:
    found = re.search(
        r"EMA on the shards of 2 ranks, 8 steps: (\d+) collectives in the updates; vs 1 process's EMA: "
        r"max \|difference\| = (\S+) \(the EMA is (\S+) from the trained weights\)",
        out,
    )
    assert found and found[1] == "0", out  # the updates ran no collective
    assert float(found[2]) <= 1e-6, out  # one process's EMA; NaN fails the comparison
    assert float(found[3]) > 1e-3, out  # an average that lags the weights, not a copy of them


def _hang_named(out: str) -> None:
    found = re.search(r"hang caught as \w+: rank 0 in #(\d+) ALLREDUCE, rank 1 in #(\d+) _ALLGATHER_BASE", out)
    assert found and found[1] == found[2], out  # both ranks' collectives, at the same position


def _step_bytes_against_parameters(out: str) -> None:
    # per step: each unit gathered twice (forward, backward) or once, and reduced once
    expected = {"FULL_SHARD": (8, 2.0, 4, 1.0), "SHARD_GRAD_OP": (4, 1.0, 4, 1.0)}
    for strategy, (gathers, gathered, scatters, reduced) in expected.items():
        found = re.search(
            rf"{strategy}, 4 units on 2 ranks, one step: (\d+) all-gathers of (\S+) P in all, "
            rf"(\d+) reduce-scatters of (\S+) P in all \(P: the parameters' bytes\); "
            rf"CommDebugMode counted (\d+) and (\d+)",
            out,
        )
        assert found, out
        assert (int(found[1]), int(found[3])) == (gathers, scatters) == (int(found[5]), int(found[6])), out
        assert float(found[2]) == gathered and float(found[4]) == reduced, out  # even shards: exact; NaN fails


def _summing_reduce_scatter(out: str) -> None:
    found = dict(
        re.findall(
            r"summing reduce-scatter on 2 ranks, (.+?): 4 calls; (unit i's gradient is the one-process sum's .+)",
            out,
        )
    )
    assert found.keys() == {"a fresh buffer each call", "one buffer handed out again"}, out
    fresh, reused = (found[k] for k in ("a fresh buffer each call", "one buffer handed out again"))
    error = {k: float(v.rsplit("=", 1)[1]) for k, v in found.items()}
    assert "of unit [0, 1, 2, 3]" in fresh and error["a fresh buffer each call"] <= 1e-5, out  # NaN fails
    assert "of unit [0, 0, 0, 0]" in reused and error["one buffer handed out again"] > 1e-4, out  # the last reduced


def _forward_prefetch_and_no_embedding_gather(out: str) -> None:
    found = re.search(r"forward, in order of issue \(F: a unit's forward, AG: its all-gather\): (.+)$", out, re.M)
    assert found and found[1] == "F0 AG0 AG1 F1 AG2 F2 AG3 F3 AG4 F4", out  # each next gather before its forward
    found = re.search(
        r"all-gathers in one step: (\d+) with the embedding gathered in backward, (\d+) with "
        r"set_unshard_in_backward\(False\)",
        out,
    )
    assert found and (int(found[1]), int(found[2])) == (10, 9), out  # one all-gather fewer per step
    found = re.search(
        r"FSDP2 with prefetching on 2 ranks vs 1 process, \d+ steps: max \|weight difference\| = (\S+)", out
    )
    assert found and float(found[1]) <= 1e-5, out  # NaN fails the comparison


def _failed_step_recovered(out: str) -> None:
    assert "caught a non-finite gradient in steps [1]; then every parameter sharded: True" in out, out
    found = re.search(
        r"FSDP2 on 2 ranks vs 1 process \(which caught steps \[1\]\), \d+ steps: max \|weight difference\| = (\S+)",
        out,
    )
    assert found and float(found[1]) <= 1e-5, out  # the stale gradients dropped; NaN fails the comparison


def _placements_like_one_process(out: str) -> None:
    assert (
        "experts' weight (3, 32, 32), (Shard(dim=1),): the ranks hold [(3, 16, 32), (3, 16, 32)]; "
        "scale a Parameter; still tied: True"
    ) in out, out  # rows of every expert on each rank, the scale left whole, the tie kept
    found = re.search(r"FSDP2 on 2 ranks vs 1 process, \d+ steps: max \|weight difference\| = (\S+)", out)
    assert found and float(found[1]) <= 1e-5, out  # the ignored scale reduced by hand; NaN fails


def _unused_experts_reduced(out: str) -> None:
    assert "rows per expert in step 0: rank 0 [3, 5], rank 1 [8, 0]" in out, out  # expert 1 unused on rank 1
    found = re.search(
        r"FSDP2 with experts unused on a rank, on 2 ranks vs 1 process, \d+ steps: "
        r"max \|weight difference\| = (\S+)",
        out,
    )
    assert found and float(found[1]) <= 1e-5, out  # NaN fails the comparison


def _branch_named_and_fixed(out: str) -> None:
    found = re.search(r"every unit on every rank: expert gradient vs 1 process: max \|difference\| = (\S+)", out)
    assert found and float(found[1]) <= 1e-5, out  # the reduced gradient is the ranks' mean; NaN fails
    caught = dict(
        re.findall(r"branch caught on rank (\d) as RuntimeError, before its collective (#\d+ \w+ of \[\d+\])", out)
    )
    assert caught.keys() == {"0", "1"}, out  # both ranks raised, in seconds
    number0, op0 = caught["0"].split(" ", 1)
    number1, op1 = caught["1"].split(" ", 1)
    # the same position, rank 0 reducing the expert-touched gradients, rank 1 all-gathering for backward
    assert number0 == number1 and op0 == "_REDUCE_SCATTER_BASE of [272]" and op1 == "_ALLGATHER_BASE of [136]", out


def _state_dict_saved_and_hang_named(out: str) -> None:
    found = re.search(
        r"full state dict gathered on every rank, written by rank 0: 6 tensors; vs 1 process: "
        r"max \|difference\| = (\S+)",
        out,
    )
    assert found and float(found[1]) == 0, out  # the whole weights, exactly; NaN fails the comparison
    waits = dict(re.findall(r"save timed out on rank (\d) \(\w+\), waiting at line \d+: (.+)", out))
    assert waits.keys() == {"0", "1"}, out  # both ranks ended, at the timeout
    assert waits["0"].startswith("full = get_model_state_dict(") and waits["1"] == "dist.barrier()", out


def _set_order_wrong_sorted_right(out: str) -> None:
    found = {
        how: (same, int(wrong), int(total))
        for how, same, wrong, total in re.findall(
            r"16 gradient norms in (set|sorted) order on 2 ranks: same order on every rank (\w+), "
            r"wrong norms (\d+) of (\d+)",
            out,
        )
    }
    assert found.keys() == {"set", "sorted"}, out
    # torchrun's ranks, each with its own string hash seed: different orders, norms paired wrong
    assert found["set"][0] == "False" and found["set"][1] > 0, out
    assert found["sorted"] == ("True", 0, 16), out  # one order on every rank: every norm right


def _blocks_compile_whole_and_train_as_eager(out: str) -> None:
    assert "each of 2 blocks compiled after fully_shard, fullgraph=True: 1 graph(s)" in out, out  # shared
    found = re.search(r"collectives in a step: eager (\{.*\}), compiled (\{.*\})", out)
    assert found and found[1] == found[2] and "_allgather_base_" in found[1], out  # FSDP's own, unchanged
    found = re.search(
        r"compiled \(aot_eager\) vs eager FSDP2 on 2 ranks, \d+ steps: max \|loss difference\| = (\S+)", out
    )
    assert found and float(found[1]) == 0, out  # aot_eager runs eager's kernels: exact; NaN fails


def _recompiles_counted(out: str) -> None:
    expected = (
        "graphs compiled so far, after a step on 32 tokens: 1; another: 1; a forward under no_grad: 2; "
        "a step on 32 tokens again: 2; a step on 16 tokens: 3; a step on 24 tokens: 3; a step on 8 tokens: 3"
    )
    assert expected in out, out  # no_grad: one more graph; the first new length: one, reused after


def _checkpointed_compiled_block(out: str) -> None:
    found = {
        m[1]: (int(m[2]), int(m[3]))
        for m in re.finditer(r"^(.+): (\d+) graph\(s\) compiled, (\d+) bytes saved for the backward$", out, re.M)
    }
    assert found.keys() == {"no checkpointing", "eager checkpointing", "checkpoint, compile, shard"}, out
    assert found["checkpoint, compile, shard"][0] == 1 and found["eager checkpointing"][0] == 0, out  # one, shared
    saved = {order: nbytes for order, (_, nbytes) in found.items()}
    assert 0 < saved["checkpoint, compile, shard"] < saved["no checkpointing"] / 2, out  # recomputed, not saved
    found = re.search(r"vs eager checkpointing on 2 ranks, \d+ steps: max \|loss difference\| = (\S+)", out)
    assert found and float(found[1]) == 0, out  # aot_eager runs eager's kernels: exact; NaN fails


def _each_block_keeps_least_selective_between(out: str) -> None:
    found = {
        m[1]: (float(m[2]), float(m[3]), m[4])
        for m in re.finditer(
            r"^(.+): (\S+) MiB held for the backward, (\S+)x the matmul FLOPs, gradients equal to none: (\w+)$",
            out,
            re.M,
        )
    }
    assert found.keys() == {"none", "each block", "selective"}, out
    held = {variant: mib for variant, (mib, _, _) in found.items()}
    assert 0 < held["each block"] < held["selective"] < held["none"], out  # NaN fails
    assert found["each block"][1] > 1.1 and found["selective"][1] == found["none"][1] == 1.0, out  # matmuls kept
    assert all(equal == "True" for _, _, equal in found.values()), out
    assert "no checkpointing's gradients finite and not all zero on every rank: True" in out, out


def _optimizer_step_compiled(out: str) -> None:
    found = re.search(r"sharded parameters with a gradient after each backward: \[(.*)\] \(of (\d+)\)", out)
    assert found and {int(n) for n in found[1].split(",")} == {int(found[2])}, out  # every one, every step
    assert re.search(r"collectives in the forwards and backwards: \{.*allgather.*reduce_scatter.*\}", out), out
    assert "collectives in the compiled optimizer steps: none" in out, out  # each rank updates its shard
    found = re.search(r"vs eager on 2 ranks, \d+ steps: max \|parameter difference\| = (\S+)", out)
    assert found and float(found[1]) < 1e-4, out  # within rounding of eager AdamW; NaN fails


def _fsdp_x_tp(out: str) -> None:
    # TP's column-wise shard, split again by FSDP (strided); the row-wise one; the unplanned head on dp alone
    assert (
        "rank 0 holds (16, 16) of blocks.0.fc.weight (64, 16): (_StridedShard(dim=0, sf=2), Shard(dim=0)) over "
        "('dp', 'tp')"
    ) in out, out
    assert "(8, 32) of blocks.0.proj.weight (16, 64): (Shard(dim=0), Shard(dim=1)) over ('dp', 'tp')" in out, out
    assert "(2, 16) of head.weight (4, 16): (Shard(dim=0),) over ('dp',)" in out, out
    found = re.search(
        r"FSDP x TP on a 2 x 2 mesh vs 1 process, \d+ steps: "
        r"max \|loss difference\| = (\S+), max \|weight difference\| = (\S+)",
        out,
    )
    assert found and float(found[1]) <= 1e-5 and float(found[2]) <= 1e-5, out  # NaN fails the comparisons


def _tp_same_batch_and_hsdp(out: str) -> None:
    def gap(prefix):
        found = re.search(rf"^{re.escape(prefix)}: ([^\s,]+)", out, re.M)
        assert found, out
        return float(found[1])

    right, wrong = gap("FSDP x TP, data by the dp coordinate"), gap("FSDP x TP, data by the global rank")
    hsdp = gap("fully_shard(mesh=2-D mesh)")
    assert right <= 1e-5 and hsdp <= 1e-5, out  # one process's weights; NaN fails the comparisons
    assert wrong > 1e-3 and wrong > 100 * right, out  # a TP pair on different batches drifts, silently
    assert "(no error raised)" in out and "placements (Replicate(), Shard(dim=0)): HSDP" in out, out


def _loss_parallel(out: str) -> None:
    assert "rank 0 holds logits (4, 16, 32) of (4, 16, 64): (Shard(dim=2),) over the vocabulary" in out, out
    found = re.search(
        r"loss parallel on 2 ranks vs 1 process, \d+ steps: "
        r"max \|loss difference\| = (\S+), max \|weight difference\| = (\S+)",
        out,
    )
    assert found and float(found[1]) <= 1e-5 and float(found[2]) <= 1e-5, out  # NaN fails the comparisons


def _clipped_across_meshes(out: str) -> None:
    assert "the parameters' meshes: ('dp', 'tp'), ('dp',)" in out, out
    assert (
        "clip_grad_norm_ on every parameter: RuntimeError: All operands in aten.stack.default must have the same mesh"
        in out
    ), out
    found = re.search(r"total norm (\S+), 1 process (\S+); max \|clipped gradient difference\| = (\S+)", out)
    assert found, out
    total, one, gap = map(float, found.groups())
    assert total > 1 and abs(total - one) <= 1e-5 * one and gap <= 1e-6, out  # clipped; NaN fails the comparisons


def _checkpoint_across_meshes(out: str) -> None:
    assert "model.pt into a plain model: <All keys matched successfully>" in out, out
    assert "checkpoint loaded on a 1-D mesh of 4: parameters equal exactly: True" in out, out
    assert "AdamW's first moments equal exactly: True" in out, out
    assert "model.pt equals the 2-D run's parameters exactly: True" in out, out


def _gqa_heads_divide(out: str) -> None:
    runs = re.findall(
        r"^(\d) heads, (\d) KV heads on 2 ranks \(both divide: True\).*runs, max \|output difference\| = (\S+)$",
        out,
        re.M,
    )
    assert [(h, kv) for h, kv, _ in runs] == [("4", "2"), ("6", "2")], out
    assert all(float(gap) <= 1e-5 for *_, gap in runs), out  # NaN fails the comparison
    fails = re.findall(r"^(\d) heads, (\d) KV heads on 2 ranks \(both divide: False\).*RuntimeError: shape", out, re.M)
    assert fails == [("4", "1"), ("6", "3")], out


def _gpt_loss_falls(out: str) -> None:
    losses = {int(step): float(loss) for step, loss in re.findall(r"^step +(\d+): loss (\S+)$", out, re.M)}
    assert sorted(losses) == [1, 10, 20, 30, 40], out
    assert all(math.isfinite(loss) for loss in losses.values()), out  # a NaN anywhere fails
    assert abs(losses[1] - math.log(256)) < 0.3, out  # it starts at a uniform guess over bytes
    assert losses[40] < losses[1] - 1, out  # and learns: more than a nat per byte lower


def _resumed_exactly(out: str) -> None:
    found = re.search(r"steps 21-40, resumed == without stopping: (\w+) \(20 losses, all finite: (\w+)\)", out)
    assert found and found[1] == "True" and found[2] == "True", out  # bit for bit, and no NaN
    assert "resumed from checkpoint/step-20 at step 21" in out, out


def _mfu_counted_right(out: str) -> None:
    ratio = re.search(r"^counted / formula: (\S+)$", out, re.M)
    assert ratio and 0.98 < float(ratio[1]) <= 1.0, out  # the formula, checked by torch's count
    found = re.search(r"^peak (\S+) GFLOP/s per rank \((?:given|estimated: [^)]+)\); MFU (\S+)$", out, re.M)
    assert found and float(found[1]) > 0 and 0 < float(found[2]) <= 1, out  # a fraction; NaN fails


def _resumed_like_uninterrupted(out: str) -> None:
    assert "attempt 0: no checkpoint, starting at step 1" in out, out
    assert "attempt 0: rank 1 killed after step 5" in out, out  # the failure happened, once
    assert "attempt 1: resumed after step 3" in out, out  # torchrun restarted; step 3's checkpoint, the newest
    found = re.search(
        r"8 steps on 2 ranks, rank 1 killed after step 5, resumed after step 3 in attempt 1: "
        r"max \|weight difference\| vs a run never interrupted = (\S+)",
        out,
    )
    assert found and float(found[1]) == 0, out  # bit for bit; NaN fails the comparison


def _other_group_trained_on_and_restarted_one_caught_up(out: str) -> None:
    killed = re.search(r"group 1 rank 1: killed after step (\d+)", out)
    assert killed, out  # the failure happened
    # the restarted group received the state at the step the live group had reached meanwhile: group 0
    # stepped on while group 1 was down (it never restarted), then both averaged again
    rejoined = re.search(r"group 1 attempt 1: step (\d+), 1 group\(s\) averaging, this group receiving the state", out)
    assert rejoined and int(rejoined[1]) > int(killed[1]), out
    assert "group 0 attempt 1" not in out, out
    assert re.search(r"group 1 attempt 1: step \d+, 2 group\(s\) averaging\n", out), out
    final = dict(re.findall(r"(group \d rank \d) attempt \d: stopped after step \d+, shards sha256 (\w+)", out))
    assert len(final) == 4, out
    assert final["group 0 rank 0"] == final["group 1 rank 0"] and final["group 0 rank 1"] == final["group 1 rank 1"], (
        out
    )
    assert len(set(re.findall(r"stopped after step (\d+)", out))) == 1, out  # every rank stopped at one step


def _what_each_rank_holds(out: str) -> None:
    for rank in (0, 1):
        assert f"rank {rank}: 0.weight (8, 6) (Shard(dim=0),), shard (4, 6)" in out, out
        assert f"rank {rank}: 0.weight.grad DTensor (Shard(dim=0),)" in out, out
        assert f"rank {rank}: full 0.weight equals the unsharded model's: True" in out, out
        assert (
            f"rank {rank}: 0.weight after forward by default: DTensor, 0.weight after forward with "
            "reshard_after_forward=False: Parameter; after backward: DTensor"
        ) in out, out


def _every_rank_resumed_its_adapter(out: str) -> None:
    assert "FULL_STATE_DICT, adapter_only=True: ranks whose lora_B is all zero after loading: []" in out, out
    assert "every rank's adapter slice restored exactly: True" in out, out
    assert "resumed losses equal the uninterrupted run's on every rank: True" in out, out


def _gathered_muon_exact_shard_local_not(out: str) -> None:
    assert "GatheredMuon: equal to torch.optim.Muon on the whole gradients: True (0.0e+00)" in out, out
    found = re.search(r"Muon on each shard: equal: False, max \|weight difference\| = (\S+)", out)
    assert found and float(found[1]) > 1e-3, out  # another optimizer; NaN fails the comparison


def _two_ranks_are_two_micro_batches_the_bug_far_above(out: str) -> None:
    assert "FSDP2 on 2 ranks vs one process in 2 micro-batches: bit-equal True" in out, out
    found = re.search(r"2 micro-batches (\S+), FSDP2 (\S+), the bug (\S+)", out)
    assert found, out
    split, sharded, bug = map(float, found.groups())
    assert split == sharded and 0 < split < 1e-5 and bug > 100 * split, out  # NaN fails these


def _zero_stages_equal_fsdp2(out: str) -> None:
    assert "the weights moved, the losses finite: True" in out, out  # equal, and not as untrained or NaN
    for stage in (1, 2, 3):
        assert f"ZeRO-{stage}: losses and weights equal to FSDP2's: True" in out, out
    assert "bf16, ZeRO-2 against FSDP2 with DeepSpeed's roundings: equal: True; moved: True" in out, out
    assert "deepspeed_shm_comm_op built" not in out, out  # no extension compiled


# Each script: the ranks it runs on, the check of what it prints (the claim its page makes of it) and,
# optionally, torchrun's arguments beside --standalone and --nproc-per-node.
CLAIMS = {
    "quickstart": (2, _loss_difference),
    "interactive": (2, _what_each_rank_holds),
    "mixed_precision": (2, _mixed_precision),
    "fp16_scaler": (2, _float16_needs_the_scaler),
    "summon_full_params": (2, _full_params_init),
    "deterministic_init": (2, _weight_difference),
    "loss_and_accumulation": (2, _accumulated_loss_difference),
    "no_sync": (2, _no_sync_reduces_once),
    "enable_wrap": (2, _same_model_less_memory),
    "migration": (2, _fsdp1_fsdp2_losses),
    "deepspeed_zero": (2, _zero_stages_equal_fsdp2),
    "state_attributes": (2, _state_timeline),
    "memory": (2, _states_against_zero3),
    "digits": (2, _digits_accuracy),
    "weight_sync": (3, _engine_holds_trainer_weights),
    "fsdp_config": (2, _config_applied),
    "pitfalls": (2, _optimizer_after_sharding),
    "outside_forward": (2, _outside_forward_like_one_process),
    "checkpoint_placement": (2, _checkpoint_inside_like_one_process),
    "lora": (2, _lora_like_one_process),
    "qlora": (2, _qlora_like_one_process),
    "qlora_adapters": (2, _adapters_whole_and_merged_dequantised),
    "qlora_cpu_repack": (2, _repack_off_evaluates_and_trains),
    "qlora_pitfalls": (2, _pitfalls_reproduced_and_fixed),
    "trainer_fsdp": (2, _trainer_fell_back_to_ddp),
    "fsdp_config_map": (2, _sharded_as_accelerate_like_one_process),
    "muon": (2, _gathered_muon_exact_shard_local_not),
    "world_sizes": (2, _two_ranks_are_two_micro_batches_the_bug_far_above),
    "peft_resume": (2, _every_rank_resumed_its_adapter),
    "frozen_weights": (2, _frozen_dtype_rule_and_traffic),
    "finetune_hf": (2, _save_pretrained_round_trip),
    "hf_dcp_export": (2, _written_by_every_rank_round_trip),
    "experts": (4, _experts_loss_difference),
    "uneven_experts": (2, _unused_experts_reduced),
    "fsdp2_controls": (2, _forward_prefetch_and_no_embedding_gather),
    "failed_step": (2, _failed_step_recovered),
    "placements": (2, _placements_like_one_process),
    "fp8": (2, _float8_follows_float32),
    "fp8_memory": (2, _one_float32_copy),
    "cluster": (4, _hsdp),
    "pipeline": (4, _pipeline),
    "pipeline_bubble": (2, _gpipe_order_and_idle_fractions),
    "beyond_the_step": (2, _uneven_eval_like_one_process),
    "ema_and_teacher": (2, _ema_on_shards_like_one_process),
    "debugging_hangs": (2, _hang_named),
    "communication": (2, _step_bytes_against_parameters),
    "collective_hooks": (2, _summing_reduce_scatter),
    "hang_branch": (2, _branch_named_and_fixed),
    "hang_state_dict": (2, _state_dict_saved_and_hang_named),
    "set_order": (2, _set_order_wrong_sorted_right),
    "compile": (2, _blocks_compile_whole_and_train_as_eager),
    "compile_recompiles": (2, _recompiles_counted),
    "checkpoint_variants": (2, _each_block_keeps_least_selective_between),
    "compile_checkpointing": (2, _checkpointed_compiled_block),
    "compiled_autograd": (2, _optimizer_step_compiled),
    "tensor_parallel": (4, _fsdp_x_tp),
    "tp_exactness": (4, _tp_same_batch_and_hsdp),
    "tp_gradients": (4, _clipped_across_meshes),
    "loss_parallel": (2, _loss_parallel),
    "tp_attention": (2, _gqa_heads_divide),
    "tp_checkpoints": (4, _checkpoint_across_meshes),
    "llm": (2, _gpt_loss_falls),
    "llm_checkpoints": (2, _resumed_exactly),
    "mfu": (2, _mfu_counted_right),
    "rank_dies": (2, _resumed_like_uninterrupted, ["--max-restarts=1"]),
    "torchft_recovery": (4, _other_group_trained_on_and_restarted_one_caught_up),  # 2 groups of 2 ranks
}

# Scripts run by more than one command (a Lighthouse and a torchrun per replica group): the test
# runs the commands the script's docstring gives, in bash, in the folder the script is copied to.
RUN_AS_DOCUMENTED = {"torchft_recovery"}


# The library a page is about, beside torch, that its script may import (as the page's reader has it).
LIBRARIES = {
    "digits": {"sklearn"},
    "deepspeed_zero": {"deepspeed"},
    "lora": {"peft", "transformers"},
    "qlora": {"bitsandbytes", "peft", "transformers"},
    "qlora_adapters": {"bitsandbytes", "peft", "transformers"},
    "qlora_cpu_repack": {"bitsandbytes", "peft", "transformers"},
    "qlora_pitfalls": {"bitsandbytes", "peft", "transformers"},
    "trainer_fsdp": {"transformers"},
    "checkpoint_variants": {"transformers"},
    "fsdp_config_map": {"transformers"},
    "peft_resume": {"accelerate", "peft", "transformers"},
    "finetune_hf": {"transformers"},
    "hf_dcp_export": {"transformers"},
    "fp8": {"torchao"},
    "fp8_memory": {"torchao"},
    "torchft_recovery": {"torchft"},
}


def test_every_page_has_its_script_and_every_script_a_claim():
    pages = {page.stem for page in NOTEBOOKS}
    scripts = {script.stem for script in SCRIPTS.glob("*.py")}
    assert scripts <= pages, f"scripts without a page: {scripts - pages}"
    assert pages == scripts, f"pages without a script: {pages - scripts}"
    assert set(CLAIMS) == scripts


@pytest.mark.parametrize("name", sorted(CLAIMS))
def test_the_page_shows_its_script_highlighted_and_as_a_download(name):
    page = next(page for page in NOTEBOOKS if page.stem == name)
    script = os.path.relpath(SCRIPTS / f"{name}.py", page.parent)  # as the page names it
    assert f"```{{literalinclude}} {script}" in page.read_text()
    assert f"{{download}}`{script}`" in page.read_text()


@pytest.mark.parametrize("name", sorted(CLAIMS))
def test_the_script_needs_torch_alone(name):
    tree = ast.parse((SCRIPTS / f"{name}.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    allowed = {*sys.stdlib_module_names, "torch", *LIBRARIES.get(name, ())}
    outside = {module for module in imported if module.split(".")[0] not in allowed}
    assert not outside, (
        f"{name}.py imports {outside}: a reader has torch and the page's library, not the guide's package"
    )


def documented_command(name: str) -> str:
    """The command a script's docstring gives: its first block indented by 4 spaces."""
    doc = ast.get_docstring(ast.parse((SCRIPTS / f"{name}.py").read_text()), clean=False)
    block = re.search(r"\n\n((?:    \S.*\n)+)", doc + "\n")
    assert block, f"{name}.py: no command in its docstring"
    return "\n".join(line[4:] for line in block[1].splitlines())


def _run_as_documented(name: str, folder) -> subprocess.CompletedProcess:
    """The docstring's commands, as a reader pastes them into bash beside a copy of the script.

    Their output goes to files, not pipes: a process they start in the background (a Lighthouse)
    would hold a pipe open after bash has ended. Whatever is left once bash has ended is killed."""
    (folder / f"{name}.py").write_text((SCRIPTS / f"{name}.py").read_text())
    env = {**os.environ, "TMPDIR": str(folder), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    command = loopback_only(["bash", "-euc", documented_command(name)])
    with open(folder / "stdout", "w") as out, open(folder / "stderr", "w") as err:
        run = subprocess.Popen(command, stdout=out, stderr=err, cwd=folder, env=env, start_new_session=True)
    try:
        returncode = run.wait(timeout=300)
    finally:  # left behind where a command failed: a Lighthouse (in bash's process group), ranks
        # (torchrun starts each in a session of its own)
        left = []
        with contextlib.suppress(psutil.Error):
            left = psutil.Process(run.pid).children(recursive=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
        for process in left:
            with contextlib.suppress(psutil.Error):
                process.kill()
        run.wait()
    return subprocess.CompletedProcess(
        command, returncode, (folder / "stdout").read_text(), (folder / "stderr").read_text()
    )


def _run_under_torchrun(name: str, folder) -> subprocess.CompletedProcess:
    if name in RUN_AS_DOCUMENTED:
        return _run_as_documented(name, folder)
    ranks, _, *torchrun_arguments = CLAIMS[name]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               *(torchrun_arguments[0] if torchrun_arguments else []), str(SCRIPTS / f"{name}.py")]  # fmt: skip
    # In a folder of its own, as a reader's copy would run (what a script writes lands there), with
    # its temporary files there too: torchrun leaves a torchelastic_* folder behind in TMPDIR.
    env = {**os.environ, "TMPDIR": str(folder)}
    return subprocess.run(loopback_only(command), capture_output=True, text=True, timeout=300, cwd=folder, env=env)


@pytest.fixture(scope="module")
def script_runs(request, tmp_path_factory):
    """The run of every script this session tests, started at the first test that asks, two at a time, in order.

    One run leaves much of the 2 cores idle (torchrun's agent and the ranks wait for each other,
    the hang scripts for their timeouts); two at a time fill it, each run in its own network
    namespace and folder. A run's own check is the same whichever run is beside it."""
    test = test_the_script_runs_under_torchrun_and_prints_what_its_page_says.__name__
    wanted = [
        item.callspec.params["name"] for item in request.session.items if getattr(item, "originalname", None) == test
    ]
    # the runs go on between this module's tests: they hold this worker's share of the machine
    # from the first run's start to the last one's end (conftest.machine_share)
    with machine_share(request.config), ThreadPoolExecutor(2, thread_name_prefix="script") as pool:
        yield {name: pool.submit(_run_under_torchrun, name, tmp_path_factory.mktemp(name)) for name in wanted}


@pytest.mark.parametrize("name", sorted(CLAIMS))
def test_the_script_runs_under_torchrun_and_prints_what_its_page_says(name, script_runs):
    done = script_runs[name].result()
    assert done.returncode == 0, done.stdout + done.stderr
    CLAIMS[name][1](done.stdout)
