"""fsdp_guide.checkpoint under faults: per-rank state, re-saving a step, keeping older ones, cleanup that fails,
crafted files, and an optimizer that does not match. Each on real gloo process groups."""

from __future__ import annotations

import pickle
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemWriter

from fsdp_guide import LaunchError, launch
from fsdp_guide.checkpoint import CheckpointError, latest


class Position:
    """A Stateful whose value may differ per rank, as a sampler's offset does."""

    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def _model_and_optimizer(optimizer=torch.optim.AdamW):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = fully_shard(nn.Linear(4, 4))
    opt = optimizer(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return model, opt


def _weights(model):
    return [p.full_tensor().clone() for p in model.parameters()]


def _per_rank_and_replicated_state(directory):
    import torch.distributed as dist

    from fsdp_guide import checkpoint

    model, opt = _model_and_optimizer()
    sampler, schedule = Position(10 + dist.get_rank()), Position(7)
    checkpoint.save(directory, 1, model, opt, sampler=sampler, schedule=schedule)
    sampler.value = schedule.value = -1
    checkpoint.load(latest(directory), model, opt, sampler=sampler, schedule=schedule)
    return sampler.value, schedule.value


def _load_on_one_rank(directory, **stateful):
    from fsdp_guide import checkpoint

    model, opt = _model_and_optimizer()
    return checkpoint.load(latest(directory), model, opt, **stateful)


def test_state_that_differs_per_rank_comes_back_per_rank_and_replicated_state_stays_one(tmp_path):
    assert launch(_per_rank_and_replicated_state, str(tmp_path), world_size=2, output="none") == [(10, 7), (11, 7)]
    schedule = Position(-1)
    assert launch(_load_on_one_rank, str(tmp_path), schedule=schedule, world_size=1, output="none") == [1]
    with pytest.raises(LaunchError, match="'sampler' was saved per rank on 2 ranks .*this run has 1"):
        launch(_load_on_one_rank, str(tmp_path), sampler=Position(-1), world_size=1, output="none")


def _resave_with_a_crash_before_the_new_name(directory):
    import os

    from fsdp_guide import checkpoint

    model, opt = _model_and_optimizer()
    checkpoint.save(directory, 1, model, opt)
    first = _weights(model)
    rename = os.rename

    def crash_on_publishing(src, dst):
        if Path(src).name.startswith(".partial-"):
            raise OSError("the machine went down here")
        rename(src, dst)

    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    checkpoint.os.rename = crash_on_publishing
    try:
        checkpoint.save(directory, 1, model, opt)
    except OSError:
        pass
    finally:
        checkpoint.os.rename = rename
    found = latest(directory)
    step = checkpoint.load(found, model, opt)
    return found.name, step, all(torch.equal(a, b) for a, b in zip(first, _weights(model)))


def test_saving_a_step_again_never_leaves_it_without_a_complete_checkpoint(tmp_path):
    [(name, step, same)] = launch(_resave_with_a_crash_before_the_new_name, str(tmp_path), world_size=1, output="none")
    assert (name, step, same) == (".old-step-00000001", 1, True)  # the first save, complete, found by latest()


def _save_steps(directory, steps, keep):
    from fsdp_guide import checkpoint

    model, opt = _model_and_optimizer()
    for step in steps:
        checkpoint.save(directory, step, model, opt, keep=keep)
    return sorted(p.name for p in Path(directory).iterdir())


def test_keep_holds_the_newest_checkpoints_up_to_this_step_and_never_deletes_a_later_one(tmp_path):
    assert launch(_save_steps, str(tmp_path / "a"), [1, 2, 3, 4, 5], 2, world_size=2, output="none")[0] == [
        "step-00000004",
        "step-00000005",
    ]
    (tmp_path / "b" / "step-00000009").mkdir(parents=True)  # another run's, further along
    assert launch(_save_steps, str(tmp_path / "b"), [1, 2, 3], 1, world_size=1, output="none")[0] == [
        "step-00000003",
        "step-00000009",
    ]
    with pytest.raises(LaunchError, match=r"keep=0: expected an int >= 1"):
        launch(_save_steps, str(tmp_path / "c"), [1], 0, world_size=1, output="none")


def _save_while_old_ones_cannot_be_deleted(directory):
    import shutil
    import warnings

    from fsdp_guide import checkpoint

    model, opt = _model_and_optimizer()
    checkpoint.save(directory, 1, model, opt, keep=1)
    rmtree = shutil.rmtree

    def busy(path, *args, **kwargs):  # an NFS .nfs* file still open on another node
        if Path(path).name == "step-00000001":
            raise OSError(16, "Device or resource busy")
        return rmtree(path, *args, **kwargs)

    checkpoint.shutil.rmtree = busy
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            checkpoint.save(directory, 2, model, opt, keep=1)
    finally:
        checkpoint.shutil.rmtree = rmtree
    return latest(directory).name, [str(w.message) for w in caught if "could not delete" in str(w.message)]


def test_a_cleanup_that_fails_is_a_warning_not_a_failed_save_or_a_hang(tmp_path):
    results = launch(_save_while_old_ones_cannot_be_deleted, str(tmp_path), world_size=2, output="none", timeout=120)
    assert results[0][0] == "step-00000002"
    assert len(results[0][1]) == 1 and "step-00000001" in results[0][1][0]  # rank 0 cleans up, and says so
    assert results[1] == ("step-00000002", [])


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")  # what a crafted file would do: anything at all


def test_a_crafted_metadata_file_is_refused_and_runs_nothing(tmp_path):
    from fsdp_guide import checkpoint

    crafted, marker = tmp_path / "step-00000001", tmp_path / "ran"
    crafted.mkdir()
    (crafted / ".metadata").write_bytes(pickle.dumps(_RunsCode(str(marker))))
    model = nn.Linear(4, 4)
    with pytest.raises(
        CheckpointError,
        match=r"step-00000001/\.metadata was refused \((io|builtins)\.open is not .*nothing in it was run",
    ):
        checkpoint.load(crafted, model, torch.optim.AdamW(model.parameters()))
    assert not marker.exists()


class _CraftedState:
    def __init__(self, marker):
        self.marker = marker

    def state_dict(self):
        return {"value": _RunsCode(self.marker)}

    def load_state_dict(self, state):
        pass


def _save_crafted_then_load(directory, marker):
    from fsdp_guide import checkpoint

    model, opt = _model_and_optimizer()
    checkpoint.save(directory, 1, model, opt, data=_CraftedState(marker))
    try:
        checkpoint.load(latest(directory), model, opt, data=Position(0))
    except CheckpointError as error:
        return str(error)
    return "loaded"


def test_a_crafted_value_in_the_data_files_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    [message] = launch(_save_crafted_then_load, str(tmp_path / "ckpt"), str(marker), world_size=1, output="none")
    assert "its files could not be read" in message  # torch.load(weights_only=True) refused the crafted value
    assert not marker.exists()


def _sgd_checkpoint_into_adamw(directory):
    from fsdp_guide import checkpoint

    model, opt = _model_and_optimizer(lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9))
    checkpoint.save(directory, 1, model, opt)
    model, opt = _model_and_optimizer()
    try:
        checkpoint.load(latest(directory), model, opt)
    except CheckpointError as error:
        return str(error)


def test_another_optimizer_s_checkpoint_names_the_mismatch_and_not_corruption(tmp_path):
    [message] = launch(_sgd_checkpoint_into_adamw, str(tmp_path), world_size=1, output="none")
    assert "['momentum_buffer']" in message and "['exp_avg', 'exp_avg_sq', 'step']" in message
    assert "saved with a different optimizer" in message and "corrupt" not in message


def test_every_file_and_directory_is_fsynced_before_and_after_the_rename(tmp_path, monkeypatch):
    import os
    import warnings

    from fsdp_guide import checkpoint

    synced = []
    fsync = os.fsync

    def recording(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording)
    model = nn.Linear(4, 4)
    with warnings.catch_warnings():  # DCP warns that it saves in one process: the intent here
        warnings.simplefilter("ignore")
        final = checkpoint.save(tmp_path / "ckpt", 1, model, torch.optim.AdamW(model.parameters()))
    partial = final.with_name(".partial-step-00000001")
    assert {partial / f.name for f in final.iterdir()} <= set(synced)  # the data files and .metadata
    assert partial in synced and final.parent in synced  # the entries, then the rename
    synced.clear()
    exported = checkpoint.export_consolidated(model, tmp_path / "model.pt")
    assert synced == [exported.with_name("model.pt.partial"), tmp_path]


class _HeldWriter(FileSystemWriter):
    """DCP's writer, writing nothing until ``release`` is set: a save certainly still in flight
    however fast or busy the machine (DCP's asynchronous save writes from a thread of the rank)."""

    release = threading.Event()

    def write_data(self, plan, planner):
        if not _HeldWriter.release.wait(timeout=120):
            raise TimeoutError("the test never released the writer")
        return super().write_data(plan, planner)


class _SlowWriter(FileSystemWriter):
    """DCP's writer, taking a second to write each rank's part: a save most likely still in flight
    when the function returns (were it written sooner, the test would pass without proving the point:
    weakened by timing, never broken)."""

    def write_data(self, plan, planner):
        time.sleep(1.0)
        return super().write_data(plan, planner)


def _two_async_saves_then_load(directory):
    from fsdp_guide import checkpoint

    model, opt = _model_and_optimizer()
    at_step_1 = _weights(model)
    first = checkpoint.async_save(directory, 1, model, opt, storage_writer=_HeldWriter)
    returned_before_written = not first.done()  # its writer is held: it cannot have written
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # training goes on while step 1 is in flight
    # Released from another thread while the second save waits: a second save that did not wait
    # for the first would return with the first still held (not done). (Were the second's own
    # staging slower than the half second, the check would pass without proving the wait: it
    # can be weakened by a busy machine, never broken.)
    threading.Timer(0.5, _HeldWriter.release.set).start()
    second = checkpoint.async_save(directory, 2, model, opt, storage_writer=_HeldWriter)
    first_done_when_second_started = first.done()  # at most one save in flight
    second.wait()
    names = sorted(p.name for p in Path(directory).iterdir())
    checkpoint.load(Path(directory) / "step-00000001", model, opt)
    restored = all(torch.equal(a, b) for a, b in zip(_weights(model), at_step_1))
    return returned_before_written, first_done_when_second_started, names, restored


def test_an_async_save_returns_before_it_is_written_keeps_the_state_at_the_call_and_one_flies_at_a_time(tmp_path):
    for returned_early, one_at_a_time, names, restored in launch(
        _two_async_saves_then_load, str(tmp_path), world_size=2, output="none"
    ):
        assert returned_early and one_at_a_time
        assert names == ["step-00000001", "step-00000002"]  # published, nothing partial left
        assert restored  # step 1's values, though the parameters were zeroed while it was written


def _async_save_killed_in_flight(directory):
    import os

    from fsdp_guide import checkpoint

    model, opt = _model_and_optimizer()
    checkpoint.save(directory, 1, model, opt)
    checkpoint.async_save(directory, 2, model, opt, storage_writer=_HeldWriter)  # never released
    os._exit(1)  # the job dies while step 2 is being written


def test_a_crash_while_an_async_save_is_in_flight_leaves_the_previous_checkpoint(tmp_path):
    with pytest.raises(LaunchError):
        launch(_async_save_killed_in_flight, str(tmp_path), world_size=2, output="none")
    assert latest(tmp_path).name == "step-00000001"
    assert launch(_load_on_one_rank, str(tmp_path), world_size=1, output="none") == [1]


class _FailsOnRank1(FileSystemWriter):
    """Rank 1 cannot write step 2 (a full disk, say), after rank 0 has written its part."""

    def write_data(self, plan, planner):
        import torch.distributed as dist

        if dist.get_rank() == 1 and "step-00000002" in str(self.path):
            time.sleep(0.5)
            raise OSError(28, "No space left on device")
        return super().write_data(plan, planner)


def _save_that_fails(directory, where, how):
    import torch.distributed as dist

    from fsdp_guide import checkpoint

    model, opt = _model_and_optimizer()
    checkpoint.save(directory, 1, model, opt)
    rename = checkpoint.os.rename
    if where == "publish" and dist.get_rank() == 0:

        def cannot_rename(src, dst):  # DCP's own renames (its .metadata) still work
            if Path(dst).name == "step-00000002":
                raise PermissionError(13, "Permission denied", str(dst))
            return rename(src, dst)

        checkpoint.os.rename = cannot_rename  # this rank's only: publishing fails on rank 0
    writer = _FailsOnRank1 if where == "write" else FileSystemWriter
    try:
        if how == "async":
            checkpoint.async_save(directory, 2, model, opt, storage_writer=writer).wait()
        else:
            checkpoint.save(directory, 2, model, opt, storage_writer=writer)
        return "published"
    except BaseException as error:  # noqa: BLE001  (DCP's CheckpointException derives from BaseException)
        return f"{type(error).__name__}: {error}"
    finally:
        checkpoint.os.rename = rename  # the launcher renames this rank's result into place


@pytest.mark.parametrize("how", ["async", "sync"])
@pytest.mark.parametrize("where", ["write", "publish"])
def test_a_save_that_fails_on_one_rank_raises_on_every_rank_at_once_and_keeps_the_previous(tmp_path, where, how):
    # collective_timeout=60: a rank left waiting in a collective for one that raised (a synchronous save
    # whose publish failed on rank 0 did that) would fail with a gloo timeout, not rank 0's error.
    raised = launch(
        _save_that_fails, str(tmp_path), where, how, world_size=2, output="none", timeout=50, collective_timeout=60
    )
    if where == "write":  # DCP gathers the write results: every rank learns of rank 1's failure
        assert all("No space left on device" in message for message in raised)
    else:  # rank 0's rename failed after every rank wrote: rank 0 tells the others
        assert "Permission denied" in raised[0]
        assert raised[1].startswith("CheckpointError: ") and "rank 0 failed with PermissionError" in raised[1]
    assert latest(tmp_path).name == "step-00000001"  # nothing half-written was published
    assert launch(_load_on_one_rank, str(tmp_path), world_size=1, output="none") == [1]


def _async_save_never_waited_for(directory):
    from fsdp_guide import checkpoint

    model, opt = _model_and_optimizer()
    checkpoint.async_save(directory, 1, model, opt, storage_writer=_SlowWriter)
    return "returned"  # without wait(): the rank publishes it before its process group goes


def test_a_launched_function_that_does_not_wait_still_gets_its_async_save_published(tmp_path):
    assert launch(_async_save_never_waited_for, str(tmp_path), world_size=2, output="none") == ["returned"] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]


def _save_one(directory):
    from fsdp_guide import checkpoint

    model, opt = _model_and_optimizer()
    return str(checkpoint.save(directory, 1, model, opt))


def _try_load(path):
    from fsdp_guide import checkpoint

    model, opt = _model_and_optimizer()
    try:
        checkpoint.load(path, model, opt)
    except CheckpointError as error:
        return str(error)
    return "loaded"


def test_a_metadata_dcp_cannot_use_never_falls_back_to_the_unchecked_rank_local_files(tmp_path):
    saved = launch(_save_one, str(tmp_path), world_size=2, output="none")[0]
    metadata_file, marker = Path(saved) / ".metadata", tmp_path / "ran"
    metadata = pickle.loads(metadata_file.read_bytes())
    metadata.storage_meta = 5  # accepted by a restricted unpickler; DCP's own read of it then fails
    metadata_file.write_bytes(pickle.dumps(metadata))
    for rank in (0, 1):  # DCP's fallback: each rank its own
        (Path(saved) / f"__{rank}.metadata").write_bytes(pickle.dumps(_RunsCode(f"{marker}{rank}")))
    messages = launch(_try_load, saved, world_size=2, output="none", timeout=60)
    assert all(m.startswith(f"{metadata_file} was refused: its storage_meta is a int") for m in messages)
    assert not any(tmp_path.glob("ran*"))


def _build_on(module: str, name: str) -> bytes:
    """A pickle whose only effect is BUILD on a class: ``setattr(module.name, 'evil', 1)``."""
    return b"\x80\x04c" + f"{module}\n{name}\n".encode() + b"N}X\x04\x00\x00\x00evilK\x01s\x86b."


@pytest.mark.parametrize("name", ["Metadata", "TensorStorageMetadata"])
def test_a_metadata_that_sets_attributes_on_an_allowed_class_is_refused_and_changes_nothing(tmp_path, name):
    import torch.distributed.checkpoint.metadata as dcp_metadata

    from fsdp_guide import checkpoint

    crafted = tmp_path / "step-00000001"
    crafted.mkdir()
    (crafted / ".metadata").write_bytes(_build_on(dcp_metadata.__name__, name))
    model = nn.Linear(4, 4)
    try:
        with pytest.raises(
            CheckpointError,
            match=rf"^{crafted}/\.metadata was refused \(it sets attributes on "
            rf"<class '.*\.{name}'>",
        ):
            checkpoint.load(crafted, model, torch.optim.AdamW(model.parameters()))
        assert not hasattr(getattr(dcp_metadata, name), "evil")  # the class is as DCP defines it
    finally:
        if hasattr(getattr(dcp_metadata, name), "evil"):
            delattr(getattr(dcp_metadata, name), "evil")


@pytest.mark.parametrize("crafted_path", ["../elsewhere.distcp", "/etc/hostname", "sub/__0_0.distcp", ".."])
def test_a_metadata_that_points_outside_the_checkpoint_is_refused_before_anything_is_read(tmp_path, crafted_path):
    import dataclasses

    [saved] = launch(_save_one, str(tmp_path), world_size=1, output="none")
    metadata_file = Path(saved) / ".metadata"
    metadata = pickle.loads(metadata_file.read_bytes())
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], relative_path=crafted_path)
    metadata_file.write_bytes(pickle.dumps(metadata))
    [message] = launch(_try_load, saved, world_size=1, output="none")
    assert message.startswith(f"{metadata_file} was refused: it points at {crafted_path!r}, which is not a file")


@pytest.mark.parametrize(
    "crafted_path",
    ["__0_0\0.distcp", "x" * 4000, "é" * 200, "__0_0\ud800.distcp"],
    ids=["nul", "4000-chars", "400-bytes", "lone-surrogate"],
)
def test_a_metadata_naming_a_file_no_file_system_can_hold_is_refused_naming_the_metadata(tmp_path, crafted_path):
    import dataclasses

    [saved] = launch(_save_one, str(tmp_path), world_size=1, output="none")
    metadata_file = Path(saved) / ".metadata"
    metadata = pickle.loads(metadata_file.read_bytes())
    for index, info in metadata.storage_data.items():  # every entry: the first looked at must be refused
        metadata.storage_data[index] = dataclasses.replace(info, relative_path=crafted_path)
    metadata_file.write_bytes(pickle.dumps(metadata))
    [message] = launch(_try_load, saved, world_size=1, output="none")  # not ValueError or OSError from the OS
    assert message.startswith(f"{metadata_file} was refused: it points at "), message
    assert "which no file can be named (a NUL byte, or over 255 bytes)" in message and len(message) < 400


@pytest.mark.parametrize(
    "content, says",
    [
        (b"not a pickle", "cannot be read"),
        (pickle.dumps({"a": 1}), "holds a dict"),
        (pickle.dumps({"a": 1})[:-3], "cannot be read"),
    ],
    ids=["garbage", "not-metadata", "truncated"],
)
def test_every_refused_metadata_is_a_checkpoint_error_naming_the_file(tmp_path, content, says):
    from fsdp_guide import checkpoint

    crafted = tmp_path / "step-00000001"
    crafted.mkdir()
    (crafted / ".metadata").write_bytes(content)
    model = nn.Linear(4, 4)
    with pytest.raises(CheckpointError, match=rf"^{crafted}/\.metadata (was refused|cannot be read)") as raised:
        checkpoint.load(crafted, model, torch.optim.AdamW(model.parameters()))
    assert says in str(raised.value)


class _SetsTheEnum:
    """Pickles as DCP's memory-format enum member with state for BUILD: an object shared by the whole process."""

    def __reduce__(self):
        from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

        return _MEM_FORMAT_ENCODING, (0,), {"_value_": 77}


class _FieldsOfItsOwn:
    """Pickles as a StorageMeta filled with attributes that are not its fields."""

    def __reduce__(self):
        from torch.distributed.checkpoint.metadata import StorageMeta

        return StorageMeta, (), {"evil": 1}


@pytest.mark.parametrize(
    "crafted, says",
    [
        (_SetsTheEnum, "it sets attributes on <_MEM_FORMAT_ENCODING"),
        (_FieldsOfItsOwn, "it fills a StorageMeta with dict state that is not its"),
    ],
    ids=["enum-member", "not-its-fields"],
)
def test_a_metadata_that_sets_what_dcp_never_sets_is_refused_and_changes_nothing(tmp_path, crafted, says):
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, Metadata

    from fsdp_guide import checkpoint

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Metadata({}, planner_data=crafted(), storage_data={})))
    with pytest.raises(CheckpointError, match=rf"^{tmp_path}/\.metadata was refused \({says}"):
        checkpoint._read_metadata(tmp_path)
    assert _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT.value == 0  # the next checkpoint still saves and loads


def test_a_metadata_that_uses_copyreg_extension_codes_is_refused(tmp_path):
    from fsdp_guide import checkpoint

    (tmp_path / ".metadata").write_bytes(b"\x80\x04\x82\x01.")  # EXT1 1: a class named by a registry, not by name
    with pytest.raises(CheckpointError, match="it uses copyreg extension codes"):
        checkpoint._read_metadata(tmp_path)


def _break_an_entry(saved: Path, how: str) -> None:
    import dataclasses

    metadata_file = saved / ".metadata"
    metadata = pickle.loads(metadata_file.read_bytes())
    if how == "tensor-size":
        metadata.state_dict_metadata["model.weight"].size = 5
    elif how == "per-rank-key":
        metadata.state_dict_metadata["data@rankx"] = metadata.state_dict_metadata.pop("step")
    elif how == "transform":
        index = next(iter(metadata.storage_data))
        metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], transform_descriptors=["zstd"])
    metadata_file.write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize(
    "how, says",
    [
        ("tensor-size", "its entry 'model.weight' is not a tensor's storage metadata"),
        ("per-rank-key", "its entry 'data@rankx' is not one this package writes"),
        ("transform", "is to be transformed (['zstd']) when read"),
    ],
)
def test_metadata_entries_this_package_never_writes_are_refused_naming_the_file(tmp_path, how, says):
    [saved] = launch(_save_one, str(tmp_path), world_size=1, output="none")
    _break_an_entry(Path(saved), how)
    [message] = launch(_try_load, saved, world_size=1, output="none")
    assert message.startswith(f"{Path(saved) / '.metadata'} was refused: ") and says in message


def test_files_of_a_checkpoint_that_are_links_elsewhere_are_refused(tmp_path):
    import os

    first, elsewhere = (launch(_save_one, str(tmp_path / d), world_size=2, output="none")[0] for d in ("a", "b"))
    for data in Path(first).glob("*.distcp"):  # the data another checkpoint (any file) holds
        data.unlink()
        os.symlink(Path(elsewhere) / data.name, data)
    messages = launch(_try_load, first, world_size=2, output="none", timeout=60)
    assert all("is not a plain file of the checkpoint (a link, a pipe or a device)" in m for m in messages)
    (Path(first) / ".metadata").unlink()
    os.symlink(Path(elsewhere) / ".metadata", Path(first) / ".metadata")
    [message] = launch(_try_load, first, world_size=1, output="none")
    assert (
        message
        == f"{Path(first) / '.metadata'} was refused: it is a link, and DCP writes a plain file; nothing was read"
    )


def test_a_metadata_pickled_by_python_3_13_names_pathlib_local_and_is_read(tmp_path):
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    from fsdp_guide import checkpoint

    # protocol 2: classes named as text (GLOBAL), so the module's name can be changed in place
    data = pickle.dumps(
        Metadata({}, storage_data={}, storage_meta=StorageMeta(checkpoint_id=Path("/ckpt"))), protocol=2
    )
    assert b"cpathlib\nPosixPath\n" in data
    (tmp_path / ".metadata").write_bytes(data.replace(b"cpathlib\n", b"cpathlib._local\n"))
    assert checkpoint._read_metadata(tmp_path).storage_meta.checkpoint_id == Path("/ckpt")


def _save_where_rank_0_cannot_make_the_directory(directory):
    import torch.distributed as dist

    from fsdp_guide import checkpoint

    model, opt = _model_and_optimizer()
    if dist.get_rank() == 0:

        def read_only(self, *args, **kwargs):
            raise PermissionError(13, "Permission denied", str(self))

        checkpoint.Path.mkdir = read_only  # this rank's only
    try:
        checkpoint.save(directory, 1, model, opt)
        return "saved"
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}"


def test_a_save_whose_directory_rank_0_cannot_make_raises_on_every_rank_at_once(tmp_path):
    raised = launch(
        _save_where_rank_0_cannot_make_the_directory,
        str(tmp_path / "ckpt"),
        world_size=2,
        output="none",
        timeout=50,
        collective_timeout=60,
    )
    assert raised[0].startswith("PermissionError: [Errno 13] Permission denied")
    assert (
        raised[1].startswith("CheckpointError: ") and "was not saved: rank 0 failed with PermissionError" in raised[1]
    )


def _save_at_a_numpy_step(directory):
    import numpy as np

    from fsdp_guide import checkpoint

    model, opt = _model_and_optimizer()
    return checkpoint.save(directory, np.int64(3), model, opt).name


def test_a_numpy_integer_step_is_an_integer(tmp_path):
    assert launch(_save_at_a_numpy_step, str(tmp_path), world_size=1, output="none") == ["step-00000003"]


def _save_beside_a_user_s_folders(directory, steps):
    from fsdp_guide import checkpoint

    model, opt = _model_and_optimizer()
    outcome = []
    for step in steps:
        try:
            outcome.append(checkpoint.save(directory, step, model, opt, keep=1).name)
        except CheckpointError as error:
            outcome.append(str(error))
    return outcome, latest(directory).name


def test_only_this_package_s_checkpoints_are_counted_kept_replaced_or_deleted(tmp_path):
    (tmp_path / "step-3").mkdir()
    (tmp_path / "step-3" / "config.json").write_text("{}")  # an export made per step, beside the checkpoints
    (tmp_path / "step-9").mkdir()  # an empty folder, further along
    (tmp_path / "step-00000006").mkdir()
    (tmp_path / "step-00000006" / "notes.txt").write_text("mine")
    for rank_outcome in launch(
        _save_beside_a_user_s_folders, str(tmp_path), [4, 5, 6], world_size=2, output="none", timeout=60
    ):
        saved, newest = rank_outcome
        assert saved[:2] == ["step-00000004", "step-00000005"]
        assert saved[2].startswith(f"{tmp_path / 'step-00000006'} exists and is not a checkpoint of fsdp_guide")
        assert newest == "step-00000005"  # neither step-9 nor the user's step-00000006
    assert (tmp_path / "step-3" / "config.json").read_text() == "{}"
    assert (tmp_path / "step-00000006" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000005", "step-00000006", "step-3", "step-9"]


@pytest.mark.parametrize("step", [-1, 1.5, True, "3", None])
@pytest.mark.parametrize("how", ["save", "async_save"])
def test_a_step_that_is_not_a_non_negative_int_is_refused_before_anything_is_written(tmp_path, step, how):
    from fsdp_guide import checkpoint

    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=rf"^step={step!r}: expected an int >= 0"):
        getattr(checkpoint, how)(tmp_path, step, model, torch.optim.AdamW(model.parameters()))
    assert list(tmp_path.iterdir()) == []


def _export_that_fails_on_rank_0(path):
    import torch.distributed as dist

    from fsdp_guide import checkpoint

    model, _ = _model_and_optimizer()
    if dist.get_rank() == 0:

        def full_disk(*args, **kwargs):
            raise OSError(28, "No space left on device")

        checkpoint.torch.save = full_disk  # this rank's only
    try:
        checkpoint.export_consolidated(model, path)
        return "written"
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}"


def test_an_export_that_fails_on_rank_0_raises_on_every_rank_at_once_and_keeps_the_file(tmp_path):
    (tmp_path / "model.pt").write_bytes(b"the previous export")
    raised = launch(
        _export_that_fails_on_rank_0,
        str(tmp_path / "model.pt"),
        world_size=2,
        output="none",
        timeout=50,
        collective_timeout=60,
    )
    assert raised[0] == "OSError: [Errno 28] No space left on device"
    assert raised[1].startswith("CheckpointError: ") and "rank 0 failed with OSError" in raised[1]
    assert (tmp_path / "model.pt").read_bytes() == b"the previous export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]


def _export(path):
    from fsdp_guide import checkpoint

    model, _ = _model_and_optimizer()
    try:
        checkpoint.export_consolidated(model, path)
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}"


@pytest.mark.parametrize("where", ["a-directory", "missing/model.pt"])
def test_an_export_to_a_path_that_cannot_be_a_file_is_refused_on_every_rank_before_the_gather(tmp_path, where):
    (tmp_path / "a-directory").mkdir()
    raised = launch(_export, str(tmp_path / where), world_size=2, output="none", timeout=50, collective_timeout=60)
    assert (
        raised[0] == f"ValueError: {tmp_path / where}: expected the path of a file to write, in a directory that exists"
    )
    assert raised[1].startswith("CheckpointError: ") and "rank 0 failed with ValueError" in raised[1]


class _WaitsForFile(FileSystemWriter):
    """DCP's writer, writing nothing until the file ``go`` exists: a save certainly still in progress
    while another run tries the same step, however fast or busy the machine."""

    go = ""

    def write_data(self, plan, planner):
        deadline = time.monotonic() + 120
        while not Path(_WaitsForFile.go).exists():
            if time.monotonic() > deadline:
                raise TimeoutError("the test never let the writer go")
            time.sleep(0.02)
        return super().write_data(plan, planner)


def _seeded(seed):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = fully_shard(nn.Linear(4, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _save_seeded(directory, seed, go=None, in_background=False):
    """Save step 2 of a model made from ``seed`` (with async_save: ``in_background``); its weights, and the save's
    path or error. Saved in the background, the same step is then saved again: the first save's claim has ended."""
    from fsdp_guide import checkpoint

    model, opt = _seeded(seed)
    _WaitsForFile.go = go or ""
    writer = _WaitsForFile if go else None
    try:
        if in_background:
            saved = str(checkpoint.async_save(directory, 2, model, opt, storage_writer=writer).wait())
            checkpoint.async_save(directory, 2, model, opt).wait()
        else:
            saved = str(checkpoint.save(directory, 2, model, opt, storage_writer=writer))
    except CheckpointError as error:
        saved = f"CheckpointError: {error}"
    return _weights(model), saved


def _load_latest(directory):
    from fsdp_guide import checkpoint

    model, opt = _seeded(7)
    checkpoint.load(checkpoint.latest(directory), model, opt)
    return _weights(model)


@pytest.mark.parametrize("in_background", [False, True], ids=["save", "async_save"])
def test_two_runs_saving_one_step_into_one_directory_never_publish_each_others_weights(tmp_path, in_background):
    # Run A (seed 0) makes step 2's partial directory and is still writing; run B (seed 1) saves step 2 there.
    # B used to delete A's partial directory and write into the same path: A then published B's weights.
    directory, go = tmp_path / "ckpt", tmp_path / "go"
    first: list = []
    a = threading.Thread(
        target=lambda: first.append(
            launch(_save_seeded, str(directory), 0, str(go), in_background, world_size=2, output="none", timeout=180)
        )
    )
    a.start()
    try:
        partial = directory / ".partial-step-00000002"
        deadline = time.monotonic() + 120
        while not (partial / ".fsdp_guide-checkpoint").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        [(_, b_saved), (_, b_saved_1)] = launch(_save_seeded, str(directory), 1, world_size=2, output="none")
    finally:
        go.touch()
        a.join(timeout=180)
    # B is refused on every rank, naming the process that is writing, and wrote nothing
    assert b_saved.startswith(f"CheckpointError: {directory / 'step-00000002'} was not saved: pid "), b_saved
    assert f"is saving the same step into {directory} now" in b_saved and b_saved_1.startswith("CheckpointError: ")
    [(a_weights, a_saved), _] = first[0]
    assert a_saved == str(directory / "step-00000002")
    loaded = launch(_load_latest, str(directory), world_size=2, output="none")[0]
    assert all(torch.equal(x, y) for x, y in zip(loaded, a_weights, strict=True))  # A's weights, as A's save said
    # the claim ends with the save: the next save of that step, another run's, replaces it
    [(b_weights, again), _] = launch(_save_seeded, str(directory), 1, world_size=2, output="none")
    assert again == str(directory / "step-00000002")
    loaded = launch(_load_latest, str(directory), world_size=2, output="none")[0]
    assert all(torch.equal(x, y) for x, y in zip(loaded, b_weights, strict=True))


def _save_then_die_holding_the_claim(directory):
    import os
    import signal

    import torch.distributed as dist

    from fsdp_guide import checkpoint

    model, opt = _seeded(0)

    class Dies(FileSystemWriter):
        def write_data(self, plan, planner):
            if dist.get_rank() == 0:
                os.kill(os.getpid(), signal.SIGKILL)  # a crash mid-save, the claim held
            return super().write_data(plan, planner)

    checkpoint.save(directory, 2, model, opt, storage_writer=Dies)


def test_a_claim_left_by_a_crashed_save_does_not_block_the_next(tmp_path):
    directory = tmp_path / "ckpt"
    with pytest.raises(LaunchError, match="SIGKILL"):
        launch(_save_then_die_holding_the_claim, str(directory), world_size=2, output="none", timeout=120)
    assert (directory / ".partial-step-00000002" / ".fsdp_guide-checkpoint").exists()  # left as the crash left it
    [(weights, saved), _] = launch(_save_seeded, str(directory), 1, world_size=2, output="none")
    assert saved == str(directory / "step-00000002") and sorted(p.name for p in directory.iterdir()) == [
        "step-00000002"
    ]
    loaded = launch(_load_latest, str(directory), world_size=2, output="none")[0]
    assert all(torch.equal(x, y) for x, y in zip(loaded, weights, strict=True))
