"""fsdp_guide.device(): the rank's device from one rule, in the environments users run in.

CUDA is mocked (availability and device count) and so is the environment torchrun or a
scheduler gives each process; the rule itself runs unmocked.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fsdp_guide
from fsdp_guide import _rank, devices, launch
from fsdp_guide.launcher import launches

_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "CUDA_VISIBLE_DEVICES",
    "TORCHELASTIC_RUN_ID",
    devices.DEVICE_ENV,
    devices.SAME_GPUS_ENV,
)


@pytest.fixture
def env(monkeypatch):
    """A clean process environment; ``env(gpus=N, **variables)`` sets up one."""
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)

    def make(gpus: int, **variables):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        for name, value in variables.items():
            monkeypatch.setenv(name, str(value))

    return make


def torchrun(rank: int, nodes: int, per_node: int) -> dict:
    """What torchrun --nnodes=nodes --nproc-per-node=per_node sets for global rank ``rank``."""
    return dict(
        RANK=rank,
        WORLD_SIZE=nodes * per_node,
        LOCAL_RANK=rank % per_node,
        LOCAL_WORLD_SIZE=per_node,
        TORCHELASTIC_RUN_ID="job",
    )


@pytest.mark.parametrize("rank", range(8))
def test_one_node_of_8_gpus_gives_each_rank_its_own_gpu_and_nccl(env, rank):
    env(gpus=8, **torchrun(rank, nodes=1, per_node=8))
    assert fsdp_guide.device() == torch.device("cuda", rank)
    assert devices.backend() == "cpu:gloo,cuda:nccl"


@pytest.mark.parametrize("rank", [0, 7, 8, 13, 15])
def test_two_nodes_of_8_gpus_judge_by_the_node_not_the_world_size(env, rank):
    env(gpus=8, **torchrun(rank, nodes=2, per_node=8))  # WORLD_SIZE=16 > 8 GPUs on each node
    assert fsdp_guide.device() == torch.device("cuda", rank % 8)
    assert devices.backend() == "cpu:gloo,cuda:nccl"


@pytest.mark.parametrize("local", [{"LOCAL_RANK": 3, "LOCAL_WORLD_SIZE": 8}, {}])
def test_a_scheduler_showing_each_task_one_gpu_puts_it_on_that_gpu(env, local):
    # srun --ntasks-per-node=8 --gpus-per-task=1: CUDA_VISIBLE_DEVICES=3 in the task with local id 3
    env(gpus=1, RANK=11, WORLD_SIZE=16, CUDA_VISIBLE_DEVICES="3", **local)
    assert fsdp_guide.device() == torch.device("cuda", 0)
    assert devices.backend() == "cpu:gloo,cuda:nccl"


@pytest.mark.parametrize("variables", [torchrun(1, 1, 2), torchrun(13, 2, 8), {}, {"CUDA_VISIBLE_DEVICES": ""}])
def test_no_gpu_means_the_cpu_and_gloo(env, variables):
    env(gpus=0, **variables)
    assert fsdp_guide.device() == torch.device("cpu")
    assert devices.backend() == "gloo"


@pytest.mark.parametrize("started_by", [{"TORCHELASTIC_RUN_ID": "job"}, {devices.SAME_GPUS_ENV: "1"}])
def test_ranks_started_together_never_pile_onto_one_visible_gpu(env, started_by):
    # torchrun --nproc-per-node=2 (or launch) with CUDA_VISIBLE_DEVICES=0: NCCL refuses two ranks on one GPU
    env(gpus=1, RANK=1, WORLD_SIZE=2, LOCAL_RANK=1, LOCAL_WORLD_SIZE=2, CUDA_VISIBLE_DEVICES="0", **started_by)
    assert devices.placement().device == torch.device("cpu")
    assert devices.backend() == "gloo"


def test_fsdp_guide_device_cuda_shares_fewer_gpus_over_gloo(env):
    env(gpus=1, **{devices.DEVICE_ENV: "cuda"}, **torchrun(1, 1, 4))
    where = devices.placement()
    assert (where.device, where.shared) == (torch.device("cuda", 0), True)
    assert devices.backend() == "gloo"  # NCCL refuses two ranks on one GPU; gloo stages CUDA tensors through the host
    env(gpus=2, **torchrun(3, 1, 4))
    assert devices.placement().device == torch.device("cuda", 1)  # rank 3 of 4 on 2 GPUs: 3 % 2


def test_fsdp_guide_device_cpu_keeps_a_gpu_machine_on_the_cpu(env):
    env(gpus=8, **{devices.DEVICE_ENV: "CPU"}, **torchrun(5, 1, 8))
    assert fsdp_guide.device() == torch.device("cpu")
    assert devices.backend() == "gloo"


def test_bad_settings_are_errors_that_say_what_is_expected(env):
    env(gpus=0, **{devices.DEVICE_ENV: "cuda"})
    with pytest.raises(ValueError, match="FSDP_GUIDE_DEVICE=cuda but no GPU is visible"):
        fsdp_guide.device()
    env(gpus=0, **{devices.DEVICE_ENV: "gpu"})
    with pytest.raises(ValueError, match="expected 'cpu', 'cuda' or unset"):
        fsdp_guide.device()
    env(gpus=8, **{devices.DEVICE_ENV: ""}, LOCAL_RANK=8, LOCAL_WORLD_SIZE=8)
    with pytest.raises(ValueError, match="LOCAL_RANK=8 must be >= 0 and < LOCAL_WORLD_SIZE=8"):
        fsdp_guide.device()


def test_init_process_group_makes_the_rule_s_gpu_current_and_picks_nccl(env, monkeypatch):
    env(gpus=8, **torchrun(13, nodes=2, per_node=8), MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    calls = {}
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.setdefault("backend", backend))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("set_device", d))
    assert _rank.init_process_group("auto") == "cpu:gloo,cuda:nccl"
    assert calls == {"backend": "cpu:gloo,cuda:nccl", "set_device": torch.device("cuda", 5)}


def test_a_gloo_only_group_keeps_the_rank_on_the_cpu_and_launch_records_where_ranks_ran():
    def where():
        return str(fsdp_guide.device()), dist.get_backend()

    before = len(launches())
    assert launch(where, world_size=2, backend="gloo") == [("cpu", "gloo"), ("cpu", "gloo")]
    record = launches()[before]
    assert record["fn"].endswith("where") and record["world_size"] == 2
    assert [r["device"] for r in record["ranks"]] == ["cpu", "cpu"]
    assert {r["backend"] for r in record["ranks"]} == {"gloo"}
    assert record["ranks"][0]["torch"] == torch.__version__


def test_launch_refuses_nccl_without_a_gpu_per_rank():
    with pytest.raises(RuntimeError, match="needs one GPU per rank"):
        launch(int, world_size=2, backend="cpu:gloo,cuda:nccl")


def test_the_low_precision_dtype_is_asked_of_the_rank_s_own_device(env, monkeypatch):
    from fsdp_guide.precision import low_precision_dtype

    asked = []
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: asked.append(1) or False)
    monkeypatch.setattr(torch.cuda, "device", lambda d: __import__("contextlib").nullcontext())
    env(gpus=8, **torchrun(5, nodes=1, per_node=8))
    assert low_precision_dtype() == torch.float16 and asked  # a pre-Ampere GPU of its own
    env(gpus=8, **{devices.DEVICE_ENV: "cpu"})
    assert low_precision_dtype() == torch.bfloat16  # kept on the CPU of a GPU machine
