"""Each page's script, run as a reader runs it: `torchrun --nproc-per-node=N script.py`, torch alone, gloo ranks.

A page shows its idea as a plain torchrun script, ``tutorials/scripts/<page>.py``: the page includes
the file (highlighted, and as a download) and these tests run that same file, each checking that it
prints what its page says it does. torchrun's store listens on every interface, so each run is in a
network namespace of its own (``fsdp_guide.isolation.loopback_only``).
"""

from __future__ import annotations

import ast
import math
import os
import re
import subprocess
import sys

import pytest
from conftest import NOTEBOOKS, ROOT

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


def _lora_like_one_process(out: str) -> None:
    found = re.search(r"LoRA: [\d,]+ of [\d,]+ parameters trainable, every one a shard: (\w+)", out)
    assert found and found[1] == "True", out  # the adapters train as shards, reduced across ranks
    found = re.search(
        r"LoRA with FSDP2 on 2 ranks vs 1 process, \d+ steps, loss \S+ -> \S+: max relative loss difference = (\S+)",
        out,
    )
    assert found and float(found[1]) <= 1e-5, out  # the page's "fp32 rounding"; NaN fails the comparison


def _save_pretrained_round_trip(out: str) -> None:
    found = re.search(
        r"FSDP2 on 2 ranks, \d+ steps, loss (\S+) -> (\S+); save_pretrained \+ from_pretrained: "
        r"max \|weight difference\| = (\S+), max \|logit difference\| = (\S+)",
        out,
    )
    assert found, out
    first, last, weights, logits = map(float, found.groups())
    assert last < first and weights == 0 and logits == 0, out  # it trained; the round trip is exact; NaN fails


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


def _uneven_eval_like_one_process(out: str) -> None:
    found = re.search(
        r"sharded eval on 2 ranks, batches per rank \[3, 2\], 9 of 9 examples, vs 1 process: "
        r"\|loss difference\| = (\S+)",
        out,
    )
    assert found and float(found[1]) <= 1e-5, out  # every example once; NaN fails the comparison


def _hang_named(out: str) -> None:
    found = re.search(r"hang caught as \w+: rank 0 in #(\d+) ALLREDUCE, rank 1 in #(\d+) _ALLGATHER_BASE", out)
    assert found and found[1] == found[2], out  # both ranks' collectives, at the same position


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


# Each script: the ranks it runs on, and the check of what it prints (the claim its page makes of it).
CLAIMS = {
    "quickstart": (2, _loss_difference),
    "mixed_precision": (2, _mixed_precision),
    "summon_full_params": (2, _full_params_init),
    "deterministic_init": (2, _weight_difference),
    "loss_and_accumulation": (2, _accumulated_loss_difference),
    "enable_wrap": (2, _same_model_less_memory),
    "migration": (2, _fsdp1_fsdp2_losses),
    "state_attributes": (2, _state_timeline),
    "memory": (2, _states_against_zero3),
    "digits": (2, _digits_accuracy),
    "weight_sync": (3, _engine_holds_trainer_weights),
    "fsdp_config": (2, _config_applied),
    "pitfalls": (2, _optimizer_after_sharding),
    "lora": (2, _lora_like_one_process),
    "finetune_hf": (2, _save_pretrained_round_trip),
    "experts": (4, _experts_loss_difference),
    "fp8": (2, _float8_follows_float32),
    "cluster": (4, _hsdp),
    "pipeline": (4, _pipeline),
    "beyond_the_step": (2, _uneven_eval_like_one_process),
    "debugging_hangs": (2, _hang_named),
    "llm": (2, _gpt_loss_falls),
    "llm_checkpoints": (2, _resumed_exactly),
    "mfu": (2, _mfu_counted_right),
}

# The library a page is about, beside torch, that its script may import (as the page's reader has it).
LIBRARIES = {
    "digits": {"sklearn"},
    "lora": {"peft", "transformers"},
    "finetune_hf": {"transformers"},
    "fp8": {"torchao"},
}

# The pages whose script is still to be written (issue 47): each one written leaves this list.
WITHOUT_A_SCRIPT_YET = {
    "communication", "compile", "fsdp2_controls", "rank_dies", "tensor_parallel",
}  # fmt: skip


def test_every_page_has_its_script_and_every_script_a_claim():
    pages = {page.stem for page in NOTEBOOKS}
    scripts = {script.stem for script in SCRIPTS.glob("*.py")}
    assert scripts <= pages, f"scripts without a page: {scripts - pages}"
    assert pages - scripts == WITHOUT_A_SCRIPT_YET
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


@pytest.mark.parametrize("name", sorted(CLAIMS))
def test_the_script_runs_under_torchrun_and_prints_what_its_page_says(name, tmp_path):
    ranks, check = CLAIMS[name]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               str(SCRIPTS / f"{name}.py")]  # fmt: skip
    # In a folder of its own, as a reader's copy would run (what a script writes lands there).
    done = subprocess.run(loopback_only(command), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    check(done.stdout)
