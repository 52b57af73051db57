"""The LLM recipe on real gloo ranks: exact resume, a crash during a save, resharding, bad checkpoints, export, two nodes."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys

import psutil
import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from fsdp_guide import LaunchError, launch
from fsdp_guide.checkpoint import latest
from fsdp_guide.recipes.train_llm import TrainConfig, train
from isolation import linux_only, loopback_only  # torchrun's store listens on every interface: run it where only lo exists

K = 4  # steps between checkpoints
SMALL = TrainConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=4, steps=2 * K, warmup=2,
                    log_every=K, progress=False)


def run(world_size=2, **changes):
    return launch(train, dataclasses.replace(SMALL, **changes), world_size=world_size, output="none")[0]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """2K steps in one go, saving every K: the run every resumed one must reproduce."""
    directory = tmp_path_factory.mktemp("straight")
    return run(checkpoint_dir=str(directory), checkpoint_every=K)["losses"]


@pytest.fixture(scope="module")
def saved_at_k(tmp_path_factory):
    """K steps on 2 ranks, then stop: the checkpoint the resume tests start from."""
    directory = tmp_path_factory.mktemp("first_half")
    run(stop_at=K, checkpoint_dir=str(directory), checkpoint_every=K)
    return directory


def test_the_model_learns_and_every_rank_agrees(straight):
    assert len(straight) == 2 * K and straight[-1] < straight[0] - 0.5  # from ln(256) = 5.5 down


def test_resume_continues_bit_for_bit(saved_at_k, straight, tmp_path):
    assert latest(saved_at_k).name == f"step-{K:08d}"
    resumed = run(checkpoint_dir=str(saved_at_k), resume="latest")
    assert resumed["first_step"] == K + 1
    assert resumed["losses"] == straight[K:]  # exactly equal, data stream included


class _KilledWhileSaving(FileSystemWriter):
    """Rank 1 is killed (SIGKILL) after writing its part of the step-2K checkpoint, before it is complete."""

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        written.wait()
        if dist.get_rank() == 1 and f"step-{2 * K:08d}" in str(self.path):
            os.kill(os.getpid(), signal.SIGKILL)
        return written


def _children():
    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_a_rank_killed_during_a_save_leaves_the_previous_checkpoint_which_resumes_exactly(straight, tmp_path):
    config = dataclasses.replace(SMALL, checkpoint_dir=str(tmp_path), checkpoint_every=K)
    before = _children()
    with pytest.raises(LaunchError, match="rank 1"):
        launch(train, config, storage_writer=_KilledWhileSaving, world_size=2, output="none", timeout=120)
    assert _children() <= before  # no rank left behind
    assert (tmp_path / f".partial-step-{2 * K:08d}").is_dir()  # the interrupted save, never published
    assert latest(tmp_path).name == f"step-{K:08d}"  # the previous checkpoint, intact
    resumed = run(checkpoint_dir=str(tmp_path), resume="latest", checkpoint_every=K)
    assert resumed["losses"] == straight[K:]
    assert latest(tmp_path).name == f"step-{2 * K:08d}" and not list(tmp_path.glob(".partial-*"))


def test_async_checkpoints_leave_training_unchanged_and_resume_bit_for_bit(straight, tmp_path):
    # steps K+1.. train while step K's checkpoint is being written: what it holds is the state at step K
    whole = run(checkpoint_dir=str(tmp_path), checkpoint_every=K, async_checkpoint=True)
    assert whole["losses"] == straight and whole["checkpoint"].endswith(f"step-{2 * K:08d}")
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step-{K:08d}", f"step-{2 * K:08d}"]
    resumed = run(resume=str(tmp_path / f"step-{K:08d}"))
    assert resumed["losses"] == straight[K:]


def test_a_rank_killed_during_an_async_save_leaves_the_previous_checkpoint_which_resumes_exactly(straight, tmp_path):
    config = dataclasses.replace(SMALL, checkpoint_dir=str(tmp_path), checkpoint_every=K, async_checkpoint=True)
    before = _children()
    with pytest.raises(LaunchError, match="rank 1"):
        launch(train, config, storage_writer=_KilledWhileSaving, world_size=2, output="none", timeout=120)
    assert _children() <= before  # no rank left behind
    assert (tmp_path / f".partial-step-{2 * K:08d}").is_dir()  # the save in flight, never published
    assert latest(tmp_path).name == f"step-{K:08d}"
    resumed = run(checkpoint_dir=str(tmp_path), resume="latest", checkpoint_every=K)
    assert resumed["losses"] == straight[K:]


@pytest.mark.parametrize("world_size", [1, 4])
def test_resume_on_a_different_number_of_ranks_reshards(saved_at_k, straight, world_size):
    resumed = run(world_size, checkpoint_dir=str(saved_at_k), resume="latest")
    # the same global batches, reduced in another order: equal up to float rounding
    assert resumed["losses"] == pytest.approx(straight[K:], rel=1e-5)


def _resume_error(config) -> str:
    with pytest.raises(LaunchError) as error:
        launch(train, config, world_size=2, output="none")
    assert "CheckpointError" in str(error.value)
    return str(error.value)


def test_resuming_from_a_missing_corrupt_or_other_shape_checkpoint_is_a_clear_error(saved_at_k, tmp_path):
    missing = tmp_path / "nowhere"
    assert f"{missing}: no such checkpoint directory" in _resume_error(dataclasses.replace(SMALL, resume=str(missing)))
    assert "no complete checkpoint (step-N) to resume from" in _resume_error(
        dataclasses.replace(SMALL, checkpoint_dir=str(tmp_path), resume="latest"))

    wider = dataclasses.replace(SMALL, n_embd=48, resume=str(latest(saved_at_k)))
    message = _resume_error(wider)
    assert "has shape (256, 32) in the checkpoint and (256, 48) in this model" in message
    assert str(latest(saved_at_k)) in message

    fp16 = dataclasses.replace(SMALL, precision="fp16", resume=str(latest(saved_at_k)))  # fp16 needs a scaler
    assert "the checkpoint holds no 'scaler' state, which this run needs" in _resume_error(fp16)

    corrupt = tmp_path / "corrupt"
    subprocess.run(["cp", "-r", str(latest(saved_at_k)), str(corrupt)], check=True)
    for data_file in corrupt.glob("*.distcp"):
        data_file.write_bytes(data_file.read_bytes()[:100])  # truncated, as by a full disk
    message = _resume_error(dataclasses.replace(SMALL, resume=str(corrupt)))
    assert f"{corrupt}: its files could not be read" in message and "missing or damaged" in message
    (corrupt / ".metadata").unlink()
    assert "not a complete checkpoint (it has no .metadata file)" in _resume_error(
        dataclasses.replace(SMALL, resume=str(corrupt)))


def test_the_consolidated_export_loads_into_the_plain_model_and_generates(tmp_path):
    from fsdp_guide.gpt import GPT

    path = tmp_path / "model.pt"
    summary = run(steps=K, export=str(path))
    model = GPT(SMALL.model_config())
    model.load_state_dict(torch.load(path, weights_only=True))
    assert model.lm_head.weight is model.tok_emb.weight  # still tied after loading
    prompt = torch.tensor([list(b"def ")])
    out = model.generate(prompt, max_new_tokens=8, temperature=0)
    assert out.shape == (1, 12) and torch.equal(out[:, :4], prompt)
    _, loss = model(*_first_batch())
    assert loss.item() < summary["losses"][0]  # the trained weights, not a fresh init


def _first_batch():
    from fsdp_guide.tokens import TokenBatches, python_docs_corpus

    x, y = next(TokenBatches(python_docs_corpus(), batch_size=4, block_size=SMALL.block_size, seed=SMALL.seed))
    return x, y


def test_sharded_initialisation_equals_one_process():
    from fsdp_guide.gpt import GPT

    def full_weights():
        from fsdp_guide import summon_full_params
        from fsdp_guide.recipes.train_llm import build_model

        model = build_model(SMALL, torch.device("cpu"), torch.float32)
        with summon_full_params(model, writeback=False):
            return {name: p.detach().clone() for name, p in model.named_parameters()}

    expected = GPT(SMALL.model_config())
    torch.manual_seed(SMALL.seed)  # as build_model seeds: just before init_weights
    expected.init_weights()
    for weights in launch(full_weights, world_size=2, output="none"):
        assert weights.keys() == dict(expected.named_parameters()).keys()
        assert all(torch.equal(weights[n], p) for n, p in expected.named_parameters())


SMALL_FLAGS = ["--steps", str(K), "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32",
               "--batch-size", "4", "--warmup", "2", "--no-progress"]


@linux_only
def test_torchrun_on_one_machine_runs_the_same_training(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as torchrun sets it: the same arithmetic on both sides
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "-m", "fsdp_guide.recipes.train_llm", *SMALL_FLAGS, "--out", str(tmp_path / "summary.json")]
    done = subprocess.run(loopback_only(command), capture_output=True, text=True, timeout=240,
                          env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "step    4 | loss" in done.stdout and "peak memory per rank, peak RSS of the whole process (ru_maxrss): rank0" in done.stdout
    assert json.loads((tmp_path / "summary.json").read_text())["losses"] == run(steps=K)["losses"]


def test_bad_settings_are_refused_with_the_valid_choices():
    with pytest.raises(ValueError, match="precision='fp8': expected one of auto, fp32, bf16, fp16"):
        TrainConfig(precision="fp8")
    with pytest.raises(ValueError, match="stop_at=50: expected 0 .* up to steps=40"):
        TrainConfig(stop_at=50)
    with pytest.raises(ValueError, match="need checkpoint_dir"):
        TrainConfig(checkpoint_every=10)
    with pytest.raises(ValueError, match="batch_size=3 does not split evenly over 2 ranks"):
        from fsdp_guide.tokens import TokenBatches

        TokenBatches(None, batch_size=3, block_size=8, rank=0, world_size=2)


@linux_only
def test_two_torchrun_nodes_train_together_and_match_one_node(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as torchrun sets it: the same arithmetic on both sides
    node = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
            "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29500", "--rdzv-id=two-nodes",
            "-m", "fsdp_guide.recipes.train_llm", *SMALL_FLAGS, "--out", str(tmp_path / "summary.json")]
    script = (f"{shlex.join(node)} > {tmp_path}/node0.log 2>&1 & a=$!; "
              f"{shlex.join(node)} > {tmp_path}/node1.log 2>&1 & b=$!; "
              "wait $a; ra=$?; wait $b; rb=$?; exit $((ra || rb))")
    nodes = subprocess.run(loopback_only(["sh", "-c", script]), timeout=240, env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
    logs = "".join((tmp_path / f"node{n}.log").read_text() for n in (0, 1))
    assert nodes.returncode == 0, logs
    two_nodes = json.loads((tmp_path / "summary.json").read_text())
    one_node = run(steps=K)
    assert two_nodes["losses"] == one_node["losses"]


def test_activation_checkpointing_recomputes_the_same_numbers(straight):
    assert run(stop_at=K, activation_checkpointing=True)["losses"] == straight[:K]


def test_gradient_accumulation_reduce_scatters_once_per_step():
    def collectives(grad_accum):
        from fsdp_guide.precision import record_dtypes
        from fsdp_guide.recipes import train_llm

        config = dataclasses.replace(SMALL, grad_accum=grad_accum)
        model = train_llm.build_model(config, torch.device("cpu"), torch.float32)
        optimizer, scheduler = train_llm.build_optimizer(model, config)
        with record_dtypes() as seen:
            train_llm.train_step(model, optimizer, scheduler, None, train_llm.make_batches(config), config,
                                 torch.device("cpu"))
        counts = {}
        for (phase, kind), n in seen.count.items():
            counts[kind] = counts.get(kind, 0) + n
        return counts

    one, four = (launch(collectives, g, world_size=2, output="none")[0] for g in (1, 4))
    units = SMALL.n_layer + 1  # each block, and the root
    assert one["reduce-scatter"] == four["reduce-scatter"] == units
    assert four["all-gather"] > one["all-gather"]  # each micro-batch gathers again


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_trains_and_fp16_checkpoints_its_scaler(precision, straight, tmp_path):
    summary = run(stop_at=K, precision=precision, checkpoint_dir=str(tmp_path), checkpoint_every=K)
    assert summary["dtype"] == {"bf16": "bfloat16", "fp16": "float16"}[precision]
    assert summary["losses"] == pytest.approx(straight[:K], rel=0.02)  # the fp32 run, to low-precision rounding
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(latest(tmp_path)).read_metadata().state_dict_metadata
    assert any(k.startswith("scaler.") for k in keys) == (precision == "fp16")
