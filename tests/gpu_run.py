"""``nox -s gpu``: execute every page with the ranks on GPUs, run the LLM recipe in bf16, record the result.

Run on a machine with one or more GPUs (``python tests/gpu_run.py``, or ``nox -s gpu``).
It refuses to run without one. What it does where there are fewer GPUs than a page's
ranks (one GPU is the common case) is :func:`plan`: the ranks share the GPUs, each
computing on ``cuda:LOCAL_RANK % GPUs``, over gloo, which stages CUDA tensors through
host memory for its collectives (NCCL refuses two ranks on one GPU). Launches with
at least one GPU per rank run on NCCL. Every page's GPU code path (its tensors on
``cuda``) is then exercised whatever the GPU count; which launches ran how is written
to the record, per page.

The record is ``src/fsdp_guide/gpu_record.json``; :func:`fsdp_guide.executed_on`
shows it on each page. Commit it after a run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "src" / "fsdp_guide" / "gpu_record.json"
PAGES = sorted((ROOT / "tutorials").glob("*.py")) + sorted((ROOT / "docs").glob("*.py"))
NO_GPU = 2  # exit status when there is no GPU


def plan(gpus: int, world_size: int) -> dict:
    """How a launch of ``world_size`` ranks runs on ``gpus`` GPUs in this check (``FSDP_GUIDE_DEVICE=cuda``).

    >>> plan(8, 2)["backend"], plan(1, 2)["backend"], plan(1, 2)["devices"]
    ('cpu:gloo,cuda:nccl', 'gloo', ['cuda:0', 'cuda:0'])
    """
    if gpus < 1:
        raise ValueError("the GPU check needs at least one GPU")
    shared = gpus < world_size
    return {
        "backend": "gloo" if shared else "cpu:gloo,cuda:nccl",
        "devices": [f"cuda:{rank % gpus}" for rank in range(world_size)],
        "shared": shared,
    }


def describe(ranks: list[dict]) -> str:
    """One launch, in words, from what its ranks reported (``fsdp_guide.launcher.launches``)."""
    devices = ", ".join(r["device"] for r in ranks)
    how = "sharing GPUs" if any(r["shared"] for r in ranks) else "one GPU each" if "cuda" in devices else "CPU"
    return f"{len(ranks)} ranks on {devices} ({how}, {ranks[0]['backend']})"


def gpu_or_exit() -> tuple[str, int, str, str]:
    """(GPU name, count, torch version, CUDA version), or a clear message and exit status 2."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        print(
            f"nox -s gpu needs a GPU: torch.cuda.is_available() is False (torch {torch.__version__}, "
            f"built with CUDA {torch.version.cuda}). Run it on a machine with one or more NVIDIA GPUs "
            "and a CUDA build of torch; on a CPU, `nox -s tests` executes every page.",
            file=sys.stderr,
        )
        raise SystemExit(NO_GPU)
    return torch.cuda.get_device_name(0), torch.cuda.device_count(), torch.__version__, str(torch.version.cuda)


def execute_page(page: Path, timeout: int) -> dict:
    """Execute one page as a notebook with its ranks on GPUs; its result and its launches."""
    import jupytext
    import nbclient

    with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as log:
        os.environ["FSDP_GUIDE_LAUNCH_LOG"] = log.name
        start = time.perf_counter()
        try:
            notebook = jupytext.read(page)
            nbclient.NotebookClient(
                notebook, timeout=timeout, resources={"metadata": {"path": str(page.parent)}}
            ).execute()
            result = {"status": "pass"}
        except Exception as error:  # noqa: BLE001  (the record says which page failed, and how)
            result = {"status": "fail", "error": (str(error).strip().splitlines() or [type(error).__name__])[-1][:300]}
        finally:
            del os.environ["FSDP_GUIDE_LAUNCH_LOG"]
        launches = [json.loads(line) for line in log.read().splitlines()]
    result["seconds"] = round(time.perf_counter() - start, 1)
    result["where"] = "; ".join(sorted({describe(entry["ranks"]) for entry in launches})) or "no launches"
    return result


def llm_bf16(gpus: int) -> dict:
    """The LLM recipe in bf16 on one rank per GPU (NCCL): tokens/s, MFU and peak memory per rank."""
    from fsdp_guide import launch
    from fsdp_guide.recipes.train_llm import TrainConfig, train

    os.environ.pop("FSDP_GUIDE_DEVICE", None)  # one GPU per rank here: the real NCCL path
    summary = launch(train, TrainConfig(steps=40, precision="bf16"), world_size=gpus, output="rank0")[0]
    os.environ["FSDP_GUIDE_DEVICE"] = "cuda"
    mfu = summary["mfu"]  # None where fsdp_guide.mfu knows no dense bf16 peak for this GPU
    return {
        "ranks": gpus,
        "dtype": summary["dtype"],
        "tokens_per_s": round(summary["tokens_per_s"]),
        "mfu": None if mfu is None else round(mfu, 4),
        "peak_memory_mib": [round(mib, 1) for mib in summary["peak_memory_mib"]],
        "peak_memory_is": summary["peak_memory_is"],
        "loss_first_last": [round(summary["losses"][0], 4), round(summary["losses"][-1], 4)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pages", nargs="*", help="page names (default: every tutorial and docs/cluster.py)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per notebook cell")
    parser.add_argument("--record", type=Path, default=RECORD)
    args = parser.parse_args(argv)
    name, count, torch_version, cuda_version = gpu_or_exit()
    pages = [p for p in PAGES if not args.pages or p.stem in args.pages]
    os.environ["FSDP_GUIDE_DEVICE"] = "cuda"  # ranks share GPUs where there are fewer GPUs than ranks: plan()
    run = {
        "date": datetime.date.today().isoformat(),
        "gpu": name,
        "gpu_count": count,
        "torch": torch_version,
        "cuda": cuda_version,
        "mode": (
            "one GPU per rank (NCCL) where a launch has at most "
            f"{count} ranks; ranks sharing the {count} GPU(s) over gloo beyond that"
        ),
        "pages": {},
    }
    for page in pages:
        run["pages"][page.stem] = result = execute_page(page, args.timeout)
        print(
            f"{page.stem:20} {result['status']:4} {result['seconds']:7.1f} s  {result['where']}"
            + (f"\n    {result['error']}" if "error" in result else ""),
            flush=True,
        )
    run["llm_bf16"] = llm_bf16(count)
    print("LLM recipe, bf16:", json.dumps(run["llm_bf16"]))
    record = json.loads(args.record.read_text()) if args.record.exists() else {"runs": []}
    record["runs"].append(run)
    args.record.write_text(json.dumps(record, indent=2) + "\n")
    print(f"recorded in {args.record}")
    return 0 if all(r["status"] == "pass" for r in run["pages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
