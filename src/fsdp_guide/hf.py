"""Hugging Face models in and out of FSDP2: a sharded ``from_pretrained`` and a gathering ``save_pretrained``.

Both are called by every rank inside a process group. ``from_pretrained`` builds the model
on the ``meta`` device, shards it (each decoder layer, then the root), allocates only the
shards, and fills them from **one read** of the safetensors files: rank 0 reads them and
torch broadcasts each tensor (``set_model_state_dict`` with ``broadcast_from_rank0``), so
no rank but rank 0 ever holds a full copy. ``save_pretrained`` gathers the full state dict
to rank 0's CPU, writes it with transformers' own ``save_pretrained`` (config, safetensors,
tied weights written once), and publishes the directory atomically.

A failure on rank 0 (no such directory, weights that do not match the config, a full disk)
is raised on every rank, so no rank waits in a collective for the others.

Needs ``transformers`` and ``safetensors`` (the package's ``hf`` extra).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

__all__ = ["from_pretrained", "save_pretrained"]


def from_pretrained(path: str | os.PathLike, *, read: str = "rank0", model_cls=None, dtype: torch.dtype | None = None,
                    mp_policy=None, reshard_after_forward: bool = True, mesh=None) -> nn.Module:
    """The model saved at ``path``, sharded with FSDP2 over every rank, its files read once.

    Every rank calls it after ``init_process_group``. How the files are read:

    - ``read="rank0"``: rank 0 reads every tensor and torch broadcasts each to the ranks,
      which keep their shard. Only rank 0's machine needs the files; rank 0 holds one full
      copy on the CPU while it loads.
    - ``read="sharded"``: each rank reads only its own slices of the safetensors files
      (DCP's ``HuggingFaceStorageReader``). No rank holds a full copy and nothing is
      broadcast, but every machine must see the files (a shared file system).

    ``model_cls`` defaults to ``AutoModelForCausalLM``; ``dtype`` to the one the config
    records (a bf16 checkpoint trains in bf16 unless ``dtype=torch.float32``). The names in
    the files must be the model's own: checkpoints whose names transformers converts while
    loading (fused MoE experts, renamed prefixes) are refused with the mismatch named. The
    units are the model's ``_no_split_modules`` (its decoder layers), then the root, which
    keeps tied embedding and output weights together. The shards live on
    :func:`fsdp_guide.device`.

    >>> import tempfile
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from fsdp_guide import launch
    >>> from fsdp_guide.hf import from_pretrained
    >>> path = tempfile.mkdtemp() + "/tiny"
    >>> config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    ...                      num_attention_heads=2, num_key_value_heads=2)
    >>> LlamaForCausalLM(config).save_pretrained(path)
    >>> def shapes():
    ...     model = from_pretrained(path)
    ...     return tuple(model.model.embed_tokens.weight.to_local().shape)
    >>> launch(shapes, world_size=2, output="none")  # 32 rows of the embedding, 16 on each rank
    [(16, 16), (16, 16)]
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp_guide.devices import device as rank_device

    if read not in ("rank0", "sharded"):
        raise ValueError(f"read={read!r}: use 'rank0' (rank 0 reads, then broadcasts) or 'sharded' "
                         f"(each rank reads its own slices; the files on every machine)")
    path = Path(path)
    # Rank 0 reads the config; its error, if any, is raised on every rank (no rank left waiting).
    config = _on_rank0_for_all(lambda: _config(path, model_cls))
    model_cls = model_cls or AutoModelForCausalLM
    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    with torch.device("meta"):
        model = model_cls.from_config(config, dtype=dtype) if hasattr(model_cls, "from_config") \
            else model_cls._from_config(config, dtype=dtype)

    device = rank_device()
    mesh = mesh or init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward,
              "mp_policy": mp_policy or MixedPrecisionPolicy()}
    units = [m for m in model.modules() if type(m).__name__ in (model._no_split_modules or ())]
    if not units:
        warnings.warn(f"{type(model).__name__} names no _no_split_modules: the whole model is one FSDP unit, "
                      f"gathered whole for every forward", stacklevel=2)
    for unit in reversed(units):  # innermost first, as fully_shard expects
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)  # the root: embeddings, final norm and the (tied) output layer

    model.to_empty(device=device)  # the shards only, uninitialised
    _init_non_persistent_buffers(model)
    if read == "sharded":
        _read_own_slices(path, model)
    else:
        full = _on_rank0_for_all(lambda: _read_weights(path, model), result_to_all=False)
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model


def _on_rank0_for_all(fn, result_to_all: bool = True):
    """``fn()`` on rank 0; its result on every rank (or ``{}`` on the others, without ``result_to_all``),
    or its error raised on every rank."""
    result, error = (None, None)
    if dist.get_rank() == 0:
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
            error = exc
    shared = [result if result_to_all else None, error]
    dist.broadcast_object_list(shared, src=0)
    if shared[1] is not None:
        raise shared[1]
    if dist.get_rank() == 0:
        return result
    return shared[0] if result_to_all else {}


def _config(path: Path, model_cls):
    """The model's config, with errors that say what is wrong with ``path`` or ``model_cls``."""
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a saved model: it has no config.json. Pass the directory that "
                                f"save_pretrained wrote (config.json and *.safetensors).")
    _weight_files(path)
    config = AutoConfig.from_pretrained(path)
    expected = getattr(getattr(model_cls, "config_class", None), "model_type", None)
    if expected is not None and expected != config.model_type:
        raise ValueError(f"{model_cls.__name__} is a {expected!r} model but {path} holds a {config.model_type!r} "
                         f"model ({', '.join(config.architectures or [])}): pass that class, or leave model_cls out.")
    return config


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files of the model: those its index names, or model.safetensors, or the only one there is."""
    index = path / "model.safetensors.index.json"
    if index.is_file():  # a sharded checkpoint; other .safetensors beside it (consolidated.*) are not the model's
        return sorted({path / name for name in json.loads(index.read_text())["weight_map"].values()})
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if len(files) != 1:
        raise FileNotFoundError(f"{path} has {'no' if not files else len(files)} *.safetensors files and no "
                                f"model.safetensors.index.json saying which hold the model: pass the directory "
                                f"save_pretrained wrote.")
    return files


def _init_non_persistent_buffers(model: nn.Module) -> None:
    # Buffers that are not in the state dict (the rotary embedding's inv_freq) came out of
    # to_empty as garbage, and no file restores them: transformers' own initialiser
    # recomputes them for the modules that hold them.
    for module in model.modules():
        if module._non_persistent_buffers_set:
            model._init_weights(module)


def _read_weights(path: Path, model: nn.Module) -> dict[str, torch.Tensor]:
    """Rank 0: every tensor in the safetensors files, each tied name filled from the one saved."""
    from safetensors.torch import load_file

    weights = {}
    for file in _weight_files(path):
        weights.update(load_file(file))
    for names in _tied_names(model):
        saved = next((weights[n] for n in names if n in weights), None)
        for name in names:
            if saved is not None and name not in weights:
                weights[name] = saved  # written once (transformers drops tied copies), loaded under each name
    _check_names(path, set(weights), set(model.state_dict()))
    return weights


def _check_names(path: Path, saved: set[str], expected: set[str]) -> None:
    # Checked before any tensor is broadcast: a mismatch found later, on rank 0 alone, would
    # leave the other ranks waiting in their next collective.
    missing, unexpected = sorted(expected - saved), sorted(saved - expected)
    if missing or unexpected:
        raise KeyError(f"the weights in {path} do not match the model its config describes: missing "
                       f"{missing[:5]}{' ...' if len(missing) > 5 else ''}, unexpected "
                       f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}. fsdp_guide.hf loads the names "
                       f"as saved; checkpoints whose names transformers converts on load are not supported.")


def _read_own_slices(path: Path, model: nn.Module) -> None:
    """Each rank: read its shards' slices of the safetensors files straight into the model's DTensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from safetensors import safe_open

    saved = set()
    for file in _on_rank0_for_all(lambda: _weight_files(path)):
        with safe_open(file, framework="pt") as f:  # the header only
            saved |= set(f.keys())
    state = get_model_state_dict(model)  # DTensors sharing storage with the parameters: DCP loads in place
    for names in _tied_names(model):
        if saved & set(names):
            for alias in set(names) - saved:
                state.pop(alias, None)  # the files hold a tied weight once; loading it fills every name
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(path)))


def _tied_names(model: nn.Module) -> list[list[str]]:
    """The names of each parameter (several for tied weights)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return list(names.values())


def save_pretrained(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write the sharded ``model`` as a Hugging Face model directory at ``path`` (every rank calls it; rank 0 writes).

    The full state dict is gathered parameter by parameter to rank 0's CPU, then
    transformers' ``save_pretrained`` writes the config and safetensors (tied weights once).
    The directory appears complete or not at all: it is written beside ``path`` and renamed,
    replacing an earlier save only once the new one is on disk.
    ``AutoModelForCausalLM.from_pretrained(path)`` in one process then loads exactly these weights.
    """
    from fsdp_guide.checkpoint import _publish

    path = Path(path)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def write():
        partial = path.with_name(f".partial-{path.name}")
        shutil.rmtree(partial, ignore_errors=True)
        model.save_pretrained(partial, state_dict=full)
        _publish(partial, path)

    _on_rank0_for_all(write)  # a failure on rank 0 (a full disk) is raised on every rank, not waited for
    return path
