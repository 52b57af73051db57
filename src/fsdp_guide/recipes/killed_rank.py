"""The LLM recipe as torchrun's script, with rank 1 killed (SIGKILL) in torchrun's first attempt only.

    torchrun --max-restarts=1 ... -m fsdp_guide.recipes.killed_rank --kill-after-step N <the recipe's flags>
    torchrun --max-restarts=1 ... -m fsdp_guide.recipes.killed_rank --kill-while-saving N <the recipe's flags>

``--kill-after-step N``: rank 1 dies once its step N is computed, in the middle of the run.
``--kill-while-saving N``: rank 1 dies once it has written its part of checkpoint N, before
the checkpoint is complete. torchrun then stops the other workers and starts them all again
(``TORCHELASTIC_RESTART_COUNT`` 1): that attempt is the recipe unchanged, as a restarted job
would run it. A real failure does not choose its moment; these two are the moments that
matter to a checkpoint: after the last one, and during one.

For the cost of the failure, rank 1 prints the time it dies (``killed at``) and rank 0
of the restarted attempt the time its first step starts (``training again at``), after
the checkpoint is loaded: the difference is the restart, torchrun's and the script's.
A fault injector for the "when a rank dies" page and the tests, not for training.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from fsdp_guide.recipes import train_llm


def die() -> None:
    print(f"[killed_rank] rank {dist.get_rank()} killed at {time.time():.3f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # as a crash or the kernel's OOM killer: no exception, no cleanup


def kill_after_step(n: int) -> None:
    """Rank 1 dies after its n-th training step (the first attempt starts at step 1)."""
    step, calls = train_llm.train_step, []

    def counted(*args, **kwargs):
        loss = step(*args, **kwargs)
        calls.append(loss)
        if len(calls) == n:
            die()
        return loss

    train_llm.train_step = counted


class KilledWhileSaving(FileSystemWriter):
    """DCP's writer, except that rank 1 dies once its part of checkpoint ``step`` is on disk, before
    every rank has written (``tests/test_llm.py`` passes a subclass as the recipe's ``storage_writer``)."""

    step = 0

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        written.wait()
        if dist.get_rank() == 1 and f"step-{self.step:08d}" in str(self.path):
            die()
        return written


def kill_while_saving(n: int) -> None:
    """Rank 1 dies once its part of checkpoint n is on disk: the writer fsdp_guide.checkpoint makes is this one."""
    KilledWhileSaving.step = n
    dcp.FileSystemWriter = KilledWhileSaving


def note_first_step() -> None:
    """Rank 0 of a restarted attempt prints when its first step starts, the checkpoint loaded."""
    step = train_llm.train_step

    def noted(*args, **kwargs):
        train_llm.train_step = step  # the first step only
        print(f"[killed_rank] training again at {time.time():.3f}", flush=True)
        return step(*args, **kwargs)

    train_llm.train_step = noted


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a step number (1 or more), got {text!r}")
    return int(text)


def _parse(argv: list[str]) -> tuple[str, int, list[str]]:
    """(how, step, the recipe's flags), or a usage error (exit status 2) as the recipe's own."""
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_guide.recipes.killed_rank",
        allow_abbrev=False,
        description="The LLM recipe under torchrun --max-restarts=1, with rank 1 killed "
        "in the first attempt; the other flags are the recipe's.",
    )
    how = parser.add_mutually_exclusive_group(required=True)
    how.add_argument("--kill-after-step", type=_positive, metavar="N", help="rank 1 dies once its step N is computed")
    how.add_argument(
        "--kill-while-saving",
        type=_positive,
        metavar="N",
        help="rank 1 dies once it has written its part of checkpoint N",
    )
    args, recipe = parser.parse_known_args(argv)
    missing = [name for name in ("TORCHELASTIC_RESTART_COUNT", "RANK") if name not in os.environ]
    if missing:
        parser.error(
            f"{' and '.join(missing)} not set: run it under torchrun, e.g. torchrun --nproc-per-node=2 "
            "--max-restarts=1 -m fsdp_guide.recipes.killed_rank --kill-after-step 3 <the recipe's flags>"
        )
    if args.kill_after_step is not None:
        return "--kill-after-step", args.kill_after_step, recipe
    return "--kill-while-saving", args.kill_while_saving, recipe


def main(argv: list[str] | None = None) -> None:
    how, n, argv = _parse(sys.argv[1:] if argv is None else argv)
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
        {"--kill-after-step": kill_after_step, "--kill-while-saving": kill_while_saving}[how](n)
    elif os.environ["TORCHELASTIC_RESTART_COUNT"] != "0" and os.environ["RANK"] == "0":
        note_first_step()
    train_llm.main(argv)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # as the recipe's own __main__: skip the interpreter's teardown of torch's threads
