"""Checkpoints that lose nothing: ``save``, ``load``, ``latest`` and ``export_consolidated``.

Everything training needs to continue exactly is saved with
``torch.distributed.checkpoint`` (DCP): the model and optimizer through
``get_state_dict``/``set_state_dict`` (sharded: each rank writes its own part, and
a checkpoint loads on any number of ranks), any object with
``state_dict``/``load_state_dict`` (scheduler, gradient scaler, data iterator), the
step, and each rank's RNG state.

A checkpoint is written to ``.partial-step-N``, its files fsynced, and renamed to
``step-N`` only once every rank has finished, so a directory named ``step-N`` is always
complete; the oldest beyond ``keep`` are deleted only after that. Each checkpoint holds a
marker file naming its step: only directories with it are counted by :func:`latest`,
kept, replaced or deleted, so a user's own ``step-3/`` beside them is never touched.
Saving again at a step that has a checkpoint renames the old one aside (``.old-step-N``, which :func:`latest`
still finds) until the new one has its name: at every moment a complete checkpoint of
the step exists. State that differs between ranks is saved per rank.

:func:`async_save` returns as soon as the state is copied to CPU memory (DCP's
``async_save``); the files are written in a background thread, on a gloo process group
of their own so that its collectives never interleave with training's, and published
under the same rules when complete. At most one save is in flight: the next save, or
``load``, waits for it.

DCP does the writing and resharding; what is written here by hand is what it does
not do: the atomic publish, choosing the latest complete checkpoint, telling per-rank
from replicated state, reading metadata without running code, and errors that name
the checkpoint and the mismatch before DCP's own would.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import operator
import os
import pickle
import re
import shutil
import stat
import warnings
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from fsdp_guide.devices import device as rank_device

__all__ = ["CheckpointError", "PendingSave", "async_save", "export_consolidated", "latest", "load", "save"]

_NAME = re.compile(r"step-(\d+)")
# Written first into every checkpoint directory this package makes: only directories that
# hold it (with their own step) are counted, kept, replaced or deleted; a user's step-3/
# (an export made per step, an empty folder) is never taken for a checkpoint.
_MARKER = ".fsdp_guide-checkpoint"


def _marker_text(step: int) -> str:
    return f"fsdp_guide checkpoint, step {step}\n"


def _is_ours(path: Path, step: int) -> bool:
    try:
        return (path / _MARKER).read_text() == _marker_text(step)
    except (OSError, UnicodeDecodeError):
        return False


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, or was saved from a different model."""


def latest(directory: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step in ``directory``, or ``None`` if there is none.

    A save of this process still in flight (:func:`async_save`) is waited for first.
    """
    _wait_in_flight()
    steps = _complete(Path(directory))
    return max(steps)[1] if steps else None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _model_and_optimizer(model: nn.Module, optimizer) -> dict:
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def _digest(state) -> str:
    return hashlib.sha256(pickle.dumps(state)).hexdigest()


def _differs_between_ranks(obj) -> bool:
    """Whether this object's state is not the same on every rank (a sampler's offset, a data-loader position).

    DCP writes a non-tensor value every rank holds under the same key once, from the
    coordinator (it de-duplicates replicated state), so per-rank state needs per-rank keys;
    replicated state keeps one key, so it still loads on any number of ranks."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return False
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, _digest(obj.state_dict()))
    return len(set(digests)) > 1


_PER_RANK = "@rank"  # state saved per rank is keyed name@rankN


def _key(name: str, rank: int | None) -> str:
    return name if rank is None else f"{name}{_PER_RANK}{rank}"


def save(
    directory: str | os.PathLike,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    keep: int = 2,
    storage_writer=None,
    **stateful,
) -> Path:
    """Save everything needed to continue at ``step`` as ``directory/step-<step>``; every rank calls it.

    ``stateful`` are objects with ``state_dict``/``load_state_dict`` (DCP's ``Stateful``)
    saved under their keyword (e.g. ``scheduler=...``, ``data=...``); ``load`` takes the
    same keywords. An object whose state differs between ranks (a sampler's position) is
    saved once per rank; one whose state is the same everywhere, once. ``keep``: how
    many checkpoints of this directory to keep, this one included (the newest steps up to
    ``step``; never a later one). ``storage_writer`` builds DCP's writer from a path
    (default ``FileSystemWriter``, which fsyncs the files it writes). Returns the
    published path.

    Raises:
        ValueError: ``step`` is not an integer >= 0, ``keep < 1``, or a ``stateful`` name that
            ``load`` could not tell apart.
        CheckpointError: ``step-<step>`` exists and is not a checkpoint of this package
            (nothing is written), or rank 0 could not make or publish it: rank 0 raises its
            own error, every other rank a :class:`CheckpointError` naming it.
    """
    state, partial, final = _prepare(directory, step, model, optimizer, keep, stateful)
    try:
        dcp.save(state, storage_writer=(storage_writer or dcp.FileSystemWriter)(partial))  # once all have written
        _on_rank0(lambda: _publish_and_clean(partial, final, step, keep), f"{final} was not published")
    finally:
        _release(partial)
    return final


class PendingSave:
    """A checkpoint being written in the background by :func:`async_save`.

    ``path`` is where it will be published; ``wait()`` blocks until it is (on every
    rank) and returns ``path``, or raises what the save raised; ``done()`` tells without
    blocking.
    """

    def __init__(self, path: Path, written: Future):
        self.path = path
        self._written = written

    def done(self) -> bool:
        return self._written.done()

    def wait(self) -> Path:
        global _in_flight
        if _in_flight is self:  # waited for here: the next save has nothing to wait for, or re-raise
            _in_flight = None
        self._written.result()
        return self.path


def async_save(
    directory: str | os.PathLike,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    keep: int = 2,
    storage_writer=None,
    **stateful,
) -> PendingSave:
    """:func:`save`, returning once the state is copied to CPU memory; the files are written in the background.

    Training may change the model, optimizer and ``stateful`` objects as soon as it
    returns: what is written is their state at the call. The checkpoint is published as
    ``step-N`` by rank 0 once every rank has written its part, and only then are older
    ones deleted, so a crash while it is in flight leaves the previous checkpoints as they
    were. At most one save is in flight: this call (and :func:`save`, :func:`load`,
    :func:`latest`) first waits for the previous one, and raises what it raised (a failed
    save surfaces there, or at ``wait()``). Call ``wait()`` on the result before the
    program ends, or before ``destroy_process_group()``: a process that exits first leaves
    only ``.partial-step-N`` (:func:`fsdp_guide.launch`'s ranks wait for it themselves).
    A ``storage_writer`` that stages asynchronously itself is not supported.

    Example:

    >>> from fsdp_guide import checkpoint, launch
    >>> def worker(directory):
    ...     import torch
    ...     model = torch.nn.Linear(4, 4)
    ...     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ...     pending = checkpoint.async_save(directory, 1, model, optimizer)
    ...     model.weight.data.zero_()  # training goes on; the checkpoint keeps step 1's values
    ...     return pending.wait().name
    >>> import tempfile
    >>> launch(worker, tempfile.mkdtemp(), output="none")
    ['step-00000001', 'step-00000001']
    """
    state, partial, final = _prepare(directory, step, model, optimizer, keep, stateful)
    group = _checkpoint_group()
    try:
        written = dcp.async_save(
            state, storage_writer=(storage_writer or dcp.FileSystemWriter)(partial), process_group=group
        )
        if not isinstance(written, Future):  # an AsyncSaveResponse: the writer staged in the background itself
            raise TypeError(
                f"storage_writer={storage_writer!r} stages asynchronously itself; give async_save a "
                "writer that stages when called (DCP's FileSystemWriter does)"
            )
    except BaseException:
        _release(partial)
        raise

    def publish() -> None:  # rank 0: every rank's part is written when the coordinator's save completes
        _publish_and_clean(partial, final, step, keep)

    global _in_flight
    _in_flight = PendingSave(
        final, _then(written, publish if _rank() == 0 else None, group, final, lambda: _release(partial))
    )
    return _in_flight


_in_flight: PendingSave | None = None
_group = None  # (the default group it was made beside, the checkpoint group)


def _wait_in_flight() -> None:
    """Let the previous asynchronous save finish first: one save in flight at a time."""
    global _in_flight
    pending, _in_flight = _in_flight, None
    if pending is not None:
        pending.wait()


def _checkpoint_group():
    """A gloo group for DCP's background collectives, apart from the training's (made once, by every rank)."""
    global _group
    if not dist.is_initialized():
        return None
    default = dist.distributed_c10d._get_default_group()
    if _group is None or _group[0] is not default:
        _group = (default, dist.new_group(backend="gloo", timeout=_timeout(default)))
    return _group[1]


def _timeout(group):
    """The group's collective timeout, so that a save waits no longer than training would (None: gloo's default)."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout  # private: no public getter
    except (AttributeError, RuntimeError):
        return None


def _then(future: Future, publish, group, final: Path, release=lambda: None) -> Future:
    """A future completed on every rank once ``future`` has and rank 0 has run ``publish()`` after it,
    and then ``release()``, whether the write or the publishing failed or not.

    It runs in the writing thread. Rank 0 then tells every rank how publishing went (a
    broadcast on the checkpoint group, success or not): no rank's ``wait()`` returns before
    the name exists, a failure on rank 0 is raised on every rank, and none is left
    waiting because another failed.
    """
    published: Future = Future()

    def run(done: Future) -> None:
        error = None
        try:
            done.result()
            if publish is not None:
                publish()
        except BaseException as failed:  # noqa: BLE001  (DCP's CheckpointException derives from BaseException)
            error = failed
        finally:
            release()
        error = _told_by_rank0(error, group, f"{final} was not published")
        if error is None:
            published.set_result(None)
        else:
            published.set_exception(error)

    future.add_done_callback(run)
    return published


def _told_by_rank0(error: BaseException | None, group, what: str) -> BaseException | None:
    """Every rank's error once rank 0 has done its part (publishing, writing, looking) or failed: rank 0 broadcasts
    how it went.

    A rank with no error of its own gets rank 0's :class:`CheckpointError` as it is, or one
    saying ``what`` failed with rank 0's error, so no rank returns before rank 0's work is
    done and none waits in a collective for one that raised."""
    try:
        if group is not None:
            outcome = [
                None if error is None else (isinstance(error, CheckpointError), f"{type(error).__name__}: {error}")
            ]
            dist.broadcast_object_list(outcome, src=0, group=group)
            if error is None and outcome[0] is not None:
                ours, message = outcome[0]
                error = CheckpointError(
                    message.removeprefix("CheckpointError: ") if ours else f"{what}: rank 0 failed with {message}"
                )
    except BaseException as failed:  # noqa: BLE001
        error = error or failed
    return error


def _on_rank0(work, what: str) -> None:
    """Run ``work()`` on rank 0 alone; what it raises is raised on every rank (see :func:`_told_by_rank0`)."""
    error = None
    if _rank() == 0:
        try:
            work()
        except Exception as failed:  # noqa: BLE001  (told to every rank, then raised)
            error = failed
    error = _told_by_rank0(error, _checkpoint_group(), what)
    if error is not None:
        raise error


def _prepare(directory, step: int, model: nn.Module, optimizer, keep: int, stateful: dict):
    """Check the arguments, wait for a save in flight, make the partial directory; the state to write."""
    _given_step = step
    try:  # an int, or an integer type of its own (numpy's int64): not a bool, a float or a string
        step = operator.index(step) if not isinstance(step, bool) else None
    except TypeError:
        step = None
    if step is None or step < 0:
        raise ValueError(
            f"step={_given_step!r}: expected an int >= 0 (the training step this checkpoint continues from)"
        )
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise ValueError(f"keep={keep!r}: expected an int >= 1 (this checkpoint and the ones before it to keep)")
    for name in stateful:
        if name in _RESERVED or "@" in name or "." in name:
            raise ValueError(
                f"{name}=...: choose another keyword for this state (not {', '.join(sorted(_RESERVED))}, "
                "and without '.' or '@')"
            )
    _wait_in_flight()
    directory, rank = Path(directory), _rank()
    final, partial = directory / f"step-{step:08d}", directory / f".partial-step-{step:08d}"
    try:
        _on_rank0(lambda: _make_partial(final, partial, step), f"{final} was not saved")  # rank 0 looks and makes it
        state = _model_and_optimizer(model, optimizer)
        for name, obj in stateful.items():  # Stateful objects: DCP calls their state_dict() itself
            state[_key(name, rank if _differs_between_ranks(obj) else None)] = obj
        state["step"] = step
        state.update(_rng_states(rank))  # each rank its own keys: they differ
    except BaseException:
        _release(partial)
        raise
    return state, partial, final


_RESERVED = ("model", "optim", "step", "rng", "cuda_rng")


def _make_partial(final: Path, partial: Path, step: int) -> None:
    """Rank 0: refuse names that are not this package's, then make the partial directory with its marker,
    and hold a lock on the marker until the save is published or has failed (``_release``).

    The lock is the save's claim on the step: another run saving the same step into the same
    directory finds the partial directory locked and is refused, instead of deleting it and
    writing its own files into the same path (the run that published would then publish the
    other's weights). flock, not a lock file: a process that dies holding it lets go of it.
    The look and the claim happen under a lock on the directory itself, so two saves cannot
    both find a crashed save's partial directory unclaimed and each delete what the other made.
    """
    partial.parent.mkdir(parents=True, exist_ok=True)
    with _locked_directory(partial.parent):
        for path in (final, partial, _aside(final)):
            if path.exists() and not _is_ours(path, step):
                raise CheckpointError(
                    f"{path} exists and is not a checkpoint of fsdp_guide.checkpoint (it has no "
                    f"{_MARKER} file for step {step}): nothing was written; move it away, or save "
                    "into another directory"
                )
        if partial.exists():  # ours (checked above): left by a crash during an earlier save, or another run's, writing
            _refuse_if_claimed(partial, final)
            shutil.rmtree(partial)  # what cannot be deleted is said as it is
        partial.mkdir()
        fd = os.open(partial / _MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            claimed = _flock(fd, fcntl.LOCK_EX)  # the file is new, in a directory this call made: nobody holds it
            os.write(fd, _marker_text(step).encode())
        except BaseException:
            os.close(fd)
            raise
        if claimed:
            _claims[partial] = fd
        else:
            os.close(fd)


_claims: dict[Path, int] = {}  # rank 0: partial directory -> its marker's open, locked descriptor
# What flock raises on a file system without it (some FUSE and Lustre mounts): saves go on, unclaimed.
_NO_FLOCK = {errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL}


def _flock(fd: int, flags: int) -> bool:
    """flock, or False where the file system has none (once, a warning says what that leaves out)."""
    try:
        fcntl.flock(fd, flags)
        return True
    except BlockingIOError:
        raise
    except OSError as error:
        if error.errno not in _NO_FLOCK:
            raise
        warnings.warn(
            "the checkpoint directory's file system does not support flock: two runs saving one step "
            "into it are not kept apart; give each run a directory of its own",
            stacklevel=2,
        )
        return False


@contextlib.contextmanager
def _locked_directory(directory: Path):
    """Held while a save looks at the directory and claims its step: one save at a time, for an instant."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _refuse_if_claimed(partial: Path, final: Path) -> None:
    """Raise if a live process holds the lock on ``partial``'s marker (a save in progress)."""
    try:
        fd = os.open(partial / _MARKER, os.O_RDONLY)
    except FileNotFoundError:
        return  # a crash before the marker was written: nobody's claim
    try:
        _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _lock_holder(os.fstat(fd))
        raise CheckpointError(
            f"{final} was not saved: {holder or 'another process'} is saving the same step into "
            f"{partial.parent} now ({partial.name} is its); two runs saving into one directory "
            "would publish each other's files: give each run a checkpoint directory of its "
            "own"
        ) from None
    finally:
        os.close(fd)  # and with it the lock, if this call took it


def _lock_holder(stat_result) -> str | None:
    """The process holding a flock on the file (Linux's /proc/locks), as "pid N (its command)"; None elsewhere."""
    try:
        locks = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    # "<major>:<minor>:<inode>", the device's numbers in hex (fs/locks.c, lock_get_status)
    where = f"{os.major(stat_result.st_dev):02x}:{os.minor(stat_result.st_dev):02x}:{stat_result.st_ino}"
    for line in locks:
        fields = line.split()
        if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == where:
            pid = fields[4]
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                command = ""
            return f"pid {pid}" + (f" ({command.strip()[:80]})" if command.strip() else "")
    return None


def _release(partial: Path) -> None:
    """Rank 0: let go of the claim on a save's step, once it is published or has failed."""
    fd = _claims.pop(partial, None)
    if fd is not None:
        os.close(fd)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(partial: Path, final: Path) -> None:
    """Rename ``partial`` to ``final`` so that a complete step-N exists at every moment.

    Saving again at a step that has a checkpoint: the old one is renamed aside to
    ``.old-step-N`` (still complete: :func:`latest` takes it if a crash comes before the
    second rename), the new one takes its name, and only then is the old one deleted.
    """
    for entry in partial.iterdir():  # DCP's writer fsyncs its data files; .metadata too, for certain
        if entry.is_file():
            _fsync(entry)
    _fsync(partial)  # the directory's entries
    old = _aside(final)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(partial, final)
    _fsync(final.parent)
    _remove(old)


def _aside(final: Path) -> Path:
    return final.with_name(f".old-{final.name}")


def _publish_and_clean(partial: Path, final: Path, step: int, keep: int) -> None:
    """Rank 0, once every rank has written: give the checkpoint its name, then delete the oldest beyond ``keep``."""
    _publish(partial, final)
    _remove_older(final.parent, step, keep)


def _remove(path: Path) -> None:
    """Delete a directory; a failure (an NFS ``.nfs*`` file still open, a file someone else removed) only warns."""
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as error:
        warnings.warn(f"could not delete the old checkpoint {path}: {error}; delete it by hand", stacklevel=3)


def _remove_older(directory: Path, step: int, keep: int) -> None:
    """Keep the newest ``keep`` checkpoints up to ``step``; later steps (another run's) are not this save's to drop."""
    older = sorted((s, p) for s, p in _complete(directory) if s < step)
    for _, path in older[: max(0, len(older) - (keep - 1))]:
        _remove(path)


def _complete(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint: step-N, or .old-step-N left by a crash mid-publish.

    Only this package's (its marker names the step) with a ``.metadata`` (DCP writes it last)."""
    found = {}
    for pattern, prefix in ((".old-step-*", ".old-"), ("step-*", "")):  # the published one wins over its .old- copy
        for path in directory.glob(pattern):
            if (
                (m := _NAME.fullmatch(path.name.removeprefix(prefix)))
                and _is_ours(path, int(m.group(1)))
                and (path / ".metadata").is_file()
            ):
                found[int(m.group(1))] = path
    return list(found.items())


def load(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, **stateful) -> int:
    """Load the checkpoint at ``path`` into ``model``, ``optimizer`` and ``stateful``; returns its step.

    Works on a different number of ranks than the checkpoint was saved on (DCP
    reshards); the RNG states are then not restored, as there is no rank to take
    them from, and state saved per rank (it differed between ranks) cannot be, which is
    an error. Raises :class:`CheckpointError` naming the path for a missing or
    incomplete checkpoint, for damaged files, and for a checkpoint saved from another
    model (naming the parameter and both shapes), with another optimizer, or without a
    state this run restores.

    What is safe to load: the ``.metadata`` file is the only one unpickled, once, with an
    unpickler that accepts only DCP's metadata classes (and sets attributes on nothing
    else), and what it holds must have the shape DCP writes, its entries pointing at files
    of the checkpoint's own directory, plain files there (not links); DCP is handed that copy,
    so it neither reads the file again with plain ``pickle`` nor falls back to the rank-local
    ``__<rank>.metadata`` files.
    Non-tensor values are read with ``torch.load(weights_only=True)``, tensors by DCP with
    ``weights_only=True`` too. A crafted checkpoint is refused (a :class:`CheckpointError`
    naming the file) instead of running code. Still, prefer checkpoints you or your jobs
    wrote: this checks what the files contain, not who made them.
    """
    _wait_in_flight()  # the checkpoint being written may be the one asked for
    path = Path(path)
    metadata = _read_metadata(path)
    state = _model_and_optimizer(model, optimizer)
    _check_model_matches(path, metadata, state["model"])
    _check_optimizer_matches(path, metadata, state["optim"])
    world = dist.get_world_size() if dist.is_initialized() else 1
    saved_ranks = sum(key.startswith("rng.rank") for key in metadata.state_dict_metadata)
    for name, obj in stateful.items():
        state[_key(name, _per_rank(path, metadata, name, world))] = obj  # Stateful: DCP loads into it
    state["step"] = 0
    rng = (
        {k: v for k, v in _rng_states(_rank()).items() if k in metadata.state_dict_metadata}
        if saved_ranks == world
        else {}
    )
    state.update(rng)
    try:
        dcp.load(state, storage_reader=_SafeReader(path, metadata), planner=_SafeLoadPlanner())
    except (Exception, dcp.CheckpointException) as error:  # noqa: BLE001  (DCP's derives from BaseException)
        raise CheckpointError(
            f"{path}: its files could not be read ({_last_line(error)}): a file is missing "
            "or damaged; resume from another checkpoint"
        ) from error
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _set_rng_states(_rank(), {k: state[k] for k in rng})
    return int(state["step"])


def _saved_value(path: str | os.PathLike, key: str):
    """One non-tensor value of the checkpoint at ``path`` (a Stateful's entry, flattened: ``"settings.values"``),
    read in this process alone and as safely as :func:`load` reads; None where the checkpoint has no such entry."""
    path = Path(path)
    metadata = _read_metadata(path)
    if key not in metadata.state_dict_metadata:
        return None
    state = {key: None}
    try:
        with warnings.catch_warnings():  # DCP warns that it loads in one process: what this is for
            warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
            dcp.load(state, storage_reader=_SafeReader(path, metadata), planner=_SafeLoadPlanner(), no_dist=True)
    except (Exception, dcp.CheckpointException) as error:  # noqa: BLE001  (DCP's derives from BaseException)
        raise CheckpointError(
            f"{path}: its files could not be read ({_last_line(error)}): a file is missing "
            "or damaged; resume from another checkpoint"
        ) from error
    return state[key]


def _per_rank(path: Path, metadata, name: str, world: int) -> int | None:
    """This rank, if ``name`` was saved per rank (on as many ranks as now); None if saved once."""
    saved = {key.split(".", 1)[0] for key in metadata.state_dict_metadata}
    if name in saved:
        return None
    ranks = sorted(int(key.split(_PER_RANK, 1)[1]) for key in saved if key.startswith(f"{name}{_PER_RANK}"))
    if not ranks:
        raise CheckpointError(
            f"{path}: the checkpoint holds no {name!r} state, which this run needs (it has "
            f"{', '.join(sorted(_names(saved)))}): it was saved by a run with other settings"
        )
    if len(ranks) != world:
        raise CheckpointError(
            f"{path}: {name!r} was saved per rank on {len(ranks)} ranks (its state differed "
            f"between ranks), and this run has {world}: resume on {len(ranks)} ranks, or "
            f"without {name!r}"
        )
    return _rank()


def _names(saved: set[str]) -> set[str]:
    return {key.split(_PER_RANK, 1)[0] for key in saved if not key.startswith(("rng.", "cuda_rng."))}


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
    """The checkpoint's ``.metadata``, unpickled without running code and checked to be DCP's metadata.

    This is the only file of a checkpoint read with pickle: :class:`_SafeReader` hands it to
    DCP, which would otherwise read it again with plain ``pickle`` (and fall back to the
    rank-local ``__<rank>.metadata`` files when that copy is unusable)."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    file = path / ".metadata"
    if file.is_symlink():
        raise CheckpointError(f"{file} was refused: it is a link, and DCP writes a plain file; nothing was read")
    if not file.is_file():
        raise CheckpointError(
            f"{path}: not a complete checkpoint (it has no .metadata file); complete ones are named step-N"
        )
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"{file} was refused ({error}): it is damaged, or was made to run code when loaded; nothing in it was run"
        ) from error
    except Exception as error:  # noqa: BLE001
        raise CheckpointError(f"{file} cannot be read ({_last_line(error)})") from error
    if problem := _not_dcp_metadata(metadata) or _not_regular_files(path, metadata):
        raise CheckpointError(f"{file} was refused: {problem}; it is damaged, or was not written by DCP")
    return metadata


def _not_dcp_metadata(metadata) -> str | None:
    """What in an unpickled ``.metadata`` is not the shape DCP writes, or None (what DCP's reader and planner use)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    if not isinstance(metadata, Metadata):
        return f"it holds a {type(metadata).__name__}, not DCP's Metadata"
    if not isinstance(metadata.storage_meta, (StorageMeta, type(None))):
        return f"its storage_meta is a {type(metadata.storage_meta).__name__}"
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict) or not all(
        isinstance(k, str) and isinstance(v, (TensorStorageMetadata, BytesStorageMetadata)) for k, v in entries.items()
    ):
        return "its state_dict_metadata is not a map from names to DCP's storage metadata"
    for key, entry in entries.items():
        if _PER_RANK in key and not re.fullmatch(rf"[^.@]+{_PER_RANK}\d+", key.split(".", 1)[0]):
            return f"its entry {key!r} is not one this package writes"
        if isinstance(entry, TensorStorageMetadata) and not (
            isinstance(entry.properties, TensorProperties)
            and isinstance(entry.size, torch.Size)
            and isinstance(entry.chunks, list)
            and all(
                isinstance(c, ChunkStorageMetadata)
                and isinstance(c.offsets, torch.Size)
                and isinstance(c.sizes, torch.Size)
                for c in entry.chunks
            )
        ):
            return f"its entry {key!r} is not a tensor's storage metadata"
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        return f"its storage_data is a {type(storage).__name__}"
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            return "its storage_data is not a map from DCP's indexes to storage entries"
        name = info.relative_path
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            return f"it points at {_shown(name)}, which is not a file of the checkpoint's own directory"
        # A NUL byte or a name longer than a file system takes would reach the OS as a raw ValueError or
        # OSError; DCP names its files __<rank>_<n>.distcp, far shorter than any limit.
        try:
            encoded = os.fsencode(name)
        except UnicodeEncodeError:  # a lone surrogate no file system encoding can write
            encoded = b"\0"
        if b"\0" in encoded or len(encoded) > _NAME_MAX:
            return f"it points at {_shown(name)}, which no file can be named (a NUL byte, or over {_NAME_MAX} bytes)"
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (info.offset, info.length)):
            return f"an entry of {name!r} has offset {info.offset!r} and length {info.length!r}"
        if getattr(info, "transform_descriptors", None):  # decompression and the like: this package writes none
            return f"an entry of {name!r} is to be transformed ({info.transform_descriptors!r}) when read"
    return None


_NAME_MAX = 255  # bytes in one file name on Linux's file systems and macOS's (os.pathconf's PC_NAME_MAX there)


def _shown(name) -> str:
    """A name from a file for a message: its repr, cut short if long."""
    text = repr(name)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(name)} characters)"


def _not_regular_files(path: Path, metadata) -> str | None:
    """Which of the files ``.metadata`` names is there but not a plain file (a symlink elsewhere, a FIFO, a device)."""
    for name in sorted({info.relative_path for info in metadata.storage_data.values()}):
        try:
            mode = os.lstat(path / name).st_mode
        except FileNotFoundError:
            continue  # missing: DCP's read says so, and load names the checkpoint
        except OSError as error:  # what else the OS says of a name (_not_dcp_metadata refused the impossible ones)
            return f"{_shown(name)} cannot be looked at ({error.strerror})"
        if not stat.S_ISREG(mode):
            return f"{name} is not a plain file of the checkpoint (a link, a pipe or a device)"
    return None


class _SafeReader(dcp.FileSystemReader):
    """DCP's file reader, given the ``.metadata`` already read by :func:`_read_metadata`.

    It never unpickles anything itself, and refuses DCP's fallback to the rank-local
    ``__<rank>.metadata`` files, which nothing here has checked."""

    def __init__(self, path: Path, metadata):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs):
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"{self.path}: rank-local metadata files are not read")
        from torch.distributed.checkpoint.metadata import StorageMeta

        if self._metadata.storage_meta is None:  # as FileSystemReader.read_metadata does
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return self._metadata


def _check_model_matches(path: Path, metadata, model_state: dict) -> None:
    """Compare every parameter's global shape with the checkpoint's, before DCP reads anything."""
    saved = {
        key[len("model.") :]: meta for key, meta in metadata.state_dict_metadata.items() if key.startswith("model.")
    }
    for name, tensor in model_state.items():
        if name not in saved:
            raise CheckpointError(
                f"{path}: this model has {name} {tuple(tensor.shape)}, the checkpoint has no "
                "such parameter: it was saved from a different model"
            )
        shape = tuple(getattr(saved[name], "size", ()))
        if shape != tuple(tensor.shape):
            raise CheckpointError(
                f"{path}: {name} has shape {shape} in the checkpoint and {tuple(tensor.shape)} "
                "in this model: it was saved from a different model shape"
            )
    extra = sorted(set(saved) - set(model_state))
    if extra:
        raise CheckpointError(
            f"{path}: the checkpoint has parameters this model lacks ({', '.join(extra[:3])}"
            f"{', ...' if len(extra) > 3 else ''}): it was saved from a different model"
        )


def _check_optimizer_matches(path: Path, metadata, optim_state: dict) -> None:
    """The saved optimizer state must have the kinds of state this optimizer keeps (AdamW's moments, not momentum)."""
    saved = metadata.state_dict_metadata
    if not any(key.startswith("optim.") for key in saved):
        raise CheckpointError(
            f"{path}: the checkpoint holds no optimizer state, which this run needs: "
            "it was saved by a run with other settings"
        )
    expected = {name for per_param in optim_state.get("state", {}).values() for name in per_param}
    found = {key.rsplit(".", 1)[1] for key in saved if key.startswith("optim.state.")}
    if expected != found:
        raise CheckpointError(
            f"{path}: the optimizer state saved there has {sorted(found) or 'nothing'} per "
            f"parameter, and this optimizer keeps {sorted(expected) or 'nothing'}: it was saved "
            "with a different optimizer (or other optimizer settings); the files are not damaged"
        )


class _MetadataUnpickler(pickle._Unpickler):
    """Unpickles only what DCP's ``.metadata`` holds: its own metadata classes and the torch
    values inside them. DCP's reader uses plain ``pickle.load`` (``FileSystemReader.read_metadata``),
    which would run whatever a crafted file names; this refuses anything else first.

    Python's own unpickler (``pickle._Unpickler``), not the C one: only it lets BUILD be
    checked. BUILD sets attributes on whatever object is below it, a class too, and a file
    that set attributes on DCP's classes would change them for the whole process."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str):
        import pathlib

        import torch.distributed.checkpoint.filesystem as dcp_filesystem
        import torch.distributed.checkpoint.metadata as dcp_metadata

        value = None
        defined = getattr(dcp_metadata, name, None)
        if module == dcp_metadata.__name__ and isinstance(defined, type) and defined.__module__ == module:
            value = defined  # DCP's own metadata classes, not whatever that module imports
        elif (module, name) == (dcp_filesystem.__name__, "_StorageInfo"):
            value = dcp_filesystem._StorageInfo
        elif module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            value = getattr(torch, name)
        elif (module, name) == ("torch.serialization", "_get_layout"):  # turns "torch.strided" into the layout
            value = torch.serialization._get_layout
        elif module in ("pathlib", "pathlib._local") and name in (
            "PosixPath",
            "WindowsPath",
            "PurePosixPath",
            "PureWindowsPath",
        ):
            value = getattr(pathlib, name)  # pathlib._local: where Python 3.13 pickles them from
        elif (module, name) == ("collections", "OrderedDict"):
            import collections

            value = collections.OrderedDict
        if value is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not something a DCP checkpoint's metadata holds")
        return value

    def _build(self) -> None:
        import dataclasses

        from torch.distributed.checkpoint.metadata import TensorProperties

        state, target = self.stack[-1], self.stack[-2]  # BUILD's state is on top, the object it fills below
        fields = {f.name for f in dataclasses.fields(target)} if type(target) in _dcp_dataclasses() else None
        if fields is None:  # a class, an enum member shared by the whole process, anything else
            raise pickle.UnpicklingError(f"it sets attributes on {target!r}, which DCP's metadata never does")
        # TensorProperties sets its fields from a tuple itself (5 of them before torch 2.15, 6 since)
        own = (
            isinstance(state, tuple)
            if type(target) is TensorProperties
            else isinstance(state, dict) and all(isinstance(k, str) for k in state) and state.keys() <= fields
        )
        if not own:
            raise pickle.UnpicklingError(
                f"it fills a {type(target).__name__} with {type(state).__name__} state that is not its fields"
            )
        pickle._Unpickler.load_build(self)

    def _no_extension(self) -> None:  # copyreg's extension codes name classes without find_class seeing them
        raise pickle.UnpicklingError("it uses copyreg extension codes, which DCP's metadata never does")

    dispatch[pickle.BUILD[0]] = _build
    for _code in (pickle.EXT1, pickle.EXT2, pickle.EXT4):
        dispatch[_code[0]] = _no_extension
    del _code


def _dcp_dataclasses() -> tuple[type, ...]:
    """The classes of DCP's metadata that pickle fills attribute by attribute."""
    from torch.distributed.checkpoint import metadata as m
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return (
        m.ChunkStorageMetadata,
        m.TensorProperties,
        m.TensorStorageMetadata,
        m.BytesStorageMetadata,
        m.StorageMeta,
        m.Metadata,
        m.MetadataIndex,
        _StorageInfo,
    )


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with non-tensor values unpickled by ``torch.load(weights_only=True)``.

    ``DefaultLoadPlanner.load_bytes`` loads them with ``weights_only=False`` (torch 2.13),
    which would run code from a crafted ``.distcp`` file; the state saved here (numbers,
    strings, lists, dicts, tensors) needs nothing more than ``weights_only`` allows."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element  # what the default planner uses

        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def export_consolidated(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write the full, unsharded model state dict to one ``torch.save`` file (rank 0 writes; all ranks call it).

    The file loads into the plain model with ``torch.load(path, weights_only=True)``. If
    rank 0 cannot write it (a full disk), every rank raises: rank 0 its error, the others a
    :class:`CheckpointError` naming it; the file is as it was.
    """
    path = _check_export_path(path)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def write() -> None:
        partial = path.with_name(path.name + ".partial")
        try:
            torch.save(full, partial)
            _fsync(partial)  # the bytes on disk before the name points at them
            os.replace(partial, path)
            _fsync(path.parent)  # and the new name itself
        except Exception:
            partial.unlink(missing_ok=True)
            raise

    _on_rank0(write, f"{path} was not written")
    return path


def _check_export_path(path: str | os.PathLike) -> Path:
    """Refuse, on every rank, a path :func:`export_consolidated` could not write, before the work that precedes it.

    Rank 0 looks (only it writes: other nodes need not have the directory) and tells the
    others; a training script calls it at its start, so that a typo does not cost the run."""
    _wait_in_flight()  # its collectives share the checkpoint group with a save in flight
    path = Path(path)

    def look() -> None:
        if path.is_dir() or not path.parent.is_dir():
            raise ValueError(f"{path}: expected the path of a file to write, in a directory that exists")

    _on_rank0(look, f"{path} was not written")
    return path
