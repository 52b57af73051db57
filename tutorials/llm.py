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
# # Training a small LLM with FSDP2: the recipe
#
# **What you will learn**
#
# - the whole FSDP2 recipe for a GPT-style model, in the order it has to happen: build on
#   the {term}`meta device`, shard each block then the root, initialise after sharding;
# - one optimizer step: AdamW, gradient clipping over the global norm, gradient accumulation
#   that reduce-scatters once per step;
# - the loss curve of 40 steps, and exporting one file for inference;
# - that the notebook runs the same code as `torchrun -m fsdp_guide.recipes.train_llm`.
#
# **What you need**: a CPU; 2 processes on gloo; about 15 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The
# recipe is written to run unchanged with one GPU per rank (NCCL): each rank computes on
# {func}`fsdp_guide.device`, its GPU `cuda:LOCAL_RANK` where it has one, else the CPU, and
# `precision="auto"` then picks bf16 (fp16 with a gradient scaler on GPUs without bf16),
# where on the CPU it trains in fp32 (`compute_dtype` and `train` in
# `fsdp_guide.recipes.train_llm`; the dtype of this page's run is printed with its losses).
# The text is the Python documentation that ships with every Python (`pydoc_data`), read
# as bytes: nothing is downloaded. The recipe's checkpoints, which resume exactly, are
# {ref}`the next page <tutorial-llm-checkpoints>`; how much of the hardware it uses,
# {ref}`the one after <tutorial-mfu>`. The tips it demonstrates are listed
# {ref}`at the end <llm-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`llm-script` ({download}`download <scripts/llm.py>`).

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
# Its model is built by `build_model`, in two steps, `shard_model` then `init_sharded`:
#
# ```{literalinclude} ../src/fsdp_guide/recipes/train_llm.py
# :language: python
# :pyobject: shard_model
# ```
#
# ```{literalinclude} ../src/fsdp_guide/recipes/train_llm.py
# :language: python
# :pyobject: init_sharded
# ```
#
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
# others are still `DTensor` shards). The harness that counts them is folded; its output follows:

# %% tags=["hide-input"]
import fsdp_guide
from fsdp_guide import launch, summon_full_params
from fsdp_guide.recipes import train_llm
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
# One optimizer step, `train_step`, over `grad_accum` micro-batches, with AdamW and a
# warm-up and cosine schedule from `build_optimizer`:
#
# ```{literalinclude} ../src/fsdp_guide/recipes/train_llm.py
# :language: python
# :pyobject: train_step
# ```
#
# The gradients of the earlier micro-batches stay local, and the last one reduce-scatters
# their sum, once per step. `clip_grad_norm_` on the sharded gradients (`DTensor`s) clips
# by the norm of the whole gradient, as one process would. The loss each rank computed is
# averaged over the ranks for the log.
#
# ## The loss curve
#
# Now train 40 steps on 2 ranks, and write the trained model to one file at the end
# (`export`, below):

# %%
import dataclasses
import math
import tempfile
from pathlib import Path

from fsdp_guide.recipes.train_llm import train

# deleted, with what the page wrote, when the kernel exits
scratch = tempfile.TemporaryDirectory(prefix="llm-")
workdir = Path(scratch.name)
export = workdir / "model.pt"
straight = launch(
    train, dataclasses.replace(config, export=str(export)), world_size=2, output="none"
)[0]
print(f"computed in {straight['dtype']}")
print(
    f"step  1: loss {straight['losses'][0]:.4f}   (ln 256 = {math.log(256):.4f}: a uniform guess over bytes)"
)
for step in range(10, 41, 10):
    print(f"step {step:2}: loss {straight['losses'][step - 1]:.4f}")

# the figures the text quotes, from this run (JupyterLab shows glue's roles unrendered)
from myst_nb import glue

glue("llm_final_loss", straight["losses"][39], display=False)  # step 40's, printed above

# %% mystnb={"image": {"alt": "Loss of the byte-level GPT over 40 steps on 2 ranks, starting near the dotted line at ln 256 (a uniform guess over bytes) and falling well below it."}}
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(range(1, 41), straight["losses"], label="40 steps")
ax.axhline(
    torch.log(torch.tensor(256.0)).item(), color="gray", ls=":", label="ln 256: uniform guess"
)
ax.set(xlabel="step", ylabel="loss (mean over ranks)", title="a byte-level GPT on 2 ranks")
ax.legend()
fig.tight_layout()

# %% [markdown]
# The loss starts near ln 256 (a uniform guess over bytes; step 1 above) and falls as the
# model learns which bytes follow which.
#
# ## One file for inference
#
# `export="model.pt"` gathered the full state dict on rank 0 at the end of the run
# ({func}`fsdp_guide.checkpoint.export_consolidated`) into a plain `torch.save` file,
# which loads into the unsharded model with `weights_only=True`:

# %%
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
# tensor, not FSDP's share alone); on a GPU, `torch.cuda.max_memory_allocated`. The last
# line, the run's {term}`MFU`, is {ref}`the MFU page <tutorial-mfu>`'s subject:

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

# %% [markdown]
# (llm-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/llm.py`.
# A small GPT over bytes (its own source file is the text), built on the meta device,
# `fully_shard` on each block then the root, its shards allocated on the rank's device and
# initialised inside `summon_full_params` one unit at a time, then trained with AdamW and
# clipping over the global norm, each rank on its rows of every global batch. Rank 0 prints
# the loss every 10 steps. The tests run this file under torchrun on 2 CPU ranks and check
# that the loss falls by more than a nat per byte, with no NaN (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/llm.py
# :language: python
# ```

# %% [markdown]
# (llm-tips)=
# ## The tips behind this
#
# - {ref}`tip-meta-init-cpu`: built on `meta`, initialised inside `summon_full_params`,
#   which is exact on a CPU mesh too.
# - {ref}`tip-custom-init-summon`: the same seed on every rank inside the context.
# - {ref}`tip-clip-grad-norm`: `clip_grad_norm_` on DTensor gradients clips by the global norm.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("llm")
