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
# (tutorial-llm)=
# # Training a small LLM with FSDP2, with checkpoints that resume exactly
#
# **What you will learn**
#
# - the whole FSDP2 recipe for a GPT-style model, in the order it has to happen: build on
#   the {term}`meta device`, shard each block then the root, initialise after sharding;
# - checkpoints with `torch.distributed.checkpoint` ({term}`DCP`) that continue *exactly* where training
#   stopped, the position in the data stream included, and survive a crash during a save;
# - saving in the background while training goes on ({term}`asynchronous checkpoint`),
#   and how long training waits for a save either way;
# - resuming on a different number of ranks, and exporting one file for inference;
# - that the notebook runs the same code as `torchrun -m fsdp_guide.recipes.train_llm`;
# - how to compute {term}`MFU` right, checked against a published run, and three ways to get it wrong.
#
# **What you need**: a CPU; 2 processes on gloo, 4 for one cell; transformers, for one
# cell that builds Llama 3.1 8B's shapes without their memory; about 65 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The
# recipe is written to run unchanged with one GPU per rank (NCCL): each rank computes on
# {func}`fsdp_guide.device`, its GPU `cuda:LOCAL_RANK` where it has one, else the CPU, and
# `precision="auto"` then picks bf16 (fp16 with a gradient scaler on GPUs without bf16),
# where on the CPU it trains in fp32 (`compute_dtype` and `train` in
# `fsdp_guide.recipes.train_llm`; the dtype of this page's run is printed with its losses).
# The text is the Python documentation that ships with every Python (`pydoc_data`), read
# as bytes: nothing is downloaded. The tips it demonstrates are listed
# {ref}`at the end <llm-tips>`.

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# ## The model and the data
#
# {class}`fsdp_guide.gpt.GPT` is a small decoder in the style of nanoGPT: embeddings,
# transformer blocks, and an output head tied to the token embedding. The blocks will be
# the FSDP units.

# %%
from fsdp_guide.gpt import GPT
from fsdp_guide.recipes.train_llm import TrainConfig

config = TrainConfig(steps=40, log_every=10, progress=False)
model = GPT(config.model_config())
print(config.model_config())
print(
    f"{sum(p.numel() for p in model.parameters()):,} parameters "
    f"({sum(p.numel() for p in model.blocks[0].parameters()):,} per block)"
)

# %%
from fsdp_guide.tokens import TokenBatches, python_docs_corpus

corpus = python_docs_corpus()
batches = TokenBatches(corpus, batch_size=config.batch_size, block_size=config.block_size, seed=0)
inputs, targets = next(batches)
print(
    f"corpus: {corpus.numel():,} bytes; a batch: inputs {tuple(inputs.shape)}, targets shifted by one"
)
print(repr(bytes(inputs[0, :48].tolist()).decode("utf-8", "replace")))
print("the iterator's whole state:", batches.state_dict())

# %% [markdown]
# Batch `i` of the stream depends only on the seed and `i`, so `{"seed", "position"}` is
# everything a checkpoint needs to continue the stream; and each rank takes its rows of the
# same global batch, so the stream is the same on any number of ranks.
#
# ## The recipe
#
# The worker function every rank runs is {func}`fsdp_guide.recipes.train_llm.train`.
# Its model is built by `build_model`, in two steps:

# %%
import inspect

from fsdp_guide.recipes import train_llm

print(inspect.getsource(train_llm.shard_model))
print(inspect.getsource(train_llm.init_sharded))

# %% [markdown]
# The order matters. `fully_shard` goes on each block first and on the root last (the root
# then holds only what is left: embeddings, final norm, the tied head). Parameters are
# allocated only after sharding (`to_empty`), so each rank allocates just its shards. They
# are then initialised on full tensors inside {func}`fsdp_guide.summon_full_params`, with
# the same seed everywhere: every rank keeps its slice of the same weights, the weights one
# process would have made. Initialising the shards directly would give every rank the same
# numbers for a different slice ({ref}`the deterministic-init pitfall <tutorial-deterministic-init>`).
# The checkpoint wrapper, when asked for, goes *inside* each unit.
#
# `init_sharded` gathers **one unit at a time** (`recurse=False`). Gathering the whole model
# at once, `with summon_full_params(model): model.init_weights()`, gives the same weights,
# but it holds every parameter in full on every rank at the same moment, which is what
# sharding was for. Both, on each rank: each time `init_weights` runs, count the bytes of
# the model's parameters that are full plain tensors at that moment (the gathered ones; the
# others are still `DTensor` shards):

# %%
import fsdp_guide
from fsdp_guide import launch, summon_full_params
from torch.distributed.tensor import DTensor

MiB = 2**20


def full_bytes(params):
    # a DTensor's numel is the whole tensor's
    return sum(p.numel() * p.element_size() for p in params)


def most_held_in_full(model, initialise):
    """Run `initialise`; the most bytes of parameters held in full while `init_weights` ran."""
    held, init_weights = [], model.init_weights

    def counting(params=None):
        held.append(full_bytes(p for p in model.parameters() if not isinstance(p, DTensor)))
        init_weights(params)

    model.init_weights = counting
    initialise()
    return max(held)


def initialisation_in_full():
    device = fsdp_guide.device()
    at_once, by_unit = (train_llm.shard_model(config, device, torch.float32) for _ in range(2))

    def whole_model():
        torch.manual_seed(config.seed)
        with summon_full_params(at_once):
            at_once.init_weights()

    return {
        "model": full_bytes(by_unit.parameters()),
        "shards": sum(p.to_local().nbytes for p in by_unit.parameters()),
        "whole model at once": most_held_in_full(at_once, whole_model),
        "one unit at a time": most_held_in_full(
            by_unit, lambda: train_llm.init_sharded(by_unit, config.seed)
        ),
        "same weights": all(
            torch.equal(a.to_local(), b.to_local())
            for a, b in zip(at_once.parameters(), by_unit.parameters(), strict=True)
        ),
    }


held = launch(initialisation_in_full, world_size=2, output="none")
print(
    f"the model in full: {held[0]['model'] / MiB:.2f} MiB; the shards each rank holds: "
    f"{held[0]['shards'] / MiB:.2f} MiB"
)
for how in ("whole model at once", "one unit at a time"):
    print(
        f"most parameters held in full while initialising, {how:19}: "
        + ", ".join(f"rank {r} {h[how] / MiB:.2f} MiB" for r, h in enumerate(held))
    )
print(
    "the two give the same weights, bit for bit, on every rank:",
    all(h["same weights"] for h in held),
)

# %% [markdown]
# All at once, every rank holds the whole model in full besides its shards; one unit at a
# time, at most one block (the largest unit here). At this size the difference is a
# fraction of a MiB; at the size FSDP is for, the first way needs a rank to hold the whole
# model, the second one block. The gathering's own temporary buffers come on top in both.
#
# One optimizer step:

# %%
print(inspect.getsource(train_llm.train_step))

# %% [markdown]
# Now train 40 steps on 2 ranks, saving a checkpoint every 20:

# %%
import dataclasses
import math
import tempfile
from pathlib import Path

from fsdp_guide import launch
from fsdp_guide.compare import largest_difference
from fsdp_guide.recipes.train_llm import train

# deleted, with what the page wrote, when the kernel exits
scratch = tempfile.TemporaryDirectory(prefix="llm-")
workdir = Path(scratch.name)
straight = launch(
    train,
    dataclasses.replace(config, checkpoint_dir=str(workdir / "straight"), checkpoint_every=20),
    world_size=2,
    output="none",
)[0]
print(f"computed in {straight['dtype']}")
print(
    f"step  1: loss {straight['losses'][0]:.4f}   (ln 256 = {math.log(256):.4f}: a uniform guess over bytes)"
)
for step in range(10, 41, 10):
    print(f"step {step:2}: loss {straight['losses'][step - 1]:.4f}")
print("checkpoints kept:", sorted(p.name for p in (workdir / "straight").iterdir()))

# the figures the text quotes, from this run (JupyterLab shows glue's roles unrendered)
from myst_nb import glue

glue("llm_final_loss", straight["losses"][39], display=False)  # step 40's, printed above

# %% mystnb={"image": {"alt": "Loss of the byte-level GPT over 40 steps on 2 ranks, starting near the dotted line at ln 256 (a uniform guess over bytes) and falling well below it."}}
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(range(1, 41), straight["losses"], label="40 steps straight")
ax.axhline(
    torch.log(torch.tensor(256.0)).item(), color="gray", ls=":", label="ln 256: uniform guess"
)
ax.set(xlabel="step", ylabel="loss (mean over ranks)", title="a byte-level GPT on 2 ranks")
ax.legend()
fig.tight_layout()

# %% [markdown]
# The loss starts near ln 256 (a uniform guess over bytes; step 1 above) and falls as the
# model learns which bytes follow which. Both checkpoints are still there: the recipe keeps
# the newest two (`keep=2`, the default of {func}`fsdp_guide.checkpoint.save`), so a
# checkpoint that turns out bad leaves one to fall back to; `step-20` goes when `step-60`
# is complete.
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
# epoch again) trains its next steps on batches it has already seen. The stream the
# recipe uses, restarted plainly after the stop at step 20 and restarted from the position
# the checkpoint saved, against the batches of steps 1 to 20:

# %%
import warnings

import torch.distributed.checkpoint as dcp


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
# `SIGKILL` halfway through the save at step 40, after it has written its part:

# %%
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
# saving each way, on the local disk and on storage that is slow to write:

# %%
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
print(f"{'':28} {'training waited in the saves at steps 20 and 40, ms':>52}")
for (storage, mode), run in runs.items():
    print(
        f"{storage + ', ' + mode:28} " + "  ".join(f"{1000 * s:8.1f}" for s in run["save_stall_s"])
    )
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
#
# ## One file for inference
#
# `export="model.pt"` gathers the full state dict on rank 0
# ({func}`fsdp_guide.checkpoint.export_consolidated`) into a plain `torch.save` file,
# which loads into the unsharded model with `weights_only=True`:

# %%
export = workdir / "model.pt"
launch(
    train,
    dataclasses.replace(config, resume=str(halves / "step-00000020"), export=str(export)),
    world_size=2,
    output="none",
)
model = GPT(config.model_config())
model.load_state_dict(torch.load(export, weights_only=True))
prompt = torch.tensor([list(b"The ")])
out = model.generate(
    prompt, max_new_tokens=60, temperature=0.8, generator=torch.Generator().manual_seed(0)
)
print(repr(bytes(out[0].tolist()).decode("utf-8", "replace")))

# %% [markdown]
# After 40 steps (a loss of about {glue:text}`llm_final_loss:.1f` nats per byte, against 5.5 for a uniform guess) the
# model has learned which bytes are common, spaces and frequent letters, not yet words: it
# is far from trained. The point here is that the exported file is a complete, ordinary
# model, loaded and sampled without FSDP, here in the notebook's own process (the export
# holds CPU tensors, whatever device the ranks trained on). (This page's figures are its
# run's, glued in by myst-nb's `glue`; JupyterLab does not render glue's roles: read them
# from the outputs, step 40's loss in the training log above.)
#
# ## The same code from the command line and under torchrun
#
# The module is also a script. Started with `python -m`, it launches its ranks the way the
# notebook does; under `torchrun` (one machine or many) `launch` runs `train` in the
# process torchrun started. Here it is from the command line, with the notebook's settings;
# this is the log the script writes (rank 0 shows a tqdm bar too, off here). The throughput
# is that of the machine that built this page. The memory line is what a rank can report
# about itself (`_peak_memory` in the recipe): on the CPU, the peak resident set of each
# whole rank process (`ru_maxrss`, in MiB: Python, torch's libraries, the data and every
# tensor, not FSDP's share alone); on a GPU, `torch.cuda.max_memory_allocated`:

# %%
import json
import subprocess

summary_file = workdir / "summary.json"
command = [
    sys.executable,
    "-m",
    "fsdp_guide.recipes.train_llm",
    "--nproc",
    "2",
    "--steps",
    "40",
    "--log-every",
    "20",
    "--no-progress",
    "--out",
    str(summary_file),
]
print(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
print(
    "same losses as the notebook:",
    json.loads(summary_file.read_text())["losses"] == straight["losses"],
)

# %% [markdown]
# ```bash
# torchrun --nproc-per-node=2 -m fsdp_guide.recipes.train_llm --steps 40
# torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \
#     -m fsdp_guide.recipes.train_llm --checkpoint-dir /shared/ckpt --checkpoint-every 100
# ```
#
# The tests run the second form with two `torchrun` processes on one machine as two nodes,
# and check that they produce the losses of one node with 2 ranks.
#
# (llm-mfu)=
# ## How much of a GPU a run uses: MFU, computed right
#
# The log's last line is the recipe's {term}`MFU`, model FLOPs utilisation: the share of
# the accelerators' peak arithmetic that the model's own FLOPs use, tokens per second x
# FLOPs per token / (GPUs x peak). On a GPU the recipe prints it (`model_flops_utilisation`
# in the recipe, with {func}`fsdp_guide.mfu.mfu`); here, on a CPU, it says why it does not: a
# CPU has no dense bf16 tensor-core peak to divide by, and the recipe trains in fp32 there.
# Three mistakes are common, each giving a number that looks plausible. Here they are on
# the one published run this page can check against: torchtitan's Llama 3.1 8B on 8 H100s
# with FSDP, 5,762 tokens per second per GPU (Table 1 of its
# [December 2024 benchmark](https://github.com/pytorch/torchtitan/blob/820504e20d1149fbf0b98c567af24c4b0433b22d/benchmarks/llama3_h100_202412_torchtitan.md)),
# at a sequence length of 8192 (`seq_len` in `train_configs/llama3_8b.toml` at the
# torchtitan commit the benchmark names, 9dec370). The text above its tables says that
# the runs without Float8, on 8 or 128 GPUs, "achieve 33% to 39% MFU", computed with the
# H100 SXM's peak (its footnote 2; `get_peak_flops` in that commit returns 989e12). The
# model is built on the {term}`meta device` from Llama 3.1 8B's configuration, to count
# its parameters without allocating them:

# %%
from fsdp_guide.fp8 import quiet_torchao
from fsdp_guide.mfu import flops_per_token, matmul_parameters, mfu

quiet_torchao()  # transformers imports torchao, whose import logs about CUDA kernels a CPU cannot load
# tqdm's notebook import: no widgets here
warnings.filterwarnings("ignore", message="IProgress not found")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

llama_3_1_8b = LlamaConfig(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=False,
)
with torch.device("meta"):
    llama = LlamaForCausalLM(llama_3_1_8b)
shape = dict(n_layers=32, n_heads=32, head_dim=128, seq_len=8192)
per_token = flops_per_token(llama, **shape)
print(
    f"parameters {sum(p.numel() for p in llama.parameters()):,}; in matmuls {matmul_parameters(llama):,} "
    f"(the input embedding is a lookup); FLOPs per token {per_token / 1e9:.1f} G"
)

tokens_per_s, h100 = 5_762, 989e12  # per GPU; the H100 SXM's dense bf16 peak, FLOP/s
ways = {
    "right: whole model, attention, dense peak": mfu(tokens_per_s, per_token, h100),
    "the sparse peak the datasheet headlines": mfu(tokens_per_s, per_token, 2 * h100),
    "a rank's shard of the parameters (1/8)": mfu(
        tokens_per_s, flops_per_token(matmul_parameters(llama) // 8, **shape), h100
    ),
    "6N alone, attention left out": mfu(tokens_per_s, 6 * matmul_parameters(llama), h100),
}
for way, value in ways.items():
    print(f"{way:42} MFU {value:6.1%}")
print(
    f"attention's share of the FLOPs per token: {1 - 6 * matmul_parameters(llama) / per_token:.0%}"
)
glue("llm_mfu_right", ways["right: whole model, attention, dense peak"], display=False)

# %% [markdown]
# The right way gives the published figure's lower end ({glue:text}`llm_mfu_right:.1%`, printed above; torchtitan's other
# three runs give the rest of its range, checked in `tests/test_mfu.py`). The sparse peak halves it; a rank's shard
# (what a parameter's local tensor holds under FSDP: count a DTensor's `numel()`, the whole
# parameter's, not its `to_local()`'s) divides the matmul term by the number of ranks; and
# leaving attention out loses its share (printed last), which grows with the sequence length. The formula itself is checked against torch's own FLOP counter
# (`torch.utils.flop_counter.FlopCounterMode`) on this page's GPT in the same test file.
#
# (llm-tips)=
# ## The tips behind this
#
# - {ref}`tip-exact-resume`: save the data position and the RNG, publish atomically.
# - {ref}`tip-meta-init-cpu`: built on `meta`, initialised inside `summon_full_params`,
#   which is exact on a CPU mesh too.
# - {ref}`tip-custom-init-summon`: the same seed on every rank inside the context.
# - {ref}`tip-clip-grad-norm`: `clip_grad_norm_` on DTensor gradients clips by the global norm.
# - {ref}`tip-async-checkpoint`: write checkpoints in the background, one at a time.
# - {ref}`tip-mfu`: MFU from the whole model, with attention, over the dense peak.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("llm")
