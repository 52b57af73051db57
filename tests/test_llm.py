"""The LLM recipe on real gloo ranks: exact resume, a crash in a save, resharding, bad checkpoints, export, 2 nodes."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys

import psutil
import pytest
import torch

# torchrun's store listens on every interface: run it where only lo exists
from isolation import (
    linux_only,
    loopback_only,
)

from fsdp_guide import LaunchError, launch
from fsdp_guide.checkpoint import latest
from fsdp_guide.launcher import _threads_per_rank
from fsdp_guide.recipes.killed_rank import KilledWhileSaving
from fsdp_guide.recipes.train_llm import TrainConfig, build_model, train

K = 4  # steps between checkpoints
SMALL = TrainConfig(
    n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=4, steps=2 * K, warmup=2, log_every=K, progress=False
)


def run(world_size=2, **changes):
    return launch(train, dataclasses.replace(SMALL, **changes), world_size=world_size, output="none")[0]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """2K steps in one go, saving every K: the run every resumed one must reproduce; its losses and checkpoints."""
    directory = tmp_path_factory.mktemp("straight")
    return run(checkpoint_dir=str(directory), checkpoint_every=K)["losses"], directory


@pytest.fixture(scope="module")
def straight(straight_run):
    return straight_run[0]


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


def test_a_resume_applies_a_new_rate_schedule_and_decay_and_says_so(saved_at_k, capfd):
    # The checkpoint restored AdamW's groups and LambdaLR's base rate: --lr was ignored without a word.
    resumed = launch(
        train,
        dataclasses.replace(
            SMALL, checkpoint_dir=str(saved_at_k), resume="latest", lr=1e-5, steps=3 * K, weight_decay=0.0
        ),
        world_size=2,
    )[0]
    out = capfd.readouterr().out
    assert (
        f"at step {K}; steps {3 * K} (the checkpoint's: {2 * K}); lr 1e-05 (the checkpoint's: 0.003); "
        "weight_decay 0.0 (the checkpoint's: 0.1)" in out
    )
    # exactly the rates of a run started with these settings, from step K + 1 on (the schedule alone decides them)
    fresh = run(lr=1e-5, steps=3 * K, weight_decay=0.0)
    assert resumed["lrs"] == fresh["lrs"][K:] and len(resumed["lrs"]) == 2 * K


def test_a_resume_that_would_change_the_run_is_refused_before_any_rank_starts(saved_at_k, tmp_path):
    command = [
        sys.executable,
        "-m",
        "fsdp_guide.recipes.train_llm",
        "--n-layer",
        "2",
        "--n-head",
        "2",
        "--n-embd",
        "32",
        "--block-size",
        "32",
        "--batch-size",
        "8",
        "--seed",
        "3",
        "--checkpoint-dir",
        str(saved_at_k),
        "--resume",
        "latest",
        "--out",
        str(tmp_path / "s.json"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "" and "[rank" not in done.stderr, done.stderr
    last = done.stderr.splitlines()[-1]
    assert last.startswith(
        f"{PROG}: error: --batch-size 8 (the checkpoint's: 4), --seed 3 (the checkpoint's: 0): "
        f"{saved_at_k / f'step-{K:08d}'} continues a run with other settings"
    ), last
    assert (
        last.endswith("leave them as they were, or start afresh without --resume")
        and not (tmp_path / "s.json").exists()
    )
    with pytest.raises(LaunchError, match=r"ValueError: seed=3 \(the checkpoint's: 0\): .* without resume"):
        run(checkpoint_dir=str(saved_at_k), resume="latest", seed=3)  # the same check, in a notebook's terms
    with pytest.raises(LaunchError, match=rf"ValueError: steps=3: .* is at step {K}, past the end of that run"):
        run(checkpoint_dir=str(saved_at_k), resume="latest", steps=K - 1, warmup=1)  # it would train nothing


def test_resume_auto_starts_fresh_without_a_checkpoint_and_resumes_from_the_newest_one(straight, tmp_path, capfd):
    # The same command for every attempt of a restarted job: the first starts, the next ones resume.
    config = dataclasses.replace(SMALL, checkpoint_dir=str(tmp_path), checkpoint_every=K, resume="auto")
    first = launch(train, dataclasses.replace(config, stop_at=K), world_size=2)[0]
    assert first["first_step"] == 1 and first["losses"] == straight[:K]
    assert f"no complete checkpoint in {tmp_path}: starting at step 1 (--resume auto)" in capfd.readouterr().out
    second = launch(train, config, world_size=2)[0]
    assert second["first_step"] == K + 1 and second["losses"] == straight[K:]
    assert f"resumed from {tmp_path / f'step-{K:08d}'} at step {K}" in capfd.readouterr().out


class _KilledWhileSaving(KilledWhileSaving):
    """Rank 1 is killed (SIGKILL) after writing its part of the step-2K checkpoint, before it is complete."""

    step = 2 * K


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


def _tied_after_sharding_and_losses(config):
    model = build_model(config, torch.device("cpu"), torch.float32)
    return model.lm_head.weight is model.tok_emb.weight, train(config)["losses"]


def test_the_tied_embedding_and_head_train_as_one_process_on_uneven_shards():
    # 3 ranks split the 256 rows of the tied embedding and head 86/85/85, and every 32-wide matrix
    # 11/11/10: the shared weight is in the root unit, and each rank's slice of it is updated
    from fsdp_guide.gpt import GPT

    config = dataclasses.replace(SMALL, batch_size=6, steps=3, log_every=1)
    assert GPT(config.model_config()).tok_emb.weight.shape[0] % 3 and config.n_embd % 3  # uneven on 3 ranks
    (tied, three), *_ = launch(_tied_after_sharding_and_losses, config, world_size=3, output="none")
    one = launch(train, config, world_size=1, output="none")[0]["losses"]
    assert tied  # one tensor after fully_shard, as in the plain model
    assert three == pytest.approx(one, rel=1e-5)  # the same global batches, reduced in another order


def _as_if_saved_without_settings(config):
    """train, on a checkpoint as saved before the recipe saved its settings (RunSettings): none to compare."""
    from fsdp_guide.recipes import train_llm

    train_llm._saved_settings = lambda path: None
    return train_llm.train(config)


def _resume_error(config, worker=train) -> str:
    with pytest.raises(LaunchError) as error:
        launch(worker, config, world_size=2, output="none")
    assert "CheckpointError" in str(error.value)
    return str(error.value)


def test_resuming_from_a_missing_corrupt_or_other_shape_checkpoint_is_a_clear_error(saved_at_k, tmp_path):
    missing = tmp_path / "nowhere"
    assert f"{missing}: no such checkpoint directory" in _resume_error(dataclasses.replace(SMALL, resume=str(missing)))
    assert "no complete checkpoint (step-N) to resume from" in _resume_error(
        dataclasses.replace(SMALL, checkpoint_dir=str(tmp_path), resume="latest")
    )

    wider = dataclasses.replace(SMALL, n_embd=48, resume=str(latest(saved_at_k)))
    # the recipe's check, first
    with pytest.raises(
        LaunchError,
        match=rf"ValueError: n_embd=48 \(the checkpoint's: 32\): {latest(saved_at_k)} "
        "continues a run with other settings",
    ):
        launch(train, wider, world_size=2, output="none")
    # what the checkpoint itself refuses, where the recipe's check has no saved settings to compare
    message = _resume_error(wider, _as_if_saved_without_settings)
    assert "has shape (256, 32) in the checkpoint and (256, 48) in this model" in message
    assert str(latest(saved_at_k)) in message
    fp16 = dataclasses.replace(SMALL, precision="fp16", resume=str(latest(saved_at_k)))  # fp16 needs a scaler
    assert "the checkpoint holds no 'scaler' state, which this run needs" in _resume_error(
        fp16, _as_if_saved_without_settings
    )

    corrupt = tmp_path / "corrupt"
    subprocess.run(["cp", "-r", str(latest(saved_at_k)), str(corrupt)], check=True)
    for data_file in corrupt.glob("*.distcp"):
        data_file.write_bytes(data_file.read_bytes()[:100])  # truncated, as by a full disk
    message = _resume_error(dataclasses.replace(SMALL, resume=str(corrupt)))
    assert f"{corrupt}: its files could not be read" in message and "missing or damaged" in message
    (corrupt / ".metadata").unlink()
    assert "not a complete checkpoint (it has no .metadata file)" in _resume_error(
        dataclasses.replace(SMALL, resume=str(corrupt))
    )


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


def test_an_export_path_that_cannot_be_written_fails_at_the_start_not_after_the_run(tmp_path):
    config = dataclasses.replace(SMALL, steps=10_000, export=str(tmp_path / "missing" / "model.pt"))
    with pytest.raises(LaunchError, match=r"missing/model\.pt: expected the path of a file to write") as raised:
        launch(train, config, world_size=2, output="none", timeout=60)  # 10,000 steps would take far longer
    assert "step " not in "\n".join(raised.value.output)  # no step ran


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


SMALL_FLAGS = [
    "--steps",
    str(K),
    "--n-layer",
    "2",
    "--n-head",
    "2",
    "--n-embd",
    "32",
    "--block-size",
    "32",
    "--batch-size",
    "4",
    "--warmup",
    "2",
    "--no-progress",
]


def _torchrun_env() -> dict:
    # The threads launch gives each of 2 ranks, for the same arithmetic on both sides (this
    # process's environment stays as it is: changing it would start another warm server).
    return {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": str(_threads_per_rank(2))}


@linux_only
def test_torchrun_on_one_machine_runs_the_same_training(tmp_path):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "fsdp_guide.recipes.train_llm",
        *SMALL_FLAGS,
        "--out",
        str(tmp_path / "summary.json"),
    ]
    done = subprocess.run(loopback_only(command), capture_output=True, text=True, timeout=240, env=_torchrun_env())
    assert done.returncode == 0, done.stdout + done.stderr
    assert (
        "step    4 | loss" in done.stdout
        and "peak memory per rank, peak RSS of the whole process (ru_maxrss): rank0" in done.stdout
    )
    assert "MFU not computed: on cpu, which has no dense bf16 peak" in done.stdout  # on a GPU it prints the MFU
    assert json.loads((tmp_path / "summary.json").read_text())["losses"] == run(steps=K)["losses"]


def _saved_state(directory, tmp_path) -> dict:
    """Everything a checkpoint holds (model, optimizer, scheduler, data position, each rank's RNG), read in
    this process with DCP's own converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = tmp_path / f"{directory.parent.name}-{directory.name}.pt"
    dcp_to_torch_save(directory, whole)
    return torch.load(whole, weights_only=False)  # our own file, just written: it holds the data position's bytes


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@linux_only
@pytest.mark.parametrize(
    "how, at", [("--kill-after-step", K + 2), ("--kill-while-saving", 2 * K)], ids=["during-training", "during-a-save"]
)
def test_torchrun_restarts_the_workers_after_a_rank_is_killed_and_they_end_as_the_uninterrupted_run(
    how, at, straight_run, tmp_path
):
    losses, straight_dir = straight_run
    checkpoints = tmp_path / "checkpoints"
    flags = [
        "--steps",
        str(2 * K),
        *SMALL_FLAGS[2:],
        "--checkpoint-dir",
        str(checkpoints),
        "--checkpoint-every",
        str(K),
        "--resume",
        "auto",
        "--out",
        str(tmp_path / "summary.json"),
    ]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "-m",
        "fsdp_guide.recipes.killed_rank",
        how,
        str(at),
        *flags,
    ]
    # A store of its own for each attempt: with the shared one, a restarted rank read the killed
    # rank's address and failed in init_process_group in 2 runs of 3 on torch 2.13, 1 of 3 on 2.9.1
    # (fsdp_guide.launcher._restart_hazard)
    env = {**_torchrun_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    done = subprocess.run(loopback_only(command), capture_output=True, text=True, timeout=300, env=env)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in log  # no warning: the hazard is avoided
    # the first attempt started fresh and lost rank 1 to SIGKILL; torchrun restarted both workers, which resumed
    assert f"no complete checkpoint in {checkpoints}: starting at step 1 (--resume auto)" in log
    assert "failed (exitcode: -9) local_rank: 1" in log  # SIGKILL, as torchrun's agent reports it
    assert f"resumed from {checkpoints / f'step-{K:08d}'} at step {K}" in log
    killed, again = (
        float(log.split(f"[killed_rank] {what} at ")[1].split()[0]) for what in ("rank 1 killed", "training again")
    )
    assert killed < again  # the restart's time, as the page measures it
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["first_step"] == K + 1 and summary["losses"] == losses[K:]  # bit for bit
    assert sorted(p.name for p in checkpoints.iterdir()) == [f"step-{K:08d}", f"step-{2 * K:08d}"]  # nothing partial
    last = f"step-{2 * K:08d}"
    assert _same(_saved_state(checkpoints / last, tmp_path), _saved_state(straight_dir / last, tmp_path))


def test_a_torchrun_that_restarts_on_its_shared_store_is_warned_about():
    from fsdp_guide.launcher import _restart_hazard

    restarting = {"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in _restart_hazard(restarting)
    assert "--max-restarts=3" in _restart_hazard(restarting)
    assert _restart_hazard({**restarting, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None  # nothing to restart
    assert _restart_hazard({**restarting, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None  # a store per attempt
    assert _restart_hazard({}) is None  # not under torchrun


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
def test_two_torchrun_nodes_train_together_and_match_one_node(tmp_path):
    node = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:29500",
        "--rdzv-id=two-nodes",
        "-m",
        "fsdp_guide.recipes.train_llm",
        *SMALL_FLAGS,
        "--out",
        str(tmp_path / "summary.json"),
    ]
    script = (
        f"{shlex.join(node)} > {tmp_path}/node0.log 2>&1 & a=$!; "
        f"{shlex.join(node)} > {tmp_path}/node1.log 2>&1 & b=$!; "
        "wait $a; ra=$?; wait $b; rb=$?; exit $((ra || rb))"
    )
    nodes = subprocess.run(loopback_only(["sh", "-c", script]), timeout=240, env=_torchrun_env())
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
            train_llm.train_step(
                model, optimizer, scheduler, None, train_llm.make_batches(config), config, torch.device("cpu")
            )
        counts = {}
        for (_phase, kind), n in seen.count.items():
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


PROG = "python -m fsdp_guide.recipes.train_llm"
# Each: the arguments, and how the one-line error must begin (the option, as given).
# "{tmp}" is an empty directory of the test's own; "{file}" a file in it.
BAD_COMMANDS = [
    ("--nproc 0", "--nproc 0: expected"),
    ("--nproc -2", "--nproc -2: expected"),
    ("--batch-size 3", "--batch-size 3: does not split"),  # over the default 2 ranks
    ("--nproc 4 --batch-size 6", "--batch-size 6: does not split"),
    ("--batch-size 0", "--batch-size 0: expected"),
    ("--n-head 3", "--n-head 3: expected a divisor of --n-embd 64"),
    ("--n-head 0", "--n-head 0: expected"),
    ("--n-embd 0", "--n-embd 0: expected"),
    ("--n-layer 0", "--n-layer 0: expected"),
    ("--block-size 0", "--block-size 0: expected"),
    ("--block-size 10000000", "--block-size 10000000: expected"),  # longer than the whole corpus
    ("--steps 0", "--steps 0: expected"),
    ("--stop-at 50", "--stop-at 50: expected"),  # past --steps 40
    ("--stop-at -1", "--stop-at -1: expected"),
    ("--lr 0", "--lr 0.0: expected"),
    ("--lr -0.1", "--lr -0.1: expected"),
    ("--lr nan", "--lr nan: expected"),
    ("--lr inf", "--lr inf: expected"),
    ("--warmup -1", "--warmup -1: expected"),
    ("--grad-accum 0", "--grad-accum 0: expected"),
    ("--weight-decay -0.1", "--weight-decay -0.1: expected"),
    ("--weight-decay nan", "--weight-decay nan: expected"),
    ("--clip 0", "--clip 0.0: expected"),
    ("--clip -1", "--clip -1.0: expected"),
    ("--clip nan", "--clip nan: expected"),
    ("--seed -1", "--seed -1: expected"),
    ("--simulated-size-in-batches 0 --data repeating", "--simulated-size-in-batches 0: expected"),
    ("--log-every 0", "--log-every 0: expected"),
    ("--keep 0", "--keep 0: expected"),
    ("--timeout 0", "--timeout 0.0: expected"),
    ("--timeout inf", "--timeout inf: expected"),
    ("--checkpoint-every -1 --checkpoint-dir {tmp}", "--checkpoint-every -1: expected"),
    ("--checkpoint-every 10", "--checkpoint-every 10: saves need --checkpoint-dir"),
    ("--checkpoint-dir {file} --checkpoint-every 2", "--checkpoint-dir {file}: "),
    ("--async-checkpoint", "--async-checkpoint needs --checkpoint-every"),
    ("--async-checkpoint --checkpoint-dir {tmp}", "--async-checkpoint needs --checkpoint-every"),
    ("--resume latest", "--resume latest needs --checkpoint-dir"),
    ("--resume auto", "--resume auto needs --checkpoint-dir"),
    ("--resume latest --checkpoint-dir {tmp}", "--resume latest: no complete checkpoint"),  # empty
    ("--resume latest --checkpoint-dir {tmp}/nowhere", "--resume latest: no complete checkpoint"),  # missing
    ("--resume {tmp}/nowhere", "--resume {tmp}/nowhere: no such checkpoint directory"),
    ("--resume {tmp}", "--resume {tmp}: not a complete checkpoint"),  # a directory without .metadata
    ("--export {tmp}/nowhere/model.pt", "--export {tmp}/nowhere/model.pt: "),
    ("--export {tmp}", "--export {tmp}: "),  # a directory, not a file
    ("--out {tmp}/nowhere/summary.json", "--out {tmp}/nowhere/summary.json: "),
    ("--out {tmp}", "--out {tmp}: "),
]


@pytest.fixture
def launches_nothing(monkeypatch):
    """main()'s launch, replaced by one that records its calls: a refused command must never reach it."""
    from fsdp_guide.recipes import train_llm

    calls = []
    monkeypatch.setattr(train_llm, "launch", lambda *args, **kwargs: calls.append(kwargs) or [{"losses": []}])
    for name in ("RANK", "WORLD_SIZE"):  # not under torchrun, unless a test says so
        monkeypatch.delenv(name, raising=False)
    return calls


def _refused(argv: str, tmp_path, capsys) -> tuple[str, dict]:
    """Run main() on these arguments: the message of its one-line usage error, and what filled the arguments in."""
    from fsdp_guide.recipes.train_llm import main

    (tmp_path / "a-file").write_text("")
    fill = dict(tmp=tmp_path / "dir", file=tmp_path / "a-file")
    (tmp_path / "dir").mkdir()
    with pytest.raises(SystemExit) as exit:
        main(shlex.split(argv.format(**fill)))
    out, err = capsys.readouterr()
    assert exit.value.code == 2 and out == ""
    last = err.splitlines()[-1]
    assert last.startswith(f"{PROG}: error: ") and err.count(": error: ") == 1, err
    return last.removeprefix(f"{PROG}: error: "), fill


@pytest.mark.parametrize("argv, begins", BAD_COMMANDS, ids=[argv for argv, _ in BAD_COMMANDS])
def test_bad_commands_are_usage_errors_naming_the_option_before_any_rank_starts(
    argv, begins, tmp_path, capsys, launches_nothing
):
    message, fill = _refused(argv, tmp_path, capsys)
    assert message.startswith(begins.format(**fill)), message
    assert launches_nothing == []  # no rank started
    assert list((tmp_path / "dir").iterdir()) == []  # nothing written: no checkpoint, export or summary


@pytest.mark.parametrize(
    "argv, begins",
    [("--batch-size 6", "--batch-size 6: does not split over the 4 ranks"), ("--nproc 2", "--nproc 2: under torchrun")],
)
def test_under_torchrun_its_world_size_is_the_number_of_ranks(
    argv, begins, tmp_path, capsys, monkeypatch, launches_nothing
):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    message, _ = _refused(argv, tmp_path, capsys)
    assert message.startswith(begins), message
    assert launches_nothing == []


def test_good_commands_reach_launch(tmp_path, launches_nothing, monkeypatch):
    from fsdp_guide.recipes.train_llm import main

    main(
        [
            "--nproc",
            "4",
            "--batch-size",
            "8",
            "--checkpoint-dir",
            str(tmp_path / "new"),
            "--checkpoint-every",
            "2",
            "--async-checkpoint",
            "--export",
            str(tmp_path / "model.pt"),
            "--out",
            str(tmp_path / "summary.json"),
            "--clip",
            "inf",
            "--warmup",
            "0",
            "--lr",
            "1e-3",
        ]
    )
    assert [call["world_size"] for call in launches_nothing] == [4]
    assert json.loads((tmp_path / "summary.json").read_text()) == {"losses": []}
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    main(["--batch-size", "4", "--out", str(tmp_path / "nowhere" / "summary.json")])  # only rank 0 writes --out
    assert [call["world_size"] for call in launches_nothing] == [4, None]


def test_a_bad_command_exits_with_status_2_and_one_line_before_starting_ranks(tmp_path):
    command = [sys.executable, "-m", "fsdp_guide.recipes.train_llm", "--nproc", "0", "--out", str(tmp_path / "s.json")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stdout == "" and "[rank" not in done.stderr and not (tmp_path / "s.json").exists()
    assert done.stderr.splitlines()[-1].startswith(f"{PROG}: error: --nproc 0: expected"), done.stderr
    assert "Traceback" not in done.stderr


def test_a_config_names_its_field_as_the_command_names_its_flag():
    with pytest.raises(ValueError, match=r"^n_head=3: expected a divisor of n_embd=64"):
        TrainConfig(n_head=3)
    with pytest.raises(ValueError, match=r"^checkpoint_every=-1: expected"):
        TrainConfig(checkpoint_every=-1, checkpoint_dir="ckpt")
    with pytest.raises(ValueError, match=r"^lr=nan: expected"):
        TrainConfig(lr=float("nan"))
    with pytest.raises(ValueError, match=r"^async_checkpoint needs checkpoint_every"):
        TrainConfig(async_checkpoint=True, checkpoint_dir="ckpt")
    with pytest.raises(ValueError, match=r"^steps=40.0: expected a positive int"):
        TrainConfig(steps=40.0)


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        ([], "one of the arguments --kill-after-step --kill-while-saving is required"),
        (["--kill-after-step"], "argument --kill-after-step: expected one argument"),
        (["--kill-while-saving", "0"], "argument --kill-while-saving: expected a step number (1 or more), got '0'"),
        (["--kill-after-step", "3", "--kill-while-saving", "4"], "not allowed with argument --kill-after-step"),
        (
            ["--kill-after-step", "3", "--steps", "4"],
            "TORCHELASTIC_RESTART_COUNT and RANK not set: run it under torchrun",
        ),
    ],
)
def test_the_fault_injector_answers_a_bad_command_with_status_2_and_one_line(argv, error):
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RESTART_COUNT", "RANK")}
    done = subprocess.run(
        [sys.executable, "-m", "fsdp_guide.recipes.killed_rank", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 2 and done.stdout == "", done.stderr
    last = done.stderr.splitlines()[-1]
    assert last.startswith("python -m fsdp_guide.recipes.killed_rank: error: ") and error in last, done.stderr
    assert "Traceback" not in done.stderr
