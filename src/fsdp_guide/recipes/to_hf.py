"""A training checkpoint turned into a Hugging Face model, offline: one process, no GPU, a tensor at a time.

::

    python -m fsdp_guide.recipes.to_hf CHECKPOINT OUT --config MODEL_DIR [--dtype bf16] [--max-shard-size 5GB]
    python -m fsdp_guide.recipes.to_hf CHECKPOINT OUT [--dtype fp32]     # the LLM recipe's GPT, as GPT-2

``CHECKPOINT`` is a DCP checkpoint directory: a ``step-N`` of :mod:`fsdp_guide.checkpoint` (the
model under ``model.``, as ``get_state_dict`` names it), or any DCP save of a model's state dict.
``OUT`` is written as ``save_pretrained`` writes a model, and ``from_pretrained`` loads it: the
config, safetensors files in the chosen dtype (split, with ``model.safetensors.index.json``,
past ``--max-shard-size``), tied weights once.

- A Hugging Face model trained under FSDP2: ``--config`` is the directory it was loaded from
  (its ``config.json``; ``generation_config.json`` and tokenizer files there are copied too).
  Each name of the model must be in the checkpoint with its shape; a checkpoint of another
  model is an error naming what differs. Names saved through a wrapper (``torch.compile``'s
  ``_orig_mod.``, activation checkpointing's ``_checkpoint_wrapped_module.``, FSDP1's
  ``_fsdp_wrapped_module.``) are read as the unwrapped model's, as DCP's
  ``get_model_state_dict`` names them. What the model keeps in fp32 whatever the dtype
  (``_keep_in_fp32_modules`` under fp16, ``_keep_in_fp32_modules_strict`` under fp16 and
  bf16) is written in fp32, as ``save_pretrained`` of the model loaded in that dtype writes it.
- The LLM recipe's GPT (:mod:`fsdp_guide.recipes.train_llm`): no ``--config``; the model's size
  is read from the settings the recipe saves in every checkpoint, and the weights are written
  as a ``GPT2LMHeadModel`` with exact GELU and no dropout, which computes what the GPT does:
  its separate ``q``, ``k``, ``v`` are concatenated into GPT-2's ``c_attn``, each ``nn.Linear``
  weight is transposed into GPT-2's ``Conv1D`` layout, and GPT-2's biases, which the GPT
  lacks, are zeros.

It runs in one process with no process group, and reads one tensor at a time with DCP
(``dcp.load`` of that key alone, ``no_dist=True``): DCP assembles it from the shards every rank
wrote, whatever the number of ranks. What it holds at once is the output file being filled
(at most ``--max-shard-size``) and one tensor as saved, never the whole model. Nothing of
``OUT`` appears until every file is written: they go to a hidden folder beside it, renamed to
``OUT`` at the end (removed, with only what this wrote, on an error). An existing ``OUT`` is
refused, never replaced.

What is written by hand: the name maps, and reading a tensor at a time (DCP's
``dcp_to_torch_save`` loads the whole checkpoint into memory at once, and its
``_consolidate_hf_safetensors`` reads only checkpoints written in the Hugging Face format).
The split into files is ``huggingface_hub``'s, the files ``safetensors``', the config
``transformers``'.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["to_hf", "main"]

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
# Files of a Hugging Face model directory, besides the config and the weights, that OUT gets copies of.
COPIED = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


class ConversionError(ValueError):
    """What is wrong with the checkpoint, the config or the output, and what would be right."""


@dataclass(frozen=True)
class _Output:
    """One tensor of the Hugging Face model: its name, shape, and how it is made from the checkpoint's tensors."""

    name: str
    shape: tuple[int, ...]
    sources: tuple[str, ...]  # the checkpoint's keys it is made of (none: zeros)
    make: Callable[[list[torch.Tensor]], torch.Tensor]
    dtype: torch.dtype | None = (
        None  # a floating-point dtype of its own (the model keeps it in fp32), or the one chosen
    )


def to_hf(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    *,
    config: str | os.PathLike | None = None,
    dtype: str = "bf16",
    max_shard_size: int | str = "5GB",
) -> Path:
    """Write the model in the DCP checkpoint ``checkpoint`` as a Hugging Face model directory ``out``.

    ``config``: the Hugging Face model directory the trained model came from (its
    ``config.json``); None for the LLM recipe's GPT, written as GPT-2. ``dtype``: ``"bf16"``,
    ``"fp32"`` or ``"fp16"``, for the floating-point weights. Returns ``out``.

    Example: a model's state dict saved with DCP, and the Hugging Face model it came from:

    >>> import tempfile
    >>> import torch.distributed.checkpoint as dcp
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from fsdp_guide.recipes.to_hf import to_hf
    >>> tmp = Path(tempfile.mkdtemp())
    >>> config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    >>> model = LlamaForCausalLM(config)
    >>> model.save_pretrained(tmp / "base")
    >>> dcp.save({"model": model.state_dict()}, checkpoint_id=tmp / "ckpt", no_dist=True)  # doctest: +ELLIPSIS
    Metadata(...)
    >>> out = to_hf(tmp / "ckpt", tmp / "hf", config=tmp / "base", dtype="fp32")
    >>> sorted(p.name for p in out.iterdir())
    ['config.json', 'generation_config.json', 'model.safetensors']
    >>> loaded = LlamaForCausalLM.from_pretrained(out)
    >>> all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    True

    Raises:
        ConversionError: ``out`` exists; ``checkpoint`` is not a complete DCP checkpoint (no
            ``.metadata``, a file it names missing or short, an unfinished ``.partial-step-N``);
            its model does not match ``config`` (a name missing, one the model lacks, a shape);
            no ``config`` and no recipe settings in the checkpoint; an unknown ``dtype``.
    """
    if dtype not in DTYPES:
        raise ConversionError(f"dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
    _check_size(max_shard_size)
    checkpoint, out = Path(checkpoint), Path(out)
    _check_out(out)
    metadata = _complete_checkpoint(checkpoint)
    saved = {key: meta for key, meta in metadata.state_dict_metadata.items() if hasattr(meta, "size")}
    if config is None:
        hf_config, outputs = _recipe_gpt(checkpoint, saved)
    else:
        hf_config, outputs = _hf_model(checkpoint, Path(config), saved, DTYPES[dtype])
    hf_config.dtype = DTYPES[dtype]  # what from_pretrained loads it in, by default

    from fsdp_guide.checkpoint import _fsync  # its checkpoints are published the same way

    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))  # ours, removed on failure
    try:
        os.chmod(partial, 0o777 & ~_umask())  # mkdtemp makes it 0700; OUT gets the usual mode
        _write_weights(checkpoint, metadata, outputs, DTYPES[dtype], partial, max_shard_size)
        hf_config.save_pretrained(partial)
        if config is not None:
            for name in COPIED:
                if (Path(config) / name).is_file():
                    shutil.copy2(Path(config) / name, partial / name)
        for file in partial.iterdir():  # on disk before the name says they are there
            _fsync(file)
        _fsync(partial)
        _check_out(out)  # still free: nothing of anyone else's is replaced
        os.rename(partial, out)  # all of it, at once (an empty folder named OUT is replaced too)
        _fsync(out.parent)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out


def _check_size(max_shard_size) -> None:
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        if not isinstance(max_shard_size, int):
            parse_size_to_int(max_shard_size)
    except (ValueError, TypeError) as error:
        raise ConversionError(f"max_shard_size={max_shard_size!r}: {error} (such as 5GB or 500MB)") from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _check_out(out: Path) -> None:
    if out.is_symlink() or (out.exists() and not (out.is_dir() and not any(out.iterdir()))):
        raise ConversionError(
            f"{out} exists: the model is written to a new directory (or an empty one), never over "
            "anything there; choose another OUT, or move that one away yourself"
        )


def _complete_checkpoint(path: Path):
    """The checkpoint's DCP metadata, read safely, once every file it names is there in full."""
    from fsdp_guide import checkpoint

    if path.name.startswith(".partial-step-"):
        raise ConversionError(
            f"{path} is a save that did not finish (fsdp_guide.checkpoint renames .partial-step-N to "
            "step-N once every rank has written): convert a step-N beside it "
            "(fsdp_guide.checkpoint.latest finds the newest)"
        )
    try:
        metadata = checkpoint._read_metadata(path)
    except checkpoint.CheckpointError as error:
        raise ConversionError(str(error)) from None
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = path / name
        size = file.stat().st_size if file.is_file() else None
        if size is None or size < end:
            raise ConversionError(
                f"{path} is incomplete: {name} is {'missing' if size is None else f'{size} bytes, of {end}'} "
                "(its .metadata names the data every rank wrote); convert a complete checkpoint"
            )
    return metadata


def _hf_model(checkpoint: Path, config_dir: Path, saved: dict, dtype: torch.dtype):
    """A Hugging Face model's config and its tensors, each read under its own name (tied ones once)."""
    import transformers

    if not (config_dir / "config.json").is_file():
        raise ConversionError(
            f"--config {config_dir}: no config.json there; pass the Hugging Face model directory "
            "the trained model was loaded from"
        )
    config = transformers.AutoConfig.from_pretrained(config_dir)
    architecture = (config.architectures or [None])[0]
    cls = getattr(transformers, architecture, None) if architecture else None
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cls(config) if cls is not None else transformers.AutoModelForCausalLM.from_config(config)
    if not config.architectures:
        config.architectures = [type(model).__name__]
    from transformers.conversion_mapping import get_model_conversion_mapping

    if get_model_conversion_mapping(model, add_legacy=False):
        raise ConversionError(
            f"{type(model).__name__} of {config_dir} keeps its weights in memory in another layout than in "
            "its files (transformers' weight conversions, such as fused experts), which this conversion does "
            "not undo: load the checkpoint into the model and call save_pretrained instead"
        )
    tied = _names_by_tensor(model)  # each tensor's names in the state dict: more than one where tied
    expected = {names[0]: shape for names, shape in tied}  # the first only, as save_pretrained writes it
    unwrapped = _unwrapped(checkpoint, saved)  # the model's names for the checkpoint's keys
    prefix = next((p for p in ("model.", "") if all(p + name in unwrapped for name in expected)), None)
    if prefix is None:
        _mismatch(checkpoint, expected, unwrapped, f"{type(model).__name__} of {config_dir}")
    for name, shape in expected.items():
        if tuple(saved[unwrapped[prefix + name]].size) != shape:
            raise ConversionError(
                f"{checkpoint}: {name} is {tuple(saved[unwrapped[prefix + name]].size)} there and {shape} in "
                f"{type(model).__name__} of {config_dir}/config.json: the checkpoint is of another model size"
            )
    known = {name for names, _ in tied for name in names}  # the second names of tied pairs too
    extra = sorted(
        key[len(prefix) :] for key in unwrapped if key.startswith(prefix) and key[len(prefix) :] not in known
    )
    if extra:
        raise ConversionError(
            f"{checkpoint}: its model has {', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''}, which "
            f"{type(model).__name__} of {config_dir} does not: it was trained from another model (or with "
            "adapters: merge them first, or save the adapters with peft)"
        )
    # What from_pretrained keeps in fp32 whatever the dtype asked (_keep_in_fp32_modules under fp16,
    # _keep_in_fp32_modules_strict under fp16 and bf16): written so, as save_pretrained of the loaded
    # model writes them. The plan and its matching are transformers' own (modeling_utils,
    # core_model_loading); both are private, and this is what they are for.
    from transformers.core_model_loading import build_glob_alternation

    plan = model._get_dtype_plan(dtype)
    in_fp32 = build_glob_alternation(list(plan))[0] if plan else None
    return config, [  # a tied pair's second name, where saved, must hold the same values
        _Output(
            names[0],
            shape,
            tuple(unwrapped[prefix + name] for name in names if name == names[0] or prefix + name in unwrapped),
            _same_values(checkpoint, names[0]),
            torch.float32 if in_fp32 is not None and in_fp32.search(names[0]) else None,
        )
        for names, shape in tied
    ]


def _unwrapped(checkpoint: Path, saved: dict) -> dict[str, str]:
    """The checkpoint's keys by the names the unwrapped model gives them.

    A model saved with its own ``state_dict()`` after ``torch.compile`` (``_orig_mod.``),
    activation checkpointing's wrapper (``_checkpoint_wrapped_module.``) or FSDP1's
    (``_fsdp_wrapped_module.``) carries those wrappers in its names; DCP's
    ``get_model_state_dict`` removes them (``_get_fqns`` in ``torch/distributed/checkpoint/
    state_dict.py``), and so does this, dropping the parts of a name that are exactly those
    wrappers' attributes, so that either checkpoint converts.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
    from torch.distributed.fsdp._common_utils import FSDP_WRAPPED_MODULE

    wrappers = {"_orig_mod", _CHECKPOINT_PREFIX.rstrip("."), FSDP_WRAPPED_MODULE}  # whole parts of a name only
    names: dict[str, str] = {}
    for key in saved:
        name = ".".join(part for part in key.split(".") if part not in wrappers)
        if name in names:
            raise ConversionError(
                f"{checkpoint}: {names[name]!r} and {key!r} are one tensor of the model once the wrappers' names "
                f"({', '.join(sorted(wrappers))}) are removed: save the model's state dict once, "
                "with torch.distributed.checkpoint.state_dict.get_model_state_dict"
            )
        names[name] = key
    return names


def _names_by_tensor(model) -> list[tuple[list[str], tuple[int, ...]]]:
    """Each tensor of the model's state dict once: its names (more than one where tied), in order, and its shape."""
    names: dict[int, list[str]] = {}
    shapes: dict[int, tuple[int, ...]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), []).append(name)
        shapes[id(tensor)] = tuple(tensor.shape)
    return [(names[key], shapes[key]) for key in names]


def _same_values(checkpoint: Path, name: str):
    """The tensor under its first name, once every other name of it in the checkpoint holds the same values."""

    def make(tensors: list[torch.Tensor]) -> torch.Tensor:
        for other in tensors[1:]:
            if not torch.equal(other, tensors[0]):
                raise ConversionError(
                    f"{checkpoint}: {name} and the weight the config ties to it differ in the checkpoint: the "
                    "tie was broken in training; write them apart with tie_word_embeddings=False in the config "
                    "you pass as --config"
                )
        return tensors[0]

    return make


def _mismatch(checkpoint: Path, expected: dict, saved: dict, what: str):
    model = sorted(key[len("model.") :] for key in saved if key.startswith("model.")) or sorted(saved)
    missing = sorted(set(expected) - set(model))
    raise ConversionError(
        f"{checkpoint}: {what} has {', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}, which the "
        f"checkpoint does not (its model has {', '.join(model[:3]) or 'no tensors'}"
        f"{', ...' if len(model) > 3 else ''}): pass --config the directory of the model that was trained"
    )


def _recipe_gpt(checkpoint: Path, saved: dict):
    """The LLM recipe's GPT as a GPT-2 (config and tensor map), its size from the settings saved with it."""
    import transformers

    from fsdp_guide.recipes import train_llm

    try:
        settings = train_llm._saved_settings(checkpoint)
    except Exception as error:  # noqa: BLE001 - a checkpoint damaged or of another kind
        settings, why = None, str(error)
    else:
        why = "it holds none of the settings the LLM recipe saves"
    if settings is None:
        raise ConversionError(
            f"{checkpoint}: {why}; for a Hugging Face model's checkpoint pass --config, the model "
            "directory it was trained from"
        )
    from fsdp_guide.gpt import GPTConfig

    try:  # the model's size only: the other settings are the run's, and may be of an older recipe
        gpt = GPTConfig(**{k: settings[k] for k in ("n_layer", "n_head", "n_embd", "block_size")})
    except (KeyError, TypeError, ValueError) as error:
        raise ConversionError(f"{checkpoint}: its saved model settings cannot be used ({error})") from None
    config = transformers.GPT2Config(
        vocab_size=gpt.vocab_size,
        n_positions=gpt.block_size,
        n_embd=gpt.n_embd,
        n_layer=gpt.n_layer,
        n_head=gpt.n_head,
        activation_function="gelu",  # the GPT's F.gelu: exact, not GPT-2's tanh approximation
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,  # the GPT's lm_head is its token embedding
        bos_token_id=None,  # bytes, no special tokens (GPT-2's 50256 is beyond these 256)
        eos_token_id=None,
        architectures=["GPT2LMHeadModel"],
    )
    d = gpt.n_embd

    def key(name: str) -> str:
        return f"model.{name}"

    def conv1d(
        t: list[torch.Tensor],
    ) -> torch.Tensor:  # nn.Linear (out, in) -> Conv1D (in, out)
        return t[0].t().contiguous()

    outputs = [
        _Output(
            "transformer.wte.weight",
            (gpt.vocab_size, d),
            (key("tok_emb.weight"),),
            lambda t: t[0],
        ),
        _Output(
            "transformer.wpe.weight",
            (gpt.block_size, d),
            (key("pos_emb.weight"),),
            lambda t: t[0],
        ),
    ]
    for i in range(gpt.n_layer):
        b, h = f"blocks.{i}.", f"transformer.h.{i}."
        outputs += [
            _Output(h + "ln_1.weight", (d,), (key(b + "ln_1.weight"),), lambda t: t[0]),
            _Output(h + "ln_1.bias", (d,), (key(b + "ln_1.bias"),), lambda t: t[0]),
            _Output(
                h + "attn.c_attn.weight",
                (d, 3 * d),
                tuple(key(b + f"attn.{x}.weight") for x in "qkv"),
                lambda t: torch.cat(t).t().contiguous(),
            ),
            _Output(h + "attn.c_attn.bias", (3 * d,), (), None),
            _Output(h + "attn.c_proj.weight", (d, d), (key(b + "attn.proj.weight"),), conv1d),
            _Output(h + "attn.c_proj.bias", (d,), (), None),
            _Output(h + "ln_2.weight", (d,), (key(b + "ln_2.weight"),), lambda t: t[0]),
            _Output(h + "ln_2.bias", (d,), (key(b + "ln_2.bias"),), lambda t: t[0]),
            _Output(h + "mlp.c_fc.weight", (d, 4 * d), (key(b + "mlp.fc.weight"),), conv1d),
            _Output(h + "mlp.c_fc.bias", (4 * d,), (), None),
            _Output(
                h + "mlp.c_proj.weight",
                (4 * d, d),
                (key(b + "mlp.proj.weight"),),
                conv1d,
            ),
            _Output(h + "mlp.c_proj.bias", (d,), (), None),
        ]
    outputs += [
        _Output("transformer.ln_f.weight", (d,), (key("ln_f.weight"),), lambda t: t[0]),
        _Output("transformer.ln_f.bias", (d,), (key("ln_f.bias"),), lambda t: t[0]),
    ]
    missing = sorted({s for o in outputs for s in o.sources} - set(saved))
    if missing:
        raise ConversionError(
            f"{checkpoint}: the recipe's GPT has {', '.join(missing[:3])}, which the checkpoint does not: "
            "it is damaged, or was saved by another model"
        )
    return config, outputs


def _write_weights(
    checkpoint: Path,
    metadata,
    outputs: list[_Output],
    dtype,
    into: Path,
    max_shard_size,
) -> None:
    """Each output file filled a tensor at a time, written, and let go before the next."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    saved = metadata.state_dict_metadata
    meta = {  # the dtype each is written in: the one chosen, for floating-point tensors
        o.name: torch.empty(
            o.shape,
            dtype=_written_dtype(saved[o.sources[0]] if o.sources else None, o.dtype or dtype),
            device="meta",
        )
        for o in outputs
    }
    split = split_torch_state_dict_into_shards(meta, max_shard_size=max_shard_size)
    by_name = {o.name: o for o in outputs}
    for filename, names in split.filename_to_tensors.items():
        tensors = {}
        for name in names:
            output = by_name[name]
            parts = [_read(checkpoint, metadata, key) for key in output.sources]
            tensor = output.make(parts) if output.sources else torch.zeros(output.shape)
            if tuple(tensor.shape) != output.shape:
                raise ConversionError(
                    f"{checkpoint}: {name} would be {tuple(tensor.shape)} and the model has {output.shape}: "
                    "the checkpoint is of another model size"
                )
            tensors[name] = tensor.to(output.dtype or dtype) if tensor.is_floating_point() else tensor
            del parts, tensor
        save_file(tensors, into / filename, metadata={"format": "pt"})  # what transformers writes
        del tensors
    if split.is_sharded:
        import json

        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (into / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _written_dtype(entry, dtype: torch.dtype) -> torch.dtype:
    saved = entry.properties.dtype if entry is not None else torch.float32
    return dtype if saved.is_floating_point else saved


def _read(checkpoint: Path, metadata, key: str) -> torch.Tensor:
    """One tensor of the checkpoint, whole, assembled by DCP from the shards the ranks wrote; in this process alone."""
    import torch.distributed.checkpoint as dcp

    from fsdp_guide import checkpoint as ours

    entry = metadata.state_dict_metadata[key]
    state = {key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)}
    with warnings.catch_warnings():  # DCP warns that it loads in one process: what this is for
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(
            state,
            storage_reader=ours._SafeReader(checkpoint, metadata),
            planner=ours._SafeLoadPlanner(allow_partial_load=True),  # this key only: the rest stays on disk
            no_dist=True,
        )
    return state[key]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_guide.recipes.to_hf",
        description=__doc__.splitlines()[0].rstrip("."),
    )
    parser.add_argument(
        "checkpoint",
        help="a DCP checkpoint directory (a step-N of fsdp_guide.checkpoint)",
    )
    parser.add_argument("out", help="the Hugging Face model directory to write (new, or empty)")
    parser.add_argument(
        "--config",
        help="the Hugging Face model directory it was trained from; omit for the LLM recipe's GPT",
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="bf16",
        help="of the weights (default: bf16)",
    )
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        help="split the weights into files past this (5GB)",
    )
    options = parser.parse_args(argv)
    # transformers imports torchao where it is installed, which logs about CUDA kernels a CPU
    # cannot load (fsdp_guide.fp8.quiet_torchao's two loggers); the conversion uses neither
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    try:
        out = to_hf(
            options.checkpoint,
            options.out,
            config=options.config,
            dtype=options.dtype,
            max_shard_size=options.max_shard_size,
        )
    except ConversionError as error:
        print(f"to_hf: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # the disk, a permission, a race for OUT: nothing was left half-written
        print(f"to_hf: {error}; nothing was written to {options.out}", file=sys.stderr)
        return 1
    files = sorted(p.name for p in out.iterdir())
    print(f"wrote {out}: {', '.join(files)}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
