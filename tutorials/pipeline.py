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
# (tutorial-pipeline)=
# # Pipeline stages with FSDP2
#
# **What you will learn**
#
# - how to split the GPT into two {term}`pipeline stages <pipeline parallelism>` with
#   `torch.distributed.pipelining`, place them on a 2D {term}`device mesh` (`pp` x `dp`,
#   4 ranks), and shard each stage with `fully_shard` over `dp`;
# - that a pipelined step of micro-batches computes the loss and gradients of one process
#   on the whole batch;
# - why pipelined stages keep their parameters gathered after forward
#   (`reshard_after_forward=False`, torchtitan's default under pipelining): the
#   all-gathers of one step, counted, with and without, for GPipe and 1F1B, and what each
#   setting holds;
# - what the schedules do in time: each rank's forward and backward of every micro-batch,
#   measured and drawn, the idle time (the *bubble*) against the schedule's formula, and
#   how many micro-batches' activations each schedule keeps alive.
#
# **What you need**: a CPU; 4 processes on gloo, then 2; about 45 seconds on 2 CPU cores ({ref}`measured <measured-times>`).
# The worker code is written to run unchanged with one GPU per rank (NCCL): the mesh and
# the stages are built on {func}`fsdp_guide.device`. This page shows what runs, what is
# exact and what the schedules do, not speed.
# The tips it demonstrates are listed {ref}`at the end <pipeline-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`pipeline-script` ({download}`download <scripts/pipeline.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# ## Two stages of the GPT
#
# A stage is an ordinary module that runs part of the model: the first takes tokens and
# returns the hidden states after its blocks, the last takes those and returns logits. The
# package's GPT ({class}`fsdp_guide.gpt.GPT`) is cut after half its blocks. torchtitan's
# `_split_module` ([`torchtitan/distributed/pipeline_parallel.py`](https://github.com/pytorch/torchtitan/blob/b5bcd76c66d0acb1a08b176d9639425bc55e0b2a/torchtitan/distributed/pipeline_parallel.py#L470-L530))
# keeps a stage's modules of a whole model and sets the others to `None`, which its models'
# forwards skip; the GPT's forward does not, so two small stage modules take its parts:

# %%
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
# Untying changes the model: a tied weight's gradient is the sum of its two uses, and here
# each copy gets its own, so after training they differ. Keeping them tied across stages
# would need the two gradients summed between the first and the last stage every step;
# this page does not do that. Its reference is the same two untied stages run one after
# the other in one process, so the comparison is like for like.
#
# ## A 2D mesh: stages over `pp`, FSDP2 over `dp`
#
# Four ranks form a 2 x 2 mesh. Along `pp`, rank 0 and rank 2 (and rank 1 and rank 3) are
# consecutive stages that send each other activations and their gradients; along `dp`,
# ranks 0 and 1 hold stage 0 and ranks 2 and 3 stage 1, each sharded by `fully_shard` over
# its pair and fed its own half of the batch. `PipelineStage` wraps a stage for the `pp`
# group; a schedule (`ScheduleGPipe`, `Schedule1F1B`) splits each rank's batch into
# micro-batches and runs their forwards and backwards in its order.
#
# To see that order, the stage below notes when each forward and backward chunk starts and
# ends, after a device synchronise, and what the stage holds when the chunk is done: its
# parameters and gradients, counted from the live tensors by {func}`fsdp_guide.memory.measure` (gathered parameters
# beside the shards, and the whole-size gradients FSDP2 accumulates while gradient sync is
# off):

# %%
import time

import torch.distributed as dist
from fsdp_guide.memory import measure
from torch.distributed.pipelining import PipelineStage


class TimedStage(PipelineStage):
    """A ``PipelineStage`` that records ``(kind, micro-batch, start, end, params bytes, grads bytes)`` per chunk."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.spans = []

    def _timed(self, kind, compute, chunk, *args, **kwargs):
        sync = torch.get_device_module(self.device).synchronize  # a no-op on the CPU
        sync()
        start = time.perf_counter()
        out = compute(chunk, *args, **kwargs)
        sync()
        end = time.perf_counter()
        held = measure(self.submod)
        self.spans.append((kind, chunk, start, end, held.params, held.grads))
        return out

    def forward_one_chunk(self, chunk, *args, **kwargs):
        return self._timed("F", super().forward_one_chunk, chunk, *args, **kwargs)

    def backward_one_chunk(self, chunk, *args, **kwargs):
        return self._timed("B", super().backward_one_chunk, chunk, *args, **kwargs)


# %% [markdown]
# The worker: build the mesh, this rank's stage, sharded over `dp`, and the schedule; run
# one step, then count the collectives of the next one, per mesh dimension, with
# {func}`fsdp_guide.collectives.count_collectives`. The first step is different: given no
# `input_args`, `PipelineStage` learns the shapes the stages exchange by running a real
# forward and backward first, then reshards and drops those gradients
# (`_forward_metadata_inference` and `_post_metadata_inference_cleanup` in
# [`torch/distributed/pipelining/stage.py`](https://github.com/pytorch/pytorch/blob/main/torch/distributed/pipelining/stage.py)),
# so its collectives are not a step's:

# %%
import fsdp_guide
from fsdp_guide import launch
from fsdp_guide.collectives import count_collectives
from fsdp_guide.compare import largest_difference

CONFIG = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=128)
# the global batch
BATCH = torch.randint(0, 256, (16, 33), generator=torch.Generator().manual_seed(1))


def pipelined_step(schedule, reshard_after_forward, n_microbatches):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    device = fsdp_guide.device()
    mesh = init_device_mesh(device.type, (STAGES, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    module = split(CONFIG)[pp].to(device)
    for block in module.blocks:
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
    fully_shard(module, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
    stage = TimedStage(
        module, stage_index=pp, num_stages=STAGES, device=device, group=mesh.get_group("pp")
    )
    schedule_class = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[schedule]
    # scale_grads=True (the default): the summed micro-batch gradients are divided by
    # n_microbatches, once, after FSDP's reduce-scatter has averaged them over dp.
    pipeline = schedule_class(stage, n_microbatches=n_microbatches, loss_fn=loss_fn)
    local = BATCH.chunk(2)[dp].to(device)  # this dp rank's half of the batch
    inputs, targets = local[:, :-1], local[:, 1:]

    def step(losses):
        stage.spans = []
        if pp == 0:
            pipeline.step(inputs)  # the first stage takes the inputs
        else:
            pipeline.step(target=targets, losses=losses)  # the last computes the loss

    step([])  # the first step also learns the shapes the stages exchange
    for p in module.parameters():
        p.grad = None
    losses = []
    with count_collectives(mesh) as seen:
        step(losses)
    return {
        "stage": pp,
        "losses": [loss.item() for loss in losses],
        "grads": {name: p.grad.full_tensor().cpu() for name, p in module.named_parameters()},
        "collectives": {f"{dim} {kind}": (n, nbytes) for dim, kind, n, nbytes in seen.rows()},
        "units": sum(
            isinstance(m, FSDPModule) for m in module.modules()
        ),  # this stage's FSDP units
        "spans": [(k, chunk, params, grads) for k, chunk, _, _, params, grads in stage.spans],
    }


# %% [markdown]
# The reference is one process running the same two stages one after the other on the
# whole batch. Then each schedule runs with 4 and 8 micro-batches per rank, every unit of
# its stages (the stage's root included) resharded after forward, or kept gathered.
# (`fully_shard`'s default, `None`, reshards every unit but the root.)


# %%
def one_process():
    """The loss and each stage's gradients of one process on the whole batch."""
    stages = split(CONFIG)
    loss = loss_fn(stages[1](stages[0](BATCH[:, :-1])), BATCH[:, 1:])
    loss.backward()
    return loss.item(), [{name: p.grad for name, p in stage.named_parameters()} for stage in stages]


reference_loss, reference_grads = one_process()
runs = {
    (schedule, reshard, m): launch(
        pipelined_step, schedule, reshard, m, world_size=4, output="none"
    )
    for schedule in ("GPipe", "1F1B")
    for reshard in (True, False)
    for m in (4, 8)
}


def mean_loss(ranks):
    """The mean over the last stage's ranks (dp) of the mean over their micro-batches."""
    per_rank = [sum(r["losses"]) / len(r["losses"]) for r in ranks if r["stage"] == 1]
    return sum(per_rank) / len(per_rank)


def grad_gap(ranks):
    """The largest difference from one process, relative to that parameter's largest gradient."""
    return largest_difference(
        (
            (r["grads"][name], reference_grads[r["stage"]][name])
            for r in ranks
            for name in r["grads"]
        ),
        relative=True,
    )


print(f"one process: loss {reference_loss:.7f}")
print(
    f"{'schedule':9} {'reshard after forward':>21} {'micro-batches':>13} {'loss':>10} {'max relative |grad gap|':>24}"
)
for (schedule, reshard, m), ranks in runs.items():
    print(
        f"{schedule:9} {str(reshard):>21} {m:13} {mean_loss(ranks):10.7f} {grad_gap(ranks):24.1e}"
    )

# %% [markdown]
# Every schedule, either way, computes the one-process loss and gradients to float32's
# rounding (the gap is relative to each parameter's largest gradient): the sums run in
# another order (per micro-batch, then per rank), nothing else differs. The mean of the
# micro-batches' mean losses is the batch's mean only because every micro-batch has as
# many tokens; with padding or ignored tokens, weigh them
# ({ref}`tutorial-loss-and-accumulation`). `scale_grads=True`, the schedule's default,
# divides the summed gradients by the number of micro-batches, right for a loss that is a
# mean ([`torch/distributed/pipelining/schedules.py`](https://github.com/pytorch/pytorch/blob/main/torch/distributed/pipelining/schedules.py));
# with a summed loss, pass `scale_grads=False`.
#
# (pipeline-all-gathers)=
# ## All-gathers per micro-batch
#
# The same step's collectives on each rank, the most each rank's stage held after any
# forward and after any backward (parameters, gradients), and the most micro-batches alive
# at once (their forward done, their backward not yet: their activations are held):

# %%
mib = [
    sum(p.numel() * p.element_size() for p in stage.parameters()) / 2**20 for stage in split(CONFIG)
]
print(
    f"parameters: stage 0 {mib[0]:.2f} MiB, stage 1 {mib[1]:.2f} MiB (whole); "
    f"FSDP units per stage: {runs['GPipe', True, 4][0]['units']}"
)
same = all(
    ranks[0]["collectives"] == ranks[1]["collectives"]
    and ranks[2]["collectives"] == ranks[3]["collectives"]
    for ranks in runs.values()
)
print(f"ranks 1 and 3 ran the same collectives as ranks 0 and 2: {same}")
print(f"{'':31} {'':>12} {'':>15} {'MiB held: params after':>22} {'grads':>7}")
print(
    f"{'schedule':9} {'reshard':>6} {'m':>2} {'all-gathers':>11} {'gathered MiB':>12} {'reduce-scatters':>15} "
    f"{'a forward':>10} {'a backward':>11} {'most':>7} {'alive':>5}"
)


def alive(spans):
    """The most micro-batches whose forward ran and whose backward has not."""
    held = most = 0
    for kind, *_ in spans:
        held += 1 if kind == "F" else -1
        most = max(most, held)
    return most


def most(spans, kind=None, what=2):
    """The most bytes (``what``: 2 parameters, 3 gradients) held after a chunk of ``kind`` (default: any), in MiB."""
    return max(span[what] for span in spans if kind in (None, span[0])) / 2**20


for (schedule, reshard, m), ranks in runs.items():
    for r in (ranks[0], ranks[2]):  # rank 0 holds stage 0, rank 2 stage 1
        gathers, gathered = r["collectives"]["dp all-gather"]
        label = (
            f"{schedule:9} {str(reshard):>6} {m:2}" if r is ranks[0] else f"{'':9} {'':>6} {'':>2}"
        )
        print(
            f"{label} {gathers:11} {gathered / 2**20:12.2f} {r['collectives']['dp reduce-scatter'][0]:15} "
            f"{most(r['spans'], 'F'):10.2f} {most(r['spans'], 'B'):11.2f} {most(r['spans'], what=3):7.2f} "
            f"{alive(r['spans']):5}   stage {r['stage']}"
        )

# %% [markdown]
# Read it stage by stage, each stage being 3 FSDP units (its 2 blocks and the stage
# itself), sharded over 2 ranks: a stage's shards are half its parameters, and gathered it
# holds them beside their whole copy.
#
# - **Resharded after forward** (`reshard=True`), a stage all-gathers its units again and
#   again: m + 1 times in a step of m micro-batches, for GPipe and 1F1B alike, and the bytes
#   grow with them. A unit is gathered whenever a chunk finds it resharded. Each forward
#   reshards it; a backward does not, because the schedule calls
#   `set_reshard_after_backward(False)` before every backward
#   (`backward_maybe_with_nosync` in `stage.py`). So GPipe gathers for each forward and for
#   the first backward. 1F1B gathers for the forwards before its first backward, and for
#   each backward that follows a forward; stage 0's last backward follows a backward and
#   finds its units still gathered.
# - **Kept gathered** (`reshard=False`), each unit is gathered once per step, whatever the
#   number of micro-batches: one all-gather per unit, the fewest there can be.
# - **Gradients are reduced once per step** either way, one reduce-scatter per unit: the
#   schedule turns gradient sync off for every micro-batch's backward, then
#   `perform_reduce_grad` turns it back on and runs FSDP's post-backward itself, once
#   (both in `stage.py`). Until then, FSDP2 accumulates whole-size gradients: the gradients
#   column holds a whole stage's worth, either way.
# - **What keeping it gathered costs.** After a forward, a resharded stage holds only its
#   shards, a gathered one its whole parameters as well. After a backward both hold them
#   whole, with a whole stage's gradients beside them: the most either holds after a chunk
#   is the same. Under GPipe the first backward gathers the stage again while every
#   micro-batch's activations are still alive, so resharding after forward does not lower
#   the step's peak; it only comes later.
#
# torchtitan avoids those per-micro-batch all-gathers: by default it shards with
# `reshard_after_forward = not pp_enabled`, "to avoid per-microbatch all-gathers, which
# can be expensive and non-overlapped" (`get_fsdp_reshard_after_forward_policy` in
# [`torchtitan/distributed/fsdp.py`](https://github.com/pytorch/torchtitan/blob/b5bcd76c66d0acb1a08b176d9639425bc55e0b2a/torchtitan/distributed/fsdp.py#L112-L136)).
#
# The last column counts, from the order the stage ran its chunks in, the micro-batches
# whose forward ran and whose backward had not yet: their activations are alive at once.
# GPipe runs every forward before any backward, so every micro-batch's activations are
# held; 1F1B starts the backwards as soon as it can, so a stage holds at most as many as
# there are stages from it to the last (2 on stage 0, 1 on stage 1), however many
# micro-batches there are.
#
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
# other page's cell runs. So these runs are 2 ranks, one per stage, without `dp`, on a
# larger GPT so that computing dominates each micro-batch. Each rank records its chunks in
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
print(
    f"{'schedule':9} {'micro-batches':>13} {'step (s)':>9} {'idle, stage 0':>13} {'idle, stage 1':>13} "
    f"{'(p-1)/(m+p-1)':>13} {'step to step':>12}"
)
for (schedule, m), ranks in timed.items():
    idle, p, seconds = bubble(ranks), len(ranks), step_seconds(ranks)
    print(
        f"{schedule:9} {m:13} {sum(seconds) / len(seconds):9.3f} {idle[0]:13.2f} {idle[1]:13.2f} "
        f"{(p - 1) / (m + p - 1):13.2f} {spread(ranks):12.2f}"
    )

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
#   column above). Its bubble in theory is GPipe's (cited above): what 1F1B saves is
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
# (pipeline-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/pipeline.py`.
# `torchrun --nproc-per-node=4 pipeline.py` starts the ranks on a 2 x 2 (`pp`, `dp`) mesh; each
# shards its stage over `dp`, kept gathered, and trains with `Schedule1F1B` on 4 micro-batches of
# its half of every batch, and rank 0 prints the largest differences in losses and weights (every
# rank checking its own stage) from the uncut model trained in one process. The tests run this
# file under torchrun on 4 CPU ranks and check that both are at most 1e-5 (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/pipeline.py
# :language: python
# ```

# %% [markdown]
# (pipeline-tips)=
# ## The tips behind this
#
# - {ref}`tip-pipeline-keep-gathered`: under pipelining, shard each stage with
#   `reshard_after_forward=False`.
# - {ref}`tip-check-against-one-process`: the check this page runs for every schedule.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("pipeline")
