"""Every tutorial executes from top to bottom as a notebook, in a real Jupyter kernel."""

from __future__ import annotations

import itertools
import math
import re
from types import SimpleNamespace

import pytest
from conftest import NOTEBOOKS, ROOT, TUTORIALS


def _text_outputs(notebook, *, failing: bool = True) -> str:
    """What the cells showed as text; ``failing=False``: not the cells tagged to raise (a failure a page shows)."""
    chunks = []
    for cell in notebook.cells:
        if not failing and "raises-exception" in cell.get("metadata", {}).get("tags", []):
            continue
        for out in cell.get("outputs", []):
            if "scrapbook" in out.get("metadata", {}):
                continue  # a value glued for the prose (myst_nb.glue), shown in the text, not as output
            if "image/png" in out.get("data", {}):
                continue  # a figure: its text/plain is "<Figure size ...>", not text the page printed
            if "text" in out:  # a stream, as printed
                chunks.append(out["text"])
            elif "text/plain" in out.get("data", {}):  # a displayed object (a Table): lines of its own
                chunks.append(out["data"]["text/plain"].rstrip("\n") + "\n")
    return "".join(chunks)


def _cells(line: str) -> list[str]:
    """The cells of a line of a displayed Table's text (``fsdp_guide.table``): columns are
    two or more spaces apart, a cell has at most single spaces inside."""
    return re.split(r"\s{2,}", line.strip())


def _table_under(notebook, header: list[str]) -> dict[str, list[str]]:
    """The rows of the displayed Table whose header is ``header``, by their first cell (a row with
    fewer cells: its last ones empty). Read from that output alone, so a table shown next is not read."""
    for cell in notebook.cells:
        for out in cell.get("outputs", []):
            lines = out.get("data", {}).get("text/plain", "").splitlines()
            if lines and _cells(lines[0]) == header:
                return {row[0]: row[1:] for row in map(_cells, lines[1:]) if 1 < len(row) <= len(header)}
    raise AssertionError(f"no table headed {header}")


def _glued(notebook) -> dict:
    """The values a page glued for its prose (``myst_nb.glue``), by name, as their text (the
    ``text/plain`` that myst-nb records under its own mime type)."""
    return {
        out["metadata"]["scrapbook"]["name"]: out["data"]["application/papermill.record/text/plain"]
        for cell in notebook.cells
        for out in cell.get("outputs", [])
        if "scrapbook" in out.get("metadata", {})
    }


def test_no_page_runs_past_450_lines():
    # issue 47: one idea a page; a page that grows past this has grown a second idea, or a harness to fold away
    lengths = {page.stem: len(page.read_text().splitlines()) for page in NOTEBOOKS}
    assert len(lengths) >= 50 and not {stem: n for stem, n in lengths.items() if n > 450}


def test_every_tutorial_is_tested():
    assert [t.stem for t in TUTORIALS] == [
        "beyond_the_step",
        "checkpoint_placement",
        "checkpoint_variants",
        "collective_hooks",
        "communication",
        "compile",
        "compile_checkpointing",
        "compile_recompiles",
        "compiled_autograd",
        "debugging_hangs",
        "deepspeed_zero",
        "deterministic_init",
        "digits",
        "ema_and_teacher",
        "enable_wrap",
        "experts",
        "failed_step",
        "finetune_hf",
        "fp16_scaler",
        "fp8",
        "fp8_memory",
        "frozen_weights",
        "fsdp2_controls",
        "fsdp_config",
        "fsdp_config_map",
        "hang_branch",
        "hang_state_dict",
        "hf_dcp_export",
        "interactive",
        "llm",
        "llm_checkpoints",
        "lora",
        "loss_and_accumulation",
        "loss_parallel",
        "memory",
        "mfu",
        "migration",
        "mixed_precision",
        "muon",
        "no_sync",
        "outside_forward",
        "peft_resume",
        "pipeline",
        "pipeline_bubble",
        "pitfalls",
        "placements",
        "qlora",
        "qlora_adapters",
        "qlora_cpu_repack",
        "qlora_pitfalls",
        "quickstart",
        "rank_dies",
        "set_order",
        "state_attributes",
        "summon_full_params",
        "tensor_parallel",
        "torchft_recovery",
        "tp_attention",
        "tp_checkpoints",
        "tp_exactness",
        "tp_gradients",
        "trainer_fsdp",
        "uneven_experts",
        "weight_sync",
        "world_sizes",
    ]


@pytest.mark.parametrize("tutorial", TUTORIALS, ids=lambda p: p.stem)
def test_tutorial_executes(tutorial, executed):
    text = _text_outputs(executed[tutorial.stem], failing=False)
    assert "Traceback" not in text
    assert "torch 2." in text  # every page says which torch it was executed with
    for cell in executed[tutorial.stem].cells:  # a cell tagged to raise did raise: its failure is what it shows
        if "raises-exception" in cell.get("metadata", {}).get("tags", []):
            assert any(out["output_type"] == "error" for out in cell.outputs), cell.source


def test_finetune_hf_measures_the_load_fine_tunes_like_one_process_and_exports_exactly(executed):
    text = _text_outputs(executed["finetune_hf"])
    # loading; rank 0 and rank 1: resident / private; shard kept
    rows = {cells[0]: cells[1:] for cells in map(_cells, text.splitlines())}
    every, broadcast, sliced = (
        [float(x) for cell in rows[k] for x in cell.split(" / ")]
        for k in ("every rank reads", "rank 0 reads, broadcasts", "each rank reads its slices")
    )
    assert len(every) == len(broadcast) == len(sliced) == 5
    # (rank 0 resident, rank 0 private, rank 1 resident, rank 1 private, shard kept), in model sizes
    assert every[1] >= 1.0 and every[3] >= 1.0  # a whole fp32 model allocated on each rank
    assert broadcast[1] <= 0.6 and broadcast[3] <= 0.75 and sliced[1] <= 0.6 and sliced[3] <= 0.6
    assert broadcast[0] <= 1.2  # rank 0: the mapped bf16 file (0.5 model sizes) plus its shard
    # The prose quotes this run's figures (glued); what it claims of them: rank 0's bf16 file shows
    # in its resident memory, not its private part (the file is half the fp32 model; sampled, so
    # most of it); rank 1's extra over its shard is a tensor at a time, never the model; reading
    # slices, the resident memory is most of the file, more than the private shard.
    assert broadcast[0] - broadcast[1] >= 0.3
    assert broadcast[3] - broadcast[4] <= 0.5
    assert all(resident > private for resident, private in ((sliced[0], sliced[1]), (sliced[2], sliced[3])))
    assert _glued(executed["finetune_hf"]).keys() >= {
        "every_rank_private",
        "rank0_mapped",
        "rank1_extra",
        "sliced_resident",
    }
    first = float(text.split("relative difference at the first step: ")[1].split(";")[0])
    assert first < 1e-5  # "to fp32 rounding"
    relative = float(text.split("largest relative difference: ")[1].split()[0])
    assert relative < 1e-4
    # step, loss on 2 ranks, loss in 1 process: the 5 steps, the losses falling
    table = [cells for cells in map(_cells, text.splitlines()) if len(cells) == 3 and cells[0].isdigit()]
    losses = [[float(x) for x in cells[1:]] for cells in table]
    assert [len(step) for step in losses] == [2] * 5 and losses[-1][0] < losses[0][0]
    assert "logits equal the sharded model's: True" in text
    # what the export wrote for the tied pair, read from the file, and both equal to what the ranks trained
    assert "the tied pair: model.embed_tokens.weight written, lm_head.weight not written" in text
    assert "each written equals the output layer the ranks trained: True (16 MiB of the file's 104 MiB)" in text


def test_hf_dcp_export_writes_from_every_rank_measures_it_and_stages_on_a_cpu(executed):
    text = _text_outputs(executed["hf_dcp_export"])
    # it trained, and every tensor loaded back equals the trained one (torch.equal: a NaN fails)
    losses = [float(v) for v in text.split("loss per step: ")[1].splitlines()[0].split()]
    assert losses[-1] < losses[0]
    assert "tensors loaded, each equal to the trained one: True (largest difference 0.0e+00)" in text
    # export, ranks; rank 0 and the other ranks' most: resident / private; seconds
    rows = {
        (cells[0], int(cells[1])): [float(v) for cell in cells[2:] for v in cell.split(" / ")]
        for cells in map(_cells, text.splitlines())
        if cells[0].startswith("write=")
    }
    assert len(rows) == 4 and all(len(row) == 5 for row in rows.values())
    gathered = {world: rows[("write='rank0'", world)][0] for world in (2, 4)}  # rank 0's resident peak
    every = {world: max(rows[("write='sharded'", world)][0], rows[("write='sharded'", world)][2]) for world in (2, 4)}
    assert all(peak > 1.0 for peak in gathered.values())  # "more than the model", on any number of ranks
    assert 0.8 <= every[2] <= 1.4 and 0.4 <= every[4] <= 0.75  # "about twice its shard" (1/2, 1/4 of the model)
    assert every[2] >= 0.75 * gathered[2] and every[4] <= 0.6 * gathered[4]  # "no better" on 2, "about half" on 4
    # the standard files, DCP's per-rank files gone
    assert (
        "['config.json', 'generation_config.json', 'model-00001-of-00001.safetensors', 'model.safetensors.index.json']"
    ) in text
    assert "tied after loading: True | logits equal the sharded model's: True" in text
    assert "StagingOptions(**{}): AssertionError: Non-blocking copy requires that the current accelerator" in text
    assert "Ignoring pin_memory flag" in text
    assert "'use_non_blocking_copy': False}): written" in text
    assert "the same tensors as save_pretrained(write='sharded') wrote: True" in text
    # offline, from the training checkpoint: the command wrote the model in bf16, each tensor the trained one
    # rounded; in fp32, split, each equal; holding a file and a tensor at a time, well under the model
    assert "wrote WORKDIR/bf16: config.json, generation_config.json, model.safetensors" in text
    assert "loaded in torch.bfloat16; each tensor the trained one rounded to bf16: True" in text
    peak, model = map(float, re.search(r"each tensor equal to the trained one: True \| peak rise of this process's "
                                      r"memory (\d+) MiB, for a (\d+) MiB model", text).groups())  # fmt: skip
    # a 20 MB file filled and the largest tensor (the 16 MiB embedding) read into a buffer and copied: about
    # 52 MiB (45 and 59 measured); the whole model would be more than all of it
    assert peak < 0.75 * model


def test_qlora_trains_4_bit_shards_like_one_process_and_shows_what_a_rank_holds(executed):
    text = _text_outputs(executed["qlora"])
    # NF4: two codes a byte in a flat column, whichever dtype stores them; a quarter of bf16's bytes
    packed = re.findall(r"storage torch\.(\w+) +Linear4bit of (\d+)x(\d+): a Params4bit \((\d+), 1\) of torch\.\w+, "
                        r"(\d+) bytes \(bf16: (\d+)\)", text)  # fmt: skip
    assert [p[0] for p in packed] == ["uint8", "bfloat16"]
    assert all(int(p[4]) * 4 == int(p[5]) == int(p[1]) * int(p[2]) * 2 for p in packed)
    # trained on 2 ranks with one process's losses (fp32 rounding), its 4-bit weights sharded in half
    one = [float(x) for x in re.search(r"one process: losses (.*)", text)[1].split()]
    assert one[-1] < one[0]
    runs = re.findall(r"2 ranks, torch\.(\w+) *: losses .*largest relative difference (\S+); "
                      r"the 4-bit weight a DTensor \(Shard\(dim=0\),\)", text)  # fmt: skip
    assert [r[0] for r in runs] == ["uint8", "bfloat16"] and all(float(r[1]) <= 1e-5 for r in runs)
    held = re.findall(r"rank \d holds (\d+) bytes of 4-bit weights, \d+ of adapters, (\d+) of scales", text)
    whole, scales = re.search(
        r"one process holds (\d+) bytes of 4-bit weights, \d+ of adapters, (\d+) of scales", text
    ).groups()
    # each rank: half the codes, all the scales (the quant_state is not a parameter)
    assert len(held) == 4 and all(2 * int(b) == int(whole) and s == scales for b, s in held)
    # what a rank holds: the 4-bit base fewer frozen bytes than the bf16 one; ignored_params trains the same
    # with whole Params4bit on every rank, and more bytes than sharding them
    rows = {cells[0]: cells[1:] for cells in map(_cells, text.splitlines()) if cells[0].startswith(("QLoRA", "bf16"))}
    assert rows.keys() == {"QLoRA, uint8", "QLoRA, bfloat16", "bf16 LoRA", "QLoRA, uint8, ignored_params"}, rows
    frozen = {case: float(row[2]) for case, row in rows.items()}
    assert frozen["bf16 LoRA"] > 2 * frozen["QLoRA, uint8"] == 2 * frozen["QLoRA, bfloat16"]
    assert frozen["QLoRA, uint8, ignored_params"] > frozen["QLoRA, uint8"]
    ignored = rows["QLoRA, uint8, ignored_params"]
    assert float(ignored[0]) <= 1e-5 and ignored[1] == "Params4bit" and rows["QLoRA, uint8"][1].startswith("DTensor")
    assert float(rows["bf16 LoRA"][3]) == 0 < float(ignored[3]) == float(rows["QLoRA, uint8"][3])  # scales
    glued = _glued(executed["qlora"])
    assert float(glued["bf16_over_qlora"]) > 2 and float(glued["ignored_over_sharded"]) > 1
    # a 7B-shaped config counted: the saving shrinks as ranks are added (the scales stay whole), under 2 at 8
    saving = {int(n): float(x) for n, x in re.findall(r"7B, (\d) rank\(s\): .*\((\S+) times less\)", text)}
    assert list(saving) == [1, 2, 8] and saving[1] > 3 > saving[2] > saving[8] and saving[8] < 2, saving


def test_qlora_pitfalls_each_fails_as_reported_and_its_fix_works(executed):
    text = _text_outputs(executed["qlora_pitfalls"])
    # sharded before it was quantised: bitsandbytes' bare assertion; quantised first, it shards and runs
    assert re.search(r"sharded, then moved:\n  +assert module\.weight\.shape\[1\] == 1\n  AssertionError", text), text
    assert "quantised, then sharded: Params4bit of torch.uint8, output (1, 128)" in text
    # a policy that casts the codes to another dtype breaks bf16-stored ones; bf16 to bf16, or uint8, trains
    assert re.search(
        r"torch\.bfloat16 +codes, param_dtype=torch\.float32 *:\n  RuntimeError: shape '\[\d+, \d+\]' is invalid", text
    )
    trains = {
        " ".join(case.split()): float(value)
        for case, value in re.findall(
            r"(torch\.\w+ +codes, param_dtype=torch\.\w+) *: trains, largest relative difference from fp32 (\S+)", text
        )
    }
    assert trains.keys() == {
        "torch.bfloat16 codes, param_dtype=torch.bfloat16",
        "torch.uint8 codes, param_dtype=torch.float32",
    }
    assert trains["torch.uint8 codes, param_dtype=torch.float32"] <= 1e-4  # fp32 rounding; NaN fails
    assert trains["torch.bfloat16 codes, param_dtype=torch.bfloat16"] <= 0.05  # the adapters in bf16 too
    # bf16-stored codes include NaN bit patterns; on these CPU ranks FSDP2's gather keeps every bit
    found = re.search(r"(\d+) of (\d+) bf16 code words are NaN bit patterns; on the cpu, gathered by FSDP2 they "
                      r"keep their bits: (\w+); so does torch\._foreach_copy_: (\w+)", text)  # fmt: skip
    assert found and 0 < int(found[1]) < int(found[2]) / 100 and found[3] == found[4] == "True", text


def test_qlora_cpu_repack_changes_the_sharded_models_loss_and_stops_gradients_until_switched_off(executed):
    text = _text_outputs(executed["qlora_cpu_repack"])
    # the CPU repack: where this CPU has AVX512-BF16, one process loses the adapters' gradients after an
    # evaluation and 2 ranks evaluate twice differently; switched off, both agree and all adapters learn
    cases = {
        (who, repack): (float(a), float(b), int(got), int(of))
        for who, repack, a, b, got, of in re.findall(
            r"(one process|2 ranks) +repack=(True|False) *: evaluations (\S+) then (\S+); then (\d+) of (\d+) adapters",
            text,
        )
    }
    assert len(cases) == 3 and all(math.isfinite(c[0]) and math.isfinite(c[1]) for c in cases.values())
    off = cases[("2 ranks", "False")]
    assert off[0] == off[1] and off[2] == off[3] > 0
    assert abs(off[0] - cases[("one process", "True")][0]) < 1e-3  # the same model: the first evaluation agrees
    if "this CPU has AVX512-BF16: True" in text:
        one_process, sharded = cases[("one process", "True")], cases[("2 ranks", "True")]
        assert one_process[0] == one_process[1] and one_process[2] == 0
        assert sharded[0] == one_process[0] != sharded[1] and sharded[2] == 0  # right once, then another loss
    else:  # no conversion on this CPU: every case as the switched-off one
        assert all(c[0] == c[1] and c[2] == c[3] for c in cases.values())


def test_qlora_adapters_saved_whole_load_as_trained_and_merge_losslessly_only_dequantised(executed):
    text = _text_outputs(executed["qlora_adapters"])
    # the model's own state dict holds DTensors: peft's save fails; rank 0's local tensors are half of each matrix
    assert "as given: RuntimeError: Attempted to access the data pointer on an invalid python storage" in text
    half = (
        r"local slices: model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight \(4, 128\)\n  RuntimeError: size mismatch"
    )
    assert re.search(half + r" for .*lora_\w\.default\.weight: copying a param with shape", text), text
    found = re.search(r"full: model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight \(8, 128\)\n  loads; largest logit "
                      r"difference from the trained model (\S+)", text)  # fmt: skip
    assert found and float(found[1]) <= 1e-5, text  # every rank's slice: the trained model (NaN fails)
    merges = ("4-bit base", "base dequantised to fp32", "base dequantised to bf16")
    rows = {cells[0]: cells[1:] for cells in map(_cells, text.splitlines()) if cells[0] in merges}
    assert tuple(rows) == merges, rows
    lost = {into: float(row[1]) for into, row in rows.items()}
    logits = {into: float(row[2]) for into, row in rows.items()}
    assert rows["4-bit base"][0] == "Linear4bit of torch.uint8" and rows["base dequantised to fp32"][0] == (
        "Linear of torch.float32"
    )
    # re-quantised, a large part of the update rounds away; dequantised to fp32, rounding only; bf16 between
    assert lost["4-bit base"] > 0.05 > lost["base dequantised to bf16"] > lost["base dequantised to fp32"]
    assert lost["base dequantised to fp32"] < 1e-5 and logits["base dequantised to fp32"] < 1e-4
    assert logits["4-bit base"] > 10 * logits["base dequantised to fp32"]
    assert "merging into the 4-bit base: UserWarning: Merge lora module to 4-bit linear" in text
    assert "merging into the base dequantised" not in text  # peft warns of the 4-bit merge alone
    base_alone = float(re.search(r"the base alone: largest logit difference from the trained model (\S+)", text)[1])
    assert base_alone > 1e-2 > float(found[1])  # training moved the logits; the saved adapters give them back
    glued = _glued(executed["qlora_adapters"])
    assert abs(float(glued["lost_base"]) - lost["4-bit base"]) < 0.01  # the prose's figure is the table's


def test_trainer_fsdp_shows_the_silent_ddp_fallback_and_the_keys_that_vanish(executed):
    text = _text_outputs(executed["trainer_fsdp"])
    # the Trainer with an FSDP2 config on CPU ranks: DDP, no FSDP module, one safetensors file
    built = {what.strip(): value for what, value in re.findall(r"^(.{24}) (.*)$", text, flags=re.M)}
    assert built["accelerate's type"] == "DistributedType.MULTI_CPU" and built["trainer.is_fsdp_enabled"] == "False"
    assert built["the model trained"] == "DistributedDataParallel" and built["any FSDP module"] == "False"
    assert built["a decoder layer"] == "LlamaDecoderLayer" and built["model files"] == "['model.safetensors']"
    # the lines that decide it, read from the installed accelerate: the plugin attached for these types only
    decided = text[
        text.index("accelerate/state.py, lines") : text.index("self.distributed_type = DistributedType.FSDP")
    ]
    assert "elif self.distributed_type in [" in decided and "DistributedType.MULTI_GPU," in decided
    assert "MULTI_CPU" not in decided and "ACCELERATE_USE_FSDP" in decided
    logged = [line for line in text.splitlines() if line.startswith("[rank0]")]  # all rank 0 printed
    assert logged and not any("fsdp" in line.lower() for line in logged), logged  # not a word of FSDP
    assert any("find_unused_parameters" in line for line in logged), logged  # DDP's own note, the one hint
    # keys transformers does not know vanish, silently; an FSDP_* variable turns checkpointing on
    rows = {row[0]: row[1:] for row in map(_cells, text.splitlines()) if len(row) == 6}
    assert rows.pop("config")[-1] == "warned or logged"  # the header
    plain = rows.pop("fsdp_config: {}")
    assert plain == ["OffloadPolicy()", "True", "False", "None", "(nothing)"], plain
    variable = rows.pop("FSDP_ACTIVATION_CHECKPOINTING=true in the environment")
    assert variable == ["OffloadPolicy()", "True", "True", "None", "(nothing)"], variable
    assert len(rows) == 3 and all(row == plain for row in rows.values()), rows  # each dropped, without a word


def test_world_sizes_says_what_is_bit_equal_from_its_own_runs_and_the_bugs_stand_far_above_rounding(executed):
    text = _text_outputs(executed["world_sizes"])
    rows = {row[0]: row[1:] for row in map(_cells, text.splitlines()) if len(row) == 5}
    assert rows.pop("run")[-1] == "bit-equal (gradients and weights) to"  # the header
    twins = {run: set(row[-1].split("; ")) - {"none"} for run, row in rows.items()}
    one = {"one process", "one process, again", "FSDP2, 1 rank", "DDP, 1 rank"}
    two = {"one process, 2 micro-batches", "FSDP2, 2 ranks", "DDP, 2 ranks"}
    four = {"FSDP2, 4 ranks", "FSDP2, 4 ranks again", "FSDP2, 4 ranks, use_deterministic_algorithms"}
    for group in (one, two, four):  # each bit-equal to the others of its group, and to nothing else
        for run in group:
            assert twins[run] == group - {run}, (run, twins[run])
    alone = set(rows) - one - two - four
    assert alone == {
        "one process, 4 micro-batches",
        "DDP, 4 ranks",
        "FSDP2, 2 ranks, same rows (a bug)",
        "FSDP2, 2 ranks, gradients summed (a bug)",
    }
    assert all(twins[run] == set() for run in alone), twins
    gaps = {run: [float(x) for x in row[:3]] for run, row in rows.items()}
    assert all(math.isfinite(x) for gap in gaps.values() for x in gap), gaps
    rounding = max(max(gap) for run, gap in gaps.items() if "bug" not in run)
    assert 0 < rounding < 1e-5, gaps  # close, not equal
    assert all(x == 0 for run in one for x in gaps[run]), gaps
    data_bug, scale_bug = gaps["FSDP2, 2 ranks, same rows (a bug)"], gaps["FSDP2, 2 ranks, gradients summed (a bug)"]
    assert min(data_bug) > 100 * rounding and scale_bug[1] > 100 * rounding, gaps  # both, in the first gradients
    glued = {name: float(value.strip("'").replace(",", "")) for name, value in _glued(executed["world_sizes"]).items()}
    assert glued["data_bug_over_floor"] > 100 and glued["scale_bug_over_floor"] > 100, glued
    # the scale bug barely shows in the losses: far below the data bug's, within 10 times rounding's
    assert glued["scale_bug_losses"] < 10 * glued["rounding_losses"] and scale_bug[0] < data_bug[0] / 100, glued


def test_checkpoint_variants_measures_each_variants_memory_and_recompute_with_gradients_unchanged(executed):
    text = _text_outputs(executed["checkpoint_variants"])
    rows = {row[0]: row[1:] for row in map(_cells, text.splitlines()) if len(row) == 8}
    assert rows.pop("variant")[0] == "activations held for backward, MiB"  # the header
    assert len(rows) == 8, rows
    held, flops = {v: float(r[0]) for v, r in rows.items()}, {v: float(r[2]) for v, r in rows.items()}
    peak = {v: float(r[1]) for v, r in rows.items()}
    assert all(math.isfinite(x) and x > 0 for x in (*held.values(), *flops.values(), *peak.values())), rows
    assert all(row[-1] == "equal" for row in rows.values()), rows  # the same gradients, bit for bit, on both ranks
    assert "no checkpointing's gradients finite and not all zero, on every rank: True" in text  # not equal as zeros
    # recomputed inside each unit: every variant gathers each block once forward, once backward (1 + 2 x 4)
    assert {(row[4], row[5]) for row in rows.values()} == {("9", "5")}, rows
    assert "the three each-block APIs hold the same bytes: True" in text
    block, child = held["each block (checkpoint_wrapper)"], held["each child of a block"]
    selective, offloaded = held["selective: matmuls saved"], held["each block, offloaded"]
    assert block < child < selective < held["none"] < held["offload to the host"], held
    assert offloaded == block, held  # on a CPU rank, each block's input copied once, in its place
    assert child > 1.3 * block, held  # each child's input kept: accelerate#3897
    assert all(flops[v] > 1.1 for v in rows if v.startswith("each")), flops  # the forward, again
    assert flops["selective: matmuls saved"] == flops["offload to the host"] == flops["none"] == 1.0, flops
    assert peak["each child of a block"] < peak["each block (checkpoint_wrapper)"] < peak["none"], peak
    found = re.search(r"set_checkpoint_early_stop\(False\)\): (\S+)× the matmul FLOPs", text)
    assert found and float(found[1]) > flops["each block (checkpoint_wrapper)"], text  # early stop skips work
    forward_peak = re.search(r"each child of a block: peak in the forward (\S+) MiB, in the step (\S+) MiB", text)
    assert forward_peak and float(forward_peak[1]) < float(forward_peak[2]), text  # the peak is the backward's
    # the cache left on: the recomputed attention meets twice the keys
    seq = re.search(r"^SEQ = (\d+)$", text, re.M)
    error = re.search(r"The size of tensor a \((\d+)\) must match the size of tensor b \((\d+)\)", text)
    assert seq and error and int(error[1]) == 2 * int(error[2]) == 2 * int(seq[1]), text
    glued = {
        name: float(value.strip("'").replace(",", ""))
        for name, value in _glued(executed["checkpoint_variants"]).items()
    }
    assert abs(glued["ac_held_block"] - block) <= 0.005 and glued["ac_child_over_block"] > 1.3, glued


def test_deepspeed_zero_stages_equal_fsdp2_bf16_matched_and_a_zero_checkpoint_resumed(executed):
    text = _text_outputs(executed["deepspeed_zero"])
    assert "every stage's losses and final weights equal FSDP2's on both ranks: True" in text
    assert "the losses fell: True" in text  # equal, and trained (a NaN loss fails the comparison)
    assert "DeepSpeed built its shared-memory extension: False" in text
    assert "DeepSpeed's gradient_clipping when the config leaves it out: 1.0" in text  # on by default
    page = executed["deepspeed_zero"]
    losses = _table_under(page, ["step", "FSDP2", "ZeRO-1", "ZeRO-2", "ZeRO-3"])
    assert len(losses) == 8 and all(len(row) == 4 and len(set(row)) == 1 for row in losses.values()), losses
    header = ["run", "distance to ZeRO-2's weights / its update", "weights that moved"]
    runs = _table_under(page, [*header, "losses and weights bit-equal to ZeRO-2's"])
    assert len(runs) == 6 and all(math.isfinite(float(row[0])) for row in runs.values()), runs
    distance = {name: float(row[0]) for name, row in runs.items()}
    moved = {name: float(row[1].rstrip("%")) for name, row in runs.items()}
    bf16_weights, policy = "weights in bf16 (no float32 copy)", "policy(bf16, float32)"
    rounded, matched = (f"policy(bf16, {dtype}), from bf16-rounded weights" for dtype in ("float32", "bf16"))
    assert runs.pop("ZeRO-2, bf16")[2] == "(itself)", runs  # the reference
    assert {name for name, row in runs.items() if row[2] == "True"} == {matched}, runs
    assert distance[matched] == 0 < distance[rounded] < distance[policy] < distance[bf16_weights], distance
    assert distance[rounded] < 0.1 * distance[policy], distance  # nearly all of it: the start
    assert moved[bf16_weights] < 50 and moved[policy] == moved[matched] == 100, moved  # most updates lost in bf16
    header = ["step", "ZeRO-3, uninterrupted", "the recipe, resumed", "weights only, Adam afresh"]
    resumed = _table_under(page, header)
    assert [len(row) == 3 and row[0] == row[1] != row[2] for row in resumed.values()] == [False] * 5 + [True] * 3
    assert len(resumed["5"]) == 3 and len(set(resumed["5"])) == 1, resumed  # the converted weights: equal
    assert "the resumed steps' losses equal ZeRO-3's: True" in text
    assert "weights only: the first resumed step's loss equal, the later ones not: True" in text
    assert float(resumed["8"][0]) < float(resumed["1"][0]), resumed  # it trained
    assert "clipped at 1.0 on steps: [1, 2, 3, 4, 5, 6, 7, 8]" in text  # equal with clipping at work


def test_muon_sharded_equals_one_process_torch_muon_right_but_chatty_shard_local_wrong(executed):
    text = _text_outputs(executed["muon"])
    found = re.search(r"rows 0-3 .* alone: max \|difference\| = (\S+)", text)
    assert found and float(found[1]) > 0.05, text  # the rows of the result are not the result for the rows
    assert re.search(r"FSDP2's forward and backward: .* bytes \(the same in every run: True\)", text)
    rows = {row[0]: row[1:] for row in map(_cells, text.splitlines()) if len(row) == 6}
    assert rows.pop("optimizer")[0] == "max |weight - one process|"  # the header
    torch_muon, local, sharded = rows["torch.optim.Muon"], rows["Muon on each shard"], rows["ShardedMuon"]
    # ShardedMuon: one process's weights bit for bit, in bf16 and in float32, two all-to-alls, fewer bytes than FSDP's
    assert float(sharded[0]) == 0.0 and float(sharded[1]) == 0.0 and sharded[2] == "2 all-to-all", sharded
    assert 0 < float(sharded[4]) < 1, sharded
    # torch's Muon: right up to bf16 rounding (float32 rounding when iterating in float32), many collectives
    assert 0 < float(torch_muon[0]) < float(local[0]) / 5 and float(torch_muon[1]) < 1e-6, torch_muon
    assert "all-gather" in torch_muon[2] and float(torch_muon[4]) > 1, torch_muon
    assert sum(int(n) for n in re.findall(r"(\d+) all-", torch_muon[2])) >= 24, torch_muon  # "dozens"
    # on each shard: no collective, and wrong whatever the precision (NaN fails these)
    assert local[2] == "none" and float(local[0]) > 1e-3 and float(local[1]) > 1e-3, local
    adamw = rows["AdamW"]  # pointwise: exact, nothing in its step
    assert float(adamw[0]) == 0.0 and float(adamw[1]) == 0.0 and adamw[2] == "none", adamw
    glued = _glued(executed["muon"])
    assert glued["gap_2"] == "'0.0e+00'" and float(glued["ratio_0"].strip("'")) > 1, glued


def test_peft_resume_loses_other_ranks_adapter_with_1_14_full_and_restores_every_slice_otherwise(executed):
    text = _text_outputs(executed["peft_resume"])
    # the Trainer's calls, read from the installed transformers: the adapter only, for both
    assert "save_fsdp_model( self.accelerator.state.fsdp_plugin" in text and "**get_fsdp_ckpt_kwargs()" in text
    assert "load_fsdp_model( self.accelerator.state.fsdp_plugin" in text
    assert "get_fsdp_ckpt_kwargs() = {'adapter_only': True}" in text
    assert "the Trainer, fsdp_config={'version': 2}: state_dict_type FULL_STATE_DICT" in text  # what a resume meets
    assert "Accelerate's plugin, fsdp_version=2: state_dict_type SHARDED_STATE_DICT" in text
    rows = [
        _cells(line) for line in text.splitlines() if line.startswith(("FULL_STATE_DICT  ", "SHARDED_STATE_DICT  "))
    ]
    found = {(row[0], row[1], row[2]): row[3:] for row in rows}
    assert len(found) == 8, rows
    for (state_dict_type, code, rank), (restored, zero, apart) in found.items():
        restored, size = map(int, restored.split(" of "))
        zero, same_size = map(int, zero.split(" of "))
        assert size == same_size > 0
        if (state_dict_type, code) == ("FULL_STATE_DICT", "accelerate 1.14"):
            assert float(apart) > 1e-6, apart  # both ranks resume on a changed model; NaN fails this
            lost = rank == "rank 1"  # rank 1's slice lost, silently; rank 0's back
            assert (restored, zero) == ((0, size) if lost else (size, 0)), (rank, restored, zero)
        else:
            assert (restored, zero, float(apart)) == (size, 0, 0.0), (state_dict_type, code, rank)
    # 1.14's file holds rank 0's local rows of each adapter; 1.15's the whole tensor
    assert re.search(r"1\.14's file, 8 tensors; \S+lora_B\.weight: DTensor of shape \(64, 8\) holding \(32, 8\)", text)
    assert re.search(
        r"1\.15's file, 8 tensors; \S+lora_B\.default\.weight: Tensor of shape \(64, 8\) holding \(64, 8\)", text
    )
    # the code the page describes, as installed: #4206's branch, 1.14's path after it, the empty dict
    assert "if sd_options is not None and sd_options.full_state_dict:" in text
    assert "return get_peft_model_state_dict(model, adapter_name=model.active_adapter)" in text
    assert "load_model = not accelerator.is_fsdp2 or accelerator.is_main_process" in text
    assert "state_dict = {}" in text
    # the check finds the lost rank, and only it; 1.15 cannot read 1.14's file
    assert "saved by accelerate 1.14, loaded by 1.14: lora_B all zero on ranks [1]" in text
    assert "saved by accelerate 1.15, loaded by 1.15: lora_B all zero on ranks []" in text
    assert re.search(r"saved by accelerate 1\.14, loaded by 1\.15: NotImplementedError: .*c10d\.broadcast_", text)
    glued = _glued(executed["peft_resume"])
    size = re.fullmatch(r"'0 of (\d+)'", glued["lost_restored"])  # the prose's figures: none back, all zero
    assert size and glued["lost_zero"] == f"'{size[1]} of {size[1]}'", glued


def test_fsdp_config_map_is_accelerates_as_it_is_and_by_hand_trains_the_same(executed):
    text = _text_outputs(executed["fsdp_config_map"])
    # what Accelerate builds from the config on ranks whose state it attached the plugin to
    after = text[text.index("and Accelerate does:\n") :].splitlines()[1:]
    steps = list(itertools.takewhile(lambda line: line.startswith("  "), after))
    assert [step.strip() for step in steps] == [
        "fully_shard(LlamaDecoderLayer, reshard_after_forward=True)",
        "fully_shard(LlamaDecoderLayer, reshard_after_forward=True)",
        "fully_shard(Embedding, reshard_after_forward=True)",
        "fully_shard(LlamaRMSNorm+Linear, reshard_after_forward=False)",
        "fully_shard(LlamaForCausalLM)",
        "saved: .bin",
    ], steps
    # the map: each key's plugin argument and what Accelerate then does differently. Exact, so that a
    # transformers or accelerate that maps a key otherwise fails here, and the page is read again.
    rows = [_cells(line) for line in text.splitlines() if re.match(r"\S+( \(TrainingArguments\))?: \S", line)]
    rows = {row[0]: row[1:] for row in rows if len(row) == 3}
    assert rows == {
        "reshard_after_forward: False": [
            "reshard_after_forward=False",
            "fully_shard(LlamaDecoderLayer, reshard_after_forward=False) ×2; "
            "fully_shard(Embedding, reshard_after_forward=False)",
        ],
        "transformer_layer_cls_to_wrap: ['LlamaMLP']": [
            "transformer_cls_names_to_wrap=LlamaMLP",
            "fully_shard(LlamaMLP, reshard_after_forward=True) ×2",
        ],
        "activation_checkpointing: True": [
            "activation_checkpointing=True",
            "fully_shard(CheckpointWrapper, reshard_after_forward=True) ×2; "
            "2 checkpoint wrappers, 0 holding parameters of their own",
        ],
        "cpu_ram_efficient_loading: True": [
            "cpu_ram_efficient_loading=True",
            "rank 0's weights broadcast (fsdp2_load_full_state_dict)",
        ],
        "state_dict_type: SHARDED_STATE_DICT": ["state_dict_type=SHARDED_STATE_DICT", "saved: .distcp, .metadata"],
        "cpu_offload: True": [
            "cpu_offload=True",
            "fully_shard(LlamaDecoderLayer, reshard_after_forward=True, CPUOffloadPolicy); "
            "RuntimeError: Cannot access accelerator device when none is available.",
        ],
        "bf16 (TrainingArguments): True": [
            "(none)",
            "every unit: MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=bfloat16, output_dtype=bfloat16, "
            "cast_forward_inputs=True)",
        ],
    }, rows
    # by hand: the same units, the same losses bit for bit, and they fall
    losses = {
        who: [float(x) for x in found.split()]
        for who, found in re.findall(r"^(Accelerate|by hand) *: rank 0's losses ([\d. ]+);", text, flags=re.M)
    }
    assert losses.keys() == {"Accelerate", "by hand"} and losses["Accelerate"] == losses["by hand"]
    assert losses["by hand"][-1] < losses["by hand"][0] and "the same losses, bit for bit: True" in text
    units = set(re.findall(r"FSDP units (\[.*\])", text))
    assert len(units) == 1 and units.pop().count("FSDPLlamaDecoderLayer") == 2


def test_lora_measures_states_trains_like_one_process_and_exports_exactly(executed):
    text = _text_outputs(executed["lora"])
    lines = text.splitlines()

    def row(prefix):
        return next(line for line in lines if line.startswith(prefix))

    # fine-tuning, then rank 0's model states in MiB: params, grads, optimizer, total
    tables = [cells for cells in map(_cells, lines) if len(cells) == 5]
    states = {cells[0]: [float(x) for x in cells[1:]] for cells in tables if cells[0] in ("full fine-tuning", "LoRA")}
    assert len(states) == 2
    full, lora = states["full fine-tuning"][-1], states["LoRA"][-1]
    assert lora < full / 3  # the frozen base has no gradients or optimizer state
    # adapt: once per rank on the structure, and once more on rank 0, on the whole pretrained model
    given = [
        (line.split(":")[0], float(line.split()[2]), line.endswith("True"))
        for line in lines
        if line.startswith("rank ") and "parameters on the" in line
    ]
    assert [(who, pretrained) for who, _, pretrained in given] == [
        ("rank 0", False),
        ("rank 0", True),
        ("rank 1", False),
    ]
    params_kept = states["LoRA"][0]
    # the same fp32 model every time; the pretrained one, on rank 0, about twice what a rank keeps (the prose's claim)
    assert len({mib for _, mib, _ in given}) == 1 and 1.9 * params_kept < given[1][1] < 2.1 * params_kept
    assert (given[1][1], params_kept) == (15.07, 7.59)  # bytes from the shapes alone; docs/fsdp_tips.rst types both
    assert float(text.split(" trainable (")[1].split("%")[0]) < 1  # the adapters: "under 1% of the parameters"
    for how in ("full fine-tuning  measured", "LoRA              measured"):
        assert abs(float(row(how).rsplit("(", 1)[1].rstrip("%)"))) < 0.05  # measure agrees with estimate
    assert float(text.split("largest relative difference: ")[1].split()[0]) < 1e-5
    # step, loss on 2 ranks, loss in 1 process: the 5 steps, the losses falling
    losses = [[float(x) for x in cells[1:]] for cells in map(_cells, lines) if len(cells) == 3 and cells[0].isdigit()]
    assert [len(step) for step in losses] == [2] * 5 and losses[-1][0] < losses[0][0]
    assert "logits equal the sharded model's: True" in text
    trainable = int(text.split(" trainable (")[0].rsplit(" ", 1)[1].replace(",", ""))
    file_kib = int(text.split("'adapter_model.safetensors'] (")[1].split(" KiB)")[0])
    assert trainable * 4 / 2**10 <= file_kib <= 1.1 * trainable * 4 / 2**10  # the fp32 adapters only, and a header
    assert float(row("merged model").rsplit(" ", 1)[1]) < 1e-4
    assert _glued(executed["lora"]).keys() >= {
        "lora_loaded_mib",
        "lora_kept_mib",
        "lora_adapter_file_kib",
        "lora_trainable",
        "lora_adapter_kib",
    }


def test_frozen_weights_dtype_rule_its_fixes_and_the_traffic_of_a_frozen_base(executed):
    text = _text_outputs(executed["frozen_weights"])
    lines = text.splitlines()

    def row(prefix):
        return next(line for line in lines if line.startswith(prefix))

    assert row("LoRA on a frozen bf16 base").endswith(": runs")
    assert "FSDP expects uniform original parameter dtype" in row("LoRA, bf16 norms trained too")
    table = {cells[0]: cells[1:] for cells in map(_cells, lines)}
    # frozen, trained dtypes; units, all-gathers per forward, rank 0 model states in MiB
    names = {
        "LoRA on the frozen": "LoRA on the frozen bf16 base",
        "1. adapters": "1. adapters in their own units",
        "2. fp32": "2. fp32 storage, bf16 compute",
        "3. adapters": "3. adapters cast to bf16",
    }
    fixes = {fix: table[name][-3:] for fix, name in names.items()}
    assert all(len(table[name]) == 5 for name in names.values())
    units, gathers, states = ({fix: float(v[i]) for fix, v in fixes.items()} for i in range(3))
    assert units["LoRA on the frozen"] == gathers["LoRA on the frozen"] == 5  # one unit per layer, and the root
    assert units["1. adapters"] == gathers["1. adapters"] == 5 + 16  # and one per adapter module
    # the fp32 base "about twice the model states" of the first fix; the third fix the smallest
    assert 1.8 * states["1. adapters"] < states["2. fp32"] < 2.2 * states["1. adapters"]
    assert states["3. adapters"] < states["1. adapters"]
    assert "1 + 1/300 = 1.0033 in fp32, 1.0000 in bf16" in text  # the update bf16 adapters lose
    modes = ("reshard after forward", "kept from forward to backward", "kept gathered across micro-batches")
    traffic = {mode: [float(x) for x in table[mode]] for mode in (*modes, "replicated")}
    assert all(len(row) == 9 for row in traffic.values())
    # per micro-batch 1-4 (base sizes gathered), per step, all-gathers, reductions, held in forward, held between
    resharded, kept, window, replicated = traffic.values()
    assert all(1.9 < resharded[i] < 2.1 and 0.95 < kept[i] < 1.05 for i in range(4))
    assert window[1:4] == [0, 0, 0] and window[0] == kept[0]
    assert replicated[:6] == [0, 0, 0, 0, 0, 0]  # no all-gather called at all
    assert resharded[5] == 40 and kept[5] == 20 and window[5] == 5
    assert resharded[6] == kept[6] == window[6] == replicated[6] == 4  # adapters reduced once per step, per layer
    # the prose's claims: resharded holds the least in forward; kept across micro-batches, it holds between them
    # what kept holds when forward ends; replicated, the base twice (its "shard" and FSDP's copy), more than kept
    assert resharded[7] < min(kept[7], window[7], replicated[7]) and window[8] == window[7] == kept[7]
    assert 1.9 < replicated[7] < 2.1 and replicated[7] > kept[7]
    # bytes from the shapes alone, the same on any machine; docs/fsdp_tips.rst (tip-frozen-weight-traffic) types them
    assert resharded[:4] == [2.01] * 4 and kept[:4] == [1.01] * 4
    assert resharded[7] == 0.95 and kept[7] == 1.51 and replicated[7] == 2.01
    assert resharded[8] < 0.6 and kept[8] < 0.6 and 1.4 < window[8] < 1.6 and 0.95 < replicated[8] < 1.1
    assert _glued(executed["frozen_weights"]).keys() >= {
        "frozen_resharded_gathered",
        "frozen_resharded_held",
        "frozen_kept_gathered",
        "frozen_kept_held",
        "frozen_replicated_held",
        "frozen_resharded_gathers",
        "frozen_reductions",
    }


def test_debugging_hangs_shows_every_tool_on_the_uneven_batches_hang_and_the_fix(executed):
    text = _text_outputs(executed["debugging_hangs"])
    drawn = next(c for c in executed["debugging_hangs"].cells if "draw_flight_recorder(" in c.source)
    assert [out["data"].keys() >= {"image/png"} for out in drawn.outputs] == [True]  # who waits for whom, drawn once
    lines = text.splitlines()

    def line(prefix):
        return next(line for line in lines if line.startswith(prefix))

    assert "default_pg_timeout): 0:30:00" in text
    assert "default_pg_nccl_timeout on this build:" in text  # the value docs/fsdp.rst's NCCL section refers to
    assert line("rank 0: innermost 'all_reduce', called from ['line").endswith("dist.all_reduce(total)']")
    assert "total += model(" in line("rank 1: innermost 'all_gather_single', called from ['line")
    detail = int(re.search(r"rank 0 is running collective number (\d+): ALLREDUCE", text)[1])
    assert f"rank 1 is running collective number {detail}: _ALLGATHER_BASE" in text
    assert "RuntimeError: [Rank 0]: Rank 1 failed to pass monitoredBarrier" in text
    assert "RuntimeError: Detected mismatch between collectives on ranks" in text  # DETAIL's error, as raised
    assert "LaunchError: the ranks did not finish within timeout=6 s; still running: ranks 0, 1." in text
    # flight recorder of hang 1: the same number on both ranks, different operations; numbered from 1, DETAIL from 0
    fr = text.split("rank 0's last collectives")[1].split("torchfrtrace on gloo")[0]
    rank0, rank1 = (part.strip().splitlines()[-1].split() for part in fr.split("rank 1's last collectives"))
    assert rank0[:2] == [rank1[0], "gloo:all_reduce"] and rank1[1] == "gloo:all_gather"
    assert int(rank0[0]) == detail + 1  # the same collective: the recorder numbers from 1, DETAIL from 0
    # torch's analyser cannot read gloo's dumps as they are (should torch fix that, the page must say so)
    assert "torchfrtrace on gloo's dumps: KeyError looking up group '0'" in text
    assert "(pg_config): {'': {'name': ''" in text and "entries name:         ('0', 'default_pg')" in text
    assert (
        f"by rank: collective {rank0[0]} has errors, COLLECTIVE_TYPE_MISMATCH: rank 0 ran all_reduce, "
        "rank 1 ran all_gather"
    ) in text
    # the analyser's "culprit" is whichever dump it read second, in the file system's order the page prints
    read = re.findall(r"fr_trace_rank_(\d)", line("the order the analyser reads the dumps"))
    assert sorted(read) == ["0", "1"]
    assert all(culprit == read[1] for culprit in re.findall(r"Culprit rank (\d+)", text))
    assert "batches evaluated per rank: [2, 2]" in text
    # rank 0 ended the dump hang itself, once every rank's dump was written
    assert text.count("the hang ended: rank 0 stopped by SIGTERM") == 1
    glued = _glued(executed["debugging_hangs"])  # the number the prose quotes, as its text
    assert glued["hang1_mismatch"] == rank0[0]


def test_hang_branch_shows_the_tools_pointing_past_the_branch_its_stacks_finding_it_and_the_fix(executed):
    text = _text_outputs(executed["hang_branch"])
    drawn = next(c for c in executed["hang_branch"].cells if "draw_flight_recorder(" in c.source)
    assert [out["data"].keys() >= {"image/png"} for out in drawn.outputs] == [True]  # who waits for whom, drawn once
    lines = text.splitlines()
    # both ranks wait in backward; DETAIL, the analyser and the stacks point past where they parted
    branch = [line for line in lines if line.startswith(("rank 0 called the expert", "rank 1 called"))]
    assert branch[0].startswith("rank 0 called the expert: True") and branch[1].startswith(
        "rank 1 called the expert: False"
    )
    assert all(line.endswith("y.sum().backward()']") for line in branch)
    parted = int(
        re.search(r"rank 0 raised before its collective number (\d+): _REDUCE_SCATTER_BASE of \[272\]", text)[1]
    )
    assert f"rank 1 raised before its collective number {parted}: _ALLGATHER_BASE of [136]" in text
    # the prose quotes the numbers (glued); what it claims of them: the analyser's mismatch (from 1) is
    # DETAIL's (from 0), asserted just below, one past where the recorder's table shows the ranks parting
    glued = _glued(executed["hang_branch"])  # each glued value, as its text
    assert glued.keys() >= {
        "hang2_detail_mismatch",
        "hang2_detail_passed",
        "hang2_mismatch",
        "hang2_matched",
        "hang2_parted",
    }
    assert glued["hang2_parted"] == glued["hang2_detail_mismatch"] == str(parted)
    assert glued["hang2_detail_passed"] == str(parted - 1)
    # the pair that matched
    assert glued["hang2_mismatch"] == str(parted + 1) and glued["hang2_matched"] == glued["hang2_parted"]
    assert (
        f"torchfrtrace, by rank: collective {parted + 1} has errors, COLLECTIVE_TYPE_MISMATCH: rank 0 ran all_reduce, "
        "rank 1 ran all_gather"
    ) in text
    # 3  all_gather [136], pre_forward, y = body(x)  all_gather [136], pre_forward, y = body(x): #, rank 0, rank 1
    rows = {
        int(cells[0]): cells[1:]
        for cells in map(_cells, lines)
        if len(cells) == 3 and cells[0].isdigit() and re.match(r"all_(gather|reduce) \[", cells[1])
    }
    assert all(
        len(rows[n]) == 2 and all(cell.endswith("pre_forward, y = body(x)") for cell in rows[n])
        for n in range(1, parted)
    )
    # the recorder's stacks show where the ranks parted
    assert rows[parted][0].endswith("pre_forward, y = expert(y)")
    assert rows[parted][1] == "all_gather [136], pre_backward, y.sum().backward()"
    assert any(cell.startswith("all_reduce [272], post_backward") for cell in rows[parted + 1])
    # the fix: the expert's gradient is the mean over the ranks' batches, not the rank's own
    grads = [
        [float(x) for x in re.findall(r"\d\.\de[+-]\d+", line)]
        for line in lines
        if re.match(r"rank \d finished; its expert gradient", line)
    ]
    assert len(grads) == 2 and all(to_mean < 1e-5 and to_own > 1e-2 for to_mean, to_own, _ in grads)
    assert grads[1][2] == 0 < grads[0][2]  # rank 1's branch never used the expert


def test_hang_state_dict_shows_py_spy_on_a_gather_on_rank_0_only_and_the_fix(executed):
    text = _text_outputs(executed["hang_state_dict"])
    lines = text.splitlines()
    # what the py-spy section states of the installed py-spy, printed: the refusal and the syscall it names
    assert "asked for both (exit status 1): Can't get native stack traces with the --nonblocking option" in text
    assert "process_vm_readv named in the binary: True" in text and re.search(r"^py-spy \d+\.\d+", text, re.M)
    assert next(line for line in lines if line.startswith("-n, --native")).startswith(
        "-n, --native Collect stack traces from native extensions"
    )
    # rank 0 ended the py-spy hang itself, once every rank's dump was written
    assert text.count("the hang ended: rank 0 stopped by SIGTERM") == 1
    spy0, spy1 = (
        text.split("rank 0, main thread, innermost first")[1]
        .split("tensors in the saved")[0]
        .split("rank 1, main thread")
    )
    assert "pthread_cond_wait" in spy0 and "c10d::Work::wait" in spy0 and "c10d::wait_tensor" in spy0
    assert "get_model_state_dict (" in spy0 and "DTensor.redistribute" in spy0 and "\n    wait_tensor (" in spy0
    assert "c10d::Work::wait" in spy1 and "barrier (" in spy1 and "get_model_state_dict" not in spy1
    assert "file written: True" in text
    # the flight recorder: each rank waits in its first collective, an all-gather on rank 0, a barrier on rank 1
    assert re.search(r"^rank 0: 1 collective\(s\); waits in #1, gloo:all_gather\w*$", text, re.M), text
    assert re.search(r"^rank 1: 1 collective\(s\); waits in #1, gloo:barrier$", text, re.M), text
    drawn = next(c for c in executed["hang_state_dict"].cells if "draw_flight_recorder(" in c.source)
    assert [out["data"].keys() >= {"image/png"} for out in drawn.outputs] == [True]  # who waits for whom, drawn once


def test_set_order_sums_wrong_on_cold_ranks_right_on_warm_ones_and_right_sorted(executed):
    text = _text_outputs(executed["set_order"])
    drawn = next(c for c in executed["set_order"].cells if "paired_wrong" in c.source)
    assert [out["data"].keys() >= {"image/png"} for out in drawn.outputs] == [True]  # the pairing, drawn once
    # warm ranks share the server's hash seed, cold ones (as torchrun's) do not: see fsdp_guide._warm
    assert re.search(
        r"set order, cold \(as torchrun\) +warm=False +same order on both ranks: False +"
        r"every sum right: False",
        text,
    )
    assert re.search(
        r"set order, warm \(forked\) +warm=True +same order on both ranks: True +every sum right: True", text
    )
    assert re.search(
        r"sorted, cold \(as torchrun\) +warm=False +same order on both ranks: True +every sum right: True", text
    )


def test_loss_and_accumulation_measures_normalisation_errors_per_rank_and_under_accumulation(executed):
    text = _text_outputs(executed["loss_and_accumulation"])
    lines = text.splitlines()

    def rows(first):  # the rows of the page's tables whose first cell is `first`
        return [_cells(line) for line in lines if _cells(line)[0] == first]

    assert "real tokens per rank: [75, 120]" in text  # the weights the page's prose works out
    reference = float(text.split("one process: loss ")[1].split()[0])
    per_rank, times_ranks, factor_one = (
        rows(how)[0] for how in ("per-rank mean", "global count x ranks", "global count, divide factor 1")
    )
    # what the prose says of its (glued) figures: the per-rank mean's gradient far from one process's, its
    # logged loss off too; the global count's within float32 rounding
    assert float(per_rank[-1]) > 0.1 and float(per_rank[-2]) != reference
    assert float(times_ranks[-1]) < 1e-6 and float(factor_one[-1]) < 1e-6
    assert _glued(executed["loss_and_accumulation"]).keys() >= {
        "per_rank_error",
        "per_rank_logged",
        "one_process_loss",
        "global_count_error",
        "rank0_tokens",
        "rank1_tokens",
        "rank0_weight",
        "rank1_weight",
        "all_tokens",
    }
    glued = _glued(executed["loss_and_accumulation"])  # the weights the prose gives follow from the counts
    assert int(glued["rank0_weight"]) == 2 * int(glued["rank0_tokens"]) != int(glued["all_tokens"])
    assert float(times_ranks[-2]) == float(factor_one[-2]) == reference
    # gloo refuses FSDP's PREMUL_SUM; should it gain the op, the page says so and this fails on purpose
    assert "a rank raised RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo" in text
    assert "rank 0: [31, 44] rank 1: [57, 63]" in text
    (naive,) = rows("micro-batch mean / micro-batches")
    accumulated = rows("global count, divide factor 1")[1]
    # the prose's (glued) claim: the usual recipe's error is further from one process than the per-rank mean's
    assert float(naive[-1]) > float(per_rank[-1]) and float(accumulated[-1]) < 1e-6
    assert "accumulated_mean_error" in _glued(executed["loss_and_accumulation"])


def test_no_sync_measures_traffic_and_gradient_memory_with_and_without_the_sync(executed):
    text = _text_outputs(executed["no_sync"])
    drawn = next(c for c in executed["no_sync"].cells if "gradients held on a rank" in c.source)
    assert [out["data"].keys() >= {"image/png"} for out in drawn.outputs] == [True]  # held per micro-batch, drawn
    lines = text.splitlines()

    def rows(mode):
        return [cells for cells in map(_cells, lines) if cells[0] == mode]

    def costs(mode, table):  # [(all-gathers, bytes), (reduce-scatters, bytes), (all-reduces, bytes)], held, error
        cells = rows(mode)[table]
        assert len(cells) == 9
        values = [float(v) for v in cells[1:7]]
        return [values[0:2], values[2:4], values[4:6]], [float(h) for h in cells[7].split()], float(cells[8])

    tables = {
        (mode, table): costs(mode, table)
        for mode, table in [
            ("sync every micro-batch", 0),
            ("no sync until the last", 0),
            ("sync every micro-batch", 1),
            ("no all-reduce until the last", 0),
            ("no sync until the last", 1),
        ]
    }
    for (mode, table), (traffic, held, error) in tables.items():
        assert traffic[0] == [20, 6.91]  # 5 all-gathers per micro-batch, whatever the mode: 1.73 P
        assert error < 1e-6  # one process's gradient in every mode
        hsdp = table == 1 or mode.startswith("no all-reduce")
        if mode.startswith("no sync"):
            assert traffic[1] == [3, 1.0] and held == [1.0, 1.0, 1.0, 0.5]
            assert traffic[2] == ([3, 0.5] if hsdp else [0, 0.0])
        else:
            assert traffic[1] == [12, 4.0] and held == [0.5] * 4
            assert traffic[2] == ([3, 0.5] if mode.startswith("no all-reduce") else [12, 2.0] if hsdp else [0, 0.0])
    assert _glued(executed["no_sync"]).keys() >= {  # the traffic the prose quotes, from the tables
        "gathers_per_micro_batch",
        "gathered_per_micro_batch",
        "scatters_synced",
        "scattered_synced",
        "scatters_unsynced",
        "scattered_unsynced",
        "held_synced",
        "held_unsynced",
        "hsdp_reduces_synced",
        "hsdp_reduced_synced",
        "hsdp_reduces_once",
        "hsdp_reduced_once",
        "hsdp_held_reduced_once",
    }


def test_beyond_the_step_measures_evaluation_and_generation(executed):
    text = _text_outputs(executed["beyond_the_step"])
    rows = {cells[0]: cells[1:] for cells in (_cells(line) for line in text.splitlines())}
    # all-gathers in forwards 1, 2, 3; held / P after each; after reshard(); plain after forward 3, after reshard()
    default, kept = rows["None (the default)"], rows["False"]
    assert len(default) == len(kept) == 5
    default_held, kept_held = default[1].split(), kept[1].split()
    assert default[0].split() == ["3", "2", "2"] and kept[0].split() == ["3", "0", "0"]  # the root stays gathered
    assert float(default_held[0]) > 0.6 and float(kept_held[0]) == 1.5 and default[2] == kept[2] == "0.50"
    # the prose's claims: the default holds its shards plus the root whole, False the whole model beside its shards
    assert float(default[2]) < float(default_held[0]) < 1
    assert float(kept_held[0]) == pytest.approx(1 + float(kept[2]), abs=0.011)
    # bytes from the shapes alone; docs/fsdp_tips.rst types 0.77 P (the prose glues it)
    assert default_held == ["0.77"] * 3
    n_params = int(text.split("plain: how many of the ")[1].split()[0])
    assert 0 < int(default[3]) < n_params and int(kept[3]) == n_params  # gathered: plain tensors in parameters()
    assert default[4] == kept[4] == "0"  # and shards again after reshard()
    # loss, examples, batches per rank
    one = float(rows["one process"][0])
    padded, exact = rows["DistributedSampler (pads)"], rows["every example once"]
    assert padded[1] == "10" and float(padded[0]) != one and padded[2] == "3, 3"  # an example counted twice
    assert exact[1] == "9" and abs(float(exact[0]) - one) < 1e-5 and exact[2] == "3, 2"
    # all-gathers, per new token, held / P, tokens as one process
    resharded, gathered = rows["resharded after each forward"], rows["kept gathered (reshard_after_forward=False)"]
    assert resharded[-1] == gathered[-1] == "True"  # one process's tokens either way
    assert int(resharded[0]) == 3 + 2 * 5 and int(gathered[0]) == 3 and float(gathered[2]) == 1.5
    assert resharded[1] == "2.17"  # the tip's all-gathers per token
    assert float(resharded[2]) == float(default_held[0])  # the root left gathered, as in evaluation
    assert "False -> RuntimeError: aten.embedding.default got mixed torch.Tensor and DTensor" in text
    assert "True  -> features of shape (1, 8, 32)" in text
    # generating kept gathered holds what evaluation with False holds
    assert float(gathered[2]) == float(kept_held[0])
    assert _glued(executed["beyond_the_step"]).keys() >= {
        "bts_eval_default_held",
        "bts_eval_shards",
        "bts_eval_kept_held",
        "bts_generation_kept_held",
        "bts_padded_examples",
        "bts_exact_examples",
        "bts_generation_gathers",
        "bts_new_tokens",
    }


def test_ema_and_teacher_keeps_a_second_copy_on_the_shards(executed):
    text = _text_outputs(executed["ema_and_teacher"])
    lines = text.splitlines()
    assert "FSDP does not support deepcopy" in text
    assert "collectives in 8 EMA updates: 0; EMA model per rank: 0.50 P" in text
    trained = float(text.split("trained model vs one process's: largest difference ")[1].split()[0])
    ema = float(text.split("exported EMA vs one process's:  largest difference ")[1].split()[0])
    assert trained < 1e-4 and ema <= 2 * trained
    assert "loads into a plain GPT: <All keys matched successfully>" in text
    assert "from 1 towards 2: 1.0010 in fp32, 1.0000 in bf16" in text  # an EMA update bf16 rounds away
    # teacher root, model, all-gathers in steps 1, 2, model states held / P
    teachers = [cells for cells in map(_cells, lines) if cells[0] in ("default", "reshard_after_forward=True")]
    assert [cells[:2] for cells in teachers] == [
        [root, who] for root in ("default", "reshard_after_forward=True") for who in ("teacher", "student")
    ]
    teachers = [[*cells[2].split(), cells[3]] for cells in teachers]
    (t1, t2, t_held), (s1, s2, s_held), (r1, r2, r_held), (q1, q2, q_held) = teachers
    # the default teacher holds what evaluation's root left gathered (0.77 P, as beyond_the_step's test checks),
    # the resharded one its shards (0.50 P)
    assert (t1, t2, t_held) == ("3", "2", "0.77") and (r1, r2, r_held) == ("3", "3", "0.50")
    assert s1 == s2 == q1 == q2 == "5" and s_held == q_held == "1.50"
    # the prose's claim: the student holds its shards of 3 copies (parameters, AdamW's two moments)
    assert float(s_held) == pytest.approx(3 * float(r_held), abs=0.011)
    assert _glued(executed["ema_and_teacher"]).keys() >= {
        "bts_student_held",
        "bts_teacher_default_held",
        "bts_teacher_resharded_held",
    }


def _numbers_after(lines, prefix):
    """The numbers on the first line that starts with prefix, after it (not those right after a letter or "(")."""
    line = next(line for line in lines if line.startswith(prefix))
    return [float(x) for x in re.findall(r"(?<![\w(])-?\d+(?:\.\d+)?(?:e-?\d+)?", line.removeprefix(prefix))]


def test_tensor_parallel_shows_the_2d_layout_and_the_collectives_of_one_step_per_mesh_dimension(executed):
    text = _text_outputs(executed["tensor_parallel"])
    drawn = next(c for c in executed["tensor_parallel"].cells if "def owners(" in c.source)
    assert [out["data"].keys() >= {"image/png"} for out in drawn.outputs] == [True]  # the layouts, drawn once
    lines = text.splitlines()

    def numbers(prefix):
        return _numbers_after(lines, prefix)

    rows = [_cells(line) for line in lines]
    assert ["2", "1", "0", "[0, 2]", "[2, 3]"] in rows  # rank 2: dp 1, tp 0, its dp group, its tp group
    # FSDP splits each TP shard's rows: rank 2 (dp 1, tp 0) holds rows 8:16 of q, not 16:24
    assert ["2 (1, 0)", "[8:16, :]", "[16:32, 0:16]", "[16:32]", "[128:256, :]"] in rows
    assert "_StridedShard(dim=0, sf=2) over dp=2, Shard(dim=0) over tp=2" in text
    # the collectives table (a Table: its text form, one row per setup and mesh dimension)
    assert re.search(r"^setup\s+dim\s+all-gathers\s+gathered / P\s+reduce-scatters", text, re.M)
    fsdp, tp = numbers("FSDP alone (dp=4)"), numbers("TP alone (tp=4)")
    assert fsdp[0] == 5 and fsdp[2:4] == [3, 1.0] and fsdp[-2] == 0.25  # (..., params held / P, saved KiB)
    assert 1 < fsdp[1] < 2  # the glued all-gathers: every unit in the forward, the blocks again in the backward
    assert tp[:2] == [10, 1.22] and tp[2] == 8 and tp[4] == 24  # activations; norms' grads
    assert 0.25 < tp[-2] < 1  # glued: more than a quarter, the embeddings and norms being whole on every rank
    assert fsdp[-3] == 0 and tp[-3] == 24  # collectives inside optimizer.step(): TP alone's 24 all run there
    both = lines.index(next(line for line in lines if line.startswith("FSDP x TP (2 x 2)")))
    dp_row, tp_row = numbers("FSDP x TP (2 x 2)"), [float(x) for x in lines[both + 1].split()[1:]]
    assert lines[both + 1].split()[0] == "tp"
    assert dp_row[0] == 5 and dp_row[2:4] == [3, 0.63] and 0.25 < dp_row[-2] < 0.4  # held: glued, about a third
    # glued: smaller all-gathers than FSDP alone, blocks half-size, root whole
    assert 0.5 * fsdp[1] < dp_row[1] < fsdp[1]
    assert dp_row[-3] == 0  # FSDP reduces the partial norms' gradients before the step
    assert tp_row[0] == 10 and tp_row[2] == 8 and tp_row[4] == 8
    assert 0 < tp_row[5] < 0.05  # glued: the norms' gradients all-reduced once, a sliver of the model
    no_sp = numbers("FSDP x TP, no seq. parallel")
    no_sp_tp = lines[lines.index(next(line for line in lines if line.startswith("FSDP x TP, no seq. parallel"))) + 1]
    # all-reduces only, no all-gather: as many and as large (glued) as sequence parallelism's reduce-scatters
    assert [float(x) for x in re.findall(r"\d+(?:\.\d+)?", no_sp_tp)] == tp_row[2:4]
    # glued: sequence parallelism saves activations, a little (less than a fifth) here
    assert no_sp[-2] == dp_row[-2] and 0.8 * no_sp[-1] < dp_row[-1] < no_sp[-1]
    # the figures the prose quotes, glued from the table these assertions read
    assert _glued(executed["tensor_parallel"]).keys() >= {
        "tp_fsdp_moved",
        "tp_fsdp_gathered",
        "tp_alone_gathers",
        "tp_alone_scatters",
        "tp_alone_reduces",
        "tp_alone_held",
        "tp_2d_gathers",
        "tp_2d_gathered",
        "tp_2d_held",
        "tp_2d_norm_reduces",
        "tp_2d_norm_reduced",
        "tp_nosp_reduces",
        "tp_nosp_reduced",
        "tp_saved_sp",
        "tp_saved_nosp",
    }


def test_tp_exactness_trains_as_one_process_and_tells_fsdp_x_tp_from_hsdp(executed):
    text = _text_outputs(executed["tp_exactness"])
    one = text.split("one process  losses ")[1].splitlines()[0]
    assert text.split("FSDP x TP    losses ")[1].splitlines()[0] == one
    exact, wrong = (float(x.split()[0]) for x in text.split("parameters after 3 steps: largest difference ")[1:3])
    assert exact < 1e-4 and wrong > 100 * exact
    assert "(no error raised)" in text and "{'dp rows': True, 'rank quarters': False}" in text
    fsdp_tp, hsdp = text.split("FSDP x TP:\n")[1], text.split("fully_shard(mesh=2D mesh):\n")[1]
    held = float(fsdp_tp.split("params held ")[1].split()[0])
    assert "q's output on a rank (4, 16, 16); params held " in fsdp_tp
    assert 0.25 < held < 0.4  # about a third, as in the collectives table (tensor_parallel's test)
    # glued: each counts 4 all-gathers, one fewer than the collectives table's 5 (tensor_parallel's test), the
    # root left gathered by the forward before
    assert "('dp', 'all-gather', 4)" in fsdp_tp and "('tp', 'all-gather', 4)" in hsdp
    assert _glued(executed["tp_exactness"])["tp_trap_gathers"] == "4"
    assert "Replicate() over dp=2, Shard(dim=0) over tp=2" in hsdp
    assert "q's output on a rank (4, 16, 32); params held 0.50 P" in hsdp and "('dp', 'all-reduce', 3)" in hsdp
    assert fsdp_tp.split("loss ")[1].split()[0] == hsdp.split("loss ")[1].split()[0]  # both train the same


def test_tp_exactness_names_the_data_parallel_dimensions_with_dp_mesh_dims(executed):
    text = _text_outputs(executed["tp_exactness"])
    layouts = dict(re.findall(r"^(.*): DataParallelMeshDims.*\n((?:  .*\n){3})", text, re.M))
    hsdp, both, tp = (
        layouts[k]
        for k in ("HSDP: replicate over x, shard over y", "FSDP over both: shard over (x, y)", "FSDP over x, TP over y")
    )
    assert "0.weight  Replicate() over x=2, Shard(dim=0) over y=2" in hsdp
    assert "0.weight  Shard(dim=0) over x_y=4" in both  # the two dimensions flattened into one
    assert "0.weight  _StridedShard(dim=0, sf=2) over x=2, Shard(dim=0) over y=2" in tp
    assert "2.weight  Shard(dim=0) over x=2, Shard(dim=1) over y=2" in tp  # TP's columns, FSDP's rows
    for layout in (hsdp, both, tp):
        assert float(layout.rsplit("=", 1)[1]) < 1e-6  # one process's weights


def test_tp_gradients_shows_partial_sums_clipping_across_meshes_and_implicit_replication(executed):
    text = _text_outputs(executed["tp_gradients"])
    lines = text.splitlines()

    def numbers(prefix):
        return _numbers_after(lines, prefix)

    # TP alone: each rank's to_local() of a norm's gradient is one term; the 4 sum to one process's
    assert "blocks.0.ln_1.weight.grad: (Partial(sum),); parameters with a partial gradient: 8" in text
    largest = float(text.split("the gradient's largest entry: ")[1].split(")")[0])
    # each rank misses the gradient (the glued smallest miss) by a sizeable part of its largest entry (glued)
    assert all(numbers(f"rank {r}: to_local()")[-1] >= 0.2 * largest for r in range(4))
    assert numbers("the 4 ranks' to_local() summed")[0] < 1e-3 * largest
    assert "step, left partial   (dim, kind, n, bytes): [('tp', 'all-reduce', 24," in text
    assert "reducing once        (dim, kind, n, bytes): [('tp', 'all-reduce', 8," in text
    assert "step, reduced        (dim, kind, n, bytes): no collective" in text
    assert _glued(executed["tp_gradients"]).keys() >= {
        "tp_partial_miss",
        "tp_grad_largest",
        "tp_partial_params",
        "tp_partial_step_reduces",
        "tp_partial_once_reduces",
    }
    assert (
        "clip_grad_norm_ on every parameter: RuntimeError: All operands in aten.stack.default must have the same mesh"
    ) in text
    assert (
        "clip_grads_with_norm_ on every parameter: RuntimeError: Cannot run aten.mul.Tensor on inputs with "
        "different meshes"
    ) in text
    one_norm, total = numbers("one process total norm")
    assert abs(one_norm - total) < 1e-6 and numbers("clipped gradients vs one process's")[0] < 1e-7
    # TP alone: plain tensors next to DTensors fail in clipping and foreach AdamW, run under implicit_replication
    assert "TP alone, parameter types: ['DTensor', 'Parameter']" in text
    mixed = "got mixed torch.Tensor and DTensor"
    assert mixed in next(line for line in lines if line.startswith("clip_grad_norm_  "))
    assert mixed in next(line for line in lines if line.startswith("AdamW(foreach=True).step"))
    implicit_norm, implicit_one_norm, implicit_difference = numbers("under implicit_replication(): total norm")
    assert abs(implicit_norm - one_norm) < 1e-6 and implicit_one_norm == one_norm and implicit_difference < 1e-4


def test_loss_parallel_splits_the_edge_layers_by_vocabulary_and_never_gathers_the_logits(executed):
    text = _text_outputs(executed["loss_parallel"])
    lines = text.splitlines()
    drawn = next(c for c in executed["loss_parallel"].cells if "draw_sharding(" in c.source)
    assert [out["data"].keys() >= {"image/png"} for out in drawn.outputs] == [True]  # the three weights, drawn once

    def numbers(prefix):
        return _numbers_after(lines, prefix)

    # the embedding and output layer plans (a Table): layouts, collectives, and the unsharded module's output
    names = (
        "embedding, vocabulary-split",
        "embedding, vocabulary-split, output along the sequence",
        "embedding, dimension-split",
        "output layer, logits gathered",
        "output layer, logits left split",
    )
    # a row: its plan's name, then at least two spaces (a longer name goes on with ", ")
    found = {name: re.search(rf"^{re.escape(name)} {{2,}}(.*)$", text, re.M) for name in names}
    assert all(found.values()), found
    edge = {name: row[1] for name, row in found.items()}
    edge["same, output along the sequence"] = edge.pop("embedding, vocabulary-split, output along the sequence")
    assert re.search(
        r"\(128, 32\) Shard\(dim=0\)\s+\(4, 16, 32\) Tensor\s+all-reduce 1 8192", edge["embedding, vocabulary-split"]
    )
    assert re.search(r"\(4, 8, 32\) Tensor\s+reduce-scatter 1 8192", edge["same, output along the sequence"])
    assert re.search(r"\(256, 16\) Shard\(dim=1\)\s+\(4, 16, 16\) Tensor\s+none", edge["embedding, dimension-split"])
    assert re.search(r"\(4, 16, 256\) Tensor\s+all-gather 1 65536", edge["output layer, logits gathered"])
    assert re.search(r"\(4, 16, 128\) Shard\(dim=2\)\s+none", edge["output layer, logits left split"])
    assert len(edge) == 5 and all(float(row.split()[-1]) < 1e-6 for row in edge.values())
    # loss parallel: a quarter of the logits per rank, never gathered; one process's loss and gradients
    one_loss = numbers("one process on the global batch: loss")[0]
    plans = {
        name: numbers(name)
        for name in (
            "TP alone, the blocks' plan",
            "TP alone, logits gathered",
            "TP alone, loss parallel",
            "FSDP x TP, loss parallel",
        )
    }
    # held, full, gathers n, bytes, [reduces n, bytes], loss, grads
    page, gathered, parallel, with_fsdp = plans.values()
    assert page[:2] == gathered[:2] == [131072, 131072] and parallel[:2] == [32768, 131072]
    assert with_fsdp[:2] == [32768, 65536]
    assert gathered[2:4] == [page[2] + 1, page[3] + 131072] and parallel[2:4] == page[2:4]  # no logits all-gather
    assert gathered[4:6] == [2, 2 * 16384]  # the embedding's output, the output layer's input gradient
    assert parallel[4:6] == [gathered[4] + 3, gathered[5] + 3 * 512]  # 3 all-reduces of one float per token
    for row in plans.values():
        assert abs(row[-2] - one_loss) < 2e-6 and row[-1] < 1e-6
    assert text.count("untied by the plans, tied again: True") == 3
    assert re.search(r"^plan\s+logits on a rank / full \(bytes\)\s+tp all-gathers", text, re.M)  # the Table's header
    assert _glued(executed["loss_parallel"]).keys() >= {
        "tp_emb_reduce_bytes",
        "tp_logits_gather_bytes",
        "tp_logits_bytes",
        "tp_extra_gather_bytes",
        "tp_hidden_reduce_bytes",
        "tp_lp_reduce_bytes",
    }


def test_tp_attention_needs_heads_that_divide_and_says_context_parallelism_does_not_run_on_the_cpu(executed):
    text = _text_outputs(executed["tp_attention"])
    drawn = next(c for c in executed["tp_attention"].cells if "draw_sharding(" in c.source)
    assert [out["data"].keys() >= {"image/png"} for out in drawn.outputs] == [True]  # k's rows and heads, drawn
    lines = text.splitlines()
    # GQA: heads and KV heads must each divide by the TP degree
    # 4  1  (4, 32)  RuntimeError: ...: heads, KV heads, k.weight on a rank, the forward's outcome
    gqa = {(row[0], row[1]): row[2:] for row in map(_cells, lines) if len(row) == 4 and row[2].startswith("(")}
    assert gqa[("4", "2")][1].startswith("runs; output vs unsharded")
    assert gqa[("6", "2")][1].startswith("runs; output vs unsharded")
    assert all(float(gqa[h][1].split()[-1]) < 1e-5 for h in (("4", "2"), ("6", "2")))
    assert gqa[("4", "1")][0] == "(4, 32)"
    assert gqa[("4", "1")][1].startswith("RuntimeError: shape '[2, 8, -1, 8]' is invalid for input of size 64")
    assert gqa[("6", "3")][0] == "(12, 32)"
    assert gqa[("6", "3")][1].startswith("RuntimeError: shape '[2, 8, -1, 8]' is invalid")
    # The page's prose says CP does not handle the CPU's attention operator: its output must show it.
    assert (
        "NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default "
        "does not have a sharding strategy registered"
    ) in text


def test_tp_checkpoints_loads_a_2d_checkpoint_on_a_1d_mesh_and_exports_it_exactly(executed):
    text = _text_outputs(executed["tp_checkpoints"])
    assert "exported file into a plain GPT: <All keys matched successfully>" in text
    assert "step 2; 1D parameters equal the 2D ones exactly: True" in text
    assert (
        "AdamW's first moments equal exactly: True" in text
        and "exported file equals the 2D parameters exactly: True" in text
    )
    assert "the 2D run's own export equals them exactly: True" in text
    # DCP's metadata: one chunk of the weight per rank of the 2 x 2 run, exactly the block that rank held
    chunks = re.findall(
        r"^chunk \[(\d+):(\d+), 0:32\] in __(\d)_0\.distcp; rank (\d) of the 2 x 2 run held \[(\d+):(\d+), :\]$",
        text,
        re.M,
    )
    assert sorted(writer for _, _, writer, _, _, _ in chunks) == ["0", "1", "2", "3"]
    assert all((start, stop) == (r0, r1) for start, stop, _, _, r0, r1 in chunks)  # the block its writer held
    assert sorted(int(start) for start, *_ in chunks) == [0, 8, 16, 24] and all(
        int(b) - int(a) == 8 for a, b, *_ in chunks
    )
    drawn = next(c for c in executed["tp_checkpoints"].cells if "draw_sharding(" in c.source)
    assert [out["data"].keys() >= {"image/png"} for out in drawn.outputs] == [True]  # saved and loaded, drawn once


def test_compile_shows_where_to_compile_and_how_to_measure_it(executed):
    text = _text_outputs(executed["compile"])
    lines = text.splitlines()
    backend = text.split("backend: ")[1].split()[0]
    assert backend in ("inductor", "aot_eager")
    # compiled, losses, params vs eager, graphs, linears per graph, AG+RS, compiled runs
    places = ("eager", "each block, after fully_shard", "each block, before fully_shard", "whole model")
    rows = {cells[0]: cells[1:] for cells in (_cells(line) for line in lines) if cells[0] in places}
    assert rows.keys() == set(places) and all(len(row) == 6 for row in rows.values())
    eager_losses = rows["eager"][0].split()
    assert len(eager_losses) == 3
    assert rows["eager"][-1] == "0"  # nothing compiled ran
    for where in places[1:]:
        losses, difference, graphs, linears, collectives, runs = rows[where]
        losses, difference = losses.split(), float(difference)
        assert (graphs, linears) == ("1", "[6]")  # one graph, a block's, shared by both blocks
        assert runs == "2"  # the profiled step ran the compiled graph, once per block
        assert collectives == rows["eager"][-2]  # FSDP's all-gathers + reduce-scatters unchanged
        assert difference == 0.0 if backend == "aot_eager" else difference < 1e-4
        assert losses == eager_losses or backend == "inductor"
    assert "whole model, dynamo: graph break in loop" in text  # the root's frame, run eagerly
    assert "fullgraph=True, each block   -> compiles" in text
    assert "fullgraph=True, whole model  -> Unsupported: Attempted to call function marked as skipped" in text
    # a dispatch mode makes dynamo run the frame eagerly, then and afterwards, until reset()
    runs = {line[:36].strip(): line.split()[-1] for line in lines if "compiled block graph ran" in line}
    assert runs == {
        "a step": "2x",
        "a step under a TorchDispatchMode": "0x",
        "a step after it": "0x",
        "a step after torch._dynamo.reset()": "2x",
    }
    assert "torch.compile(block): blocks.0._orig_mod.ln_1.weight" in text
    assert "block.compile():      blocks.0.ln_1.weight" in text
    # the wrapped block's checkpoint, loaded into an eager block: torch's own message names both sets of keys
    assert re.search(
        r'Missing key\(s\) in state_dict: "ln_1.weight".*\n\s*Unexpected key\(s\) in state_dict: '
        r'"_orig_mod.ln_1.weight"',
        text,
    )


def test_compile_recompiles_shows_what_recompiles_and_what_dynamo_reports(executed):
    text = _text_outputs(executed["compile_recompiles"])
    lines = text.splitlines()
    graphs = {line[:30].strip(): int(line[30:].split()[0]) for line in lines if line.endswith("graph(s)")}
    assert graphs == {
        "train step 1": 1,
        "train step 2": 1,
        "model.eval(), a forward": 1,
        "model.eval() under no_grad": 2,
        "model.train(), a step": 2,
        "reshard_after_forward=False": 2,
        "a step on 16 tokens": 3,
        "a step on 24 tokens": 3,
        "a step on 8 tokens": 3,
    }
    # the two remedies, run: neither has fewer graphs than none at the end; none recompiles once, then reuses
    remedies = {
        line.split()[0]: [int(n) for n in re.findall(r"\d+", line.split("tokens: ")[1])]
        for line in lines
        if "graphs after steps on 32" in line
    }
    assert remedies["none"] == [1, 2, 2, 2]
    assert remedies["dynamic=True"][-1] >= remedies["none"][-1] and remedies["mark_dynamic"] == remedies["none"]
    # TORCH_LOGS: the break at FSDP's disable wrapper, the root's frame skipped; the recompile's guard
    assert "Graph break in user code at torch/distributed/fsdp/_fully_shard/_fsdp_common.py" in text
    assert "frame skipped: forward (fsdp_guide/gpt.py" in text and "x = block(x)" in text
    assert "Recompiling function forward in fsdp_guide/gpt.py" in text
    assert "tensor 'x' size mismatch at index 1. expected 32, actual 16" in text
    explained = text.split("torch._dynamo.explain(model): ")[1].splitlines()[0]
    assert "'graphs': 1, 'graph breaks': 0, 'break reasons': 0" in explained and "'linears per graph': [6]" in explained


def test_compile_checkpointing_shows_each_order_saves_and_trains(executed):
    text = _text_outputs(executed["compile_checkpointing"])
    lines = text.splitlines()
    # order, graphs, linears per graph, saved KiB, params vs no checkpointing
    names = ("no checkpointing, eager", "checkpointing, eager", "checkpoint, then compile", "compile, then checkpoint")
    orders = {cells[0]: cells[1:] for cells in (_cells(line) for line in lines) if cells[0] in names}
    assert orders.keys() == set(names) and all(len(row) == 4 for row in orders.values())
    saved = {order: float(row[2]) for order, row in orders.items()}
    assert all(float(row[3]) == 0.0 for row in orders.values())  # checkpointing changes no number
    assert orders["checkpoint, then compile"][:2] == ["1", "[0]"] and orders["compile, then checkpoint"][:2] == [
        "1",
        "[6]",
    ]
    assert saved["checkpointing, eager"] == saved["compile, then checkpoint"] < saved["checkpoint, then compile"]
    assert saved["checkpoint, then compile"] < saved["no checkpointing, eager"] / 2
    rng_kib = float(text.split("the CPU generator's state: ")[1].split()[0])
    assert abs(saved["checkpoint, then compile"] - saved["checkpointing, eager"] - 2 * rng_kib) < 1.5  # one per block
    # the prose quotes the extra (glued) and claims it is the generator's state, once per block (2)
    glued = _glued(executed["compile_checkpointing"])
    assert glued.keys() >= {"compile_ac_extra_kib"}
    assert abs(float(glued["compile_ac_extra_kib"]) - 2 * rng_kib) < 1.0
    # ... and the saved tensors show it: two uint8 tensors of the generator state's size, in the compiled order only
    state_bytes = int(text.split("a uint8 tensor of ")[1].split()[0])
    kinds = {
        order: line.split(f"saved for backward, {order}: ")[1]
        for line in lines
        for order in ("checkpointing, eager", "checkpoint, then compile")
        if f"saved for backward, {order}: " in line
    }
    assert (
        f"2 x uint8 [{state_bytes}]" in kinds["checkpoint, then compile"]
        and "uint8" not in kinds["checkpointing, eager"]
    )


def test_compiled_autograd_loses_the_root_callback_and_the_optimizer_step_compiles(executed):
    text = _text_outputs(executed["compiled_autograd"])
    lines = text.splitlines()
    # compiled autograd: the root's final callback and its reduce-scatter never happen
    # one step, eager backward, compiled autograd
    names = (
        "all-gathers",
        "reduce-scatters",
        "root's final callback",
        "compiled autograd graphs",
        "graph breaks",
        "sharded parameters with a grad",
        "left unsharded after backward",
    )
    ca = {cells[0]: cells[1:] for cells in (_cells(line) for line in lines) if cells[0] in names}
    assert ca.keys() == set(names) and all(len(row) == 2 for row in ca.values())
    assert ca["all-gathers"][0] == ca["all-gathers"][1]
    assert int(ca["reduce-scatters"][1]) == int(ca["reduce-scatters"][0]) - 1
    assert ca["root's final callback"] == ["1", "0"]
    assert (
        int(ca["compiled autograd graphs"][1]) > 1 and ca["graph breaks"][0] == "0" and int(ca["graph breaks"][1]) > 0
    )
    (eager_grads, of), (compiled_grads, of_too) = (cell.split(" of ") for cell in ca["sharded parameters with a grad"])
    assert eager_grads == of == of_too and int(compiled_grads) == int(eager_grads) - 4
    assert ca["left unsharded after backward"] == ["0", "4"]
    assert "block parameters' gradients vs eager: 0.0e+00" in text
    for name in ("tok_emb.weight", "pos_emb.weight", "ln_f.weight", "ln_f.bias"):
        line = next(line for line in lines if line.startswith(f"{name:15} gradient vs eager"))
        own, mean = float(line.split("rank 0's ")[1].split(",")[0]), float(line.split("mean over ranks ")[1])
        assert own > 1e-3 and mean < 1e-7  # this rank's own gradient; the average is eager's
    assert "graph breaks, by reason: ['Call to `torch._dynamo.graph_break()`']" in text  # the optimizer's own
    # the compiled optimizer step: one graph on DTensors, run every step, no collectives, close to eager
    assert "compiled optimizer.step: 1 graph(s), with [14] DTensor inputs, for 14 parameters" in text
    # the real group's flag: set on GPUs only
    assert "the compiled graph ran 3x in 3 steps" in text and "capturable: [False]" in text
    # no collective of any kind, counted by a count that sees an all-reduce when one runs
    assert "collectives in the compiled steps: none (around one all-reduce: {'c10d::allreduce_': 1})" in text
    difference = float(text.split("parameters after 3 steps vs eager AdamW: max |difference| ")[1].split()[0])
    assert 0 < difference < 1e-4
    # the difference is there without AOTAutograd (backend='eager'): it comes from what dynamo traces
    dynamo_only = float(text.split("no AOTAutograd): ")[1].split()[0])
    assert 0 < dynamo_only < 1e-4


def test_interactive_keeps_the_ranks_across_cells_recovers_from_a_failure_and_runs_the_script(executed):
    nb = executed["interactive"]

    def text_of(cell) -> str:
        return _text_outputs(SimpleNamespace(cells=[cell]))

    cells = [c for c in nb.cells if c.cell_type == "code"]
    placements = text_of(next(c for c in cells if "named_parameters()" in c.source and "%%ranks" in c.source))
    # the same on both ranks: shown once; each parameter split by rows, half each
    assert placements.startswith("[ranks 0, 1]\n") and placements.count("(Shard(dim=0),)") == 4, placements
    assert "0.weight (8, 6) (Shard(dim=0),) shard (4, 6)" in placements
    rows = text_of(next(c for c in cells if "to_local()[:, :3]" in c.source))
    assert "[rank 0]" in rows and "[rank 1]" in rows  # each rank's own rows: shown apart
    step = text_of(next(c for c in cells if ".backward()" in c.source and "grad.placements" in c.source))
    assert step.strip() == "[ranks 0, 1]\nDTensor (Shard(dim=0),) (4, 6)", step
    check = text_of(next(c for c in cells if "torch.equal(full[0], full[1])" in c.source))
    assert "both ranks gathered the same weight: True" in check and "it is the unsharded model's: True" in check
    summoned = text_of(next(c for c in cells if "with summon_full_params(model):" in c.source))
    assert "inside:  Parameter (8, 6)" in summoned and "outside: DTensor (4, 6)" in summoned, summoned
    kept = text_of(next(c for c in cells if "reshard_after_forward=False" in c.source and "%%ranks" in c.source))
    assert "default                     0.weight after forward: DTensor, after backward: DTensor" in kept, kept
    assert "reshard_after_forward=False 0.weight after forward: Parameter, after backward: DTensor" in kept, kept
    failing = next(c for c in cells if "raises-exception" in c.metadata.get("tags", []))
    assert "NameError: name 'loss' is not defined" in text_of(failing)
    error = "\n".join(next(o for o in failing.outputs if o.output_type == "error").traceback)
    assert "rank 0 raised NameError" in error and "did not end the cell" in error and "restarted" in error
    assert "[rank1]" in error and "in all_reduce" in error and "line 3 in <module>" in error
    assert float(_glued(nb)["live_faster"]) > 3  # a cell on live ranks costs a small part of a launch
    script = text_of(next(c for c in cells if c.source.startswith("%torchrun")))
    for rank in (0, 1):
        assert f"[rank0] rank {rank}: full 0.weight equals the unsharded model's: True" in script, script


def test_quickstart_shows_real_rank_output_and_the_equality_check(executed):
    text = _text_outputs(executed["quickstart"])
    assert "[rank0] step  0  loss" in text and "[rank1]" not in text
    # parameter, full shape, rank 0 holds, rank 1 holds
    shapes = {cells[0]: cells[1:] for cells in (_cells(line) for line in text.splitlines()) if len(cells) == 4}
    assert shapes["layers.0.weight"] == ["(64, 16)", "(32, 16)", "(32, 16)"]
    for api in ("FSDP2", "FSDP1"):
        line = next(ln for ln in text.splitlines() if ln.startswith(f"{api} on 2 ranks vs 1 process"))
        assert float(line.rsplit("=", 1)[1]) <= 1e-5


def test_summon_full_params_tutorial_shows_exact_init_and_training(executed):
    text = _text_outputs(executed["summon_full_params"])
    assert "rank 0: FSDP2 init equals single process exactly: True" in text
    assert "rank 1: FSDP2 init equals single process exactly: True" in text
    assert "FSDP1 init equals single process exactly: True" in text
    assert "tied inside the context: True" in text and "still tied: True" in text
    # FSDP1's embedding called outside the root's forward fails, and runs inside summon_full_params
    assert "use_orig_params=False: RuntimeError: setStorage:" in text and "out of bounds for storage of size 0" in text
    assert "use_orig_params=True: RuntimeError: 'weight' must be 2-D" in text
    assert text.count("in summon_full_params: (1, 4, 16)") == 2


def test_enable_wrap_tutorial_measures_wrap_as_you_build(executed):
    text = _text_outputs(executed["enable_wrap"])
    assert "FSDP1 unit 2       sharding_strategy=FULL_SHARD" in text
    assert "FSDP2 unit 1 after forward: weight is a Parameter" in text
    assert "FSDP2 unit 2 after forward: weight is a DTensor" in text
    # build, most between blocks, ratio, after sharding
    builds = ("build, then wrap", "wrap as you build", "meta device, shard, to_empty")
    rows = {cells[0]: cells[1:] for cells in (_cells(line) for line in text.splitlines()) if cells[0] in builds}
    assert rows.keys() == set(builds) and all(len(row) == 3 for row in rows.values())
    ratios = {name: float(row[1]) for name, row in rows.items()}  # max parameter bytes / building first's
    # The prose quotes building first's share of the model and wrapping as you build's ratio (glued); what it
    # claims of them: building first holds the whole model (100%); wrapping as you build, 15/16 · 1/2 + 1/16 of
    # it on 2 ranks; on meta, the shards only: 1/world_size
    full_model = int(re.search(r"full model: ([\d,]+) bytes", text)[1].replace(",", ""))
    assert int(rows["build, then wrap"][0].replace(",", "")) == full_model and ratios["build, then wrap"] == 1.0
    assert ratios["wrap as you build"] == round(15 / 16 * 1 / 2 + 1 / 16, 2)
    assert ratios["meta device, shard, to_empty"] == 1 / 2
    assert _glued(executed["enable_wrap"]).keys() >= {"wrap_build_first", "wrap_as_you_build"}


def test_deterministic_init_tutorial_reproduces_the_bug_and_every_fix(executed):
    text = _text_outputs(executed["deterministic_init"])
    assert text.count("rank 0's rows == rank 1's rows: True") == 2  # on purpose, and via meta + to_empty
    assert "16x16 weight initialised after sharding: rank 8 of 16" in text
    # the prose quotes the 32x16 weight's rank (glued) and claims it full, "rank 16 too", like independent numbers'
    full, possible = (int(v) for v in re.search(r"matrix rank: (\d+) of a possible (\d+)", text).groups())
    assert full == possible == 16 and _glued(executed["deterministic_init"]).keys() >= {"sharded_init_rank"}
    assert "DTensor random operators may not have complete support on cpu device mesh" in text
    assert text.count("equals the single process exactly: True") == 4
    assert "forward before to_empty: RuntimeError: FSDP parameters should be materialized from meta device" in text
    assert "to() instead of to_empty: NotImplementedError: Cannot copy out of meta tensor; no data!" in text


def test_state_attributes_tutorial_shows_the_timelines(executed):
    text = _text_outputs(executed["state_attributes"])
    drawn = next(c for c in executed["state_attributes"].cells if "def element_ranges(" in c.source)
    assert [out["data"].keys() >= {"image/png"} for out in drawn.outputs] == [True]  # FSDP1's and FSDP2's split, drawn
    lines = {
        row[0]: row[1:]
        for row in (_cells(line) for line in text.splitlines())
        if row[0] in ("inside forward", "after backward")
    }
    assert "_shard_param_infos" in text and "_unpadded_unsharded_size" in text
    assert "rank 1  placements           (Shard(dim=0),)" in text
    assert text.count("inside forward") == 2 and text.count("after optimizer step") == 2
    assert lines  # the two timeline tables were printed
    # The prose quotes the splits, the flat lengths, rank 1's positions and the timelines' bytes (glued); what it
    # claims of them: torch.chunk splits the rows evenly on 2 ranks; FSDP1 flattens every parameter into one
    # vector (its _unpadded_unsharded_size), half on each rank; rank 1 holds the rest of 0.weight at the start
    # of its shard, then all of 0.bias; FSDP2's full weight is twice its shard; FSDP1's weight is freed outside
    # forward and backward, its flat parameter a 4-byte-per-number shard outside the computation, the whole inside
    tables = {
        (api, int(rank)): {row[0]: row for row in (re.split(r"\s{2,}", line) for line in body.splitlines()[2:])}
        for api, rank, body in re.findall(r"(FSDP[12]), rank (\d):\n(.*?)\ntotal local bytes", text, re.S)
    }

    def numel(shape):  # "(6, 8)" -> 48
        n = 1
        for d in re.findall(r"\d+", shape):
            n *= int(d)
        return n

    for name in ("0.weight", "2.weight"):
        rows = [int(re.findall(r"\d+", tables[("FSDP2", rank)][name][2])[0]) for rank in (0, 1)]
        assert rows[0] == rows[1] == int(re.findall(r"\d+", tables[("FSDP2", 0)][name][1])[0]) / 2
    flat = sum(numel(row[1]) for row in tables[("FSDP1", 0)].values())
    assert [sum(numel(row[2]) for row in tables[("FSDP1", rank)].values()) for rank in (0, 1)] == [flat / 2] * 2
    assert re.search(rf"_unpadded_unsharded_size +Size +torch.Size\(\[{flat}\]\)", text)
    weight, bias = tables[("FSDP1", 1)]["0.weight"], tables[("FSDP1", 1)]["0.bias"]
    on_rank0 = numel(tables[("FSDP1", 0)]["0.weight"][2])
    rest = numel(weight[1]) - on_rank0
    assert weight[4] == f"elements {on_rank0}:{numel(weight[1])} (flattened)" and weight[3].startswith(
        f"at [0:{rest}] "
    )
    assert bias[4] == f"elements 0:{numel(bias[1])} (flattened)" and bias[3].startswith(
        f"at [{rest}:{rest + numel(bias[1])}] "
    )
    # the two timeline Tables, FSDP2's then FSDP1's (its header the one with "weight's bytes"): when, then values
    fsdp2, fsdp1 = (
        {
            row[0]: row[1:]
            for row in (_cells(line) for line in part.splitlines())
            if row[0] in ("before forward", "inside forward", "after backward")
        }
        for part in text.split("weight's bytes", 1)
    )
    assert int(fsdp2["inside forward"][2]) == 4 * numel(weight[1]) == 2 * int(fsdp2["before forward"][2])
    assert fsdp1["before forward"][2] == fsdp1["after backward"][2] == "0"
    assert int(fsdp1["before forward"][3]) == 4 * flat // 2 and int(fsdp1["inside forward"][3]) == 4 * flat
    assert _glued(executed["state_attributes"]).keys() >= {
        "sa_small_rows_0",
        "sa_small_rows_1",
        "sa_large_rows_0",
        "sa_large_rows_1",
        "sa_flat_numel",
        "sa_flat_shard",
        "sa_r1_weight_elements",
        "sa_r1_weight_at",
        "sa_r1_bias_at",
        "sa_fsdp2_full_bytes",
        "sa_fsdp2_shard_bytes",
        "sa_fsdp1_freed_bytes",
        "sa_fsdp1_shard_bytes",
        "sa_fsdp1_full_bytes",
    }


def test_pitfalls_tutorial_shows_each_wrong_way_of_the_step_failing_and_the_fix(executed):
    text = _text_outputs(executed["pitfalls"])
    assert "optimizer built before sharding: losses [1.15356, 1.15356, 1.15356]" in text
    orders = {
        line[:30].strip(): line[30:]
        for line in text.splitlines()
        if line.startswith(("optimizer, then forward", "forward, then optimizer", "forward, reshard()"))
    }
    assert orders["forward, then optimizer"] == " the optimizer holds ['Parameter']; losses [1.15356, 1.15356, 1.15356]"
    assert orders["optimizer, then forward"] == orders["forward, reshard(), optimizer"]  # the shards, and it trains
    assert (
        "['DTensor']" in orders["optimizer, then forward"]
        and "[1.15356, 1.15356" not in orders["optimizer, then forward"]
    )
    rows = {
        tuple(line.split()[:2]): line.split(maxsplit=2)[2]
        for line in text.splitlines()
        if line.startswith(("AdamW ", "Adafactor ", "Muon "))
    }
    assert rows[("AdamW", "FSDP2")] == rows[("AdamW", "FSDP1")] == "0.0e+00"  # pointwise: exactly DDP
    assert rows[("Adafactor", "FSDP2")].startswith("RuntimeError") and float(rows[("Adafactor", "FSDP1")]) > 1e-3
    assert float(rows[("Muon", "FSDP2")]) > 1e-4 and rows[("Muon", "FSDP1")].startswith(
        "ValueError: Muon only supports 2D"
    )
    in_float32 = float(
        next(ln for ln in text.splitlines() if ln.startswith("Muon, FSDP2, iterating in float32")).split()[-1]
    )
    assert in_float32 < 1e-6  # the Muon difference is bfloat16 rounding, nothing else


def test_outside_forward_tutorial_shows_each_wrong_way_failing_and_the_fix(executed):
    text = _text_outputs(executed["outside_forward"])
    strategy = {
        line[:18].strip(): line[18:]
        for line in text.splitlines()
        if line.startswith(("on the DTensor", "to_local()", "register_sharding "))
    }
    assert (
        "ranks [0, 1] raised NotImplementedError: Operator aten.renorm.default does not have a sharding strategy"
        in strategy["on the DTensor"]
    )
    for way in ("to_local()", "register_sharding"):
        assert "largest row norm 0.500" in strategy[way] and float(strategy[way].rsplit("=", 1)[1]) < 1e-6
    assert "unregistered: RuntimeError: aten.addmm.default got mixed torch.Tensor and DTensor" in text
    assert "registered:   [1, 1]" in text
    assert "summon_full_params:     the next forward sees [1.0, 1.0, 1.0, 1.0]" in text


def test_checkpoint_placement_tutorial_counts_the_gathers_of_each_placement(executed):
    text = _text_outputs(executed["checkpoint_placement"])
    # reentrant checkpointing on an input that needs no grad: no graph; the non-reentrant one trains
    reentrant = text.split("\nreentrant:\n", 1)[1].split("\nno_reentrant:\n", 1)
    assert "UserWarning: None of the inputs have requires_grad=True" in reentrant[0]
    assert "RuntimeError: element 0 of tensors does not require grad and does not have a grad_fn" in reentrant[0]
    assert reentrant[1].lstrip().startswith("trained: 6 gradients")
    # API, checkpoint, placement, all-gathers, reduce-scatters, max |w - 1 process|
    gathers = {
        tuple(cells[:3]): cells[3:]
        for cells in (_cells(line) for line in text.splitlines())
        if len(cells) == 6 and cells[0] in ("FSDP1", "FSDP2") and cells[2] in ("inside", "around", "whole-model")
    }
    assert len(gathers) == 12  # 2 APIs x 2 checkpoint implementations x 3 placements
    # The prose quotes the counts (glued); what it claims of them: reentrant checkpointing around each FSDP1
    # unit gathers every unit a second time, half as much again; around the whole model FSDP1 gathers more
    # than inside; FSDP2 the same in every arrangement; inside never more than another arrangement
    count = {key: int(g[0]) for key, g in gathers.items()}
    assert count[("FSDP1", "reentrant", "around")] == 1.5 * count[("FSDP1", "reentrant", "inside")]
    assert count[("FSDP1", "no_reentrant", "whole-model")] > count[("FSDP1", "no_reentrant", "inside")]
    assert len({n for (api, _, _), n in count.items() if api == "FSDP2"}) == 1
    assert all(count[(api, impl, "inside")] <= n for (api, impl, _), n in count.items())
    # docs/fsdp.rst's claim: around FSDP1's whole model, reentrant gathers more than non-reentrant, and
    # either more than inside each unit
    whole = {impl: count[("FSDP1", impl, "whole-model")] for impl in ("reentrant", "no_reentrant")}
    assert whole["reentrant"] > whole["no_reentrant"] > count[("FSDP1", "no_reentrant", "inside")]
    assert whole["reentrant"] > count[("FSDP1", "reentrant", "inside")]
    assert _glued(executed["checkpoint_placement"]).keys() >= {
        "fsdp1_reentrant_around",
        "fsdp1_reentrant_inside",
        "fsdp1_whole_model",
        "fsdp2_all_gathers",
    }
    assert all(float(g[2]) < 1e-6 for g in gathers.values())  # every arrangement trains correctly


def test_fsdp_config_tutorial_shows_the_plan_the_strategies_and_the_dtypes(executed):
    text = _text_outputs(executed["fsdp_config"])
    assert text.count("[rank0] fsdp_config -> ") == 2 and "[rank1]" not in text
    assert "[rank0]     blocks.0                 Sequential            1,056  checkpoint" in text
    tables = [_cells(line) for line in text.splitlines()]
    # API, strategy, stored, all-gathers, reduce-scatters, all-reduces, loss vs 1 process
    strategies = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
    rows = {tuple(cells[:2]): cells[2:] for cells in tables if len(cells) == 7 and cells[1] in strategies}
    assert len(rows) == 8  # 2 APIs x 4 strategies
    for api in ("fsdp2", "fsdp1"):  # stored share, all-gathers, reduce-scatters, all-reduces, loss difference
        # the prose quotes FULL_SHARD's all-gathers (glued) and claims two per unit but the root's one
        share, gathers, scatters, reduces = rows[(api, "FULL_SHARD")][:4]
        assert [share, scatters, reduces] == ["0.250", "4", "0"] and int(gathers) == 2 * int(scatters) - 1
        assert rows[(api, "SHARD_GRAD_OP")][:4] == ["0.250", "4", "4", "0"]
        assert rows[(api, "NO_SHARD")][:4] == ["1.000", "0", "0", "4"]
        assert rows[(api, "HYBRID_SHARD")][0] == "0.500" and rows[(api, "HYBRID_SHARD")][3] == "4"
        assert all(float(rows[(api, s)][4]) < 1e-6 for s in strategies)
    assert rows[("fsdp2", "FULL_SHARD")][1] == rows[("fsdp1", "FULL_SHARD")][1]  # "both APIs"
    assert _glued(executed["fsdp_config"]).keys() >= {"full_shard_all_gathers"}
    # API, preset, low, forward matmul, grad matmul, reduce-scatter, buffer
    presets = [cells for cells in tables if len(cells) == 7 and cells[1] in ("FULL", "DEFAULT", "PURE")]
    assert ["fsdp2", "DEFAULT", "bf16", "bfloat16", "bfloat16", "float32", "float32"] in presets
    assert ["fsdp1", "DEFAULT", "bf16", "bfloat16", "bfloat16", "float32", "bfloat16"] in presets  # FSDP1 casts buffers
    assert ["fsdp2", "PURE", "bf16", "bfloat16", "bfloat16", "bfloat16", "float32"] in presets
    assert "did you mean 'sharding_strategy'?" in text and "did you mean 'DEFAULT'?" in text
    assert "cpu_offload=True with api='fsdp1' needs the ranks on an accelerator" in text


def test_digits_tutorial_logs_like_the_classic_example_and_reaches_97_percent(executed):
    text = _text_outputs(executed["digits"])
    assert "1437 training and 360 test images of shape (1, 8, 8)" in text
    epochs = [line for line in text.splitlines() if line.startswith("Train Epoch: ")]
    tests = [line for line in text.splitlines() if line.startswith("Test set: Average loss: ")]
    assert len(epochs) == len(tests) == 5
    correct = int(tests[-1].split("Accuracy: ")[1].split("/")[0])
    assert correct / 360 >= 0.97
    assert "largest |train loss FSDP1 - FSDP2| over the epochs: 0.0e+00" in text
    # The prose quotes this run's image counts (glued); what it claims of them: the training set is
    # odd, so the sampler pads it by one image (read twice) and each rank reads half the padded list.
    glued = {k: int(v) for k, v in _glued(executed["digits"]).items()}
    assert glued.keys() >= {"digits_train_images", "digits_read_images", "digits_rank_images"}
    assert glued["digits_train_images"] % 2 == 1
    assert glued["digits_read_images"] == glued["digits_train_images"] + 1 == 2 * glued["digits_rank_images"]


def test_memory_tutorial_shows_where_cpu_offloading_puts_the_states(executed):
    text = _text_outputs(executed["memory"])
    policies = dict(re.findall(r"((?:CPU)?OffloadPolicy\([^)]*\)):\n+((?:    .*\n)+)", text))
    for policy in ("OffloadPolicy()", "CPUOffloadPolicy(pin_memory=False)"):
        rows = dict((line[4:26].strip(), line[26:].strip()) for line in policies[policy].splitlines())
        # CPU ranks: nothing to offload from
        assert {
            rows[k] for k in ("batch", "gathered for forward", "parameter shards", "gradients", "optimizer state")
        } == {"cpu"}
    measured = [
        re.search(r"measure\s+(.*)", policies[p])[1] for p in ("OffloadPolicy()", "CPUOffloadPolicy(pin_memory=False)")
    ]
    assert measured[0] == measured[1]
    assert (
        "fully_shard            RuntimeError: Cannot access accelerator device"
        in policies["CPUOffloadPolicy(pin_memory=True)"]
    )


def test_memory_tutorial_reproduces_zero_and_matches_measurements(executed):
    text = _text_outputs(executed["memory"])
    # strategy, params, grads, optimizer, total (GB per device)
    zero = [_cells(line) for line in text.split("GB per device:\n", 1)[1].splitlines()[1:4]]
    totals = {row[0]: row[-1] for row in zero if len(row) == 5}
    # the prose quotes the totals (glued) and claims them the paper's numbers: ZeRO's Figure 1, constants from the paper
    assert totals == {"DDP": "120.0", "SHARD_GRAD_OP": "16.6", "FULL_SHARD": "1.9"}
    # strategy, API, estimated MB, measured MB, measured / estimated params, grads, optimizer; one table per rank count
    measured = text.split("\n2 ranks:\n", 1)[1].split("\n4 ranks:\n", 1)
    assert len(measured) == 2
    tables = {ranks: [_cells(line) for line in table.splitlines()] for ranks, table in zip((2, 4), measured)}
    rows = [
        row
        for table in tables.values()
        for row in table
        if len(row) == 7 and row[0] in ("DDP", "NO_SHARD", "FULL_SHARD")
    ]
    assert len(rows) == 10  # DDP, NO_SHARD x 2 APIs, FULL_SHARD x 2 APIs; on 2 and 4 ranks
    assert all(1 <= float(r) <= 1.01 for row in rows for r in row[4:])  # measured = estimated, up to padding
    params = {}  # (ranks, strategy, api) -> measured / estimated parameters; "in step": SHARD_GRAD_OP in the step
    for ranks, table in tables.items():
        for row in table:
            if len(row) == 7 and row[1] in ("ddp", "fsdp2", "fsdp1"):
                params[(ranks, row[0].replace("in step", "in_step"), row[1])] = float(row[4])
    assert len(params) == 18  # 9 rows per rank count
    # The prose quotes the padding and the in-step ratios (glued); what it claims of them: FSDP2 pads on 4 ranks,
    # on 2 nothing; FSDP1 pads too, less (once per unit); in the step SHARD_GRAD_OP holds 1 + 1/N of the
    # estimate, with FSDP2's padding on 4 ranks (the gathered parameters are padded too)
    padding = params[(4, "FULL_SHARD", "fsdp2")]
    assert padding > 1 and params[(2, "FULL_SHARD", "fsdp2")] == params[(2, "NO_SHARD", "fsdp2")] == 1
    assert 1 < params[(4, "FULL_SHARD", "fsdp1")] < padding
    assert all(
        round(params[(ranks, "in_step", api)], 2) == 1 + 1 / ranks
        for ranks in (2, 4)
        for api in ("fsdp2", "fsdp1")
        if (ranks, api) != (4, "fsdp2")
    )
    assert params[(4, "in_step", "fsdp2")] == pytest.approx((1 + 1 / 4) * padding, abs=2e-4)
    assert params[(4, "in_step", "fsdp2")] > params[(4, "in_step", "fsdp1")]
    assert _glued(executed["memory"]).keys() >= {
        "mem_zero_ddp",
        "mem_zero_stage2",
        "mem_zero_stage3",
        "mem_fsdp2_padding",
        "mem_fsdp1_padding",
        "mem_in_step_2",
        "mem_in_step_4",
        "mem_in_step_4_fsdp2",
    }


def test_fp8_tutorial_measures_bytes_scales_and_accumulation(executed):
    text = _text_outputs(executed["fp8"])
    assert "Failed to load" not in text and "_pytree" not in text  # torchao's import noise is silenced
    last = [float(v) for v in next(_cells(ln) for ln in text.splitlines() if _cells(ln)[0] == "last")[1:]]
    assert len(last) == 4 and max(last) <= 1.01 * min(last)  # the prose's "the last losses within 1%"
    rows = [_cells(ln) for ln in text.splitlines()]
    gathered = {tuple(row[:2]): row for row in rows if len(row) == 6 and row[2] == "all-gather"}
    assert gathered[("fp32", "forward")][-2:] == ["3", "196608"]
    assert gathered[("bf16", "forward")][-3:] == ["bfloat16", "3", "98304"]
    assert gathered[("fp8", "forward")][-3:] == ["uint8", "3", "49152"]  # one byte per element, as uint8 on gloo
    assert _glued(executed["fp8"]).keys() >= {"fp8_fp32_gathered"}
    assert "{'forward all-reduce': '3 x float32', 'backward all-reduce': '3 x float32'}" in text
    assert "{'c10d_functional.all_reduce': 1}" in text
    accumulation = {row[0]: float(row[1]) for row in rows if len(row) == 2 and row[0].endswith(" batch")}
    assert len(accumulation) == 3
    assert accumulation["fp32: 2 micro-batches vs 1 batch"] < 1e-6
    assert 0 < accumulation["fp8: 2 micro-batches vs 1 batch"] <= 1.5 * accumulation["fp8 vs fp32, 1 batch"]
    counts = re.findall(
        r"micro-batch(?:es)?: (\d+)", next(ln for ln in text.splitlines() if "reduce-scatters in" in ln)
    )
    assert len(counts) == 4 and len(set(counts)) == 1  # reduced once per step, however many micro-batches


def test_fp8_memory_tutorial_measures_activations_and_master_copies(executed):
    text = _text_outputs(executed["fp8_memory"])
    assert "Failed to load" not in text and "_pytree" not in text  # torchao's import noise is silenced
    rows = [_cells(line) for line in text.splitlines()]
    # fp8  49152  49152  98304  ...: mode, params, grads, optimizer, saved in forward, held after forward
    memory = {
        row[0]: [int(v) for v in row[1:]]
        for row in rows
        if row[0] in ("fp32", "bf16", "fp8", "fp8+bf16") and len(row) == 6 and all(v.isdigit() for v in row[1:])
    }
    assert len(memory) == 4  # a row for each precision
    assert len({tuple(v[:3]) for v in memory.values()}) == 1  # the same model states in every mode
    assert memory["fp32"][0] == 4 * (3 * 128 * 128) // 2  # the prose's "per rank, 4 bytes each" (it glues the counts)
    saved, held = {mode: v[3] for mode, v in memory.items()}, {mode: v[4] for mode, v in memory.items()}
    assert all(held[mode] < saved[mode] for mode in held)  # FSDP2 frees the gathered weights after forward
    assert held["fp8"] > held["bf16"]  # "FP8 used more memory than BF16": float32 activations
    assert 0 < held["fp8"] - held["fp32"] < 64 and 0 < held["fp8+bf16"] - held["bf16"] < 64  # + the scales
    assert saved["fp8+bf16"] < saved["bf16"]  # float8 weights are smaller when saved, then freed
    # fp8, AdamW  ...: set-up, params, grads, optimizer, total, bytes/param, measured/estimated, loss
    setups = {row[0]: row[1:] for row in rows if row[0].startswith(("bf16, ", "fp8, ")) and len(row) == 8}
    per_param = {name: int(v[4]) for name, v in setups.items()}
    # one fp32 copy, either way
    assert per_param == {
        "bf16, AdamW": 16,
        "fp8, master-weight AdamW": 20,  # FSDP's fp32 shard + the optimizer's
        "fp8, AdamW": 16,
        "fp8, bf16 stored, master AdamW": 16,
    }
    assert {v[5] for v in setups.values()} == {"1.0000"}  # measured exactly as estimated
    assert "measured - estimated, bytes, each set-up: [0, 0, 0, 0]" in text  # "exactly"
    losses = {name: float(v[6]) for name, v in setups.items()}
    assert all(math.isfinite(loss) for loss in losses.values())  # "all four take their 3 steps"
    assert losses["fp8, master-weight AdamW"] == losses["fp8, AdamW"]  # "end at the same loss"
    assert _glued(executed["fp8_memory"]).keys() >= {
        "fp8_params",
        "fp8_rank_params",
        "fp8_master_bytes",
        "fp8_bf16_bytes",
        "fp8_master_ratio",
    }


def test_mixed_precision_tutorial_shows_the_dtypes_and_the_boundary_between_policies(executed):
    text = _text_outputs(executed["mixed_precision"])
    rows = {
        cells[0]: cells[1:]
        for cells in (_cells(line) for line in text.splitlines())
        if cells[0]
        in ("no mixed precision", "autocast bf16 only", "FSDP bf16 only", "FSDP1 bf16 only", "FSDP + autocast bf16")
    }
    assert len(rows) == 5 and all(len(row) == 8 for row in rows.values())
    # all-gather, forward weight, matmul, softmax, loss, grad matmul, stored grad, reduce
    assert rows["no mixed precision"] == ["float32"] * 8
    assert rows["autocast bf16 only"][:3] == ["float32", "float32", "bfloat16"]  # fp32 weights, cast per matmul
    assert rows["FSDP bf16 only"] == rows["FSDP1 bf16 only"] == ["bfloat16"] * 6 + ["float32"] * 2
    assert rows["FSDP + autocast bf16"][4] == "float32"  # the contrast: autocast runs the loss in float32
    assert "torch.autocast('cuda') without dtype= computes in torch.float16" in text
    boundary = dict(re.findall(r"^(body bf16[^:\n]*):\n    (.*)$", text, re.M))
    assert boundary["body bf16, head float32"].startswith("body ['bfloat16 -> bfloat16'], head ['-']: RuntimeError")
    assert boundary["body bf16 with output_dtype=float32"] == "body bfloat16 -> bfloat16, head float32 -> float32"
    # the float32 input reached the bf16 body
    refused = boundary["body bf16, output_dtype=float32, cast_forward_inputs=False"]
    assert refused.startswith("body ['-'], head ['-']: RuntimeError") and "got Float and BFloat16" in refused


def test_fp16_scaler_float16_stops_learning_without_a_scaler_and_an_overflow_skips_every_rank(executed):
    text = _text_outputs(executed["fp16_scaler"])
    rows = [_cells(line) for line in text.splitlines()]
    runs = {row[0]: row[1:] for row in rows if len(row) == 4 and (", no scaler" in row[0] or "Scaler" in row[0])}
    assert len(runs) == 5
    assert runs["fp16, no scaler"][0] == runs["fp16, no scaler"][1] and runs["fp16, no scaler"][2] == "100%"
    assert (
        float(runs["fp16, GradScaler"][1]) < float(runs["fp16, GradScaler"][0]) and runs["fp16, GradScaler"][2] == "0%"
    )
    assert runs["FSDP1 fp16, no scaler"][2] == "100%" and runs["FSDP1 fp16, ShardedGradScaler"][2] == "0%"
    # bfloat16 needs none: its gradients survive and it learns
    assert float(runs["bf16, no scaler"][1]) < float(runs["bf16, no scaler"][0]) and runs["bf16, no scaler"][2] == "0%"
    # only rank 0's shard overflowed, and both ranks skipped the step (the found-inf flag is reduced)
    assert "rank 0: its own gradient shards finite: False; step skipped: True, scale 1 -> 0.5" in text
    assert "rank 1: its own gradient shards finite: True; step skipped: True, scale 1 -> 0.5" in text
    assert _glued(executed["fp16_scaler"]).keys() >= {"fp16_smallest_normal", "fp16_to_zero"}


def test_llm_recipe_initialises_by_unit_trains_exports_and_runs_the_same_from_the_command_line(executed):
    text = _text_outputs(executed["llm"])
    assert "the two give the same weights, bit for bit, on every rank: True" in text
    held = {
        how: [float(mib) for mib in re.findall(r"rank \d ([\d.]+) MiB", line)]
        for line in text.splitlines()
        for how in ("whole model at once", "one unit at a time")
        if line.startswith("most parameters held in full while initialising, " + how)
    }
    assert all(
        unit < whole for unit, whole in zip(held["one unit at a time"], held["whole model at once"], strict=True)
    )
    assert len(held["one unit at a time"]) == 2
    assert "[rank0] step   40 | loss" in text and "tokens/s" in text and "[rank1]" not in text  # the script's log
    assert "peak memory per rank, peak RSS of the whole process (ru_maxrss): rank0" in text
    final = float(text.split("step 40: loss ")[1].split()[0])
    assert 2.5 < final < 3.5  # "about 3" (the plot's text; the prose glues it), far below ln 256 = 5.55
    assert "same losses as the notebook: True" in text
    # the recipe's log says why it computes no MFU on a CPU (the MFU page's subject)
    assert "MFU not computed: on cpu, which has no dense bf16 peak" in text or "(fsdp_guide.mfu)" in text  # on a GPU
    assert _glued(executed["llm"]).keys() >= {"llm_final_loss"}


def test_llm_checkpoints_resume_exactly_survive_a_crash_save_in_the_background_and_reshard(executed):
    text = _text_outputs(executed["llm_checkpoints"])
    assert "checkpoints kept: ['step-00000020', 'step-00000040']" in text  # keep=2
    assert "straight == stopped and resumed, all 40 losses bit for bit: True" in text
    # the data position: a plain restart repeats batches, the saved position does not
    repeats = dict(
        re.findall(r"^(plain restart|position from the checkpoint) *: steps 21-40 train on +(\d+)", text, re.M)
    )
    assert int(repeats["plain restart"]) == 20 and int(repeats["position from the checkpoint"]) == 0
    assert "LaunchError: rank 1" in text and "left on disk: ['.partial-step-00000040', 'step-00000020']" in text
    assert "steps 21-40 after the crash equal the straight run: True" in text
    # slow storage  synchronous  1012.3  1008.9: storage, saves, the ms training waited at steps 20 and 40
    stalls = {
        f"{row[0]}, {row[1]}": [float(ms) for ms in row[2:]]
        for row in (_cells(line) for line in text.splitlines())
        if len(row) == 4 and row[0] == "slow storage"
    }
    assert all(ms > 500 for ms in stalls["slow storage, synchronous"])  # the half-second write, waited for
    # step 20's write went on while training did: the asynchronous save's writes ran off the training
    # thread, the synchronous one's on it (what the stall's difference shows, whatever the machine's load)
    assert "\nsynchronous saves to slow storage: the half-second writes ran on training thread\n" in text
    assert "asynchronous saves to slow storage: the half-second writes ran on background\n" in text
    assert stalls["slow storage, asynchronous"][0] < stalls["slow storage, synchronous"][0]
    assert "losses equal the straight run: True" in text
    assert "published, by every run: [('step-00000020', 'step-00000040')]" in text
    for world_size in (4, 1):
        line = next(ln for ln in text.splitlines() if ln.startswith(f"saved on 2, resumed on {world_size}:"))
        assert float(line.rsplit("=", 1)[1]) < 1e-4


def test_llm_checkpoints_show_a_state_dict_loaded_the_wrong_ways_and_the_right_ones(executed):
    text = _text_outputs(executed["llm_checkpoints"])
    ways = dict(re.findall(r"^(load_state_dict\(.+\)|dcp\.load .+|set_model_state_dict\(.+\)):\n    (.+)$", text, re.M))
    assert "got mixed torch.Tensor and DTensor" in text  # a full state dict into DTensor parameters
    assert ways["load_state_dict(full state dict)"].startswith("RuntimeError: Error(s) in loading state_dict")
    assert "size mismatch for 0.weight: copying a param with shape torch.Size([4, 8])" in text  # one rank's rows
    assert ways["dcp.load into the model with a head added"] == (
        "RuntimeError: Missing key in checkpoint state_dict: model.score.weight."
    )
    assert ways["dcp.load into a wider model"].startswith("ValueError: Size mismatch between saved torch.Size([8, 8])")
    assert ways["set_model_state_dict(full state dict)"] == ways["dcp.load into the same model"] == "loaded"


def test_mfu_counts_flops_like_torch_measures_a_run_and_reproduces_torchtitans_published_mfu(executed):
    text = _text_outputs(executed["mfu"])
    ratio = float(text.split("counted / formula: ")[1].split()[0])
    assert 0.98 < ratio <= 1.0  # the formula's extra: the layer norms' few parameters
    assert "[rank0] step   10 | loss" in text  # the recipe's own log, briefly
    assert "MFU not computed: on cpu, which has no dense bf16 peak" in text or "(fsdp_guide.mfu)" in text  # on a GPU
    cpu = float(text.split("MFU over that estimate ")[1].split("%")[0])
    assert 0 < cpu < 100  # a fraction of what the matmuls reach (NaN fails)
    # torchtitan's published run, the right way and three wrong ones
    ways = {
        line[:42].strip(): float(line.rsplit("MFU", 1)[1].strip(" %"))
        for line in text.splitlines()
        if line.startswith(("right: ", "the sparse peak", "a rank's shard", "6N alone"))
    }
    right = ways["right: whole model, attention, dense peak"]
    assert 33 <= right < 34  # torchtitan's "33% to 39%": its slowest run, the lower end (the prose glues it)
    assert ways["the sparse peak the datasheet headlines"] == pytest.approx(right / 2, abs=0.1)
    assert ways["a rank's shard of the parameters (1/8)"] < right / 3 < ways["6N alone, attention left out"] < right
    assert _glued(executed["mfu"]).keys() >= {"llm_mfu_right", "mfu_counted_ratio", "mfu_cpu_estimate"}


def test_cluster_page_runs_hsdp_on_a_2x2_mesh(executed):
    text = _text_outputs(executed["cluster"])
    rows = [re.split(r"\s{2,}", line.strip()) for line in text.splitlines()]
    assert ["0", "[0, 1]", "[0, 2]", "(Replicate(), Shard(dim=0))", "(32, 16)"] in rows
    assert ["3", "[2, 3]", "[1, 3]", "(Replicate(), Shard(dim=0))", "(32, 16)"] in rows
    assert "{'_allgather_base_': 4, '_reduce_scatter_base_': 2, 'allreduce_': 2}" in text
    assert _glued(executed["cluster"]).keys() >= {"hsdp_all_gathers", "hsdp_reduce_scatters", "hsdp_all_reduces"}
    drawn = next(c for c in executed["cluster"].cells if "figure = draw_mesh(ranks)" in c.source)
    assert [out["data"].keys() >= {"image/png"} for out in drawn.outputs] == [True]  # the mesh, drawn once
    line = next(ln for ln in text.splitlines() if ln.startswith("HSDP on a 2 x 2 mesh vs one process"))
    assert float(line.rsplit("=", 1)[1]) < 1e-6
    script = next(c.source for c in executed["cluster"].cells if "#SBATCH" in c.source)
    assert "\n#!/bin/bash\n#SBATCH --job-name=fsdp-llm\n" in script  # the shebang sbatch needs, as written


def test_cluster_page_reproduces_the_messages_a_launch_fails_with(executed):
    text = _text_outputs(executed["cluster"])
    said = {line.split(" -> ")[0]: line.split(" -> ", 1)[1] for line in text.splitlines() if " -> " in line}
    assert said["python train.py"].startswith("ValueError: Error initializing torch.distributed using env://")
    assert said["a collective first"].startswith("ValueError: Default process group has not been initialized")
    assert "name: EADDRINUSE" in said["a second job on port 29500"]
    assert said["rank 1 never comes"].endswith("1/2 clients joined.")
    assert "while trying to connect to (127.0.0.1, 29502)" in said["no store at MASTER_ADDR:MASTER_PORT"]
    # torchrun: the box names rank 1, killed, as the root cause; rank 0's error is the consequence
    box = text[text.index("ChildFailedError") :]
    root = box[box.index("Root Cause") :]
    assert "rank      : 1 (local_rank: 1)" in root and "exitcode  : -9" in root and "Signal 9 (SIGKILL)" in root
    # rank 0's error, when it noticed before torchrun stopped it, is gloo's word that its peer went away
    before = text[text.index("torch 2.") : text.index("ChildFailedError")].splitlines()
    assert all("by peer" in line for line in before if line.startswith("[rank0]:"))
    assert not any(line.startswith("[rank1]:") for line in before)  # a killed rank writes nothing
    assert "torchrun's exit status: 1" in text
    assert "RuntimeError: Distributed package doesn't have NCCL built in" in text
    assert "RuntimeError: No backend type associated with device type cpu" in text
    assert "full_tensor() = [1.0, 1.0, 1.0, 1.0]" in text  # the same shards on a group with a CPU backend
    assert "RuntimeError: Mesh should not be bigger than default world size 4, but found 8 ranks!" in text
    assert "/tmp/" not in box  # the script's path is its name alone


def test_migration_tutorial_trains_both_ways_alike_and_carries_the_checkpoint_over(executed):
    text = _text_outputs(executed["migration"])
    line = next(ln for ln in text.splitlines() if ln.startswith("max |FSDP1 - FSDP2| over"))
    assert float(line.rsplit(":", 1)[1]) < 1e-5
    # step, FSDP1's loss, FSDP2's: a row per step, the two columns the same
    table = [cells for cells in map(_cells, text.splitlines()) if len(cells) == 3 and cells[0].isdigit()]
    assert [int(cells[0]) for cells in table] == list(range(6))
    assert all(abs(float(fsdp1) - float(fsdp2)) < 1e-5 for _, fsdp1, fsdp2 in table)
    carried = {
        ln.split("checkpoint, ")[1].split(":")[0].strip(): float(ln.rsplit("=", 1)[1])
        for ln in text.splitlines()
        if "FSDP2 from FSDP1's checkpoint" in ln
    }
    assert carried["model and optimizer"] < 1e-5  # FSDP2 continues exactly where FSDP1 would have
    assert carried["model only"] > 1e-3  # without AdamW's state, it does not
    # FSDP1's messages, each with its FSDP1 fix running; FSDP2 takes the frozen block and the uint8 parameter
    fixed = re.findall(r"^(.+):\n    (.+)\n  with (.+?): (.+)$", text, re.M)
    assert {(mistake, message.split(":")[0], after) for mistake, message, _, after in fixed} >= {
        ("a bfloat16 block in the unit", "ValueError", "ok"),
        ("a frozen block in the unit", "ValueError", "ok"),
        ("a uint8 parameter first", "ValueError", "ok"),
        ("clip_grad_norm_ on an inner unit", "RuntimeError", "ok"),
        ("no device_id on a CPU-only machine", "RuntimeError", "ok"),
    }
    assert "FSDP2: a frozen block and a uint8 parameter in one unit, a step:\n    ok" in text
    assert "UserWarning: FSDP is switching to use `NO_SHARD` instead of ShardingStrategy.FULL_SHARD" in text


def test_communication_tutorial_measures_the_wire_the_step_and_the_order(executed):
    text = _text_outputs(executed["communication"])
    rows = [_cells(line) for line in text.splitlines()]
    # ranks, collective, sent by all ranks / S, ring optimum
    wire = {
        (int(row[0]), row[1]): float(row[2])
        for row in rows
        if len(row) == 4 and row[1] in ("all-reduce", "all-gather", "reduce-scatter") and row[0].isdigit()
    }
    assert len(wire) == 6
    for world in (2, 4):
        assert wire[(world, "all-gather")] == pytest.approx(world - 1, rel=0.1)  # the ring optimum
        assert wire[(world, "all-reduce")] == pytest.approx(2 * (world - 1), rel=0.1)
        assert wire[(world, "reduce-scatter")] == pytest.approx(wire[(world, "all-reduce")], rel=0.1)  # gloo's
    # strategy, collectives per step, sent / P, vs DDP, textbook vs DDP, params held / P, grads held / P
    strategies = ("DDP", "replicate", "SHARD_GRAD_OP", "FULL_SHARD")
    steps = {row[0]: row[1:] for row in rows if len(row) == 7 and row[0] in strategies}
    assert steps.keys() == set(strategies)
    assert steps["DDP"][0] == "2 all-reduce"  # DDP's first bucket is capped at 1 MiB, the other 3 MiB share the next
    assert steps["replicate"][0] == "4 all-reduce"  # one per unit
    assert steps["SHARD_GRAD_OP"][0] == "4 all-gather, 4 reduce-scatter"
    assert steps["FULL_SHARD"][0] == "8 all-gather, 4 reduce-scatter"
    ratio = {name: float(row[2]) for name, row in steps.items()}
    assert ratio["replicate"] == pytest.approx(1.0, rel=0.05)
    # The prose quotes these ratios (glued); what it claims of them: on gloo the reduce-scatter costs an
    # all-reduce, so each strategy moves what the first table's collectives predict (an all-gather and a
    # reduce-scatter, two all-gathers and a reduce-scatter, against DDP's all-reduce), more than DDP, and
    # FULL_SHARD's extra all-gather more than SHARD_GRAD_OP
    gather, reduce, scatter = (wire[(2, kind)] for kind in ("all-gather", "all-reduce", "reduce-scatter"))
    assert ratio["SHARD_GRAD_OP"] == pytest.approx((gather + scatter) / reduce, rel=0.1)
    assert ratio["FULL_SHARD"] == pytest.approx((2 * gather + scatter) / reduce, rel=0.1)
    assert 1 < ratio["SHARD_GRAD_OP"] < ratio["FULL_SHARD"]
    assert _glued(executed["communication"]).keys() >= {
        "ddp_buckets",
        "shard_grad_op_gathers",
        "shard_grad_op_scatters",
        "full_shard_gathers",
        "shard_grad_op_vs_ddp",
        "full_shard_vs_ddp",
    }
    held = {name: [float(x) for x in row[-2:]] for name, row in steps.items()}  # params, grads / P
    assert held["DDP"] == held["replicate"] == [1.0, 1.0]  # the whole model and gradient on each of 2 ranks
    assert held["SHARD_GRAD_OP"] == held["FULL_SHARD"] == [0.5, 0.5]
    assert "the gradient buckets DDP all-reduced, in order: 1.00 MiB, 3.00 MiB\n" in text  # the measured step's only
    assert "AG0 AG1 AG2 AG3 B3 AG3 AG2 RS3 B2 AG1 RS2 B1 AG0 RS1 B0 RS0" in text  # one unit ahead
    assert "AG0 AG1 AG2 AG3 B3 AG3 AG2 AG1 RS3 B2 AG0 RS2 B1 RS1 B0 RS0" in text  # two units ahead
    assert "AG0 AG1 AG2 AG3 B3 RS3 B2 RS2 B1 RS1 B0 RS0" in text  # no backward all-gathers


def test_collective_hooks_replaces_fsdp2s_collectives_counts_the_buffers_in_flight_and_reduces_by_hand(executed):
    text = _text_outputs(executed["collective_hooks"])
    comms = dict(re.findall(r"(torch's default|recorded[^:\n]*):\n(.*\n.*)$", text, re.M))
    assert "calls seen: none" in comms["torch's default"]
    for setting in ("recorded", "recorded, one buffer per size"):  # each unit gathered twice, reduced once
        assert "8 all-gather on 'default_pg', 8 MiB; 4 reduce-scatter on 'default_pg', 4 MiB" in comms[setting]
    separate = comms["recorded + separate reduce-scatter group"]
    assert "8 all-gather on 'default_pg'" in separate and "4 reduce-scatter on 'fsdp_reduce_scatter'" in separate
    for setting, units in comms.items():
        equals = units.split("gradient of unit ")[1].split("]")[0] + "]"
        pooled = setting.endswith("one buffer per size")
        assert equals == ("[0, 0, 0, 0]" if pooled else "[0, 1, 2, 3]")  # a reused output: every unit's is unit 0's
        assert float(units.rsplit("=", 1)[1]) < 1e-6
    waits = {
        ln[:48].strip(): ln[48:].strip()
        for ln in text.splitlines()
        if ln.startswith(("default (max", "max_input", "set_is_last", "two roots"))
    }
    assert waits["default (max_input_buffers=1)"] == "waits before units: [2, 1, 0]"
    assert waits["max_input_buffers=2, set before the first step"] == "waits before units: [1, 0]"
    assert waits["max_input_buffers=4, set after the first step"] == "waits before units: [2, 1, 0]"  # read once
    assert waits["set_is_last_backward(False, False, True)"] == (
        "waits before units, per backward: [[2, 1, 0], [3, 2, 1, 0], [3, 2, 1, 0]]; "
        "forwards FSDP keeps after each: [4, 8, 0]"
    )
    assert waits["two roots, each its own context"] == "waits before units: [2, 0]"
    assert waits["two roots, share_comm_ctx"] == "waits before units: [2, 1]"  # unit 1 waits for the other root's
    assert _glued(executed["collective_hooks"]).keys() >= {"forwards_kept_first", "forwards_kept_second"}
    hooks = {ln.split()[1]: ln for ln in text.splitlines() if ln.startswith("hook: ")}
    apart = {k: float(v.split("differ by ")[1].split(";")[0]) for k, v in hooks.items()}
    error = {k: float(v.rsplit("=", 1)[1]) for k, v in hooks.items()}
    assert apart["False"] > 1e-5 and error["False"] > 1e-5  # each group of 2 averaged only its own batches
    assert "[131072, 131072, 131072, 131072]" in hooks["True"] and apart["True"] == 0 and error["True"] < 1e-6
    assert "DeprecationWarning: Use `set_gradient_divide_factor` instead" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("max |old name - new name|"))
    same, doubled = (float(x.split(";")[0]) for x in line.split("= ")[1:])
    assert same == 0 and doubled < 1e-6  # the same sums, twice the mean


def test_fsdp2_controls_shows_the_order_of_gathers_and_a_skipped_backward_gather(executed):
    text = _text_outputs(executed["fsdp2_controls"])
    drawn = next(c for c in executed["fsdp2_controls"].cells if "order of issue on the host" in c.source)
    assert [out["data"].keys() >= {"image/png"} for out in drawn.outputs] == [True]  # the orders, drawn once
    orders = {
        how: line[25:]
        for line in text.splitlines()
        for how in ("default", "forward prefetch", "unshard(async_op=True)")
        if line.startswith(how + " ")
    }
    assert orders["default"] == "F0 AG0 F1 AG1 F2 AG2 F3 AG3 F4 AG4"  # each unit gathers when its forward begins
    assert orders["forward prefetch"] == "F0 AG0 AG1 F1 AG2 F2 AG3 F3 AG4 F4"  # the next one's, ahead of its forward
    assert orders["unshard(async_op=True)"] == "AG0 F0 F1 AG1 F2 AG2 F3 AG3 F4 AG4"  # before the forward, once
    gathers = {
        line.split("(")[1].split(")")[0].strip(): line
        for line in text.splitlines()
        if line.startswith("set_unshard_in_backward(")
    }
    assert "10 all-gathers" in gathers["True"] and "9 all-gathers" in gathers["False"]
    for line in gathers.values():
        assert float(line.rsplit("=", 1)[1]) < 1e-6  # the gradients of one process either way


def test_failed_step_recovers_with_reset_iter_state_and_the_stale_gradients_dropped(executed):
    text = _text_outputs(executed["failed_step"])
    assert "after reset_iter_state(): parameters sharded, gathered gradients left: (True, 2)" in text
    runs = {line.split(" caught ")[0].strip(): line for line in text.splitlines() if " caught ['step 1" in line}
    error = {how: float(line.rsplit("=", 1)[1]) for how, line in runs.items()}
    assert "then sharded: False" in runs["nothing"] and error["nothing"] > 1e-4  # a unit left gathered
    reset, fixed = "reset_iter_state()", "reset_iter_state() + drop_stale_gradients"
    # the stale inf reaches the weights in step 2, so step 3's gradient is not finite either; the
    # difference from one process is then NaN, and shown as NaN (it was printed as 1.2e-03)
    assert "then sharded: True" in runs[reset] and "'step 3: a non-finite gradient'" in runs[reset]
    assert "weights not finite after step: 2;" in runs[reset] and math.isnan(error[reset])
    assert "weights not finite after step: None;" in runs["nothing"]
    assert "then sharded: True" in runs[fixed] and "step 3" not in runs[fixed] and error[fixed] < 1e-6
    assert "weights not finite after step: None;" in runs[fixed]


def test_placements_splits_experts_by_rows_keeps_tied_weights_in_one_unit_and_reduces_an_ignored_one(executed):
    text = _text_outputs(executed["placements"])
    ignored = {
        line.split("all-reduced: ")[1][:5].strip(): line
        for line in text.splitlines()
        if line.startswith("scale's gradient all-reduced:")
    }
    for line in ignored.values():
        assert "types ['DTensor', 'Parameter']" in line  # the ignored scale is not sharded
    # clipping over DTensors and the plain scale at once is refused; in two groups it is one process's norm
    assert (
        "clip_grad_norm_ over every parameter: "
        "RuntimeError: aten._foreach_norm.Scalar got mixed torch.Tensor and DTensor" in text
    )
    total, one, apart = map(
        float,
        re.search(
            r"total norm (\S+); one process's (\S+); clipped gradients vs one "
            r"process's: (\S+)\n",
            text,
        ).groups(),
    )
    assert total == pytest.approx(one, rel=1e-6) and total > 0.1  # the clip (max_norm 0.1) scaled the gradients
    assert apart < 1e-6  # and they are one process's clipped gradients; a NaN fails here too
    apart = {k: float(v.split("differ by ")[1].split(";")[0]) for k, v in ignored.items()}
    error = {k: float(v.rsplit("=", 1)[1]) for k, v in ignored.items()}
    assert apart["False"] > 1e-4 and error["False"] > 1e-4  # FSDP did not reduce it
    assert apart["True"] == 0 and error["True"] < 1e-6
    drawn = next(c for c in executed["placements"].cells if "draw_sharding(" in c.source)
    assert [out["data"].keys() >= {"image/png"} for out in drawn.outputs] == [True]  # both layouts, drawn once
    placed = text.split("shard_placement_fn: ")[1:]
    assert "Shard(dim=0) over mesh 2  [0:2, :, :]" in placed[0] and "[2:3, :, :]" in placed[0]  # 2 experts and 1
    assert "Shard(dim=1) over mesh 2  [:, 0:16, :]" in placed[1] and "[:, 16:32, :]" in placed[1]  # rows of all 3
    assert all(float(p.split("= ")[1].split()[0]) < 1e-6 for p in placed)  # one process's weights either way
    tied = {
        line[:20].strip(): line[20:]
        for line in text.splitlines()
        if line.startswith(("a unit each", "one unit for both", "the root holds both"))
    }
    assert (
        "ranks [0, 1] raised ValueError: Parameter 'head.weight' is shared with a parameter already managed"
        in tied["a unit each"]
    )
    for units in ("one unit for both", "the root holds both"):
        assert "still tied: True" in tied[units] and float(tied[units].rsplit("=", 1)[1]) < 1e-5


@pytest.mark.parametrize("tutorial", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_page_that_executes_opens_with_what_you_learn_what_you_need_and_how_long_it_runs(tutorial):
    import json
    import sys

    import jupytext

    sys.path.insert(0, str(ROOT / "bench"))
    from results import PAGE_TIMES, stated

    opening = jupytext.read(tutorial).cells[0]
    assert opening.cell_type == "markdown"
    text = " ".join(opening.source.split())
    assert "**What you will learn**" in text and "**What you need**" in text
    assert re.search(r"\d+ process|ranks|GPU", text), "say what it needs: processes, CPU or GPU"
    # How long it runs: the time measured by `python bench/bench_site.py --record`, not a typed one.
    record = json.loads(PAGE_TIMES.read_text())
    assert tutorial.stem in record["seconds"], "no recorded time: run python bench/bench_site.py --record"
    measured_on = record.get("separately", {}).get(tutorial.stem, record)["machine"]  # a page recorded alone
    assert stated(record["seconds"][tutorial.stem], measured_on["cores"]) in text, (
        "the stated time is not the recorded one: run python bench/bench_site.py --record"
    )


def test_weight_sync_measures_three_ways_and_the_engine_computes_the_trainers_logits(executed):
    text = _text_outputs(executed["weight_sync"])
    header = text.split("the model: ")[1]
    model, largest = float(header.split(" MiB")[0]), float(header.split("its largest ")[1].split(" MiB")[0])
    parameters = int(header.split(" parameters")[0].split(", ")[-1])
    # sync; rank 0's and rank 1's peak rise, MiB; messages; seconds; max |engine - trainer| logits
    rows = {
        cells[0]: cells[1:]
        for cells in map(_cells, text.splitlines())
        if cells[0].startswith(("gathered state dict,", "per parameter,", "bucketed,"))
    }
    assert len(rows) == 4 and all(len(row) == 5 for row in rows.values())
    rank0, rank1 = ({how: float(row[i]) for how, row in rows.items()} for i in (0, 1))
    messages = {how: int(row[2]) for how, row in rows.items()}
    gap = {how: float(row[4]) for how, row in rows.items()}
    assert rank0["gathered state dict, bfloat16"] > model  # the whole model on rank 0 before the first message
    # gathered and its bf16 copy; at worst the previous pair too, when gloo's worker thread lets go of it late
    assert 1.5 * largest - 0.2 <= rank0["per parameter, bfloat16"] <= 3 * largest + 0.2 < model / 4
    assert rank0["bucketed, bfloat16"] <= 16 + 2 * largest  # the buffer, and a parameter or two
    assert all(rank1[how] <= 2 * largest + 0.1 for how in rows if not how.startswith("gathered"))  # one, or two
    assert messages["per parameter, bfloat16"] == messages["gathered state dict, bfloat16"] == parameters
    assert messages["bucketed, bfloat16"] < 10  # "a handful"
    assert gap["per parameter, float32"] == 0  # bit for bit
    assert "the engine's bf16 logits are the same all three ways: True" in text
    assert 0 < gap["per parameter, bfloat16"] < 0.05


def test_pipeline_matches_one_process_and_counts_all_gathers_per_micro_batch(executed):
    text = _text_outputs(executed["pipeline"])
    drawn = next(c for c in executed["pipeline"].cells if "parameters held after it, MiB" in c.source)
    assert [out["data"].keys() >= {"image/png"} for out in drawn.outputs] == [True]  # what stage 0 holds, drawn
    one_process = float(text.split("one process: loss ")[1].split()[0])
    table = [_cells(line) for line in text.splitlines()]
    # GPipe  True  4  5.5789211  5.8e-07
    exact = [row for row in table if len(row) == 5 and row[0] in ("GPipe", "1F1B")]
    assert len(exact) == 8  # two schedules, both reshard settings, 4 and 8 micro-batches
    assert all(abs(float(row[3]) - one_process) < 1e-6 and float(row[4]) < 1e-5 for row in exact)

    units = int(text.split("FSDP units per stage: ")[1].split()[0])
    whole = [float(x) for x in re.findall(r"stage \d ([\d.]+) MiB", text)]
    assert "ranks 1 and 3 ran the same collectives as ranks 0 and 2: True" in text
    # GPipe  True  4  0  15  8.22  3  0.82  2.47  1.64  4: schedule, reshard, m, stage, then what it sent and held
    rows = [row for row in table if len(row) == 11 and row[0] in ("GPipe", "1F1B")]
    assert len(rows) == 16
    for schedule, reshard, m, stage, gathers, gathered, scatters, after_f, after_b, grads, alive in rows:
        reshard = reshard == "True"
        m, stage, gathers, scatters, alive = map(int, (m, stage, gathers, scatters, alive))
        gathered, after_f, after_b, grads = map(float, (gathered, after_f, after_b, grads))
        shards = whole[stage] / 2  # sharded over the 2 ranks of dp
        assert scatters == units  # gradients reduced once per step, whatever m
        assert grads == pytest.approx(whole[stage], abs=0.01)  # whole-size gradients accumulated, either way
        assert after_b == pytest.approx(shards + whole[stage], abs=0.02)  # gathered after a backward, either way
        if reshard:  # gathered again for every micro-batch, and once more; only the shards after a forward
            assert gathers == units * (m + 1) and after_f == pytest.approx(shards, abs=0.01)
        else:  # once per step: the stage's parameters, gathered once, and kept
            assert gathers == units and gathered == pytest.approx(whole[stage], abs=0.01) and after_f == after_b
        assert alive == (m if schedule == "GPipe" else 2 - stage)  # 1F1B: the stages from this one to the last


def test_pipeline_bubble_times_the_schedules_against_the_formula_and_draws_them(executed):
    text = _text_outputs(executed["pipeline_bubble"])
    drawn = next(c for c in executed["pipeline_bubble"].cells if "ax.broken_barh" in c.source)
    assert [out["data"].keys() >= {"image/png"} for out in drawn.outputs] == [True]  # the schedules, drawn once
    # GPipe  1  0.328  0.53  0.48  0.50  0.02: schedule, m, step (s), idle on stage 0 and 1, the formula, the spread
    idle = {
        (cells[0], int(cells[1])): (float(cells[3]), float(cells[4]), float(cells[5]), float(cells[6]))
        for cells in (_cells(line) for line in text.splitlines())
        if len(cells) == 7 and cells[0] in ("GPipe", "1F1B")
    }
    assert set(idle) == {("GPipe", 1), ("GPipe", 2), ("GPipe", 4), ("GPipe", 8), ("1F1B", 4), ("1F1B", 8)}
    assert all(idle["GPipe", m][2] == pytest.approx(1 / (m + 1), abs=0.005) for m in (1, 2, 4, 8))  # p = 2
    assert all(0 <= v < 1 for values in idle.values() for v in values[:2])  # a NaN fails here too
    # The claims, each with the margin this run's own step-to-step spread justifies (the timed cell runs
    # alone among the pages, but a busy machine still stretches some chunks: seen beside another page,
    # 1F1B's fraction once differed from GPipe's by more than 0.1, with steps varying as much):
    mean = {key: (stage0 + stage1) / 2 for key, (stage0, stage1, _, _) in idle.items()}
    spread = {key: values[3] for key, values in idle.items()}
    # - more micro-batches, a smaller bubble: m = 1 and 2 against m = 4 and 8 (the formula's gaps: 0.17 to 0.39)
    assert all(
        mean["GPipe", few] - mean["GPipe", many] > 0.1 - spread["GPipe", few] - spread["GPipe", many]
        and mean["GPipe", few] > mean["GPipe", many]
        for few, many in ((1, 4), (1, 8), (2, 8))
    ), idle
    # - the formula is the model the table is read against: within 0.1 of it, beyond what the steps varied
    assert all(abs(mean[key] - formula) < 0.1 + spread[key] for key, (_, _, formula, _) in idle.items()), idle
    # - "what 1F1B saves is memory, not idle time": its bubble within 0.1 of GPipe's at the same m
    assert all(
        abs(mean["1F1B", m] - mean["GPipe", m]) < 0.1 + spread["1F1B", m] + spread["GPipe", m] for m in (4, 8)
    ), idle

    # The order of each stage's chunks, from when each started: fixed by the schedule, whatever the timing.
    orders = dict(re.findall(r"(GPipe|1F1B), 4 micro-batches.*\n(?:stage.*\n){2}  stage 0 ran: (.*)\n", text))
    orders1 = dict(re.findall(r"(GPipe|1F1B), 4 micro-batches.*\n(?:stage.*\n){2}.*\n  stage 1 ran: (.*)\n", text))
    assert orders == {"GPipe": "0 1 2 3 a b c d", "1F1B": "0 1 a 2 b 3 c d"}  # stage 0: two forwards first
    assert orders1 == {"GPipe": "0 1 2 3 a b c d", "1F1B": "0 a 1 b 2 c 3 d"}  # the last stage alternates
    drawn = re.findall(r"stage (\d) \|([0-9a-j.]+)\|", text)
    assert len(drawn) == 4  # the drawing of those steps (a chunk shorter than a column may hide under the next)


def test_experts_match_one_process_only_with_the_divide_factor(executed):
    text = _text_outputs(executed["experts"])
    drawn = next(c for c in executed["experts"].cells if 'draw_sharding(tables, "emb.weight"' in c.source)
    assert [out["data"].keys() >= {"image/png"} for out in drawn.outputs] == [True]  # who holds what, drawn once
    assert float(text.split("max |MoE layer - every expert on every token| = ")[1].split()[0]) < 1e-6
    one_process = float(text.split("loss: one process ")[1].split(";")[0])
    losses = [float(x) for x in re.findall(r"(?:average|divide factor|sum, global tokens) (\d\.\d{7})", text)]
    assert len(losses) == 3 and all(abs(x - one_process) < 1e-5 for x in losses)  # the forward is right every way
    # moe.experts.w1  1.0e+00  1.1e-07  1.1e-07: the parameter, then its gap averaged, divided, summed
    gaps = {
        cells[0]: [float(x) for x in cells[1:]]
        for cells in (_cells(line) for line in text.splitlines())
        if len(cells) == 4 and cells[0] != "parameter"
    }
    assert len(gaps) == 7
    for name, (average, divided, summed) in gaps.items():
        assert divided < 1e-5 and summed < 1e-5, name
        assert (average == pytest.approx(1, abs=1e-3)) if name.startswith("moe.experts.") else average < 1e-5, name
    assert float(text.split("against twice one process's: ")[1].split()[0]) < 1e-5  # exactly twice


def test_the_moe_module_is_the_code_the_experts_page_writes_out():
    # uneven_experts imports the experts page's model from fsdp_guide.moe: the two copies must not drift
    import inspect

    import fsdp_guide.moe as moe

    page = "".join((ROOT / "tutorials" / "experts.py").read_text().split())
    for name in (
        "Experts",
        "MoE",
        "Model",
        "make_model",
        "loss_of",
        "sharded",
        "one_step",
        "one_process",
        "expected",
        "gap",
    ):
        assert "".join(inspect.getsource(getattr(moe, name)).split()) in page, name


def test_uneven_experts_handle_empty_routes_unused_experts_and_too_few_experts_to_split(executed):
    text = _text_outputs(executed["uneven_experts"])
    drawn = next(c for c in executed["uneven_experts"].cells if "np.ndenumerate(grid)" in c.source)
    assert [out["data"].keys() >= {"image/png"} for out in drawn.outputs] == [True]  # where the tokens go, drawn once
    # the experts page's step, divide factor: every gradient one process's
    assert float(text.split("largest |gradient - one process|, relative: ")[1].split()[0]) < 1e-5
    rows = [_cells(line) for line in text.splitlines()]
    sent = [[int(n) for n in row[1:]] for row in rows if re.fullmatch(r"rank \d", row[0]) and len(row) > 1]
    assert len(sent) == 4 and all(len(row) == 8 for row in sent) and sum(map(sum, sent)) == 4 * 2 * 16
    total = [sum(column) for column in zip(*sent)]
    assert max(total) >= 3 * min(total)  # "several times"
    computed = [
        [int(n) for n in re.findall(r"e\d (\d+)", line)]
        for line in text.splitlines()
        if re.match(r"  rank \d: e\d", line)
    ]
    # ranks 0 and 1 form one ep group (experts 0-3 on rank 0, 4-7 on rank 1), ranks 2 and 3 the other
    assert computed == [
        [sum(sent[s][e] for s in group) for e in experts]
        for group in ((0, 1), (2, 3))
        for experts in (range(4), range(4, 8))
    ]
    # the prose: ranks 0 and 1 send expert 3 no token, so its copy on rank 0 computes on an empty run,
    # in a step that matched one process
    assert sent[0][3] == sent[1][3] == 0 and computed[0][3] == 0
    busiest_rank, busiest_expert = (
        float(x) for x in re.findall(r"busiest (?:rank|expert)(?: computes)? ([\d.]+)x", text)
    )
    assert busiest_rank < busiest_expert  # "the ranks differ less"

    collectives = {
        (row[0], row[1]): (int(row[2]), int(row[3])) for row in rows if len(row) == 4 and row[0] in ("dp", "edp", "ep")
    }
    assert {key: n for key, (n, _) in collectives.items()} == {
        ("dp", "all-gather"): 1,
        ("dp", "reduce-scatter"): 1,
        ("edp", "all-gather"): 2,
        ("edp", "reduce-scatter"): 1,
        ("ep", "all-to-all"): 5,
    }
    sent0, computed0 = sum(sent[0]), sum(computed[0])
    assert collectives["ep", "all-to-all"][1] == 8 * 8 + 2 * (sent0 + computed0) * 32 * 4  # from the routing

    # 2  Shard(0)  (1, 32, 64)  (0, 32, 64)  65536  3.1e-07
    placements = {
        (int(row[0]), int(row[1][len("Shard(") : -1])): (row[2], row[3], int(row[4]), float(row[5]))
        for row in rows
        if len(row) == 6 and row[1].startswith("Shard(")
    }
    assert len(placements) == 4
    assert placements[8, 0][:2] == ("(2, 32, 64)", "(2, 32, 64)") and placements[8, 1][:2] == (
        "(4, 16, 64)",
        "(4, 16, 64)",
    )
    assert placements[2, 0][:2] == ("(1, 32, 64)", "(0, 32, 64)")  # one expert cannot split over two ranks by dim 0
    assert placements[2, 1][:2] == ("(1, 16, 64)", "(1, 16, 64)")
    assert placements[2, 0][2] == 2 * placements[2, 1][2]  # the padding, gathered
    assert all(worst < 1e-5 for *_, worst in placements.values())  # every placement trains right
    moe = {
        line.split("): ", 1)[0] + ")": line.split("): ", 1)[1]
        for line in text.splitlines()
        if "set_reduce_scatter_unused_params(" in line
    }
    uneven, swapped = "rank 1: every row to expert 0; ", "each rank: every row to another expert; "
    assert "rows per expert, rank 0 [3, 5], rank 1 [8, 0]" in text and "rank 0 [0, 8], rank 1 [8, 0]" in text
    aborted = moe[uneven + "set_reduce_scatter_unused_params(False)"]  # rank 1 receives rank 0's longer message
    assert "ranks killed by SIGABRT: [1]; Received data size doesn't match expected size" in aborted
    silent = moe[swapped + "set_reduce_scatter_unused_params(False)"]
    assert "no gradient for ['0.experts.0.weight', '0.experts.0.bias']" in silent  # rank 1 used expert 0
    assert all(float(e.split(";")[0]) > 1e-3 for e in silent.split("= ")[1:])  # wrong, and nothing failed
    for case in (uneven, swapped):
        fixed_moe = moe[case + "set_reduce_scatter_unused_params(True )"]
        assert fixed_moe.count("no gradient for none") == 2
        assert all(float(e.split(";")[0]) < 1e-6 for e in fixed_moe.split("= ")[1:])


def test_rank_dies_restarts_exactly_under_torchrun_and_computes_the_interval(executed):
    import math

    text = _text_outputs(executed["rank_dies"])
    table = [_cells(line) for line in text.splitlines()]
    # killed after step 7  6  1  3.7  True: run, resumed at, steps redone, restart s, = uninterrupted
    rows = {
        run: (int(resumed), int(redone), float(restart), same)
        for run, resumed, redone, restart, same in (row for row in table if len(row) == 5)
        if run in ("killed after step 7", "killed saving step 12")
    }
    # a checkpoint every 2 steps: step 6 was the newest before step 7; every 6: step 12's was being written
    assert rows["killed after step 7"][:2] == (6, 1) and rows["killed saving step 12"][:2] == (6, 6), text
    assert all(restart > 0 and same == "True" for _, _, restart, same in rows.values())
    assert text.count("failed (exitcode: -9) local_rank: 1") == 2  # SIGKILL, once per run, as torchrun saw it
    assert text.count("starting at step 1 (--resume auto)") == 2
    drawn = next(c for c in executed["rank_dies"].cells if "computed again after the restart" in c.source)
    assert [out["data"].keys() >= {"image/png"} for out in drawn.outputs] == [True]  # the two attempts, drawn

    save = float(text.split("a save δ = ")[1].split(" ms")[0]) / 1000
    assert "Daly's Fig. 3 (M = 24 h, δ = 5 min): τ = 117 min" in text  # the paper's own example
    # 1 h  22.30  22.20  308  0.72%: failure every, Young τ (s), Daly τ (s), Daly τ (steps), time lost
    rows = [(row[0].removesuffix(" h"), row[1], row[2]) for row in table if len(row) == 5 and row[0].endswith(" h")]
    assert [int(hours) for hours, _, _ in rows] == [1, 8, 24]
    for hours, young, daly in rows:
        assert float(young) == pytest.approx(math.sqrt(2 * save * int(hours) * 3600), rel=0.02, abs=0.1)
        # Daly's is √(2δM)(1 + ⅓√(δ/2M) + ...) − δ: about ⅔δ under Young's while δ << M
        assert float(young) - float(daly) == pytest.approx(2 / 3 * save, abs=0.011)


def test_torchft_recovery_keeps_the_other_group_training_and_ends_as_the_quorums_computed(executed):
    text = _text_outputs(executed["torchft_recovery"])
    drawn = next(c for c in executed["torchft_recovery"].cells if "a tick per step" in c.source)
    assert [out["data"].keys() >= {"image/png"} for out in drawn.outputs] == [True]  # each worker's steps, drawn
    # 6-71  group 0  (steps, gradients averaged from, receiving the state: empty at the line's end)
    rows = [_cells(line) for line in text.splitlines()]
    segments = [
        (int(m[1]), int(m[2]), row[1], row[2] if len(row) > 2 else "")
        for row in rows
        if len(row) in (2, 3) and (m := re.fullmatch(r"(\d+)-(\d+)", row[0])) and row[1].startswith("group")
    ]
    died = int(text.split("group 1's rank 1 died after step ")[1].split(";")[0])
    back = int(text.split("group 1 back at step ")[1].split(",")[0])
    assert died == 8 and back > died + 1
    # after the death: group 0 alone until group 1 is back, then group 1 receiving the state at the step
    # it came back, then both. Group 0's steps alone may start before the death: on a busy machine (a CI
    # run), group 1 took steps 0 to 8 in quorums of its own, then died before joining group 0's.
    at = next(i for i, s in enumerate(segments) if s[0] <= died + 1 <= s[1])
    assert segments[at][1:3] == (back - 1, "group 0"), segments
    assert segments[at + 1][:2] == (back, back) and segments[at + 1][3] == "group 1"
    assert segments[at + 2][0] == back + 1 and segments[at + 2][2] == "group 0, group 1"
    assert "every line from its first attempt: True" in text  # no rank of group 0 restarted
    assert text.count("= the replay's: True") == 4 and "False" not in text.split("group 0's shards")[1]
    steps_alone = int(text.split(" computed again; ")[1].split()[0])
    assert steps_alone == back - died - 1
    # beside torchrun's restart of the same recipe, rank 1 killed after step 7 with a checkpoint every 2 steps
    assert "torchrun: rank 1 killed after step 7, resumed after step 6, " in text, text
    side_by_side = {row[0]: row[1:] for row in rows if len(row) == 3}
    assert side_by_side["steps computed again"][0] == "1" and side_by_side["steps computed again"][1].isdigit(), text
    again = side_by_side["steps the other ranks took meanwhile"]
    assert again[0] == "none: stopped" and again[1].isdigit(), text
