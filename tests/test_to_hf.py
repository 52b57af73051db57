"""fsdp_guide.recipes.to_hf: checkpoints of 2 and 4 gloo ranks turned into Hugging Face models in one process."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from fsdp_guide import launch
from fsdp_guide.checkpoint import latest
from fsdp_guide.recipes.to_hf import ConversionError, main, to_hf

TOKENS = torch.arange(24).reshape(3, 8) % 40
TINY = dict(
    vocab_size=40,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)


def _save_llama(path, **changes):
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**TINY, **changes})).save_pretrained(path)
    return path


def _train_and_save(base, directory, steps):
    """Fine-tune the saved Llama sharded on these ranks, save a checkpoint; the trained model's logits on TOKENS."""
    import fsdp_guide
    from fsdp_guide import checkpoint
    from fsdp_guide.hf import from_pretrained

    model = from_pretrained(base)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = TOKENS.to(fsdp_guide.device())
    for _ in range(steps):
        model(tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    checkpoint.save(directory, steps, model, optimizer)
    with torch.no_grad():
        return model(tokens).logits.cpu()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return _save_llama(tmp_path_factory.mktemp("base") / "tiny-llama")


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def trained(request, base, tmp_path_factory):
    """A checkpoint of the tiny Llama after 3 steps on 2 or 4 ranks, and the trained model's logits."""
    directory = tmp_path_factory.mktemp(f"ckpt{request.param}")
    logits = launch(_train_and_save, base, directory, 3, world_size=request.param, output="none")[0]
    return latest(directory), logits


def _loaded(out, **options):
    model = AutoModelForCausalLM.from_pretrained(out, **options)
    with torch.no_grad():
        return model, model(TOKENS).logits


def test_a_checkpoint_loads_with_from_pretrained_and_computes_what_the_trained_model_did(trained, base, tmp_path):
    checkpoint, trained_logits = trained
    out = to_hf(checkpoint, tmp_path / "hf", config=base, dtype="fp32")
    model, logits = _loaded(out)
    assert torch.equal(logits, trained_logits)  # the trained weights, the same arithmetic on a CPU
    assert model.dtype == torch.float32
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied again by from_pretrained
    saved = load_file(out / "model.safetensors")
    assert "model.embed_tokens.weight" in saved and "lm_head.weight" not in saved  # the tied weight once
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert not list(tmp_path.glob(".*"))  # no hidden folder left beside it


def test_bf16_weights_are_the_fp32_ones_rounded_and_from_pretrained_loads_them_in_bf16(trained, base, tmp_path):
    checkpoint, _ = trained
    fp32 = load_file(to_hf(checkpoint, tmp_path / "fp32", config=base, dtype="fp32") / "model.safetensors")
    out = to_hf(checkpoint, tmp_path / "bf16", config=base)  # bf16 by default
    bf16 = load_file(out / "model.safetensors")
    assert bf16.keys() == fp32.keys()
    for name, tensor in bf16.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, fp32[name].to(torch.bfloat16)), name
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model, logits = _loaded(out)
    assert model.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_past_max_shard_size_the_weights_are_split_with_an_index_that_from_pretrained_follows(trained, base, tmp_path):
    checkpoint, trained_logits = trained
    out = to_hf(checkpoint, tmp_path / "hf", config=base, dtype="fp32", max_shard_size="8KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for f in files for t in load_file(out / f).values())
    assert torch.equal(_loaded(out)[1], trained_logits)


def _save_initial(base, directory):
    from fsdp_guide import checkpoint
    from fsdp_guide.hf import from_pretrained

    model = from_pretrained(base)
    checkpoint.save(directory, 0, model, torch.optim.AdamW(model.parameters()))


def _peak_rise_without_log_records(fn):
    """``host_peak_rise(fn)`` with logging off: DCP logs 8 DEBUG records per load to a logger of its
    own that discards them, but once something in this process has made that logger propagate (seen
    in CI, after other tests in the same worker), pytest's capture keeps them all: for a conversion's
    600, 2 to 4 MiB more (measured) that the harness holds, not the code measured."""
    from fsdp_guide.memory import host_peak_rise

    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        return host_peak_rise(fn)
    finally:
        logging.disable(previous)


def test_the_conversion_holds_one_output_file_at_a_time_not_the_model(tmp_path):
    big = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=8, vocab_size=2048)
    base = _save_llama(tmp_path / "base", **big)
    launch(_save_initial, base, tmp_path / "ckpt", world_size=2, output="none")
    model_mib = sum(t.numel() * 4 for t in load_file(base / "model.safetensors").values()) / 2**20
    checkpoint = latest(tmp_path / "ckpt")
    to_hf(checkpoint, tmp_path / "warm-up", config=base, max_shard_size="2MB")  # imports, caches: not measured
    out, resident, private = _peak_rise_without_log_records(
        lambda: to_hf(checkpoint, tmp_path / "hf", config=base, dtype="fp32", max_shard_size="2MB")
    )
    assert model_mib > 30 and len(list(out.glob("*.safetensors"))) > 10
    # a 2 MB file filled and serialized, a 1 MiB tensor read into a buffer and copied: about 6 MiB (6.3
    # measured), never the model's 30+
    assert resident < model_mib / 3, (resident, private, model_mib)
    # and the measurement sees a whole model when one is held: DCP's own conversion loads it all at once
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    _, whole, _ = _peak_rise_without_log_records(lambda: dcp_to_torch_save(checkpoint, tmp_path / "whole.pt"))
    assert whole > model_mib, (whole, model_mib)


def test_the_recipes_gpt_becomes_a_gpt2_that_computes_its_logits(tmp_path):
    from fsdp_guide.gpt import GPT
    from fsdp_guide.recipes.train_llm import TrainConfig, train

    config = TrainConfig(
        n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=4, steps=3, warmup=1, progress=False,
        checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=3, export=str(tmp_path / "gpt.pt"),
    )  # fmt: skip
    launch(train, config, world_size=2, output="none")
    gpt = GPT(config.model_config())
    gpt.load_state_dict(torch.load(tmp_path / "gpt.pt", weights_only=True))
    tokens = torch.randint(256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = gpt(tokens)[0]
    # the command a reader types: no --config, the recipe's settings say the model's size
    done = subprocess.run(
        [sys.executable, "-m", "fsdp_guide.recipes.to_hf", str(latest(tmp_path / "ckpt")), str(tmp_path / "hf"),
         "--dtype", "fp32"],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        logits = model(tokens).logits
    assert (logits - expected).abs().max() < 1e-4  # GPT-2's Conv1D and attention: the same sums, other order
    assert model.lm_head.weight is model.transformer.wte.weight


@pytest.fixture
def one_checkpoint(tmp_path, base):
    launch(_save_initial, base, tmp_path / "ckpt", world_size=2, output="none")
    return latest(tmp_path / "ckpt")


def _refused(tmp_path, checkpoint, match, **options):
    with pytest.raises(ConversionError, match=match):
        to_hf(checkpoint, tmp_path / "out", **options)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))  # nothing written


def test_an_existing_output_is_refused_and_left_as_it_was(one_checkpoint, base, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConversionError, match=r"exists: .* never over anything there"):
        to_hf(one_checkpoint, out, config=base)
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    assert not list(tmp_path.glob(".out.partial-*"))
    assert main([str(one_checkpoint), str(out), "--config", str(base)]) == 2  # the command: status 2, said


def test_a_checkpoint_with_a_file_missing_or_cut_short_or_unfinished_is_refused(one_checkpoint, base, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(one_checkpoint, broken)
    data = sorted(broken.glob("*.distcp"))
    data[1].unlink()
    _refused(tmp_path, broken, rf"incomplete: {data[1].name} is missing", config=base)
    shutil.copy2(one_checkpoint / data[1].name, data[1])
    with open(data[0], "r+b") as f:
        f.truncate(100)
    _refused(tmp_path, broken, rf"incomplete: {data[0].name} is 100 bytes, of \d+", config=base)
    unfinished = tmp_path / ".partial-step-00000000"
    shutil.copytree(one_checkpoint, unfinished)
    _refused(tmp_path, unfinished, "did not finish", config=base)
    _refused(tmp_path, tmp_path / "nowhere", "no such checkpoint directory", config=base)


def test_a_config_of_another_model_is_named_in_the_error(one_checkpoint, tmp_path):
    wider = _save_llama(tmp_path / "wider", hidden_size=48)
    _refused(tmp_path, one_checkpoint, r"is \(40, 32\) there and \(40, 48\) in LlamaForCausalLM", config=wider)
    shallower = _save_llama(tmp_path / "shallower", num_hidden_layers=1)
    _refused(tmp_path, one_checkpoint, r"its model has model\.layers\.1\..*which LlamaForCausalLM", config=shallower)
    from transformers import GPT2Config

    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=40)).save_pretrained(gpt2)
    _refused(
        tmp_path, one_checkpoint, r"GPT2LMHeadModel .* has .*transformer\..*which the checkpoint does not", config=gpt2
    )
    _refused(tmp_path, one_checkpoint, "no config.json there", config=tmp_path)
    _refused(tmp_path, one_checkpoint, "holds none of the settings the LLM recipe saves.*pass --config", config=None)
    _refused(tmp_path, one_checkpoint, r"dtype='int8': expected one of bf16, fp32, fp16", config=wider, dtype="int8")


def test_the_command_says_what_is_wrong_on_stderr(one_checkpoint, tmp_path, capsys):
    assert main([str(one_checkpoint), str(tmp_path / "out")]) == 2
    assert "to_hf: " in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_a_tied_pair_that_differs_in_the_checkpoint_is_refused_not_dropped(base, tmp_path):
    import torch.distributed.checkpoint as dcp

    state = LlamaForCausalLM.from_pretrained(base).state_dict()
    state["lm_head.weight"] = state["lm_head.weight"] + 1  # the tie broken in training: two tensors now
    dcp.save({"model": state}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    _refused(tmp_path, tmp_path / "ckpt", r"model\.embed_tokens\.weight and the weight the config ties", config=base)


def test_a_model_transformers_converts_in_memory_and_a_bad_shard_size_are_refused(one_checkpoint, tmp_path):
    from transformers import MixtralConfig, MixtralForCausalLM

    mixtral = tmp_path / "mixtral"
    MixtralForCausalLM(
        MixtralConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=2)
    ).save_pretrained(mixtral)  # fmt: skip
    _refused(tmp_path, one_checkpoint, "another layout than in its files", config=mixtral)
    _refused(tmp_path, one_checkpoint, r"max_shard_size='lots'", config=tmp_path.parent, max_shard_size="lots")


def test_names_of_compile_and_checkpoint_wrappers_convert_as_the_unwrapped_models(base, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = LlamaForCausalLM.from_pretrained(base)
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(layer)  # activation checkpointing's wrapper, per layer
    compiled = torch.compile(model)  # its names start with _orig_mod. (nothing is compiled yet)
    # the parameters by name, as a hand-written save takes them (state_dict() drops the checkpoint wrapper's part)
    state = {name: p.detach() for name, p in compiled.named_parameters()}
    assert any(k.startswith("_orig_mod.") and "_checkpoint_wrapped_module." in k for k in state)  # both wrappers
    dcp.save({"model": state}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    loaded, logits = _loaded(to_hf(tmp_path / "ckpt", tmp_path / "converted", config=base, dtype="fp32"))
    unwrapped = LlamaForCausalLM.from_pretrained(base)
    assert loaded.state_dict().keys() == unwrapped.state_dict().keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in unwrapped.state_dict().items())
    with torch.no_grad():
        assert torch.equal(logits, unwrapped(TOKENS).logits)
    # a name saved twice, once wrapped and once not: two tensors for one, refused
    state = unwrapped.state_dict()
    state["_orig_mod.model.norm.weight"] = state["model.norm.weight"] + 1
    dcp.save({"model": state}, checkpoint_id=tmp_path / "twice", no_dist=True)
    _refused(
        tmp_path,
        tmp_path / "twice",
        r"'model\.model\.norm\.weight' and 'model\._orig_mod\.model\.norm\.weight' are one tensor",
        config=base,
    )


def test_what_transformers_keeps_in_fp32_is_written_in_fp32_as_save_pretrained_writes_it(tmp_path):
    import torch.distributed.checkpoint as dcp
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=40, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=4)
    torch.manual_seed(0)
    T5ForConditionalGeneration(config).save_pretrained(tmp_path / "t5")
    assert T5ForConditionalGeneration._keep_in_fp32_modules == ["wo"]  # fp32 when loaded in fp16 (not bf16)
    model = T5ForConditionalGeneration.from_pretrained(tmp_path / "t5")
    dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    for dtype, torch_dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        to_hf(tmp_path / "ckpt", tmp_path / dtype, config=tmp_path / "t5", dtype=dtype)
        written = {k: v.dtype for k, v in load_file(tmp_path / dtype / "model.safetensors").items()}
        # what transformers itself writes: the model loaded in that dtype, saved again
        T5ForConditionalGeneration.from_pretrained(tmp_path / "t5", dtype=torch_dtype).save_pretrained(tmp_path / "hf")
        assert written == {k: v.dtype for k, v in load_file(tmp_path / "hf" / "model.safetensors").items()}
        kept = sorted(k for k, d in written.items() if d == torch.float32)
        assert (kept and all(".wo." in k for k in kept)) if dtype == "fp16" else not kept, kept
        shutil.rmtree(tmp_path / "hf")
