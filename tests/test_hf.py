"""fsdp_guide.hf on real process groups of 1, 2 and 4 ranks, against the same model in one process."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from fsdp_guide import LaunchError, launch
from fsdp_guide.hf import from_pretrained, save_pretrained

TOKENS = torch.arange(24).reshape(3, 8) % 40


def _llama(**sizes) -> LlamaForCausalLM:
    config = dict(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
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
    return {
        "rank": dist.get_rank(),
        "logits": logits,
        "reads": len(reads),
        "local": local,
        "total": total,
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
    }


@pytest.mark.parametrize("read, world_size", [("rank0", 1), ("rank0", 2), ("rank0", 4), ("sharded", 2), ("sharded", 4)])
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


def _train(path, out, steps, tokens, write="rank0"):
    model = from_pretrained(path)
    losses = _steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2), tokens, steps)
    save_pretrained(model, out, write=write)
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


@pytest.fixture(scope="module")
def saved_41_rows(tmp_path_factory):
    """The tiny Llama with 41 vocabulary rows: 2 ranks hold 21 and 20 rows of the tied embedding and head."""
    path = tmp_path_factory.mktemp("hf") / "tiny-llama-41"
    _llama(vocab_size=41).save_pretrained(path)
    return path, None


@pytest.mark.parametrize(
    "weights, write",
    [("saved", "rank0"), ("saved_41_rows", "rank0"), ("saved_41_rows", "sharded")],
    ids=["even-shards", "uneven-tied-shards", "uneven-tied-shards-written-by-every-rank"],
)
def test_fine_tuned_on_two_ranks_saves_what_one_process_trains(weights, write, tmp_path, request):
    path, _ = request.getfixturevalue(weights)
    tokens = torch.arange(32).reshape(4, 8) % 40  # 2 rows per rank, each the same length: mean of means = mean
    sharded = launch(_train, path, tmp_path / "tuned", 3, tokens, write, world_size=2, output="none")[0]

    single = AutoModelForCausalLM.from_pretrained(path)
    optimizer = torch.optim.AdamW(single.parameters(), lr=1e-2)
    for loss in sharded:
        step = single(tokens, labels=tokens).loss
        assert abs(step.item() - loss) < 1e-5
        step.backward()
        optimizer.step()
        optimizer.zero_grad()

    from safetensors import safe_open

    weights = [name for name in _exported(tmp_path / "tuned") if name.endswith(".safetensors")]
    assert weights == (["model.safetensors"] if write == "rank0" else ["model-00001-of-00001.safetensors"])
    with safe_open(tmp_path / "tuned" / weights[0], "pt") as written:
        assert "model.embed_tokens.weight" in written.keys()
        assert "lm_head.weight" not in written.keys()  # the tied pair written once, as transformers saves it
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "tuned")
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight  # still tied
    for (name, a), (_, b) in zip(reloaded.state_dict().items(), single.state_dict().items(), strict=True):
        assert torch.allclose(a, b, atol=1e-5), name
    assert [p.name for p in tmp_path.iterdir()] == ["tuned"]  # nothing written beside it
    assert sorted(p.name for p in (tmp_path / "tuned").iterdir()) == _exported(tmp_path / "tuned")  # nor left in it


def _tiny_round_trip(path, out, read, write="rank0"):
    import torch.distributed as dist

    import fsdp_guide

    model = from_pretrained(path, read=read)
    empty = [n for n, p in model.named_parameters() if p.to_local().numel() == 0]
    with torch.no_grad():
        logits = model((TOKENS % 8).to(fsdp_guide.device())).logits.cpu()
    save_pretrained(model, out, write=write)
    return dist.get_rank(), empty, logits


@pytest.mark.parametrize("read, write", [("rank0", "rank0"), ("sharded", "sharded")])
def test_parameters_with_fewer_rows_than_ranks_leave_empty_shards_that_still_work(tmp_path, read, write):
    model = _llama(
        vocab_size=8,
        hidden_size=2,
        intermediate_size=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=2,
        num_hidden_layers=1,
    )
    model.save_pretrained(tmp_path / "tiny")
    with torch.no_grad():
        expected = model(TOKENS % 8).logits
    ranks = launch(_tiny_round_trip, tmp_path / "tiny", tmp_path / "out", read, write, world_size=4, output="none")
    assert ranks[0][1] == [] and "model.norm.weight" in ranks[3][1]  # 2 rows on 4 ranks: ranks 2 and 3 hold none
    assert all(torch.equal(logits, expected) for _, _, logits in ranks)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for (name, a), (_, b) in zip(reloaded.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def _load_and_save(path, out):
    save_pretrained(from_pretrained(path), out)


def _user_files(out) -> dict:
    """What a user keeps beside an export, written into ``out`` first: a tokenizer, notes, a model card,
    a folder of checkpoints. Returns each file's bytes by its path under ``out``."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    words = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>").save_pretrained(out)
    (out / "notes.txt").write_text("lr 1e-2, 3 steps\n")
    (out / "README.md").write_text("# my model\n\nnotes by hand\n")
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "step-1").write_text("a training checkpoint")
    return _files(out)


def _files(out) -> dict:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def _export_sharded(path, out, full_disk_on_rank=None):
    """Load ``path`` sharded and export it to ``out`` with ``write="sharded"``; DCP's write of
    ``full_disk_on_rank`` raises ENOSPC."""
    import errno

    import torch.distributed as dist
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    model = from_pretrained(path)
    if dist.get_rank() == full_disk_on_rank:

        def full_disk(self, plan, planner):
            raise OSError(errno.ENOSPC, "No space left on device")

        HuggingFaceStorageWriter.write_data = full_disk
    save_pretrained(model, out, write="sharded")


def test_an_export_written_by_every_rank_replaces_the_gathered_one_keeps_the_users_files_and_survives_a_full_disk(
    saved, tmp_path
):
    path, _ = saved
    out = tmp_path / "out"
    mine = _user_files(out)
    launch(_export, path, [out], world_size=2, output="none", timeout=120)  # model.safetensors, gathered
    launch(_export_sharded, path, out, world_size=2, output="none", timeout=120)
    files = _files(out)
    assert files.items() >= mine.items()  # untouched
    # one consolidated file and its index; the gathered export's model.safetensors is gone, as are
    # DCP's per-rank files and the partial directory
    assert (
        sorted(set(files) - set(mine))
        == _exported(out)
        == sorted(
            [
                "config.json",
                "generation_config.json",
                "model-00001-of-00001.safetensors",
                "model.safetensors.index.json",
            ]
        )
    )
    assert sorted(p.name for p in out.iterdir()) == sorted({*_exported(out), *(p.split("/")[0] for p in mine)})
    _assert_loads_as(out, _llama())
    with pytest.raises(LaunchError, match="No space left on device"):  # rank 1's write fails: every rank raises
        launch(_export_sharded, path, out, 1, world_size=2, output="none", timeout=120)
    assert _files(out) == files  # the previous export whole
    _assert_loads_as(out, _llama())


def _save_with(write, adapters):
    from peft import LoraConfig, get_peft_model

    model = _llama()
    if adapters:
        model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    save_pretrained(model, "unused", write=write)


@pytest.mark.parametrize(
    "write, adapters, error",
    [
        ("gathered", False, "write='gathered': expected 'rank0' .* or 'sharded'"),
        ("sharded", True, "write='sharded' writes a whole model; .* use write='rank0'"),
    ],
)
def test_a_write_it_does_not_know_or_adapters_written_by_every_rank_are_refused_before_anything_is_written(
    tmp_path, write, adapters, error
):
    with pytest.raises(LaunchError, match=error):
        launch(_save_with, write, adapters, world_size=2, output="none", timeout=120)


def _export(path, outs, max_shard_size=None, full_disk_at=None):
    """Load ``path`` sharded and export it to each of ``outs``; transformers splits the weights at
    ``max_shard_size``, and its ``full_disk_at``-th file write (counted from 0) raises ENOSPC."""
    import errno
    import functools

    import transformers.modeling_utils

    model = from_pretrained(path)
    if max_shard_size is not None:  # transformers' default (50GB) writes a model this small as one file
        model.save_pretrained = functools.partial(model.save_pretrained, max_shard_size=max_shard_size)
    if full_disk_at is not None:
        write, written = transformers.modeling_utils.safe_save_file, []

        def full_disk(*args, **kwargs):
            if len(written) == full_disk_at:
                raise OSError(errno.ENOSPC, "No space left on device")
            written.append(write(*args, **kwargs))

        transformers.modeling_utils.safe_save_file = full_disk
    for out in outs:
        save_pretrained(model, out)


def _exported(out) -> list[str]:
    """The files of the model exported to ``out``: its configs, and its index and the files it names
    or model.safetensors."""
    import json

    index = out / "model.safetensors.index.json"
    weights = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) + [index.name]
        if index.exists()
        else ["model.safetensors"]
    )
    return sorted(["config.json", "generation_config.json", *weights])


def _assert_loads_as(out, model):
    reloaded = AutoModelForCausalLM.from_pretrained(out)  # transformers itself, offline, in this process
    for (name, a), (_, b) in zip(reloaded.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_an_export_keeps_the_files_beside_it_and_leaves_no_stale_shards_when_split_otherwise(saved, tmp_path):
    path, _ = saved
    out = tmp_path / "out"
    mine = _user_files(out)
    exports = []
    for max_shard_size in ["20KB", None, "40KB"]:  # 5 files, then 1, then 3: each time the previous files are stale
        launch(_export, path, [out], max_shard_size, world_size=2, output="none", timeout=120)
        exports.append(_exported(out))
        assert sorted(p.name for p in out.iterdir()) == sorted({*exports[-1], *(p.split("/")[0] for p in mine)})
        assert {name: data for name, data in _files(out).items() if name in mine} == mine  # untouched
        _assert_loads_as(out, _llama())
    assert [len(files) for files in exports] == [8, 3, 6]  # configs + index + 5 shards, one file, index + 3 shards
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # nothing written beside it


def test_an_export_that_fails_midway_leaves_the_previous_export_and_the_users_files(saved, tmp_path):
    path, _ = saved
    out = tmp_path / "out"
    mine = _user_files(out)
    launch(_export, path, [out], "20KB", world_size=2, output="none", timeout=120)
    before = _files(out)
    assert before.items() >= mine.items()
    # the next export, split otherwise, fails at its second file: rank 0's error is raised on every rank
    with pytest.raises(LaunchError, match="OSError: \\[Errno 28\\] No space left on device"):
        launch(_export, path, [out], "40KB", 1, world_size=2, output="none", timeout=120)
    assert _files(out) == before  # the previous export whole, the user's files, nothing partial left
    assert sorted(p.name for p in out.iterdir()) == sorted({p.split("/")[0] for p in before})
    _assert_loads_as(out, _llama())


def _export_adapters(path, out):
    save_pretrained(from_pretrained(path, adapt=_add_lora), out)


def test_adapters_and_a_full_export_keep_the_users_files_and_replace_only_each_others(saved, tmp_path):
    from peft import PeftModel

    path, _ = saved
    out = tmp_path / "out"
    mine = _user_files(out)
    readme = mine.pop("README.md")
    launch(_export_adapters, path, out, world_size=2, output="none", timeout=120)
    files = _files(out)
    assert files.items() >= mine.items()
    assert sorted(set(files) - set(mine)) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    assert readme.decode() in files["README.md"].decode()  # peft updates a model card, keeping what it held
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), out)  # loads

    launch(_export, path, [out], world_size=2, output="none", timeout=120)
    files = _files(out)
    assert files.items() >= mine.items()
    # the adapter files are gone: transformers would add them to the model it loads from out
    assert sorted(set(files) - set(mine)) == ["README.md", *_exported(out)]
    _assert_loads_as(out, _llama())


def test_an_export_through_a_symlink_or_into_missing_folders_writes_there_and_into_a_file_is_an_error(saved, tmp_path):
    path, _ = saved
    target = tmp_path / "big-disk" / "model"
    mine = _user_files(target)
    (tmp_path / "link").symlink_to(target, target_is_directory=True)
    launch(
        _export, path, [tmp_path / "link", tmp_path / "new" / "dirs" / "out"], world_size=2, output="none", timeout=120
    )
    assert (tmp_path / "link").is_symlink()  # still the user's link: the export went where it points
    assert _files(target).items() >= mine.items()
    for out in target, tmp_path / "new" / "dirs" / "out":
        assert sorted(_files(out).keys() - mine.keys()) == _exported(out)
        _assert_loads_as(out, _llama())
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(LaunchError, match="NotADirectoryError: .*a-file is a file"):
        launch(_export, path, [tmp_path / "a-file"], world_size=2, output="none", timeout=120)
    assert (tmp_path / "a-file").read_text() == "not a directory"


@pytest.mark.parametrize("read", ["rank0", "sharded"])
def test_a_checkpoint_in_several_files_is_read_from_its_index_and_other_files_are_ignored(saved, tmp_path, read):
    path, expected = saved
    _llama().save_pretrained(tmp_path / "split", max_shard_size="20KB")  # model-0000N-of-0000M + an index
    files = sorted(p.name for p in (tmp_path / "split").glob("*.safetensors"))
    assert len(files) > 2 and (tmp_path / "split" / "model.safetensors.index.json").exists()
    shutil.copy(path / "model.safetensors", tmp_path / "split" / "consolidated.safetensors")  # not the model's
    ranks = launch(_load_and_run, tmp_path / "split", TOKENS, read, None, world_size=2, output="none")
    assert all(torch.equal(r["logits"], expected) for r in ranks)


def _rewritten(path, out, change):
    """A copy of the saved model at ``out`` whose weights ``change`` has edited in place."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(path, out)
    weights = load_file(out / "model.safetensors")
    change(weights)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda w: w.pop("model.norm.weight"), "missing \\['model.norm.weight'\\], unexpected \\[\\]"),
        (lambda w: w.update(extra=torch.ones(2)), "missing \\[\\], unexpected \\['extra'\\]"),
    ],
    ids=["missing", "extra"],
)
def test_weights_that_do_not_match_the_model_are_an_error_on_every_rank_not_a_hang(saved, tmp_path, change, message):
    path, _ = saved
    with pytest.raises(LaunchError, match="do not match the model its config describes: " + message) as raised:
        launch(
            _load_and_run,
            _rewritten(path, tmp_path / "broken", change),
            TOKENS,
            "rank0",
            None,
            world_size=2,
            output="none",
            timeout=120,
        )
    assert "KeyError" in str(raised.value)


def _errors(path, read):
    """This rank's error from from_pretrained, returned rather than raised: the test sees every rank's."""
    try:
        from_pretrained(path, read=read)
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}"
    return "loaded"


SHORT_NORM = "size mismatch between saved torch.Size([31]) and current: torch.Size([32]) for model.norm.weight"


@pytest.mark.parametrize(
    "read, name, value, mismatch",
    [
        ("rank0", "model.norm.weight", torch.ones(31), SHORT_NORM),
        ("sharded", "model.norm.weight", torch.ones(31), SHORT_NORM),
        (
            "rank0",
            "model.embed_tokens.weight",
            torch.ones(40, 33),  # tied: saved once, for the output layer too
            "size mismatch between saved torch.Size([40, 33]) and current: torch.Size([40, 32]) for "
            "model.embed_tokens.weight",
        ),
        (
            "rank0",
            "model.layers.0.mlp.up_proj.weight",
            torch.ones(64, 32, dtype=torch.int64),
            "dtype mismatch between saved I64 and current: torch.float32 for model.layers.0.mlp.up_proj.weight",
        ),
        (
            "sharded",
            "model.norm.weight",
            torch.ones(32, dtype=torch.bool),
            "dtype mismatch between saved BOOL and current: torch.float32 for model.norm.weight",
        ),
    ],
    ids=["rank0-shape", "sharded-shape", "rank0-tied-shape", "rank0-int", "sharded-bool"],
)
def test_a_weight_of_another_shape_or_dtype_is_the_same_named_error_on_every_rank_not_a_hang(
    saved, tmp_path, read, name, value, mismatch
):
    path, _ = saved
    broken = _rewritten(path, tmp_path / "broken", lambda w: w.update({name: value}))
    errors = launch(_errors, broken, read, world_size=2, output="none", timeout=60)  # a rank left waiting: LaunchError
    assert errors[0] == errors[1]
    assert errors[0].startswith(
        f"ValueError: the weights in {broken} do not match the model its config describes: "
        f"{mismatch} in model.safetensors"
    )


@pytest.mark.parametrize("read", ["rank0", "sharded"])
def test_a_truncated_file_or_an_index_naming_a_missing_shard_is_an_error_on_every_rank(tmp_path, saved, read):
    path, _ = saved
    truncated = tmp_path / "truncated"
    shutil.copytree(path, truncated)
    (truncated / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes()[:-100])
    errors = launch(_errors, truncated, read, world_size=2, output="none", timeout=60)
    assert errors[0] == errors[1]
    assert errors[0].startswith(f"SafetensorError: {truncated / 'model.safetensors'}: Error while deserializing header")

    split = tmp_path / "split"
    _llama().save_pretrained(split, max_shard_size="20KB")
    shard = sorted(split.glob("model-*.safetensors"))[1]
    shard.unlink()
    errors = launch(_errors, split, read, world_size=2, output="none", timeout=60)
    assert errors[0] == errors[1]
    assert errors[0].startswith(
        f"FileNotFoundError: {split / 'model.safetensors.index.json'} names ['{shard.name}'], not in {split}"
    )


_DAMAGED_INDEXES = [
    (b'{"weight_map": {"a": ', "it is not JSON"),
    (b"[1, 2]", "it holds a JSON list, not an object"),
    (b'{"metadata": {}}', 'it has no "weight_map"'),
    (b'{"weight_map": ["model.safetensors"]}', 'its "weight_map" is not an object'),
]


@pytest.mark.parametrize(("content", "problem"), _DAMAGED_INDEXES, ids=["not-json", "a-list", "no-map", "map-a-list"])
def test_a_damaged_index_is_named_by_a_load_and_refused_by_either_export_which_writes_nothing(
    saved, tmp_path, content, problem
):
    path, _ = saved
    damaged = tmp_path / "damaged"
    shutil.copytree(path, damaged)
    index = damaged / "model.safetensors.index.json"
    index.write_bytes(content)
    assert f"ValueError: {index} is damaged: {problem}" in _error_of(damaged)  # not JSONDecodeError or KeyError
    out = tmp_path / "out"
    _user_files(out)
    (out / index.name).write_bytes(content)
    before = _files(out)
    for export in (_export, _export_sharded):  # write="rank0", then write="sharded"
        with pytest.raises(LaunchError, match=re.escape(f"{out / index.name} is damaged: {problem}")) as raised:
            launch(export, path, [out] if export is _export else out, world_size=2, output="none", timeout=120)
        assert "overwrites no file it did not write: move or delete this one" in str(raised.value)
        # nothing written, nothing partial left
        assert _files(out) == before and sorted(p.name for p in out.iterdir()) == sorted(
            {name.split("/")[0] for name in before}
        )


def _unpicklable_error_on_rank_0():
    from fsdp_guide.hf import _on_rank0_for_all

    def fail():
        error = OSError("the disk went away")
        error.handle = lambda: None  # an attribute pickle cannot carry to the other ranks
        raise error

    try:
        _on_rank0_for_all(fail)
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}"


def test_an_error_on_rank_0_that_cannot_be_pickled_is_still_raised_on_every_rank():
    errors = launch(_unpicklable_error_on_rank_0, world_size=2, output="none", timeout=60)
    assert errors == ["RuntimeError: OSError: the disk went away"] * 2


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
    return {
        "losses": losses,
        "trainable": sum(p.numel() for p in trainable),
        "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "units": sum(isinstance(m, FSDPModule) for m in model.modules()),
        "tied": llama.lm_head.weight is llama.model.embed_tokens.weight,
    }


@pytest.mark.parametrize(
    "read, dtype, world_size, variant",
    [
        ("rank0", torch.float32, 2, {}),
        ("sharded", torch.float32, 4, {}),
        ("sharded", torch.float32, 2, {"dora": True}),
        ("rank0", torch.bfloat16, 2, {}),
        ("sharded", torch.bfloat16, 2, {"train_norms": True}),
    ],
)
def test_lora_added_by_adapt_trains_like_one_process_and_saves_peft_adapters(
    saved, tmp_path, read, dtype, world_size, variant
):
    from peft import PeftModel, get_peft_model_state_dict

    path, _ = saved
    tokens = torch.arange(32).reshape(4, 8) % 40
    ranks = launch(
        _lora_train, path, tmp_path / "adapter", read, dtype, 3, tokens, variant, world_size=world_size, output="none"
    )

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

    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
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
