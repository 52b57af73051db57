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
# (tutorial-pipeline-bubble)=
# # The pipeline bubble
#
# **What you will learn**
#
# - what a pipeline schedule does in time: each stage's forward and backward of every
#   micro-batch, measured and drawn, for GPipe and 1F1B on 2 stages;
# - the idle time of each stage (the *bubble*) against the schedule's formula
#   (*p* - 1) / (*m* + *p* - 1): more micro-batches, a smaller bubble;
# - that 1F1B runs its chunks in another order than GPipe but idles about as long: what
#   it saves is memory.
#
# **What you need**: a CPU; 2 processes on gloo; about 30 seconds on 2 CPU cores ({ref}`measured <measured-times>`).
# The worker code is written to run unchanged with one GPU per rank (NCCL): the stages are
# built on {func}`fsdp_guide.device`. The previous page, {ref}`tutorial-pipeline`, cuts
# the GPT into the stages timed here and shards them with FSDP2; this one leaves FSDP out,
# to see the schedules alone.
# The tips it demonstrates are listed {ref}`at the end <pipeline-bubble-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`pipeline-bubble-script` ({download}`download <scripts/pipeline_bubble.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# ## Two stages, timed
#
# The same two stages of the package's GPT as on the previous page,
# {ref}`tutorial-pipeline` (the code, repeated from there, is folded): the first takes
# tokens and returns the hidden states after half the blocks, the last returns logits
# (with its own, untied copy of the output head).

# %% tags=["hide-input"]
import torch.nn as nn
import torch.nn.functional as F
from fsdp_guide.gpt import GPT, GPTConfig

STAGES = 2


class FirstStage(nn.Module):
    """The embeddings and the first blocks: tokens in, hidden states out."""

    def __init__(self, gpt: GPT, blocks: range):
        super().__init__()
        self.tok_emb, self.pos_emb = gpt.tok_emb, gpt.pos_emb
        self.blocks = nn.ModuleList(gpt.blocks[i] for i in blocks)

    def forward(self, idx):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return x


class LastStage(nn.Module):
    """The last blocks, the final norm and the output head: hidden states in, logits out."""

    def __init__(self, gpt: GPT, blocks: range):
        super().__init__()
        self.blocks = nn.ModuleList(gpt.blocks[i] for i in blocks)
        self.ln_f = gpt.ln_f
        # The GPT ties its head to the token embedding, which lives on the other stage: a
        # tensor cannot sit on two ranks, so this stage gets its own copy (untied).
        self.lm_head = nn.Linear(gpt.config.n_embd, gpt.config.vocab_size, bias=False)
        self.lm_head.weight = nn.Parameter(gpt.lm_head.weight.detach().clone())

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def split(config: GPTConfig, seed: int = 0) -> list[nn.Module]:
    """The seeded GPT, cut into ``STAGES`` (two) stages after half its blocks."""
    torch.manual_seed(seed)
    gpt = GPT(config)
    gpt.init_weights()
    half = config.n_layer // 2
    return [FirstStage(gpt, range(half)), LastStage(gpt, range(half, config.n_layer))]


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# %% [markdown]
# A stage that notes when each of its forward and backward chunks starts and ends, after
# a device synchronise:

# %%
import time

import fsdp_guide
import torch.distributed as dist
from fsdp_guide import launch
from torch.distributed.pipelining import PipelineStage


class TimedStage(PipelineStage):
    """A ``PipelineStage`` that records ``(kind, micro-batch, start, end)`` per chunk."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.spans = []

    def _timed(self, kind, compute, chunk, *args, **kwargs):
        sync = torch.get_device_module(self.device).synchronize  # a no-op on the CPU
        sync()
        start = time.perf_counter()
        out = compute(chunk, *args, **kwargs)
        sync()
        self.spans.append((kind, chunk, start, time.perf_counter()))
        return out

    def forward_one_chunk(self, chunk, *args, **kwargs):
        return self._timed("F", super().forward_one_chunk, chunk, *args, **kwargs)

    def backward_one_chunk(self, chunk, *args, **kwargs):
        return self._timed("B", super().backward_one_chunk, chunk, *args, **kwargs)


# %% [markdown]
# (pipeline-bubble)=
# ## The bubble
#
# A stage waits for the one before it to send its first activations, and the first stage
# waits for the last to send back its first gradients: the pipeline's *bubble*. With *p*
# equal stages and *m* micro-batches, each taking the same time, a stage is idle for
# (*p* - 1) / (*m* + *p* - 1) of the step: more micro-batches, a smaller bubble. The
# [GPipe paper](https://arxiv.org/abs/1811.06965) gives GPipe's as
# O((*K* - 1) / (*M* + *K* - 1)) for *K* partitions and *M* micro-batches, and
# [Narayanan et al. (2021)](https://arxiv.org/abs/2104.04473), section 2.2.1, show 1F1B's
# ("PipeDream-Flush") to be the same, (*p* - 1) / *m* of the ideal time.
#
# Timing it needs each stage on a CPU core of its own, or the stages would slow each other
# down instead of waiting: the site's build runs the next cell (tagged `alone`) while no
# other page's cell runs. So these runs are 2 ranks, one per stage, without FSDP, on a
# larger GPT than the previous page's so that computing dominates each micro-batch. Each rank records its chunks in
# three steps after the first; the table gives the three steps' mean time, and each
# stage's idle fraction of the three together, since one step's varies from the next's
# (the last column: the largest minus the smallest of the three steps' mean idle
# fractions).
#
# What a span measures: on the CPU a kernel runs when it is called, so a chunk's span is
# its compute (and the synchronise adds nothing). On a GPU, as expectation rather than a
# run: the same synchronise would also wait for the sends the schedule posts without
# waiting (`_step_microbatches` in `torch/distributed/pipelining/schedules.py`), so a span
# would include communication; timing the compute alone there takes CUDA events recorded
# on the compute stream around each chunk.

# %% tags=["alone"]
import os

from fsdp_guide.table import Table
from IPython.display import display

TIMED = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=384)


def timed_steps(schedule, n_microbatches, micro_batch=8, steps=3):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    device = fsdp_guide.device()
    pp = dist.get_rank()
    stage = TimedStage(
        split(TIMED)[pp].to(device), stage_index=pp, num_stages=STAGES, device=device
    )
    schedule_class = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[schedule]
    pipeline = schedule_class(stage, n_microbatches=n_microbatches, loss_fn=loss_fn)
    batch = torch.randint(
        0, 256, (n_microbatches * micro_batch, 65), generator=torch.Generator().manual_seed(1)
    )
    batch = batch.to(device)
    kept = []
    for step in range(1 + steps):  # the first step also learns the shapes; the next ones are kept
        stage.spans = []
        dist.barrier()  # both ranks start the step together
        start = time.perf_counter()
        if pp == 0:
            pipeline.step(batch[:, :-1])
        else:
            pipeline.step(target=batch[:, 1:], losses=[])
        seconds = time.perf_counter() - start
        if step:
            kept.append(
                {
                    "seconds": seconds,
                    "spans": [
                        (k, chunk, s - start, e - start) for k, chunk, s, e, *_ in stage.spans
                    ],
                }
            )
    return kept


timed = {
    (schedule, m): launch(timed_steps, schedule, m, world_size=2, output="none")
    for schedule, m in [
        ("GPipe", 1),
        ("GPipe", 2),
        ("GPipe", 4),
        ("GPipe", 8),
        ("1F1B", 4),
        ("1F1B", 8),
    ]
}


def step_seconds(ranks):
    """Each kept step's time: its slowest rank's."""
    return [max(steps[i]["seconds"] for steps in ranks) for i in range(len(ranks[0]))]


def bubble(ranks):
    """Each rank's idle fraction of the kept steps together: the time outside its chunks.

    That includes waiting, and also what runs between chunks: the last stage's loss, and
    after the last backward the schedule's ``perform_reduce_grad``, which here (no FSDP on
    these stages) only divides the gradients by the number of micro-batches. Over several
    steps, because one step's fraction varies from the next's (``spread``, printed).
    """
    busy = [sum(e - s for step in steps for _, _, s, e in step["spans"]) for steps in ranks]
    return [1 - b / sum(step_seconds(ranks)) for b in busy]


def spread(ranks):
    """How much the two stages' mean idle fraction varied from one kept step to the next (largest minus smallest)."""
    means = [
        sum(1 - sum(e - s for _, _, s, e in steps[i]["spans"]) / seconds for steps in ranks)
        / len(ranks)
        for i, seconds in enumerate(step_seconds(ranks))
    ]
    return max(means) - min(means)


print(f"{os.cpu_count()} CPU cores here, one rank per stage")
rows = []
for (schedule, m), ranks in timed.items():
    idle, p, seconds = bubble(ranks), len(ranks), step_seconds(ranks)
    fractions = [f"{x:.2f}" for x in (*idle, (p - 1) / (m + p - 1), spread(ranks))]
    rows.append([schedule, m, f"{sum(seconds) / len(seconds):.3f}", *fractions])
header = ["schedule", "micro-batches", "step (s)", "idle, stage 0", "idle, stage 1"]
display(Table(header + ["(p-1)/(m+p-1)", "step to step"], rows))

# %% [markdown]
# The last kept step drawn from those records, one character per slice of time: a digit is a
# forward of that micro-batch, a letter its backward (`a` for micro-batch 0), a dot is
# neither (waiting, or the work between chunks):


# %%
def timeline(ranks, width=72):
    """One row per stage; micro-batches 0 to 9 (one character each)."""
    step = max(r["seconds"] for r in ranks)
    rows = []
    for rank, r in enumerate(ranks):
        row = ["."] * width
        for kind, chunk, start, end in r["spans"]:
            first = int(start / step * width)
            last = min(width, max(int(end / step * width), first + 1))  # at least one column
            row[first:last] = (str(chunk) if kind == "F" else chr(ord("a") + chunk)) * (
                last - first
            )
        rows.append(f"stage {rank} |{''.join(row)}|")
    return "\n".join(rows)


def order(r):
    """The stage's chunks in the order they started: the schedule's order, whatever their lengths."""
    return " ".join(
        str(chunk) if kind == "F" else chr(ord("a") + chunk)
        for kind, chunk, *_ in sorted(r["spans"], key=lambda span: span[2])
    )


for key in [("GPipe", 4), ("1F1B", 4)]:
    last = [steps[-1] for steps in timed[key]]
    print(f"{key[0]}, {key[1]} micro-batches, {max(r['seconds'] for r in last):.2f} s")
    print(timeline(last))
    for rank, r in enumerate(last):
        print(f"  stage {rank} ran: {order(r)}")

# %% [markdown]
# The same two steps drawn to scale: each bar a chunk, numbered by its micro-batch, forwards
# blue and backwards orange; the white in a stage's row is its bubble.

# %% tags=["hide-input"] mystnb={"image": {"alt": "Two timelines, GPipe and 1F1B with 4 micro-batches on 2 stages: each stage's forwards and backwards drawn as numbered bars in time, the stage's idle time (the bubble) left white: at both ends of stage 1's row and in the middle of stage 0's."}}
import matplotlib.pyplot as plt

fig, axes = plt.subplots(2, 1, figsize=(10, 3.6))  # each step to its own scale
for ax, key in zip(axes, [("GPipe", 4), ("1F1B", 4)]):
    last = [steps[-1] for steps in timed[key]]
    for stage, r in enumerate(last):
        for kind, chunk, start, end in r["spans"]:
            color = "tab:blue" if kind == "F" else "tab:orange"
            ax.broken_barh([(start * 1000, (end - start) * 1000)], (stage - 0.4, 0.8), color=color)
            ax.text(
                (start + end) / 2 * 1000, stage, str(chunk), ha="center", va="center", fontsize=8
            )
    ax.set_yticks([0, 1], ["stage 0", "stage 1"])
    ax.invert_yaxis()
    ax.set_title(f"{key[0]}, {key[1]} micro-batches (blue: forward, orange: backward)", fontsize=9)
    ax.set_xlabel("ms since the step began", fontsize=8)
fig.tight_layout()

# %% [markdown]
# What the drawing shows:
#
# - **The fill and the drain.** Stage 1 starts only when stage 0's first forward arrives,
#   and finishes first, waiting while stage 0 runs its last backward: its bubble is at the
#   two ends of its row. Stage 0's is in the middle, between its forwards and its
#   backwards, waiting for the last stage's first gradients (and at its very end, the
#   schedule's `perform_reduce_grad`, outside the chunks: these timed stages have no FSDP,
#   so it only divides the gradients by the number of micro-batches; with FSDP it would also
#   reduce-scatter them).
# - **GPipe** runs every forward, then every backward; **1F1B**, after as many forwards as
#   there are stages from it to the last, alternates one backward and one forward. Its
#   steady state frees each micro-batch's activations as soon as it can (the "alive"
#   column of {ref}`pipeline-all-gathers`). Its bubble in theory is GPipe's (cited above): what 1F1B saves is
#   memory, not idle time.
# - **What the formula leaves out**: the time of each message, the work between chunks
#   (the last stage computes its loss outside them, drawn as dots), and stages of
#   different speeds, which would make the faster stage wait more and the slower less.
#   The measured idle fractions differ from the formula's, above or below; which of these
#   makes the difference is not separated on this page.
#
# Schedules with several stages per rank (`ScheduleInterleaved1F1B`) and those that split
# each backward into its input and weight gradients (the zero-bubble ones) shrink the
# bubble further; they are not run here.

# %% [markdown]
# (pipeline-bubble-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/pipeline_bubble.py`.
# `torchrun --nproc-per-node=2 pipeline_bubble.py` makes each rank one stage of a small
# model, times a few steps of `ScheduleGPipe` with 1 and with 4 micro-batches, and rank 0
# prints, for each, the order each stage ran its chunks in and each stage's idle fraction
# beside the formula's. The tests run this file under torchrun on 2 CPU ranks and check
# what timing cannot change: the order of the chunks (every forward, then every backward),
# and idle fractions that are numbers in [0, 1) (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/pipeline_bubble.py
# :language: python
# ```

# %% [markdown]
# (pipeline-bubble-tips)=
# ## The tips behind this
#
# - {ref}`tip-pipeline-micro-batches`: more micro-batches, a smaller bubble; 1F1B for its memory.
# - {ref}`tip-pipeline-keep-gathered` (proved on {ref}`tutorial-pipeline`): under pipelining,
#   shard each stage with `reshard_after_forward=False`.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("pipeline_bubble")
