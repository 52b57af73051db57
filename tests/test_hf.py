"""fsdp_guide.hf on real process groups of 1, 2 and 4 ranks, against the same model in one process."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from fsdp_guide import LaunchError, launch
from fsdp_guide.hf import from_pretrained, save_pretrained

TOKENS = torch.arange(24).reshape(3, 8) % 40


def _llama(**sizes) -> LlamaForCausalLM:
    config = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**config, **sizes}))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Llama written with save_pretrained, and its logits on TOKENS in this one process."""
    path = tmp_path_factory.mktemp("hf") / "tiny-llama"
    model = _llama()
    model.save_pretrained(path)
    with torch.no_grad():
        return path, model(TOKENS).logits


def _load_and_run(path, tokens, read, model_cls):
    import safetensors.torch
    import torch.distributed as dist

    import fsdp_guide

    reads = []
    load_file = safetensors.torch.load_file
    safetensors.torch.load_file = lambda *a, **k: reads.append(a[0]) or load_file(*a, **k)
    model = from_pretrained(path, read=read, model_cls=model_cls)
    with torch.no_grad():
        logits = model(tokens.to(fsdp_guide.device())).logits.cpu()
    local = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    return {"rank": dist.get_rank(), "logits": logits, "reads": len(reads), "local": local, "total": total,
            "tied": model.lm_head.weight is model.model.embed_tokens.weight}


@pytest.mark.parametrize("read, world_size", [("rank0", 1), ("rank0", 2), ("rank0", 4), ("sharded", 2),
                                              ("sharded", 4)])
def test_the_sharded_model_computes_what_the_saved_one_does_with_either_read(saved, read, world_size):
    path, expected = saved
    model_cls = LlamaForCausalLM if world_size == 1 else None  # the concrete class, or the Auto class by default
    ranks = launch(_load_and_run, path, TOKENS, read, model_cls, world_size=world_size, output="none")
    for r in ranks:
        assert torch.equal(r["logits"], expected)  # the same weights, the same arithmetic on CPU
        assert r["tied"]
    # rank0: rank 0 reads the whole file and the others receive; sharded: nobody loads a whole file
    # (each reads its slices through DCP; the equal logits show the slices were the right ones)
    whole_reads = [1] + [0] * (world_size - 1) if read == "rank0" else [0] * world_size
    assert [r["reads"] for r in ranks] == whole_reads
    total = ranks[0]["total"]
    assert sum(r["local"] for r in ranks) == total  # the shards add up to the model, once
    if world_size > 1:
        assert max(r["local"] for r in ranks) < total / world_size + 200  # each rank about 1/N of it


def _train(path, out, steps, tokens):
    model = from_pretrained(path)
    losses = _steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2), tokens, steps)
    save_pretrained(model, out)
    return losses


def _steps(model, optimizer, tokens, steps) -> list[float]:
    """``steps`` optimizer steps, each rank on its rows of the global batch; the mean loss of each step."""
    import torch.distributed as dist

    import fsdp_guide

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = tokens[rank::world].to(fsdp_guide.device())  # this rank's rows of the global batch
    losses = []
    for _ in range(steps):
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def test_fine_tuned_on_two_ranks_saves_what_one_process_trains(saved, tmp_path):
    path, _ = saved
    tokens = torch.arange(32).reshape(4, 8) % 40  # 2 rows per rank, each the same length: mean of means = mean
    sharded = launch(_train, path, tmp_path / "tuned", 3, tokens, world_size=2, output="none")[0]

    single = AutoModelForCausalLM.from_pretrained(path)
    optimizer = torch.optim.AdamW(single.parameters(), lr=1e-2)
    for loss in sharded:
        step = single(tokens, labels=tokens).loss
        assert abs(step.item() - loss) < 1e-5
        step.backward()
        optimizer.step()
        optimizer.zero_grad()

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "tuned")
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight  # still tied
    for (name, a), (_, b) in zip(reloaded.state_dict().items(), single.state_dict().items(), strict=True):
        assert torch.allclose(a, b, atol=1e-5), name
    assert [p.name for p in tmp_path.iterdir()] == ["tuned"]  # published whole, nothing partial left


def _tiny_round_trip(path, out, read):
    import torch.distributed as dist

    import fsdp_guide

    model = from_pretrained(path, read=read)
    empty = [n for n, p in model.named_parameters() if p.to_local().numel() == 0]
    with torch.no_grad():
        logits = model((TOKENS % 8).to(fsdp_guide.device())).logits.cpu()
    save_pretrained(model, out)
    return dist.get_rank(), empty, logits


@pytest.mark.parametrize("read", ["rank0", "sharded"])
def test_parameters_with_fewer_rows_than_ranks_leave_empty_shards_that_still_work(tmp_path, read):
    model = _llama(vocab_size=8, hidden_size=2, intermediate_size=2, num_attention_heads=1, num_key_value_heads=1,
                   head_dim=2, num_hidden_layers=1)
    model.save_pretrained(tmp_path / "tiny")
    with torch.no_grad():
        expected = model(TOKENS % 8).logits
    ranks = launch(_tiny_round_trip, tmp_path / "tiny", tmp_path / "out", read, world_size=4, output="none")
    assert ranks[0][1] == [] and "model.norm.weight" in ranks[3][1]  # 2 rows on 4 ranks: ranks 2 and 3 hold none
    assert all(torch.equal(logits, expected) for _, _, logits in ranks)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for (name, a), (_, b) in zip(reloaded.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def _load_and_save(path, out):
    save_pretrained(from_pretrained(path), out)


def test_saving_again_replaces_the_directory_whole(saved, tmp_path):
    path, _ = saved
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "stale.txt").write_text("from an earlier save")
    launch(_load_and_save, path, tmp_path / "out", world_size=2, output="none")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "generation_config.json",
                                                                     "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("read", ["rank0", "sharded"])
def test_a_checkpoint_in_several_files_is_read_from_its_index_and_other_files_are_ignored(saved, tmp_path, read):
    path, expected = saved
    _llama().save_pretrained(tmp_path / "split", max_shard_size="20KB")  # model-0000N-of-0000M + an index
    files = sorted(p.name for p in (tmp_path / "split").glob("*.safetensors"))
    assert len(files) > 2 and (tmp_path / "split" / "model.safetensors.index.json").exists()
    shutil.copy(path / "model.safetensors", tmp_path / "split" / "consolidated.safetensors")  # not the model's
    ranks = launch(_load_and_run, tmp_path / "split", TOKENS, read, None, world_size=2, output="none")
    assert all(torch.equal(r["logits"], expected) for r in ranks)


def _drop_a_tensor(path, out):
    from safetensors.torch import load_file, save_file

    shutil.copytree(path, out)
    weights = load_file(out / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})


def test_weights_that_do_not_match_the_model_are_an_error_on_every_rank_not_a_hang(saved, tmp_path):
    path, _ = saved
    _drop_a_tensor(path, tmp_path / "broken")
    with pytest.raises(LaunchError, match="do not match the model its config describes: missing "
                                          "\\['model.norm.weight'\\]") as raised:
        launch(_load_and_run, tmp_path / "broken", TOKENS, "rank0", None, world_size=2, output="none", timeout=120)
    assert "KeyError" in str(raised.value)


def test_a_save_that_fails_on_rank_0_fails_on_every_rank(saved, tmp_path):
    path, _ = saved
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(LaunchError, match="rank [01] raised (NotADirectoryError|FileNotFoundError)"):
        launch(_load_and_save, path, tmp_path / "a-file" / "out", world_size=2, output="none", timeout=120)


def _load(path, **options):
    from_pretrained(path, **options)


def _error_of(path, **options) -> str:
    with pytest.raises(LaunchError) as raised:
        launch(_load, path, **options, world_size=2, output="none", timeout=120)
    return str(raised.value)


def test_a_directory_that_is_not_a_saved_model_or_an_unknown_read_is_named_in_the_error(tmp_path):
    assert "read='all': use 'rank0'" in _error_of(tmp_path, read="all")
    assert f"{tmp_path} is not a saved model: it has no config.json" in _error_of(tmp_path)
    _llama().config.save_pretrained(tmp_path)  # a config alone
    assert "has no *.safetensors files and no model.safetensors.index.json" in _error_of(tmp_path)


def test_a_model_class_that_does_not_match_the_config_says_which_to_pass(saved):
    from transformers import GPT2LMHeadModel

    path, _ = saved
    error = _error_of(path, model_cls=GPT2LMHeadModel)
    assert "GPT2LMHeadModel is a 'gpt2' model but" in error and "holds a 'llama' model (LlamaForCausalLM)" in error


def _add_lora(model, train_norms=False, dora=False):
    from peft import LoraConfig, get_peft_model

    # init_lora_weights=False: B is random too, so the adapters change the outputs from the start.
    # DoRA: its magnitudes are computed from the pretrained weights, which adapt must therefore see.
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, use_dora=dora)
    model = get_peft_model(model, config)
    for name, p in model.named_parameters():
        if train_norms and "norm" in name:
            p.requires_grad_(True)  # trainable in the base's dtype, beside peft's fp32 adapters
    return model


def _lora_train(path, out, read, dtype, steps, tokens, variant):
    import functools

    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    torch.manual_seed(dist.get_rank())  # seeded apart on purpose: every rank must still get rank 0's adapters
    model = from_pretrained(path, read=read, dtype=dtype, adapt=functools.partial(_add_lora, **variant))
    trainable = [p for p in model.parameters() if p.requires_grad]
    losses = _steps(model, torch.optim.AdamW(trainable, lr=1e-2), tokens, steps)
    save_pretrained(model, out)
    llama = model.base_model.model
    return {"losses": losses, "trainable": sum(p.numel() for p in trainable),
            "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "units": sum(isinstance(m, FSDPModule) for m in model.modules()),
            "tied": llama.lm_head.weight is llama.model.embed_tokens.weight}


@pytest.mark.parametrize("read, dtype, world_size, variant", [
    ("rank0", torch.float32, 2, {}), ("sharded", torch.float32, 4, {}), ("sharded", torch.float32, 2, {"dora": True}),
    ("rank0", torch.bfloat16, 2, {}), ("sharded", torch.bfloat16, 2, {"train_norms": True})])
def test_lora_added_by_adapt_trains_like_one_process_and_saves_peft_adapters(saved, tmp_path, read, dtype, world_size,
                                                                             variant):
    from peft import PeftModel, get_peft_model_state_dict

    path, _ = saved
    tokens = torch.arange(32).reshape(4, 8) % 40
    ranks = launch(_lora_train, path, tmp_path / "adapter", read, dtype, 3, tokens, variant,
                   world_size=world_size, output="none")

    torch.manual_seed(0)  # rank 0's seed
    single = _add_lora(AutoModelForCausalLM.from_pretrained(path, dtype=dtype), **variant)
    optimizer = torch.optim.AdamW([p for p in single.parameters() if p.requires_grad], lr=1e-2)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16 sums in another order on 2 ranks
    for loss in ranks[0]["losses"]:
        step = single(input_ids=tokens, labels=tokens).loss
        assert abs(step.item() - loss) < tolerance
        step.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert ranks[0]["trainable"] == sum(p.numel() for p in single.parameters() if p.requires_grad)
    # peft keeps adapters in fp32 on a bf16 base. Beside a frozen base they share its units (FSDP2
    # wants one dtype among a unit's trainable parameters only); beside trainable bf16 norms, each of
    # the 2 layers x 2 projections x (A, B) adapter modules is a unit of its own.
    assert ranks[0]["dtypes"] == sorted({"torch.float32", str(dtype)})
    assert ranks[0]["units"] == 2 + 1 + (8 if variant.get("train_norms") else 0)
    assert ranks[0]["tied"]

    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["README.md", "adapter_config.json",
                                                                         "adapter_model.safetensors"]
    import safetensors.torch

    written = safetensors.torch.load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    expected = get_peft_model_state_dict(single)
    assert sorted(written) == sorted(expected)  # what peft itself saves for this model, nothing less
    for name, value in expected.items():
        assert torch.allclose(written[name].float(), value.float(), atol=1e-4), name
    if variant.get("train_norms"):
        return  # norms trained outside peft's adapters are not in its file (adapters and modules_to_save only)
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=dtype), tmp_path / "adapter")
    with torch.no_grad():
        assert torch.allclose(reloaded(input_ids=tokens).logits, single(input_ids=tokens).logits, atol=1e-3)
