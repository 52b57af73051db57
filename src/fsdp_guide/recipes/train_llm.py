"""Train a small GPT with FSDP2, with checkpoints that resume exactly.

One worker function, ``train(config)``, runs in every way a reader needs::

    fsdp_guide.launch(train, TrainConfig(steps=40), world_size=2)      # a notebook
    python -m fsdp_guide.recipes.train_llm --nproc 2 --steps 40         # one machine, no torchrun
    torchrun --nproc-per-node=2 -m fsdp_guide.recipes.train_llm --steps 40
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 -m fsdp_guide.recipes.train_llm      # a cluster

The steps, in order: build the model on the meta device, apply activation
checkpointing per block, ``fully_shard`` each block then the root, allocate the
shards and initialise them one unit at a time (as one process would, through
``summon_full_params``), then train with AdamW, a warm-up + cosine schedule,
gradient clipping over the global norm, and gradient accumulation that
reduce-scatters once per step. Checkpoints
(``fsdp_guide.checkpoint``) hold everything needed to continue bit for bit,
the position in the data stream included.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_guide import launch
from fsdp_guide.devices import device as rank_device

__all__ = ["TrainConfig", "train", "main", "build_model", "shard_model", "init_sharded"]

DATA = ("python-docs", "repeating")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")


@dataclass(frozen=True)
class TrainConfig:
    # model
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 64
    # data: rows of the global batch per micro-batch, split over the ranks
    data: str = "python-docs"
    batch_size: int = 8
    grad_accum: int = 1
    simulated_size_in_batches: int = 16  # the period of data="repeating"
    seed: int = 0
    # optimisation
    steps: int = 40  # the length of the run, which the learning-rate schedule spans
    stop_at: int = 0  # stop after this step (a job's time limit), to resume later; 0: run all steps
    lr: float = 3e-3
    warmup: int = 5
    weight_decay: float = 0.1
    clip: float = 1.0
    precision: str = "auto"  # bf16 on GPUs that compute in it, fp16 + scaler on older ones, fp32 on CPU
    activation_checkpointing: bool = False
    # checkpoints
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # steps; 0: never
    keep: int = 2  # checkpoints kept in checkpoint_dir, the newest
    async_checkpoint: bool = False  # write checkpoints in the background while training goes on
    resume: str | None = None  # "latest" (in checkpoint_dir) or a checkpoint's path
    export: str | None = None  # write the consolidated model here at the end
    # output
    log_every: int = 10
    progress: bool = True  # a tqdm bar on rank 0

    def __post_init__(self):
        if self.data not in DATA:
            raise ValueError(f"data={self.data!r}: expected one of {', '.join(DATA)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r}: expected one of {', '.join(PRECISIONS)}")
        for name in ("batch_size", "grad_accum", "steps", "log_every", "simulated_size_in_batches", "keep"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected a positive int")
        if not 0 <= self.stop_at <= self.steps:
            raise ValueError(f"stop_at={self.stop_at!r}: expected 0 (run all steps) or a step up to steps={self.steps}")
        if (self.checkpoint_every or self.resume == "latest") and not self.checkpoint_dir:
            raise ValueError("checkpoint_every and resume='latest' need checkpoint_dir")

    def model_config(self):
        from fsdp_guide.gpt import GPTConfig

        return GPTConfig(block_size=self.block_size, n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd)


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The one precision setting: "auto" is fp32 on CPU, else bf16 where the GPU has it, else fp16."""
    from fsdp_guide.precision import low_precision_dtype

    if precision == "auto":
        return torch.float32 if device.type == "cpu" else low_precision_dtype()
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def build_model(config: TrainConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Meta-device model -> activation checkpointing per block -> fully_shard blocks, then root -> init."""
    model = shard_model(config, device, dtype)
    init_sharded(model, config.seed)
    return model


def shard_model(config: TrainConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The GPT built on the meta device and sharded; its shards allocated on ``device``, not initialised."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from fsdp_guide.gpt import GPT

    with torch.device("meta"):
        model = GPT(config.model_config())  # no memory yet, whatever the size
    if config.activation_checkpointing:  # inside each unit: FSDP's hooks stay outside the recomputation
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)  # the root: embeddings, final norm, tied head
    model.to_empty(device=device)  # each rank allocates its shards only
    return model


def init_sharded(model: nn.Module, seed: int) -> None:
    """Initialise a sharded GPT as one process would, one FSDP unit at a time.

    Each unit's parameters are gathered, initialised and written back before the next
    unit's (``summon_full_params(unit, recurse=False)``), so a rank holds at most one unit
    in full besides its shards. Seeded alike on every rank, each rank keeps its slice of
    the same weights (on the shards themselves, every rank would draw the same numbers
    for a different slice). The units go in the order ``init_weights`` draws in, the
    root's embeddings then each block, so the weights are bit for bit those of
    ``init_weights`` on the whole model.
    """
    from torch.distributed.tensor import DTensor

    from fsdp_guide import summon_full_params

    torch.manual_seed(seed)
    for unit in (model, *model.blocks):
        with summon_full_params(unit, recurse=False):
            model.init_weights(p for p in unit.parameters() if not isinstance(p, DTensor))  # the gathered ones


def build_optimizer(model: nn.Module, config: TrainConfig):
    """AdamW, and a linear warm-up to ``lr`` followed by a cosine decay to 10% of it."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay,
                                  betas=(0.9, 0.95))

    def schedule(step: int) -> float:
        if step < config.warmup:
            return (step + 1) / config.warmup
        progress = (step - config.warmup) / max(1, config.steps - config.warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def make_batches(config: TrainConfig):
    from fsdp_guide.tokens import TokenBatches, python_docs_corpus

    corpus = python_docs_corpus() if config.data == "python-docs" else None
    return TokenBatches(corpus, batch_size=config.batch_size, block_size=config.block_size, seed=config.seed,
                        simulated_size_in_batches=config.simulated_size_in_batches,
                        rank=dist.get_rank(), world_size=dist.get_world_size())  # it checks batch_size splits


def train_step(model, optimizer, scheduler, scaler, batches, config: TrainConfig, device) -> float:
    """One optimizer step over ``grad_accum`` micro-batches; returns the loss averaged over ranks."""
    loss_sum = torch.zeros((), device=device)
    for micro in range(config.grad_accum):
        # Gradients of earlier micro-batches stay local and unsharded; the last one
        # reduce-scatters the sum, once.
        model.set_requires_gradient_sync(micro == config.grad_accum - 1)
        inputs, targets = (t.to(device) for t in next(batches))
        _, loss = model(inputs, targets)
        loss = loss / config.grad_accum
        (scaler.scale(loss) if scaler else loss).backward()
        loss_sum += loss.detach()
    if scaler:
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
    torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip)  # the norm of the full gradient (DTensor)
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    dist.all_reduce(loss_sum)  # gloo has no AVG: sum, then divide
    return loss_sum.item() / dist.get_world_size()


def _peak_memory(device: torch.device) -> tuple[str, float]:
    """What this rank can report as its peak memory, and the amount in MiB.

    On a GPU, the most memory torch's allocator held for tensors. On the CPU there is no
    such counter: the peak resident set of the whole rank process (Python, torch's
    libraries, the data and every tensor), which ``ru_maxrss`` gives in KiB on Linux.
    """
    if device.type == "cuda":
        return "peak torch.cuda.max_memory_allocated", torch.cuda.max_memory_allocated(device) / 2**20
    kib = 2**10 if sys.platform != "darwin" else 1  # ru_maxrss is in KiB on Linux, in bytes on macOS
    return "peak RSS of the whole process (ru_maxrss)", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * kib / 2**20


def train(config: TrainConfig, *, storage_writer=None) -> dict:
    """Train on the ranks of the default process group; returns a summary of the run.

    Every rank returns the same losses and memory peaks (each rank's, gathered);
    ``tokens_per_s`` is timed on this rank's clock, as is ``save_stall_s``, the seconds
    training waited in each checkpoint save.

    ``storage_writer`` builds DCP's writer from a path (default ``FileSystemWriter``).
    """
    from tqdm.auto import tqdm

    from fsdp_guide import checkpoint

    rank, device = dist.get_rank(), rank_device()
    dtype = compute_dtype(config.precision, device)
    model = build_model(config, device, dtype)
    optimizer, scheduler = build_optimizer(model, config)
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None  # fp16 gradients underflow
    batches = make_batches(config)
    stateful = dict(scheduler=scheduler, data=batches, **({"scaler": scaler} if scaler else {}))

    start = 0
    if config.resume:
        path = checkpoint.latest(config.checkpoint_dir) if config.resume == "latest" else Path(config.resume)
        if path is None:  # asked to resume: never a silent fresh start
            raise checkpoint.CheckpointError(f"{config.checkpoint_dir}: no complete checkpoint (step-N) to resume from")
        start = checkpoint.load(path, model, optimizer, **stateful)
        if rank == 0:
            print(f"resumed from {path} at step {start}")

    tokens_per_step = config.batch_size * config.block_size * config.grad_accum
    losses, last_log, last_time, saved, stalls = [], start, time.perf_counter(), None, []
    bar = tqdm(total=config.steps, initial=start, disable=rank != 0 or not config.progress, file=sys.stderr)
    last = config.stop_at or config.steps
    run_start = time.perf_counter()
    for step in range(start + 1, last + 1):
        losses.append(train_step(model, optimizer, scheduler, scaler, batches, config, device))
        bar.update()
        if step % config.log_every == 0 or step == last:
            now = time.perf_counter()
            tokens_per_s = tokens_per_step * (step - last_log) / (now - last_time)
            last_log, last_time = step, now
            bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{tokens_per_s:,.0f}")
            if rank == 0:  # tqdm.write prints above the bar, or plainly when there is none
                tqdm.write(f"step {step:4} | loss {losses[-1]:.4f} | lr {scheduler.get_last_lr()[0]:.1e} "
                           f"| {tokens_per_s:8,.0f} tokens/s", file=sys.stdout)
        if config.checkpoint_every and step % config.checkpoint_every == 0:
            save = checkpoint.async_save if config.async_checkpoint else checkpoint.save
            stall = time.perf_counter()  # how long training waits for the save
            saved = save(config.checkpoint_dir, step, model, optimizer, keep=config.keep,
                         storage_writer=storage_writer, **stateful)
            stalls.append(time.perf_counter() - stall)
    if isinstance(saved, checkpoint.PendingSave):  # the last one is published before the run ends
        stall = time.perf_counter()
        saved = saved.wait()
        stalls[-1] += time.perf_counter() - stall  # the end of the run waits for it
    bar.close()
    tokens_per_s = tokens_per_step * len(losses) / (time.perf_counter() - run_start)  # saves included
    if config.export:
        checkpoint.export_consolidated(model, config.export)
    peaks = [None] * dist.get_world_size()
    what, peak = _peak_memory(device)
    dist.all_gather_object(peaks, peak)
    if rank == 0:
        print(f"peak memory per rank, {what}: " + ", ".join(f"rank{r} {mib:,.0f} MiB" for r, mib in enumerate(peaks)))
    return dict(first_step=start + 1, losses=losses, dtype=str(dtype).removeprefix("torch."),
                peak_memory_mib=peaks, peak_memory_is=what, tokens_per_s=tokens_per_s,
                checkpoint=str(saved) if saved else None, save_stall_s=stalls)


_HELP = {
    "data": "python-docs: the Python documentation as bytes; repeating: random tokens with a fixed period",
    "batch_size": "rows of the global batch per micro-batch, split over the ranks",
    "steps": "the length of the run, which the learning-rate schedule spans",
    "stop_at": "stop after this step (a job's time limit) and resume later; 0: run all steps",
    "precision": "auto: bf16 on GPUs that have it, fp16 with a gradient scaler on older GPUs, fp32 on CPU",
    "checkpoint_every": "save every N steps into --checkpoint-dir (0: never)",
    "keep": "how many checkpoints to keep in --checkpoint-dir, the newest (at least 1)",
    "async_checkpoint": "write each checkpoint in the background (DCP's async_save) while training goes on",
    "resume": "'latest' (the newest complete checkpoint in --checkpoint-dir) or a checkpoint's path",
    "export": "write the consolidated model (one torch.save file) here at the end",
}


def _parse(argv) -> tuple[TrainConfig, int, str | None, float | None]:
    parser = argparse.ArgumentParser(prog="python -m fsdp_guide.recipes.train_llm", description=__doc__.split("\n")[0])
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        if field.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default,
                                help=_HELP.get(field.name))
        else:
            kind = {"int": int, "float": float}.get(str(field.type), str)
            choices = {"data": DATA, "precision": PRECISIONS}.get(field.name)
            parser.add_argument(flag, type=kind, default=field.default, choices=choices, help=_HELP.get(field.name))
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks to start when not under torchrun (default 2; under torchrun, its WORLD_SIZE)")
    parser.add_argument("--out", help="rank 0 writes the summary (losses, memory) to this JSON file")
    parser.add_argument("--timeout", type=float, default=None,
                        help="stop the ranks after this many seconds (default: no limit)")
    args = vars(parser.parse_args(argv))
    nproc, out, timeout = args.pop("nproc"), args.pop("out"), args.pop("timeout")
    if timeout is not None and not 0 < timeout < math.inf:
        parser.error(f"--timeout {timeout}: expected a finite number of seconds > 0, or no --timeout for no limit")
    try:
        return TrainConfig(**args), nproc, out, timeout
    except ValueError as error:
        parser.error(str(error))


def main(argv=None) -> dict:
    config, nproc, out, timeout = _parse(argv)
    # Under torchrun, launch runs train in this process; otherwise it starts nproc ranks.
    summary = launch(train, config, world_size=nproc, output="all", timeout=timeout)[0]
    if out and int(os.environ.get("RANK", "0")) == 0:  # every rank has the summary; one writes it
        Path(out).write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
    # The run is done and written: skip interpreter shutdown. Tearing down torch's C++
    # threads (the store, gloo) in the interpreter's order sometimes aborts with "terminate
    # called without an active exception" (seen once under torchrun on torch 2.15, in CI),
    # which would fail a finished run; the launcher's ranks skip it for the same reason
    # (fsdp_guide/_rank.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
