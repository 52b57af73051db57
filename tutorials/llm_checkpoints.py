# ---
# jupyter:
#   jupytext:
#     notebook_metadata_filter: -jupytext.text_representation.jupytext_version,-jupytext.text_representation.format_version
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# (tutorial-llm-checkpoints)=
# # Checkpoints that resume exactly
#
# **What you will learn**
#
# - checkpoints with `torch.distributed.checkpoint` ({term}`DCP`) that continue *exactly* where
#   training stopped, the position in the data stream included;
# - why a crash in the middle of a save leaves the last complete checkpoint loadable;
# - saving in the background while training goes on ({term}`asynchronous checkpoint`),
#   and how long training waits for a save either way;
# - resuming on a different number of ranks;
# - the ways a `state_dict` or a checkpoint gets loaded into a sharded model wrongly, and the
#   right ones.
#
# **What you need**: a CPU; 2 processes on gloo, 4 for one cell; about 35 seconds on 2 CPU cores ({ref}`measured <measured-times>`).
# The same code is written to run unchanged with one GPU per rank (NCCL): each rank computes on
# {func}`fsdp_guide.device`, its GPU `cuda:LOCAL_RANK` where it has one, else the CPU. The
# training is {ref}`the LLM recipe <tutorial-llm>`'s, run briefly here: a small GPT over the bytes
# of the Python documentation, 40 steps on 2 ranks (`fsdp_guide.recipes.train_llm.train`).
# The tips it demonstrates are listed {ref}`at the end <llm-checkpoints-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`llm-checkpoints-script` ({download}`download <scripts/llm_checkpoints.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# ## The run to compare with
#
# The recipe's run, 40 steps on 2 ranks without stopping, saving a checkpoint every 20 steps
# (`checkpoint_every=20` into `checkpoint_dir`, with {func}`fsdp_guide.checkpoint.save`):

# %%
import dataclasses
import tempfile
from pathlib import Path

from fsdp_guide import launch
from fsdp_guide.compare import largest_difference
from fsdp_guide.recipes.train_llm import TrainConfig, train

config = TrainConfig(steps=40, log_every=10, progress=False)
# deleted, with what the page wrote, when the kernel exits
scratch = tempfile.TemporaryDirectory(prefix="llm-checkpoints-")
workdir = Path(scratch.name)
straight = launch(
    train,
    dataclasses.replace(config, checkpoint_dir=str(workdir / "straight"), checkpoint_every=20),
    world_size=2,
    output="none",
)[0]
print(f"computed in {straight['dtype']}")
for step in (1, 20, 40):
    print(f"step {step:2}: loss {straight['losses'][step - 1]:.4f}")
print("checkpoints kept:", sorted(p.name for p in (workdir / "straight").iterdir()))

# %% [markdown]
# Both checkpoints are still there: the recipe keeps the newest two (`keep=2`, the default of
# {func}`fsdp_guide.checkpoint.save`), so a checkpoint that turns out bad leaves one to fall
# back to; `step-20` goes when `step-60` is complete.
#
# (llm-resume)=
# ## Stop, resume, and get the same numbers
#
# Train 20 steps and stop; then start again with `resume="latest"` and train to 40:

# %%
halves = workdir / "halves"
first = launch(
    train,
    dataclasses.replace(config, stop_at=20, checkpoint_dir=str(halves), checkpoint_every=20),
    world_size=2,
    output="none",
)[0]
second = launch(
    train,
    dataclasses.replace(config, checkpoint_dir=str(halves), resume="latest"),
    world_size=2,
    output="none",
)[0]
print(f"first run: steps 1-{len(first['losses'])}; resumed run: steps {second['first_step']}-40")
resumed = first["losses"] + second["losses"]
print(
    f"straight == stopped and resumed, all 40 losses bit for bit: {resumed == straight['losses']}"
)

# %% [markdown]
# Bit for bit, because the checkpoint holds everything the next step reads: the sharded
# model and optimizer state (through DCP's `get_state_dict`/`set_state_dict`), the learning
# rate schedule, the gradient scaler when there is one, the data iterator's position, each
# rank's RNG state and the step.
#
# The data position is the part most often forgotten. A job that restores the model and
# the optimizer but rebuilds its data stream from scratch (a new `DataLoader` begins its
# epoch again) trains its next steps on batches it has already seen. The recipe's stream
# (`fsdp_guide.tokens.TokenBatches`) makes batch `i` from the seed and `i` alone, so its whole
# state is `{"seed", "position"}`, which the checkpoint saves. That stream, restarted plainly
# after the stop at step 20 and restarted from the position the checkpoint saved, against
# the batches of steps 1 to 20:

# %%
import warnings

import torch.distributed.checkpoint as dcp
from fsdp_guide.tokens import TokenBatches, python_docs_corpus

corpus = python_docs_corpus()


def next_batches(stream, n):
    return [next(stream)[0] for _ in range(n)]


def seen_before(batch, earlier):
    return any(torch.equal(batch, old) for old in earlier)


steps_1_to_20 = next_batches(
    TokenBatches(corpus, batch_size=config.batch_size, block_size=config.block_size, seed=0), 20
)
plain_restart = TokenBatches(
    corpus, batch_size=config.batch_size, block_size=config.block_size, seed=0
)
from_checkpoint = TokenBatches(
    corpus, batch_size=config.batch_size, block_size=config.block_size, seed=0
)
saved = {"data": plain_restart.state_dict()}  # the keys to read; DCP fills in the saved values
with warnings.catch_warnings():  # DCP warns that it reads in one process: that is the intent here
    warnings.filterwarnings("ignore", "torch.distributed is disabled")
    dcp.load(saved, checkpoint_id=halves / "step-00000020", no_dist=True)
print("the data state saved at step 20:", saved["data"])
from_checkpoint.load_state_dict(saved["data"])
for name, stream in (
    ("plain restart", plain_restart),
    ("position from the checkpoint", from_checkpoint),
):
    repeats = sum(seen_before(b, steps_1_to_20) for b in next_batches(stream, 20))
    print(f"{name:28}: steps 21-40 train on {repeats:2} of 20 batches already seen in steps 1-20")

# %% [markdown]
# (llm-crash)=
# ## A crash in the middle of a save
#
# A checkpoint is written to `.partial-step-N` and renamed to `step-N` only when every
# rank has finished ({func}`fsdp_guide.checkpoint.save`). To see why, kill rank 1 with
# `SIGKILL` halfway through the save at step 40, after it has written its part (the storage writer that kills it is folded: click to show it):

# %% tags=["hide-input"]
import os
import signal

import torch.distributed as dist
from fsdp_guide import LaunchError
from torch.distributed.checkpoint import FileSystemWriter


class KilledWhileSaving(FileSystemWriter):
    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        written.wait()
        if dist.get_rank() == 1 and "step-00000040" in str(self.path):
            os.kill(os.getpid(), signal.SIGKILL)
        return written


# %%
crash = workdir / "crash"
try:
    launch(
        train,
        dataclasses.replace(config, checkpoint_dir=str(crash), checkpoint_every=20),
        storage_writer=KilledWhileSaving,
        world_size=2,
        output="none",
    )
except LaunchError as error:
    print(f"{type(error).__name__}: {str(error).splitlines()[0]}")
print("left on disk:", sorted(p.name for p in crash.iterdir()))

# %%
from fsdp_guide.checkpoint import latest

after_crash = launch(
    train,
    dataclasses.replace(config, checkpoint_dir=str(crash), resume="latest", checkpoint_every=20),
    world_size=2,
    output="none",
)[0]
print(f"resumed at step {after_crash['first_step']}")
print(f"newest complete checkpoint now: {latest(crash).name}")
print(
    f"steps 21-40 after the crash equal the straight run: {after_crash['losses'] == straight['losses'][20:]}"
)

# %% [markdown]
# The half-written `step-40` never got its final name, so `resume="latest"` took `step-20`,
# the last complete checkpoint, and the rerun of steps 21 to 40 is the straight run again.
# A job that restarts itself when a rank dies (`torchrun --max-restarts` with
# `--resume auto`), what the failure costs, and torchft's way of training on through it
# are on {ref}`tutorial-rank-dies` and {ref}`tutorial-torchft-recovery`.
#
# (llm-async-checkpoint)=
# ## Saving in the background
#
# A synchronous save stops training until every rank has written its part.
# `async_checkpoint=True` (`--async-checkpoint` on the command line) saves with
# {func}`fsdp_guide.checkpoint.async_save` instead, built on DCP's `async_save`: it gathers
# the state dict, copies it to CPU memory, returns, and a background thread writes the
# files, on a gloo process group of its own, then rank 0 publishes `step-N` as before.
# Training waits for the foreground part, and for the previous save if it is still in
# flight (one at a time); the end of the run waits for the last one, which the time of the
# last save below includes. The straight run above saved synchronously; the same run,
# saving each way, on the local disk and on storage that is slow to write (the slow
# storage's writer, folded, sleeps half a second and notes the thread that wrote):

# %% tags=["hide-input"]
import time


class SlowStorage(FileSystemWriter):
    """A file system that takes half a second per rank's write, as a busy network file system may.
    It notes which thread wrote: training's own, or one in the background."""

    def write_data(self, plan, planner):
        import threading

        time.sleep(0.5)
        with open(workdir / "slow-writes.txt", "a") as log:
            log.write(
                "training thread\n"
                if threading.current_thread() is threading.main_thread()
                else "background\n"
            )
        return super().write_data(plan, planner)


# %%
from fsdp_guide.table import Table
from IPython.display import display

runs, writers = {}, {}
for storage in ("local disk", "slow storage"):
    for mode in ("synchronous", "asynchronous"):
        (workdir / "slow-writes.txt").write_text("")
        where = workdir / f"{storage} {mode}".replace(" ", "-")
        runs[storage, mode] = launch(
            train,
            dataclasses.replace(
                config,
                checkpoint_dir=str(where),
                checkpoint_every=20,
                async_checkpoint=mode == "asynchronous",
            ),
            storage_writer=SlowStorage if storage == "slow storage" else None,
            world_size=2,
            output="none",
        )[0]
        runs[storage, mode]["published"] = sorted(p.name for p in where.iterdir())
        writers[storage, mode] = sorted(
            set((workdir / "slow-writes.txt").read_text().split("\n")) - {""}
        )
print("training waited in the saves at steps 20 and 40, in ms:")
rows = [
    [storage, mode, *(f"{1000 * s:.1f}" for s in run["save_stall_s"])]
    for (storage, mode), run in runs.items()
]
display(Table(["storage", "saves", "step 20", "step 40"], rows))
for mode in ("synchronous", "asynchronous"):
    print(
        f"{mode} saves to slow storage: the half-second writes ran on {' and '.join(writers['slow storage', mode])}"
    )
print(
    "losses equal the straight run:",
    all(run["losses"] == straight["losses"] for run in runs.values()),
)
print("published, by every run:", sorted({tuple(run["published"]) for run in runs.values()}))

# %% [markdown]
# Both ways train exactly the straight run and publish both checkpoints. On the local
# disk the write is short, and what a save costs in the foreground is not broken down here
# (the state dict, the copy to CPU memory and, for the first save, the checkpoint group's
# creation happen there); the numbers vary from run to run.
# With storage that takes half a second to write, a synchronous save stops training for
# that half second and more; the asynchronous one at step 20 stops it for a fraction of
# that, as the write goes on in the background (the last two lines) while steps 21 to 40 train. The save at step 40 is the
# run's last, and the run waits for its write before it ends.
#
# %% [markdown]
# (llm-reshard)=
# ## Resume on another number of ranks
#
# DCP stores each tensor with its global shape and each rank's piece of it, so a checkpoint
# saved by 2 ranks loads on 4, or on 1, each taking the pieces its own shards need:

# %%
for world_size in (4, 1):
    other = launch(
        train,
        dataclasses.replace(config, resume=str(halves / "step-00000020")),
        world_size=world_size,
        output="none",
    )[0]
    difference = largest_difference(zip(other["losses"], straight["losses"][20:]))
    print(
        f"saved on 2, resumed on {world_size}: max |loss - straight run| over steps 21-40 = {difference:.1e}"
    )

# %% [markdown]
# The losses continue as on 2 ranks, up to float rounding: the global batches are the same,
# but the work is split differently (each rank's rows, and the sum across ranks; one rank
# has none), so the float32 additions come in another order. The RNG states are per rank,
# so they are restored only on the same number of ranks (nothing here draws random numbers
# after initialisation).
#
# (llm-load-errors)=
# ## A `state_dict` or checkpoint loaded the wrong way: missing keys, other shapes
#
# Each way below of putting saved weights into a sharded model is a common mistake, made on
# purpose on a small model, with its message; the last two load a DCP checkpoint into a
# model that is not the one saved. The right ways follow them:

# %%
import traceback

import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import fully_shard


def sharded(width=8, head=False):
    """A small sharded model; with ``head``, a scoring head added (as a reward model adds ``score``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width))
    if head:
        model.add_module("score", nn.Linear(width, 1))
    for layer in model:
        fully_shard(layer)
    return fully_shard(model)


def loading_mistakes(folder):
    model = sharded()  # fully_shard puts it on the mesh's device: fsdp_guide.device()'s
    # a torch.save'd file
    full = {name: tensor.full_tensor().cpu() for name, tensor in model.state_dict().items()}
    # each rank's own shards
    local = {name: tensor.to_local() for name, tensor in model.state_dict().items()}
    dcp.save({"model": model.state_dict()}, checkpoint_id=folder)

    def outcome(attempt):
        try:
            attempt()
        except CheckpointException as error:  # a BaseException, not an Exception: name it
            # it gathers every rank's failure; this rank's own says what went wrong
            return "".join(
                traceback.format_exception_only(error.failures[dist.get_rank()][0])
            ).strip()
        except Exception as error:
            return "".join(traceback.format_exception_only(error)).strip()
        return "loaded"

    return {
        "load_state_dict(full state dict)": outcome(lambda: sharded().load_state_dict(full)),
        "load_state_dict(this rank's shards)": outcome(lambda: sharded().load_state_dict(local)),
        "dcp.load into the model with a head added": outcome(
            lambda: dcp.load({"model": sharded(head=True).state_dict()}, checkpoint_id=folder)
        ),
        "dcp.load into a wider model": outcome(
            lambda: dcp.load({"model": sharded(width=16).state_dict()}, checkpoint_id=folder)
        ),
        "set_model_state_dict(full state dict)": outcome(
            lambda: set_model_state_dict(
                sharded(),
                full,
                options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
            )
        ),
        "dcp.load into the same model": outcome(
            lambda: dcp.load({"model": sharded().state_dict()}, checkpoint_id=folder)
        ),
    }


for way, result in launch(loading_mistakes, str(workdir / "small"), world_size=2, output="none")[
    0
].items():
    print(f"{way}:\n    {result}")

# %% [markdown]
# A sharded model's state dict holds `DTensor`s: `load_state_dict` copies each saved
# tensor into one (`Module._load_from_state_dict`), and a plain full tensor cannot be
# copied into a DTensor, while one rank's shards have the wrong (global) shape. Load full
# weights with `set_model_state_dict(..., full_state_dict=True)` (with
# `broadcast_from_rank0=True`, only rank 0 needs them), and sharded ones with DCP, which
# reshards. DCP loads what the state dict it is given asks for: a key the checkpoint lacks,
# or a global shape that differs, fails on every rank (`create_default_local_load_plan`
# in `torch/distributed/checkpoint/default_planner.py`), and the `CheckpointException`
# carries each rank's failure in `failures` (it derives from `BaseException`,
# `torch/distributed/checkpoint/api.py`, so `except Exception` does not catch it). Load
# into the model the checkpoint was saved from, and change it after loading;
# `DefaultLoadPlanner(allow_partial_load=True)` skips missing keys on purpose.

# %% [markdown]
# (llm-checkpoints-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone:
# {download}`scripts/llm_checkpoints.py`. A small GPT over bytes, sharded with `fully_shard`,
# trains 40 steps without stopping; a second run trains 20 steps and saves the sharded model
# and AdamW's state with `dcp.save` (through `get_state_dict`), with the step, which is also the
# data position (batch `i` depends only on `i`); a third model, initialised differently, loads
# the checkpoint (`dcp.load`, `set_state_dict`) and trains steps 21 to 40. Rank 0 prints
# whether those losses equal the uninterrupted run's, compared with `==`. The tests run this
# file under torchrun on 2 CPU ranks and check that they are equal and all finite
# (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/llm_checkpoints.py
# :language: python
# ```

# %% [markdown]
# (llm-checkpoints-tips)=
# ## The tips behind this
#
# - {ref}`tip-exact-resume`: save the data position and the RNG, publish atomically.
# - {ref}`tip-async-checkpoint`: write checkpoints in the background, one at a time.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("llm_checkpoints")
