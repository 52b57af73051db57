"""Hugging Face models in and out of FSDP2: a sharded ``from_pretrained`` and a gathering ``save_pretrained``.

Both are called by every rank inside a process group. ``from_pretrained`` builds the model
on the ``meta`` device, shards it (each decoder layer, then the root), allocates only the
shards, and fills them from **one read** of the safetensors files: rank 0 reads them and
torch broadcasts each tensor (``set_model_state_dict`` with ``broadcast_from_rank0``), so
no rank but rank 0 ever holds a full copy. ``save_pretrained`` gathers the full state dict
to rank 0's CPU, writes it with transformers' own ``save_pretrained`` (config, safetensors,
tied weights written once), and publishes the directory atomically.

Needs ``transformers`` and ``safetensors`` (the package's ``hf`` extra).
"""

from __future__ import annotations

import os
import shutil
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
    records. The units are the model's ``_no_split_modules`` (its decoder layers), then the
    root, which keeps tied embedding and output weights together. The shards live on
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
    config = _config(Path(path), model_cls)
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
    for unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)  # the root: embeddings, final norm and the (tied) output layer

    model.to_empty(device=device)  # the shards only, uninitialised
    _init_non_persistent_buffers(model)
    if read == "sharded":
        _read_own_slices(Path(path), model)
    else:
        full = _read_weights(Path(path), model) if dist.get_rank() == 0 else {}
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model


def _config(path: Path, model_cls):
    """The model's config, with errors that say what is wrong with ``path`` or ``model_cls``."""
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a saved model: it has no config.json. Pass the directory that "
                                f"save_pretrained wrote (config.json and *.safetensors).")
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"{path} has no *.safetensors weights: save the model with save_pretrained "
                                f"(safetensors is its default).")
    config = AutoConfig.from_pretrained(path)
    expected = getattr(getattr(model_cls, "config_class", None), "model_type", None)
    if expected is not None and expected != config.model_type:
        raise ValueError(f"{model_cls.__name__} is a {expected!r} model but {path} holds a {config.model_type!r} "
                         f"model ({', '.join(config.architectures or [])}): pass that class, or leave model_cls out.")
    return config


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
    for file in sorted(path.glob("*.safetensors")):
        weights.update(load_file(file))
    for names in _tied_names(model):
        saved = next((weights[n] for n in names if n in weights), None)
        for name in names:
            if saved is not None and name not in weights:
                weights[name] = saved  # written once (transformers drops tied copies), loaded under each name
    return weights


def _read_own_slices(path: Path, model: nn.Module) -> None:
    """Each rank: read its shards' slices of the safetensors files straight into the model's DTensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from safetensors import safe_open

    saved = set()
    for file in path.glob("*.safetensors"):
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
    if dist.get_rank() == 0:
        partial = path.with_name(f".partial-{path.name}")
        shutil.rmtree(partial, ignore_errors=True)
        model.save_pretrained(partial, state_dict=full)
        _publish(partial, path)
    dist.barrier()
    return path
