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
the position in the data stream included, and the settings they were saved with: a
resume may change the schedule and the optimiser's settings (``--steps``, ``--lr``,
``--warmup``, ``--weight-decay``, ``--clip``), which it applies and prints, but not what
makes the run (the model, the data and its order, the seed, the precision), which is a
usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_guide import launch
from fsdp_guide.devices import device as rank_device
from fsdp_guide.mfu import flops_per_token, mfu

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
    resume: str | None = None  # "latest" or "auto" (in checkpoint_dir), or a checkpoint's path
    export: str | None = None  # write the consolidated model here at the end
    # output
    log_every: int = 10
    progress: bool = True  # a tqdm bar on rank 0

    def __post_init__(self):
        if problem := _problem(vars(self), cli=False):
            raise ValueError(problem)

    def model_config(self):
        from fsdp_guide.gpt import GPTConfig

        return GPTConfig(block_size=self.block_size, n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd)


def _naming(values: dict, cli: bool):
    """How a message names a setting (``name``) and a setting as given (``given``).

    In a notebook the reader wrote TrainConfig's fields, ``stop_at=50``; on the command
    line the flags, ``--stop-at 50``: the same checks speak to each in its own terms.
    """

    def name(field: str) -> str:
        return "--" + field.replace("_", "-") if cli else field

    def given(field: str) -> str:
        value = values[field]
        if not cli:
            return f"{field}={value!r}"
        return name(field) if value is True else f"{name(field)} {shlex.quote(str(value))}"

    return name, given


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _problem(v: dict, cli: bool) -> str | None:
    """The first thing wrong with these TrainConfig settings, in one line; None if nothing is.

    Only what the settings alone tell: the number of ranks and the files are the
    command's (``_command_problem``). Each of these would otherwise fail on every rank
    after they started, or, worse, train on silently (a negative clip flips the gradients).
    """
    name, given = _naming(v, cli)
    if v["data"] not in DATA:
        return f"{given('data')}: expected one of {', '.join(DATA)}"
    if v["precision"] not in PRECISIONS:
        return f"{given('precision')}: expected one of {', '.join(PRECISIONS)}"
    for field in (
        "n_layer",
        "n_head",
        "n_embd",
        "block_size",
        "batch_size",
        "grad_accum",
        "steps",
        "log_every",
        "simulated_size_in_batches",
        "keep",
    ):
        if not _is_int(v[field]) or v[field] < 1:
            return f"{given(field)}: expected a positive int"
    if v["n_embd"] % v["n_head"]:  # each head attends over an equal slice of the embedding
        return f"{given('n_head')}: expected a divisor of {given('n_embd')}"
    for field, zero in (("warmup", "no warm-up"), ("checkpoint_every", "never save")):
        if not _is_int(v[field]) or v[field] < 0:
            return f"{given(field)}: expected 0 ({zero}) or a number of steps"
    if not _is_int(v["stop_at"]) or not 0 <= v["stop_at"] <= v["steps"]:
        return f"{given('stop_at')}: expected 0 (run all steps) or a step up to {given('steps')}"
    if not _is_int(v["seed"]) or not 0 <= v["seed"] < 2**32:  # larger ones overflow torch's generator seeds
        return f"{given('seed')}: expected an int from 0 to 2**32 - 1"
    # Each written `not <what is right>`: NaN fails every comparison, so it is refused too.
    if not _is_real(v["lr"]) or not 0 < v["lr"] < math.inf:
        return f"{given('lr')}: expected a finite number > 0"
    if not _is_real(v["weight_decay"]) or not 0 <= v["weight_decay"] < math.inf:
        return f"{given('weight_decay')}: expected a finite number >= 0 (0: no decay)"
    if not _is_real(v["clip"]) or not v["clip"] > 0:  # 0 zeroes every gradient; below it, they point uphill
        return f"{given('clip')}: expected the largest gradient norm, a number > 0 (inf: no clipping)"
    if v["checkpoint_every"] and not v["checkpoint_dir"]:
        return f"{given('checkpoint_every')}: saves need {name('checkpoint_dir')}, the directory to write them into"
    if v["resume"] in ("latest", "auto") and not v["checkpoint_dir"]:
        return f"{given('resume')} needs {name('checkpoint_dir')}, the directory to take the newest checkpoint from"
    if v["async_checkpoint"] and not v["checkpoint_every"]:  # else it would do nothing, silently
        return (
            f"{name('async_checkpoint')} needs {name('checkpoint_every')} and {name('checkpoint_dir')}: "
            "without them there is no checkpoint to write in the background"
        )
    return None


def _command_problem(args: dict) -> str | None:
    """What the settings alone cannot tell: the number of ranks, and the files the run reads and writes.

    Checked before any rank starts: a missing checkpoint would otherwise fail on every rank
    after they started, and an --out or --export into a missing directory only after the
    whole run, losing what it wrote.
    """
    from fsdp_guide.launcher import _under_torchrun

    given = _naming(args, cli=True)[1]
    nproc, timeout = args["nproc"], args["timeout"]
    if timeout is not None and not 0 < timeout < math.inf:
        return f"{given('timeout')}: expected a finite number of seconds > 0, or no --timeout for no limit"
    if _under_torchrun():  # launch runs train in this process, one of the WORLD_SIZE torchrun started
        world = int(os.environ["WORLD_SIZE"])
        if nproc is not None and nproc != world:
            return f"{given('nproc')}: under torchrun, which started WORLD_SIZE={world} ranks; leave --nproc out"
    elif nproc is not None and nproc < 1:
        return f"{given('nproc')}: expected a number of ranks >= 1"
    else:
        world = 2 if nproc is None else nproc  # launch's default
    if args["batch_size"] % world:  # each rank takes an equal share of the rows
        return f"{given('batch_size')}: does not split over the {world} ranks; expected a multiple of {world}"
    if args["data"] == "python-docs":
        from fsdp_guide.tokens import python_docs_corpus

        size = python_docs_corpus().numel()  # each row is a window of block_size + 1 bytes, drawn from it
        if args["block_size"] > size - 2:
            return f"{given('block_size')}: expected at most {size - 2} (the corpus is {size} bytes)"
    directory, resume = args["checkpoint_dir"], args["resume"]
    if directory and Path(directory).exists() and not Path(directory).is_dir():
        return f"{given('checkpoint_dir')}: not a directory; expected a directory to save checkpoints into"
    if resume == "latest":
        from fsdp_guide import checkpoint

        if checkpoint.latest(directory) is None:  # asked to resume: never a silent fresh start
            return (
                f"{given('resume')}: no complete checkpoint (step-N) in {given('checkpoint_dir')} "
                "written by fsdp_guide.checkpoint (its marker file names its step) "
                "to resume from; leave --resume out to start afresh"
            )
    elif resume == "auto":
        pass  # the newest checkpoint if there is one, else a fresh start: both are right
    elif resume and not Path(resume).is_dir():
        return f"{given('resume')}: no such checkpoint directory; expected 'latest', 'auto' or a checkpoint's path"
    elif resume and not (Path(resume) / ".metadata").is_file():  # DCP writes it last: the sign of a complete one
        return (
            f"{given('resume')}: not a complete checkpoint (it has no .metadata file); complete ones are named step-N"
        )
    if resume:
        from fsdp_guide import checkpoint

        path = checkpoint.latest(directory) if resume in ("latest", "auto") else Path(resume)
        try:
            saved = path and _saved_settings(path)
        except checkpoint.CheckpointError as error:
            return f"{given('resume')}: {error}"
        if saved and (problem := _resume_problem(saved, args, path, cli=True)):
            return problem
    if int(os.environ.get("RANK", "0")) == 0:  # rank 0 writes both files; other nodes need not have the directory
        for field in ("export", "out"):
            path = args[field] and Path(args[field])
            if path and path.is_dir():
                return f"{given(field)}: a directory; expected the path of a file to write"
            if path and not path.parent.is_dir():
                return f"{given(field)}: its directory {shlex.quote(str(path.parent))} does not exist; create it first"
    return None


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
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95))

    def schedule(step: int) -> float:
        if step < config.warmup:
            return (step + 1) / config.warmup
        progress = (step - config.warmup) / max(1, config.steps - config.warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def make_batches(config: TrainConfig):
    from fsdp_guide.tokens import TokenBatches, python_docs_corpus

    corpus = python_docs_corpus() if config.data == "python-docs" else None
    # it checks batch_size splits
    return TokenBatches(
        corpus,
        batch_size=config.batch_size,
        block_size=config.block_size,
        seed=config.seed,
        simulated_size_in_batches=config.simulated_size_in_batches,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
    )


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


# A resume continues the run it was saved from. What makes that run, the model, the data and
# their order, the precision, must be the checkpoint's: a usage error names any that differ.
# The schedule and the optimiser's settings may change, and are applied (a longer run, a lower
# rate); the rest (when to stop, save, log, export) is the command's alone.
_SAME_RUN = (
    "n_layer",
    "n_head",
    "n_embd",
    "block_size",
    "data",
    "batch_size",
    "grad_accum",
    "simulated_size_in_batches",
    "seed",
    "precision",
)
_APPLIED = ("steps", "lr", "warmup", "weight_decay", "clip")
_SETTINGS = "settings.values"  # RunSettings' entry in a checkpoint, as DCP flattens it


class RunSettings:
    """The settings a checkpoint was saved with (DCP's ``Stateful``, saved beside the model): what a resume compares."""

    def __init__(self, config: TrainConfig):
        self.config = config

    def state_dict(self) -> dict:
        return {"values": json.dumps({field: getattr(self.config, field) for field in _SAME_RUN + _APPLIED})}

    def load_state_dict(self, state: dict) -> None:  # read before the load instead (_saved_settings)
        raise NotImplementedError("the saved settings are read with _saved_settings, not loaded")


def _saved_settings(path: Path) -> dict | None:
    """The settings the checkpoint at ``path`` was saved with, and its step (``"step"``); None for one saved
    before the settings were. Raises CheckpointError if they cannot be read."""
    from fsdp_guide import checkpoint

    saved = checkpoint._saved_value(path, _SETTINGS)
    if saved is None:
        return None
    try:
        settings = json.loads(saved)
        if not isinstance(settings, dict):
            raise TypeError(f"a JSON {type(settings).__name__}")
    except (TypeError, ValueError) as error:
        raise checkpoint.CheckpointError(
            f"{path}: its saved settings cannot be read ({error}): it is damaged, or was not saved by this recipe"
        ) from error
    return {**settings, "step": checkpoint._saved_value(path, "step")}


def _resume_problem(saved: dict, values: dict, path: Path, cli: bool) -> str | None:
    """What of the run the checkpoint at ``path`` continues the settings ``values`` change, in a line; None if none."""
    name, given = _naming(values, cli)
    # the repeating data's period only makes the data when that is the data
    same_run = [f for f in _SAME_RUN if f != "simulated_size_in_batches" or values["data"] == "repeating"]
    changed = [field for field in same_run if field in saved and saved[field] != values[field]]
    if not changed:
        if isinstance(saved.get("step"), int) and saved["step"] > values["steps"]:
            return (
                f"{given('steps')}: {path} is at step {saved['step']}, past the end of that run; expected "
                f"{name('steps')} {saved['step']} or more"
            )
        return None
    what = ", ".join(f"{given(field)} (the checkpoint's: {saved[field]})" for field in changed)
    return (
        f"{what}: {path} continues a run with other settings, and a resume continues that run; leave "
        f"{'them' if len(changed) > 1 else 'it'} as {'they were' if len(changed) > 1 else 'it was'}, "
        f"or start afresh without {name('resume')}"
    )


def _apply_changed_settings(saved: dict, config: TrainConfig, optimizer, scheduler) -> dict:
    """Give the resumed optimizer and schedule the settings this run asks for where they differ from the
    checkpoint's (which the load restored); returns {field: (the checkpoint's, now)} for those."""
    changed = {f: (saved[f], getattr(config, f)) for f in _APPLIED if f in saved and saved[f] != getattr(config, f)}
    if {"lr", "steps", "warmup"} & changed.keys():  # LambdaLR's base rate came back from the checkpoint
        scheduler.base_lrs = [config.lr] * len(optimizer.param_groups)
        for group, lr in zip(optimizer.param_groups, scheduler.base_lrs):
            group["initial_lr"] = lr
            group["lr"] = lr * scheduler.lr_lambdas[0](scheduler.last_epoch)  # as LambdaLR computes it
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports
    if "weight_decay" in changed:
        for group in optimizer.param_groups:
            group["weight_decay"] = config.weight_decay
    return changed  # steps and warmup reach the schedule, and clip the step, through config itself


def _checkpoint_to_resume(config: TrainConfig) -> Path | None:
    """The checkpoint ``--resume`` names; None for a fresh start (no ``--resume``, or ``auto`` before a first save)."""
    from fsdp_guide import checkpoint

    if config.resume not in ("latest", "auto"):
        return Path(config.resume) if config.resume else None
    path = checkpoint.latest(config.checkpoint_dir)
    if path is None and config.resume == "latest":  # asked to resume: never a silent fresh start
        raise checkpoint.CheckpointError(
            f"{config.checkpoint_dir}: no complete checkpoint (step-N) to resume from, "
            "of those fsdp_guide.checkpoint writes (its marker file names its step)"
        )
    return path


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
    if config.export:  # a typo found now, not after the whole run
        checkpoint._check_export_path(config.export)
    dtype = compute_dtype(config.precision, device)
    model = build_model(config, device, dtype)
    optimizer, scheduler = build_optimizer(model, config)
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None  # fp16 gradients underflow
    batches = make_batches(config)
    stateful = dict(scheduler=scheduler, data=batches, **({"scaler": scaler} if scaler else {}))

    start, path = 0, _checkpoint_to_resume(config)
    if path is not None:
        saved_with = _saved_settings(path) or {}
        if problem := _resume_problem(saved_with, vars(config), path, cli=False):
            raise ValueError(problem)
        start = checkpoint.load(path, model, optimizer, **stateful)
        changed = _apply_changed_settings(saved_with, config, optimizer, scheduler)
        if rank == 0:
            print(
                f"resumed from {path} at step {start}"
                + "".join(f"; {f} {now} (the checkpoint's: {was})" for f, (was, now) in changed.items())
            )
    elif config.resume == "auto" and rank == 0:  # a restarted job's first attempt: nothing saved yet
        print(f"no complete checkpoint in {config.checkpoint_dir}: starting at step 1 (--resume auto)")
    stateful["settings"] = RunSettings(config)  # saved with every checkpoint of this run, never loaded

    tokens_per_step = config.batch_size * config.block_size * config.grad_accum
    losses, lrs, last_log, last_time, saved, stalls = [], [], start, time.perf_counter(), None, []
    bar = tqdm(total=config.steps, initial=start, disable=rank != 0 or not config.progress, file=sys.stderr)
    last = config.stop_at or config.steps
    run_start = time.perf_counter()
    for step in range(start + 1, last + 1):
        lrs.append(scheduler.get_last_lr()[0])  # the rate this step uses
        losses.append(train_step(model, optimizer, scheduler, scaler, batches, config, device))
        bar.update()
        if step % config.log_every == 0 or step == last:
            now = time.perf_counter()
            tokens_per_s = tokens_per_step * (step - last_log) / (now - last_time)
            last_log, last_time = step, now
            bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{tokens_per_s:,.0f}")
            if rank == 0:  # tqdm.write prints above the bar, or plainly when there is none
                tqdm.write(
                    f"step {step:4} | loss {losses[-1]:.4f} | lr {scheduler.get_last_lr()[0]:.1e} "
                    f"| {tokens_per_s:8,.0f} tokens/s",
                    file=sys.stdout,
                )
        if config.checkpoint_every and step % config.checkpoint_every == 0:
            save = checkpoint.async_save if config.async_checkpoint else checkpoint.save
            stall = time.perf_counter()  # how long training waits for the save
            saved = save(
                config.checkpoint_dir,
                step,
                model,
                optimizer,
                keep=config.keep,
                storage_writer=storage_writer,
                **stateful,
            )
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
    utilisation, why_not = model_flops_utilisation(model, config, tokens_per_s, device)
    if rank == 0:
        print(f"peak memory per rank, {what}: " + ", ".join(f"rank{r} {mib:,.0f} MiB" for r, mib in enumerate(peaks)))
        print(f"MFU {utilisation:.1%} (fsdp_guide.mfu)" if why_not is None else f"MFU not computed: {why_not}")
    return dict(
        first_step=start + 1,
        losses=losses,
        lrs=lrs,
        dtype=str(dtype).removeprefix("torch."),
        peak_memory_mib=peaks,
        peak_memory_is=what,
        tokens_per_s=tokens_per_s,
        mfu=utilisation,
        checkpoint=str(saved) if saved else None,
        save_stall_s=stalls,
    )


def model_flops_utilisation(
    model: nn.Module, config: TrainConfig, tokens_per_s: float, device: torch.device
) -> tuple[float | None, str | None]:
    """The run's MFU on GPUs (:mod:`fsdp_guide.mfu`: the whole model's FLOPs per token, all
    ranks' tokens over all ranks' dense peak), or None and why not."""
    if device.type != "cuda":
        # A CPU has no dense bf16 tensor-core peak to divide by, and the recipe runs fp32 there.
        return None, f"on {device.type}, which has no dense bf16 peak in fsdp_guide.mfu.PEAK_BF16_DENSE"
    per_token = flops_per_token(
        model,
        n_layers=config.n_layer,
        n_heads=config.n_head,
        head_dim=config.n_embd // config.n_head,
        seq_len=config.block_size,
    )
    try:
        return mfu(tokens_per_s, per_token, torch.cuda.get_device_name(device), devices=dist.get_world_size()), None
    except ValueError as error:  # a GPU the table does not know
        return None, str(error)


_HELP = {
    "data": "python-docs: the Python documentation as bytes; repeating: random tokens with a fixed period",
    "batch_size": "rows of the global batch per micro-batch, split over the ranks",
    "steps": "the length of the run, which the learning-rate schedule spans",
    "clip": "the largest norm of the whole gradient, above which it is scaled down (inf: no clipping)",
    "stop_at": "stop after this step (a job's time limit) and resume later; 0: run all steps",
    "precision": "auto: bf16 on GPUs that have it, fp16 with a gradient scaler on older GPUs, fp32 on CPU",
    "checkpoint_every": "save every N steps into --checkpoint-dir (0: never)",
    "keep": "how many checkpoints to keep in --checkpoint-dir, the newest (at least 1)",
    "async_checkpoint": "write each checkpoint in the background (DCP's async_save) while training goes on",
    "resume": (
        "'latest' (the newest complete checkpoint in --checkpoint-dir), 'auto' (that, or a fresh start "
        "when there is none yet: what a job restarted by torchrun --max-restarts needs), or a checkpoint's path; "
        "the model, data, seed and precision flags must be the checkpoint's, --steps, --lr, --warmup, "
        "--weight-decay and --clip are applied"
    ),
    "export": "write the consolidated model (one torch.save file) here at the end",
}


def _parse(argv) -> tuple[TrainConfig, int, str | None, float | None]:
    parser = argparse.ArgumentParser(prog="python -m fsdp_guide.recipes.train_llm", description=__doc__.split("\n")[0])
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        if field.type in ("bool", bool):
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=field.default, help=_HELP.get(field.name)
            )
        else:
            kind = {"int": int, "float": float}.get(str(field.type), str)
            choices = {"data": DATA, "precision": PRECISIONS}.get(field.name)
            parser.add_argument(flag, type=kind, default=field.default, choices=choices, help=_HELP.get(field.name))
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="ranks to start when not under torchrun (default 2; under torchrun, its WORLD_SIZE)",
    )
    parser.add_argument("--out", help="rank 0 writes the summary (losses, memory) to this JSON file")
    parser.add_argument(
        "--timeout", type=float, default=None, help="stop the ranks after this many seconds (default: no limit)"
    )
    args = vars(parser.parse_args(argv))
    # Every check before any rank starts: a usage error (exit status 2, one line naming the flag).
    if problem := _problem(args, cli=True) or _command_problem(args):
        parser.error(problem)
    nproc, out, timeout = args.pop("nproc"), args.pop("out"), args.pop("timeout")
    return TrainConfig(**args), nproc, out, timeout


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
