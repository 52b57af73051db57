"""`nox -s gpu` and the record it writes, tested as far as a machine without a GPU allows.

The check refuses to run here; its plan for fewer GPUs than ranks is the device rule's
(mocked CUDA); a page executes and is recorded with where its ranks ran; a recorded run
turns the page's "On GPUs" line from "not verified" to what the record says.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gpu_run
import pytest
import torch
from conftest import ROOT

from fsdp_guide import devices
from fsdp_guide.executed import executed_on


def test_the_gpu_check_refuses_to_run_without_a_gpu():
    done = subprocess.run([sys.executable, "tests/gpu_run.py"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == gpu_run.NO_GPU
    assert "nox -s gpu needs a GPU: torch.cuda.is_available() is False" in done.stderr
    assert "recorded" not in done.stdout


def test_nox_s_gpu_refuses_cleanly_without_a_gpu():
    # --no-venv runs the `python` on PATH: this environment's, as under `nox -s tests`, also where
    # pytest was started from the environment without activating it
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        [sys.executable, "-m", "nox", "-s", "gpu", "--no-venv"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "nox -s gpu needs a GPU" in output and "Traceback" not in output


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_the_plan_for_n_gpus_is_what_the_device_rule_does_in_each_rank(monkeypatch, gpus, world_size):
    planned = gpu_run.plan(gpus, world_size)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv(devices.DEVICE_ENV, "cuda")  # what gpu_run sets
    monkeypatch.setenv(devices.SAME_GPUS_ENV, "1")  # what launch sets
    for rank in range(world_size):
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world_size))
        where = devices.placement()
        assert str(where.device) == planned["devices"][rank]
        assert where.shared == planned["shared"] == (gpus < world_size)
        assert devices.backend() == planned["backend"]


def test_a_page_is_executed_and_recorded_with_where_its_ranks_ran(tmp_path):
    page = tmp_path / "tiny.py"
    page.write_text(
        "# %%\nimport torch.distributed as dist\nfrom fsdp_guide import launch\n"
        "print(launch(dist.get_rank, world_size=2))\n"
    )
    result = gpu_run.execute_page(page, timeout=120)
    assert result["status"] == "pass"
    assert result["where"] == "2 ranks on cpu, cpu (CPU, gloo)"
    broken = tmp_path / "broken.py"
    broken.write_text("# %%\nraise ValueError('this page is broken')\n")
    result = gpu_run.execute_page(broken, timeout=120)
    assert result["status"] == "fail" and "this page is broken" in result["error"]


def test_a_recorded_gpu_run_turns_the_page_s_line_green(tmp_path):
    record = tmp_path / "gpu_record.json"
    assert "**On GPUs**: not verified" in str(executed_on("quickstart", record=record))
    run = {
        "date": "2026-12-01",
        "gpu": "NVIDIA H200",
        "gpu_count": 1,
        "torch": "2.11.0+cu130",
        "cuda": "13.0",
        "pages": {
            "quickstart": {"status": "pass", "where": "2 ranks on cuda:0, cuda:0 (sharing GPUs, gloo)"},
            "digits": {"status": "fail", "error": "RuntimeError: boom"},
        },
    }
    record.write_text(json.dumps({"runs": [run]}))
    assert (
        "**On GPUs**: passed on 1 × NVIDIA H200 (torch 2.11.0+cu130, CUDA 13.0), 2026-12-01: "
        "2 ranks on cuda:0, cuda:0 (sharing GPUs, gloo)."
    ) in str(executed_on("quickstart", record=record))
    assert "FAILED (RuntimeError: boom)" in str(executed_on("digits", record=record))
    assert "not verified" in str(executed_on("llm", record=record))


def test_the_shipped_record_holds_only_real_runs():
    record = json.loads((ROOT / "src" / "fsdp_guide" / "gpu_record.json").read_text())
    for run in record["runs"]:  # each written by gpu_run.main on a GPU machine
        assert {"date", "gpu", "gpu_count", "torch", "cuda", "pages", "llm_bf16"} <= set(run)
        assert "+cu" in run["torch"] or run["cuda"] not in ("None", "")


def test_no_text_claims_a_gpu_run_the_record_does_not_hold():
    runs = json.loads((ROOT / "src" / "fsdp_guide" / "gpu_record.json").read_text())["runs"]
    readme = (ROOT / "README.md").read_text()
    assert ("No GPU run has been recorded yet" in readme) == (not runs)
    if not runs:  # then nothing may say the code ran on a GPU
        pages = [
            p.read_text()
            for p in [ROOT / "index.rst", *(ROOT / "docs").glob("*.rst"), *(ROOT / "tutorials").glob("*.py")]
        ]
        claims = ("runs on GPUs", "runs on NCCL", "unchanged, on GPUs", "NCCL on GPUs with the same code")
        assert not [c for text in pages for c in claims if c in text]
