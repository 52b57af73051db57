"""Checkpoints that lose nothing: ``save``, ``load``, ``latest`` and ``export_consolidated``.

Everything training needs to continue exactly is saved with
``torch.distributed.checkpoint`` (DCP): the model and optimizer through
``get_state_dict``/``set_state_dict`` (sharded: each rank writes its own part, and
a checkpoint loads on any number of ranks), any object with
``state_dict``/``load_state_dict`` (scheduler, gradient scaler, data iterator), the
step, and each rank's RNG state.

A checkpoint is written to ``.partial-step-N`` and renamed to ``step-N`` only once
every rank has finished, so a directory named ``step-N`` is always complete; older
ones are deleted only after that. A crash while saving a new step leaves the previous
checkpoint as it was. Saving again at a step that already has a checkpoint deletes
that ``step-N`` just before the rename, so a crash between the two loses it.

DCP does the writing and resharding; what is written here by hand is what it does
not do: the atomic publish, choosing the latest complete checkpoint, and errors that
name the checkpoint and the mismatch before DCP's own would.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from fsdp_guide.devices import device as rank_device

__all__ = ["CheckpointError", "export_consolidated", "latest", "load", "save"]

_NAME = re.compile(r"step-(\d+)")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, or was saved from a different model."""


def latest(directory: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step in ``directory``, or ``None`` if there is none."""
    directory = Path(directory)
    steps = [(int(m.group(1)), p) for p in directory.glob("step-*") if (m := _NAME.fullmatch(p.name))]
    return max(steps)[1] if steps else None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _state(model: nn.Module, optimizer, stateful: dict) -> dict:
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    for name, obj in stateful.items():
        state[name] = obj.state_dict()
    return state


def save(directory: str | os.PathLike, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, *,
         storage_writer=None, **stateful) -> Path:
    """Save everything needed to continue at ``step`` as ``directory/step-<step>``; every rank calls it.

    ``stateful`` are objects with ``state_dict``/``load_state_dict`` saved under their
    keyword (e.g. ``scheduler=...``, ``data=...``); ``load`` takes the same keywords.
    ``storage_writer`` builds DCP's writer from a path (default ``FileSystemWriter``).
    Returns the published path.
    """
    directory, rank = Path(directory), _rank()
    final, partial = directory / f"step-{step:08d}", directory / f".partial-step-{step:08d}"
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by a crash during an earlier save
        partial.mkdir(parents=True)
    _barrier()
    state = _state(model, optimizer, stateful)
    state["step"] = step
    state.update(_rng_states(rank))  # each rank its own keys: they differ
    dcp.save(state, storage_writer=(storage_writer or dcp.FileSystemWriter)(partial))
    _barrier()  # every rank has written its part
    if rank == 0:
        _publish(partial, final)
        for older in directory.glob("step-*"):
            if older != final and _NAME.fullmatch(older.name):
                shutil.rmtree(older)
    _barrier()
    return final


def _publish(partial: Path, final: Path) -> None:
    """Rename ``partial`` to ``final`` in one step, and make the rename durable."""
    if final.exists():  # saved again at the same step: replace it
        shutil.rmtree(final)
    os.rename(partial, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, **stateful) -> int:
    """Load the checkpoint at ``path`` into ``model``, ``optimizer`` and ``stateful``; returns its step.

    Works on a different number of ranks than the checkpoint was saved on (DCP
    reshards); the RNG states are then not restored, as there is no rank to take
    them from. Raises :class:`CheckpointError` naming the path for a missing,
    incomplete or corrupt checkpoint, and naming the parameter and both shapes for
    one saved from a different model.
    """
    path = Path(path)
    metadata = _read_metadata(path)
    state = _state(model, optimizer, stateful)
    _check_model_matches(path, metadata, state["model"])
    _check_has_states(path, metadata, ["optim", *stateful])
    state["step"] = 0
    saved_ranks = sum(key.startswith("rng.rank") for key in metadata.state_dict_metadata)
    same_ranks = saved_ranks == (dist.get_world_size() if dist.is_initialized() else 1)
    rng = {k: v for k, v in _rng_states(_rank()).items() if k in metadata.state_dict_metadata} if same_ranks else {}
    state.update(rng)
    try:
        dcp.load(state, checkpoint_id=path)
    except (Exception, dcp.CheckpointException) as error:  # noqa: BLE001  (DCP's derives from BaseException)
        raise CheckpointError(f"{path}: the checkpoint could not be read ({_last_line(error)}); "
                              "it may be corrupt: resume from an earlier one") from error
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for name, obj in stateful.items():
        obj.load_state_dict(state[name])
    _set_rng_states(_rank(), {k: state[k] for k in rng})
    return int(state["step"])


def _rng_states(rank: int) -> dict[str, torch.Tensor]:
    """This rank's random-number generators: the CPU's, and its GPU's when it computes on one."""
    states = {f"rng.rank{rank}": torch.get_rng_state()}
    if rank_device().type == "cuda":
        states[f"cuda_rng.rank{rank}"] = torch.cuda.get_rng_state(rank_device())
    return states


def _set_rng_states(rank: int, states: dict[str, torch.Tensor]) -> None:
    if f"rng.rank{rank}" in states:
        torch.set_rng_state(states[f"rng.rank{rank}"])
    if f"cuda_rng.rank{rank}" in states and rank_device().type == "cuda":
        torch.cuda.set_rng_state(states[f"cuda_rng.rank{rank}"], rank_device())


def _last_line(error: BaseException) -> str:
    """DCP's errors hold every rank's traceback; the last line names the cause."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(error).__name__


def _read_metadata(path: Path):
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path}: not a complete checkpoint (it has no .metadata file); "
                              f"complete ones are named step-N")
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except Exception as error:  # noqa: BLE001
        raise CheckpointError(f"{path}: its .metadata cannot be read ({_last_line(error)})") from error


def _check_model_matches(path: Path, metadata, model_state: dict) -> None:
    """Compare every parameter's global shape with the checkpoint's, before DCP reads anything."""
    saved = {key[len("model."):]: meta for key, meta in metadata.state_dict_metadata.items()
             if key.startswith("model.")}
    for name, tensor in model_state.items():
        if name not in saved:
            raise CheckpointError(f"{path}: this model has {name} {tuple(tensor.shape)}, the checkpoint has no "
                                  "such parameter: it was saved from a different model")
        shape = tuple(getattr(saved[name], "size", ()))
        if shape != tuple(tensor.shape):
            raise CheckpointError(f"{path}: {name} has shape {shape} in the checkpoint and {tuple(tensor.shape)} "
                                  "in this model: it was saved from a different model shape")
    extra = sorted(set(saved) - set(model_state))
    if extra:
        raise CheckpointError(f"{path}: the checkpoint has parameters this model lacks ({', '.join(extra[:3])}"
                              f"{', ...' if len(extra) > 3 else ''}): it was saved from a different model")


def _check_has_states(path: Path, metadata, names: list[str]) -> None:
    """Every object this run restores must be in the checkpoint (e.g. no scaler in an fp32 one)."""
    saved = {key.split(".", 1)[0] for key in metadata.state_dict_metadata}
    for name in names:
        if name not in saved:
            raise CheckpointError(f"{path}: the checkpoint holds no {name!r} state, which this run needs "
                                  f"(it has {', '.join(sorted(k for k in saved if not k.startswith(('rng.', 'cuda_rng.'))))}): "
                                  "it was saved by a run with other settings")


def export_consolidated(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write the full, unsharded model state dict to one ``torch.save`` file (rank 0 writes; all ranks call it).

    The file loads into the plain model with ``torch.load(path, weights_only=True)``.
    """
    path = Path(path)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if _rank() == 0:
        partial = path.with_name(path.name + ".partial")
        torch.save(full, partial)
        os.replace(partial, path)
    _barrier()
    return path
