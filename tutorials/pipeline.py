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
#   all-gathers of one step, counted, with and without, for GPipe and 1F1B, what each
#   setting holds, and how many micro-batches' activations each schedule keeps alive.
#
# What the schedules do in time (the idle time, or *bubble*) is the next page's idea:
# {ref}`tutorial-pipeline-bubble`.
#
# **What you need**: a CPU; 4 processes on gloo; about 10 seconds on 2 CPU cores ({ref}`measured <measured-times>`).
# The worker code is written to run unchanged with one GPU per rank (NCCL): the mesh and
# the stages are built on {func}`fsdp_guide.device`. This page shows what runs and what is
# exact, not speed.
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
# To see that order, the stage below notes each forward and backward chunk as it runs, and
# what the stage holds when the chunk is done: its parameters and gradients, counted from
# the live tensors by {func}`fsdp_guide.memory.measure` (gathered parameters beside the
# shards, and the whole-size gradients FSDP2 accumulates while gradient sync is off):

# %%
from fsdp_guide.memory import measure
from torch.distributed.pipelining import PipelineStage


class RecordingStage(PipelineStage):
    """A ``PipelineStage`` that records ``(kind, micro-batch, params bytes, grads bytes)`` per chunk."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.spans = []

    def _recorded(self, kind, compute, chunk, *args, **kwargs):
        out = compute(chunk, *args, **kwargs)
        held = measure(self.submod)
        self.spans.append((kind, chunk, held.params, held.grads))
        return out

    def forward_one_chunk(self, chunk, *args, **kwargs):
        return self._recorded("F", super().forward_one_chunk, chunk, *args, **kwargs)

    def backward_one_chunk(self, chunk, *args, **kwargs):
        return self._recorded("B", super().backward_one_chunk, chunk, *args, **kwargs)


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
from fsdp_guide.table import Table
from IPython.display import display

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
    stage = RecordingStage(
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
        "spans": stage.spans,
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
rows = [
    [schedule, reshard, m, f"{mean_loss(ranks):.7f}", f"{grad_gap(ranks):.1e}"]
    for (schedule, reshard, m), ranks in runs.items()
]
header = ["schedule", "reshard after forward", "micro-batches", "loss", "max relative |grad gap|"]
display(Table(header, rows))

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


rows = []
for (schedule, reshard, m), ranks in runs.items():
    for r in (ranks[0], ranks[2]):  # rank 0 holds stage 0, rank 2 stage 1
        gathers, gathered = r["collectives"]["dp all-gather"]
        spans = r["spans"]
        sent = [gathers, f"{gathered / 2**20:.2f}", r["collectives"]["dp reduce-scatter"][0]]
        held = [f"{most(spans, 'F'):.2f}", f"{most(spans, 'B'):.2f}", f"{most(spans, what=3):.2f}"]
        rows.append([schedule, reshard, m, r["stage"], *sent, *held, alive(spans)])
header = ["schedule", "reshard", "m", "stage", "all-gathers", "gathered MiB", "reduce-scatters"]
header += ["params MiB after a forward", "params MiB after a backward", "grads MiB", "most alive"]
display(Table(header, rows))

# %% tags=["hide-input"] mystnb={"image": {"alt": "The parameters stage 0 holds after each forward (F) and backward (B) chunk of one step of 4 micro-batches, under GPipe and under 1F1B, resharded after forward and kept gathered: resharded, it holds only its shards after each forward and its whole parameters after the backwards; kept gathered, it holds them whole after every chunk."}}
import matplotlib.pyplot as plt

fig, axes = plt.subplots(1, 2, figsize=(10, 3), sharey=True)
for ax, schedule in zip(axes, ("GPipe", "1F1B")):
    for reshard, style in ((True, "o-"), (False, "s--")):
        spans = runs[schedule, reshard, 4][0]["spans"]  # rank 0: stage 0
        held = [params / 2**20 for _, _, params, _ in spans]
        label = "resharded after forward" if reshard else "kept gathered"
        ax.plot(range(len(spans)), held, style, label=label)
    ax.set_xticks(range(len(spans)), [f"{kind}{chunk}" for kind, chunk, *_ in spans])
    ax.set(
        title=f"{schedule}, 4 micro-batches: stage 0", xlabel="chunk, in the order the stage ran it"
    )
axes[0].set_ylabel("parameters held after it, MiB")
axes[0].legend(fontsize=8)
fig.tight_layout()

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
# micro-batches there are. How long each stage waits in either schedule (the *bubble*) is
# timed and drawn on the next page, {ref}`tutorial-pipeline-bubble`.

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
