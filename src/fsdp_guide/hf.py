"""Hugging Face models in and out of FSDP2: a sharded ``from_pretrained`` and a gathering ``save_pretrained``.

Both are called by every rank inside a process group. ``from_pretrained`` builds the model
on the ``meta`` device, shards it (each decoder layer, then the root), allocates only the
shards, and fills them from **one read** of the safetensors files: rank 0 reads them and
torch broadcasts each tensor (``set_model_state_dict`` with ``broadcast_from_rank0``), so
no rank but rank 0 ever holds a full copy. ``save_pretrained`` gathers the full state dict
to rank 0's CPU, writes it with transformers' own ``save_pretrained`` (config, safetensors,
tied weights written once: the names that share a parameter share the gathered tensor),
and renames each file into place once it is on disk, leaving the other files in the
directory as they were; with ``write="sharded"`` every rank writes its shards with DCP's
Hugging Face writer instead, and rank 0 consolidates them, so no rank holds the whole model.

A failure on rank 0 (no such directory, weights that do not match the config, a full disk)
is raised on every rank, so no rank waits in a collective for the others.

Needs ``transformers`` and ``safetensors`` (the package's ``hf`` extra).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

__all__ = ["from_pretrained", "save_pretrained"]


def from_pretrained(
    path: str | os.PathLike,
    *,
    read: str = "rank0",
    model_cls=None,
    dtype: torch.dtype | None = None,
    mp_policy=None,
    reshard_after_forward: bool = True,
    mesh=None,
    adapt: Callable[[nn.Module], nn.Module] | None = None,
) -> nn.Module:
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
    loading (fused MoE experts, renamed prefixes) are refused with the mismatch named. So is
    a tensor whose shape differs from the model's, or an integer or bool one for a float
    parameter, naming its file: the headers are checked before any tensor is read. The
    units are the model's ``_no_split_modules`` (its decoder layers), then the root, which
    keeps tied embedding and output weights together. The shards live on
    :func:`fsdp_guide.device`.

    ``reshard_after_forward`` applies to every unit, the root included: with the default,
    ``True``, nothing stays gathered after a forward (evaluation, generation). FSDP2's own
    default for the root (``None``) keeps the root's parameters (embeddings, output layer)
    gathered from forward to backward, saving their all-gather in backward.

    ``adapt`` changes the model before it is sharded, e.g. adds LoRA adapters with
    ``lambda model: peft.get_peft_model(model, LoraConfig(...))``. Every rank runs it on
    the model allocated on the CPU but never written (for its structure and names: it
    costs address space, not memory), and rank 0 runs it once more on the pretrained model
    loaded whole (``model_cls.from_pretrained``: one full copy on rank 0's CPU, briefly),
    so that what it adds gets the values one process would give it, including values
    computed from the weights (DoRA's magnitudes, copies for ``modules_to_save``); seed
    before calling, as you would in one process. Every rank takes rank 0's values. The
    saved weights go to the parameters they belong to, whatever ``adapt`` renamed them to
    (a wrapped layer keeps its parameters). FSDP2 wants one dtype among a unit's trainable
    parameters (frozen ones may differ): peft's fp32 adapters on a frozen bf16 base share
    the layers' units, but added parameters that train beside trainable parameters of
    another dtype (fp32 adapters, bf16 norms) get units of their own.

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
    from transformers import AutoModelForCausalLM

    from fsdp_guide.devices import device as rank_device

    if read not in ("rank0", "sharded"):
        raise ValueError(
            f"read={read!r}: use 'rank0' (rank 0 reads, then broadcasts) or 'sharded' "
            f"(each rank reads its own slices; the files on every machine)"
        )
    path = Path(path)
    # Rank 0 reads the config; its error, if any, is raised on every rank (no rank left waiting).
    config = _on_rank0_for_all(lambda: _config(path, model_cls))
    model_cls = model_cls or AutoModelForCausalLM
    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    with torch.device("meta"):
        model = (
            model_cls.from_config(config, dtype=dtype)
            if hasattr(model_cls, "from_config")
            else model_cls._from_config(config, dtype=dtype)
        )
    saved = _on_rank0_for_all(lambda: _check_saved(path, model))  # the names in the files, once checked
    saved_as = {name: name for name in model.state_dict()}  # the model's name -> the name in the files
    added: dict[str, torch.Tensor] = {}  # what adapt added -> rank 0's initial value (empty on other ranks)
    added_names: list[str] = []
    if adapt is not None:
        model, saved_as, added_names = _adapted(model, adapt)
        added = _on_rank0_for_all(
            lambda: _added_values(path, model_cls, dtype, adapt, added_names), result_to_all=False
        )

    device = rank_device()
    mesh = mesh or init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs = {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
    }
    for owner in _owners_training_in_another_dtype(model, set(added_names)):
        fully_shard(owner, **kwargs)  # FSDP2 reduces one dtype per unit: fp32 adapters apart from bf16 norms
    units = [m for m in model.modules() if type(m).__name__ in (model._no_split_modules or ())]
    if not units:
        warnings.warn(
            f"{type(model).__name__} names no _no_split_modules: the whole model is one FSDP unit, "
            f"gathered whole for every forward",
            stacklevel=2,
        )
    for unit in reversed(units):  # innermost first, as fully_shard expects
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)  # the root: embeddings, final norm and the (tied) output layer

    model.to_empty(device=device)  # the shards only, uninitialised
    _init_non_persistent_buffers(model)
    if read == "sharded":
        _read_own_slices(path, model, saved_as, saved)
        if added_names:  # rank 0's values of what adapt added, one broadcast each (every rank takes part)
            set_model_state_dict(
                model,
                added if dist.get_rank() == 0 else {},
                options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False),
            )
    else:
        full = _on_rank0_for_all(lambda: {**_read_weights(path, model, saved_as), **added}, result_to_all=False)
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model


def _adapted(model: nn.Module, adapt) -> tuple[nn.Module, dict[str, str], list[str]]:
    """``adapt(model)`` for its structure: the adapted model on ``meta``, the saved name of each tensor it kept,
    the names of those it added.

    adapt runs on the model allocated on the CPU but never written (pages nothing touches
    take no memory; libraries' initialisers need real tensors, not ``meta`` ones), with the
    random stream restored afterwards: rank 0's run on the real weights is the one that counts.
    """
    import torch.utils.deterministic as deterministic

    fill = deterministic.fill_uninitialized_memory
    deterministic.fill_uninitialized_memory = False  # with deterministic algorithms on, torch.empty writes NaNs
    tied = _names_by_tensor(model)
    try:
        _retied(model.to_empty(device="cpu"), tied)
    finally:
        deterministic.fill_uninitialized_memory = fill
    before = _names_by_tensor(model)
    with torch.random.fork_rng(devices=[]):
        adapted = adapt(model)
    if not isinstance(adapted, nn.Module):
        raise TypeError(
            f"adapt returned {type(adapted).__name__}: it must return the model to shard "
            f"(e.g. lambda model: peft.get_peft_model(model, config))"
        )
    saved_as, added = {}, []
    for key, (_, names) in _names_by_tensor(adapted).items():
        if key in before:  # a tensor of the saved model, perhaps renamed (peft: ...q_proj.base_layer.weight)
            old = before[key][1]
            if len(old) != len(names):
                raise ValueError(f"adapt changed how often a tensor is shared: {old} became {names}")
            saved_as.update(zip(names, old))
        else:
            added += names
    tied = _names_by_tensor(adapted)
    return _retied(adapted.to("meta"), tied), saved_as, added


def _added_values(path: Path, model_cls, dtype: torch.dtype, adapt, names: list[str]) -> dict[str, torch.Tensor]:
    """Rank 0: what ``adapt`` gives the tensors it adds to the pretrained model, loaded whole as in one process."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Loading weights" bar in rank 0's output for a load the user did not ask for
    try:
        state = adapt(model_cls.from_pretrained(path, dtype=dtype)).state_dict()
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return {name: state[name] for name in names}


def _retied(model: nn.Module, tensors: dict[int, tuple[torch.Tensor, list[str]]]) -> nn.Module:
    """Tie again the parameters ``tensors`` lists under several names: moving a module to
    another device gives each module a parameter of its own (the output layer loses its tie
    to the embedding)."""
    for _, names in tensors.values():
        first = model.get_parameter(names[0]) if len(names) > 1 else None
        for name in names[1:]:
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner).register_parameter(leaf, first)
    return model


def _names_by_tensor(model: nn.Module) -> dict[int, tuple[torch.Tensor, list[str]]]:
    """Each tensor of the state dict, once, with its names (several for tied weights), in module order."""
    found: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        found.setdefault(id(tensor), (tensor, []))[1].append(name)
    return found


def _owners_training_in_another_dtype(model: nn.Module, added: set[str]) -> list[nn.Module]:
    """The modules holding added trainable parameters whose dtype no other trainable parameter has.

    A holder that is not called (a ParameterDict, as peft's embedding adapters use) is
    replaced by its parent: FSDP2 gathers a unit in its forward hook."""
    params = dict(model.named_parameters())
    others = {p.dtype for name, p in params.items() if p.requires_grad and name not in added}
    owners = set()
    for name in added:
        if name in params and params[name].requires_grad and others and params[name].dtype not in others:
            owner = name.rpartition(".")[0]
            while owner and type(model.get_submodule(owner)).forward is nn.Module.forward:
                owner = owner.rpartition(".")[0]
            owners.add(owner)
    return [module for name, module in model.named_modules() if name in owners]


def _on_rank0_for_all(fn, result_to_all: bool = True):
    """``fn()`` on rank 0; its result on every rank (or ``{}`` on the others, without ``result_to_all``),
    or its error raised on every rank."""
    result, error = (None, None)
    if dist.get_rank() == 0:
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
            error = exc
        try:
            pickle.dumps(error)
        except Exception:  # noqa: BLE001 - rank 0 would raise in the broadcast, leaving the others waiting in it
            unpicklable, error = error, RuntimeError(f"{type(error).__name__}: {error}")
            error.__cause__ = unpicklable
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
        raise FileNotFoundError(
            f"{path} is not a saved model: it has no config.json. Pass the directory that "
            f"save_pretrained wrote (config.json and *.safetensors)."
        )
    config = AutoConfig.from_pretrained(path)
    expected = getattr(getattr(model_cls, "config_class", None), "model_type", None)
    if expected is not None and expected != config.model_type:
        raise ValueError(
            f"{model_cls.__name__} is a {expected!r} model but {path} holds a {config.model_type!r} "
            f"model ({', '.join(config.architectures or [])}): pass that class, or leave model_cls out."
        )
    return config


def _weight_map(index: Path, then: str) -> dict[str, str]:
    """The ``weight_map`` of a safetensors index file, or a ValueError naming the file, what is wrong with it
    and ``then``: what that means for the caller."""
    try:
        content = json.loads(index.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        problem = f"it is not JSON ({error})"
    else:
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        if isinstance(weight_map, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            return weight_map
        problem = (
            f"it holds a JSON {type(content).__name__}, not an object"
            if not isinstance(content, dict)
            else 'it has no "weight_map"'
            if "weight_map" not in content
            else 'its "weight_map" is not an object from tensor names to file names'
        )
    raise ValueError(
        f"{index} is damaged: {problem}. A safetensors index, as save_pretrained writes it, is a JSON "
        f'object whose "weight_map" names the .safetensors file of each tensor; {then}.'
    )


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files of the model: those its index names, or model.safetensors, or the only one there is."""
    index = path / "model.safetensors.index.json"
    if index.is_file():  # a sharded checkpoint; other .safetensors beside it (consolidated.*) are not the model's
        files = sorted({path / name for name in _weight_map(index, "the model cannot be read from it").values()})
        missing = [file.name for file in files if not file.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names {missing}, not in {path}: the checkpoint is incomplete.")
        return files
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if len(files) != 1:
        raise FileNotFoundError(
            f"{path} has {'no' if not files else len(files)} *.safetensors files and no "
            f"model.safetensors.index.json saying which hold the model: pass the directory "
            f"save_pretrained wrote."
        )
    return files


def _init_non_persistent_buffers(model: nn.Module) -> None:
    # Buffers that are not in the state dict (the rotary embedding's inv_freq) came out of
    # to_empty as garbage, and no file restores them: transformers' own initialiser
    # recomputes them for the modules that hold them.
    for module in model.modules():
        if module._non_persistent_buffers_set:
            model._init_weights(module)


def _check_saved(path: Path, model: nn.Module) -> set[str]:
    """Rank 0: the names in the safetensors files, once their headers (names, shapes, dtypes) are checked against
    the model on ``meta``.

    Checked before any tensor is read or broadcast: a mismatch found later, on rank 0 alone,
    would leave the other ranks waiting in their next collective (``read="rank0"``), and DCP's
    own error (``read="sharded"``) names no file.
    """
    from safetensors import SafetensorError, safe_open

    headers = {}  # the saved name -> (its file, shape, dtype as safetensors names it)
    for file in _weight_files(path):
        try:
            with safe_open(file, framework="pt") as f:  # the header only
                for name in f.keys():
                    header = f.get_slice(name)
                    headers[name] = (file, torch.Size(header.get_shape()), header.get_dtype())
        except SafetensorError as error:  # a truncated or corrupt file: safetensors' message names no file
            raise SafetensorError(f"{file}: {error}") from error
    tensors = _names_by_tensor(model).values()
    unsaved_ties = {name for _, names in tensors if headers.keys() & set(names) for name in set(names) - headers.keys()}
    _check_names(path, set(headers), {name for _, names in tensors for name in names} - unsaved_ties)
    mismatches = []
    for tensor, names in tensors:
        for name in headers.keys() & set(names):
            file, shape, dtype = headers[name]
            if shape != tensor.shape:
                mismatches.append(
                    f"size mismatch between saved {shape} and current: {tensor.shape} for {name} in {file.name}"
                )
            elif dtype.startswith(("F", "BF")) != tensor.is_floating_point():  # F32, BF16, F8_E4M3; I64, BOOL
                mismatches.append(
                    f"dtype mismatch between saved {dtype} and current: {tensor.dtype} for {name} "
                    f"in {file.name} (loading would cast it)"
                )
    if mismatches:
        raise ValueError(
            f"the weights in {path} do not match the model its config describes: "
            f"{'; '.join(mismatches[:5])}{' ...' if len(mismatches) > 5 else ''}"
        )
    return set(headers)


def _read_weights(path: Path, model: nn.Module, saved_as: dict[str, str]) -> dict[str, torch.Tensor]:
    """Rank 0: every tensor in the safetensors files under the model's names, each tied name filled from the saved."""
    from safetensors.torch import load_file

    weights = {}
    for file in _weight_files(path):
        weights.update(load_file(file))
    for names in _tied_names(model, saved_as):
        saved = next((weights[n] for n in names if n in weights), None)
        for name in names:
            if saved is not None and name not in weights:
                weights[name] = saved  # written once (transformers drops tied copies), loaded under each name
    return {name: weights[saved] for name, saved in saved_as.items()}


def _check_names(path: Path, saved: set[str], expected: set[str]) -> None:
    missing, unexpected = sorted(expected - saved), sorted(saved - expected)
    if missing or unexpected:
        raise KeyError(
            f"the weights in {path} do not match the model its config describes: missing "
            f"{missing[:5]}{' ...' if len(missing) > 5 else ''}, unexpected "
            f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}. fsdp_guide.hf loads the names "
            f"as saved; checkpoints whose names transformers converts on load are not supported."
        )


def _read_own_slices(path: Path, model: nn.Module, saved_as: dict[str, str], saved: set[str]) -> None:
    """Each rank: read its shards' slices of the safetensors files (holding the names ``saved``) straight into
    the model's DTensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    # DTensors sharing storage with the parameters, under their saved names: DCP loads in place.
    state = {saved_as[name]: t for name, t in get_model_state_dict(model).items() if name in saved_as}
    for names in _tied_names(model, saved_as):
        if saved & set(names):
            for alias in set(names) - saved:
                state.pop(alias, None)  # the files hold a tied weight once; loading it fills every name
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(path)))


def _tied_names(model: nn.Module, saved_as: dict[str, str]) -> list[list[str]]:
    """The saved names of each parameter (several for tied weights)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if name in saved_as:
            names.setdefault(id(param), []).append(saved_as[name])
    return list(names.values())


def save_pretrained(model: nn.Module, path: str | os.PathLike, *, write: str = "rank0") -> Path:
    """Write the sharded ``model`` as a Hugging Face model directory at ``path`` (every rank calls it).

    ``write="rank0"`` (the default): the full state dict is gathered parameter by parameter
    to rank 0's CPU, then transformers' ``save_pretrained`` writes the config and
    safetensors (tied weights once). Rank 0 holds the whole model, and only it needs to see
    ``path``.

    ``write="sharded"``: nothing is gathered. Every rank writes its own shards with
    ``torch.distributed.checkpoint``'s ``HuggingFaceStorageWriter``, and rank 0 then
    consolidates them into one safetensors file with its index
    (``model-00001-of-00001.safetensors``, ``model.safetensors.index.json``), the configs
    beside them written by transformers' ``save_pretrained`` (with no weights). Tied
    weights are written once, under their first name. ``path`` must be on a file system
    every rank sees.

    Either way ``AutoModelForCausalLM.from_pretrained(path)`` in one process then loads
    exactly these weights.

    A peft model (LoRA) writes its adapters only, in peft's format (``adapter_config.json``,
    ``adapter_model.safetensors``; ``PeftModel.from_pretrained(base, path)`` reloads them):
    only the tensors peft saves are gathered (``get_peft_model_state_dict``), not the frozen
    base; only ``write="rank0"`` writes them.

    As with transformers' own ``save_pretrained``, the other files in ``path`` (a tokenizer,
    notes, checkpoints) stay; a file of the same name is replaced. Each file is written into
    ``path/.partial-export`` and, once all are on disk, renamed into place, the weights before
    the index and configs that name them. Then the files an earlier export left and this one
    did not write are deleted: weight files of another split (the index first), adapter files
    beside a full model (transformers would add them to it on load), and not any other file.
    A crash while writing leaves ``path`` as it was, with ``.partial-export``, which the next
    export deletes; one during the renames can leave some files new and others old, each
    whole, and an index never names a file that is not there.
    """
    path = Path(path)
    adapters = hasattr(model, "peft_config")
    if write not in ("rank0", "sharded"):
        raise ValueError(
            f"write={write!r}: expected 'rank0' (gather to rank 0, which writes) or 'sharded' "
            "(every rank writes its shards with DCP, rank 0 consolidates them)"
        )
    if write == "sharded":
        if adapters:
            raise ValueError(
                "write='sharded' writes a whole model; a peft model's adapters are small and saved in "
                "peft's own format: use write='rank0', which gathers only them"
            )
        return _save_sharded(model, path)
    if adapters:  # gather only what peft's save_pretrained will pick out of the state dict
        from peft import get_peft_model_state_dict

        state = model.state_dict(keep_vars=True)
        wanted = {id(t) for t in get_peft_model_state_dict(model, state_dict=state).values()}
        full = {name: _full_on_cpu(t) for name, t in state.items() if id(t) in wanted}
    else:
        full = _tied_again(
            model, get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        )

    def write():
        _exported_files(path, adapters)  # a damaged index there: refused before anything is written
        partial = _fresh_partial(path)
        try:
            if adapters and (path / "README.md").is_file():  # peft updates a model card, keeping what it holds
                shutil.copy2(path / "README.md", partial)
            model.save_pretrained(partial, state_dict=full)
            _move_into(partial, path, adapters)
        finally:
            shutil.rmtree(partial, ignore_errors=True)

    _on_rank0_for_all(write)  # a failure on rank 0 (a full disk) is raised on every rank, not waited for
    return path


def _save_sharded(model: nn.Module, path: Path) -> Path:
    """``save_pretrained(write="sharded")``: DCP writes every rank's shards, rank 0 consolidates and publishes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    partial = path / ".partial-export"

    def configs() -> None:  # before DCP writes: transformers' save_pretrained would delete weights it did not write
        _exported_files(path, adapters=False)  # a damaged index there: refused before anything is written
        # no tensors: transformers writes the config and generation config, and no weight file (no shard to write)
        model.save_pretrained(_fresh_partial(path), state_dict={})

    _on_rank0_for_all(configs)
    state = get_model_state_dict(model)  # each rank's shards, as DTensors: no gather
    # safetensors refuses two names for one tensor in a file: keep the first name, as transformers does
    aliases = {alias for names in _tied_names(model, {name: name for name in state}) for alias in names[1:]}
    try:
        dcp.save(
            {name: t for name, t in state.items() if name not in aliases},
            storage_writer=HuggingFaceStorageWriter(str(partial), save_distributed=True, enable_consolidation=True),
        )
    except dcp.CheckpointException:  # DCP raises a rank's failure on every rank: all can clean up together
        _on_rank0_for_all(lambda: shutil.rmtree(partial, ignore_errors=True))
        raise

    def publish() -> None:
        try:
            shutil.rmtree(partial / "sharded")  # each rank's file, now consolidated (SHARDED_DIR_NAME in DCP)
            _move_into(partial, path, adapters=False)
        finally:
            shutil.rmtree(partial, ignore_errors=True)

    _on_rank0_for_all(publish)
    return path


def _fresh_partial(path: Path) -> Path:
    """An empty ``path/.partial-export`` to write an export into (rank 0): inside ``path``, so on its file
    system wherever a symlink points; one left by an export that crashed is deleted first."""
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path} is a file: save_pretrained writes a directory there")
    partial = path / ".partial-export"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


def _tied_again(model: nn.Module, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tied name pointed at one gathered tensor: gathering gave every name a copy of its own, and
    transformers writes a tied weight once only when its names share storage
    (``remove_tied_weights_from_state_dict`` in ``transformers/modeling_utils.py``)."""
    for names in _tied_names(model, {name: name for name in full}):
        for alias in names[1:]:
            full[alias] = full[names[0]]
    return full


def _move_into(partial: Path, path: Path, adapters: bool) -> None:
    """Rename each file under ``partial`` to the same name under ``path``, then delete the files of an
    earlier export there that were not replaced."""
    from fsdp_guide.checkpoint import _fsync

    earlier = _exported_files(path, adapters)  # read before the new index replaces the old one
    entries = list(partial.iterdir())
    weights = [entry for entry in entries if entry.name.endswith(".safetensors")]
    # The weights on disk under their names before the index and configs that name them, and all
    # of it before any old file goes.
    for group in (weights, [entry for entry in entries if entry not in weights]):
        for entry in group:
            if entry.is_dir():  # peft writes adapters not named "default" into folders of their own
                (path / entry.name).mkdir(exist_ok=True)
                _move_into(entry, path / entry.name, adapters)
            else:
                _fsync(entry)  # its bytes on disk before its name is in path
                os.replace(entry, path / entry.name)
        _fsync(path)
    written = {entry.name for entry in entries}
    for file in earlier:
        if file.name not in written:
            file.unlink(missing_ok=True)
    _fsync(path)


def _exported_files(path: Path, adapters: bool) -> list[Path]:
    """The files in ``path`` that an export of a full model (or of adapters) replaces, the index before its shards."""
    from transformers.utils import (
        ADAPTER_CONFIG_NAME,
        ADAPTER_SAFE_WEIGHTS_NAME,
        ADAPTER_WEIGHTS_NAME,
        SAFE_WEIGHTS_INDEX_NAME,
        SAFE_WEIGHTS_NAME,
    )

    names = [ADAPTER_CONFIG_NAME, ADAPTER_SAFE_WEIGHTS_NAME, ADAPTER_WEIGHTS_NAME]
    if not adapters:
        index = path / SAFE_WEIGHTS_INDEX_NAME
        # A damaged index is refused, not replaced: the export would overwrite a file it did not write.
        named = (
            _weight_map(
                index,
                "the export writes an index of its own there and overwrites no file it did "
                "not write: move or delete this one",
            ).values()
            if index.is_file()
            else ()
        )
        # only weight files in path itself: an index is no licence to delete anything else
        shards = sorted({name for name in named if Path(name).name == name and name.endswith(".safetensors")})
        names = [SAFE_WEIGHTS_INDEX_NAME, *shards, SAFE_WEIGHTS_NAME, *names]
    return [path / name for name in names if (path / name).is_file()]


def _full_on_cpu(param: torch.Tensor) -> torch.Tensor:
    """The whole parameter on the CPU (a collective for a DTensor: every rank calls it, in the same order)."""
    full = param.full_tensor() if hasattr(param, "full_tensor") else param
    return full.detach().cpu()
