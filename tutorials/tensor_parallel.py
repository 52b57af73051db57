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
# (tutorial-tensor-parallel)=
# # Tensor parallelism and FSDP on a 2D mesh
#
# **What you will learn**
#
# - how a 2D {term}`device mesh` with named dimensions (`dp`, `tp`) groups 4 ranks, and
#   which process groups each dimension stands for;
# - how to apply {term}`tensor parallelism` (column-wise and row-wise `Linear`s, with
#   {term}`sequence parallelism` for the norms) to the GPT's attention and MLP, then shard
#   with `fully_shard` over `dp`, and what each rank then holds, strided shards included;
# - the collectives of one training step with FSDP alone, TP alone and both, counted per
#   mesh dimension with their bytes.
#
# **What you need**: a CPU; 4 processes on gloo; about 10 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The
# worker code is written to run unchanged with one GPU per rank (NCCL): the mesh is built
# on {func}`fsdp_guide.device`'s type. Tensor parallelism is expected to pay off on GPUs
# joined by a fast link (NVLink) inside a node; this page shows what runs, not speed.
# The tips it demonstrates are listed {ref}`at the end <tensor-parallel-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`tensor-parallel-script` ({download}`download <scripts/tensor_parallel.py>`).
#
# The pages after this one build on its plan: {ref}`2D training equals one process, and a 2D mesh alone is HSDP
# <tutorial-tp-exactness>`; {ref}`the gradients of a TP model <tutorial-tp-gradients>`; {ref}`loss parallel
# <tutorial-loss-parallel>`; {ref}`heads and context parallelism <tutorial-tp-attention>`; {ref}`checkpoints across
# meshes <tutorial-tp-checkpoints>`.

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# The model is the package's small GPT ({class}`fsdp_guide.gpt.GPT`): 2 blocks of
# attention (4 heads) and MLP, token and position embeddings, and an output head tied to
# the token embedding. One global batch of 8 sequences is the data of every run; one
# process training on all of it is the reference.

# %%
import fsdp_guide
import torch.distributed as dist
from fsdp_guide import launch
from fsdp_guide.gpt import GPT, GPTConfig
from torch.distributed.device_mesh import init_device_mesh

CONFIG = GPTConfig(block_size=16, n_layer=2, n_head=4, n_embd=32)
BATCH = 8  # sequences in the global batch


def build_model():
    torch.manual_seed(0)
    model = GPT(CONFIG)
    model.init_weights()
    return model


def global_batch(step=0):
    g = torch.Generator().manual_seed(100 + step)
    rows = torch.randint(CONFIG.vocab_size, (BATCH, CONFIG.block_size + 1), generator=g)
    return rows[:, :-1], rows[:, 1:]


def make_mesh(dp=2, tp=2):
    return init_device_mesh(fsdp_guide.device().type, (dp, tp), mesh_dim_names=("dp", "tp"))


def whole_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


# %% [markdown]
# (tp-mesh)=
# ## The mesh: 4 ranks as 2 x 2


# %%
from fsdp_guide.table import Table
from IPython.display import display


def where_am_i():
    mesh = make_mesh()
    dp, tp = mesh.get_coordinate()
    groups = {name: dist.get_process_group_ranks(mesh.get_group(name)) for name in ("dp", "tp")}
    return dist.get_rank(), dp, tp, groups["dp"], groups["tp"]


rows = launch(where_am_i, world_size=4, output="none")
display(Table(["rank", "dp", "tp", "its dp group", "its tp group"], rows))

# %% [markdown]
# The mesh is the ranks laid out as a 2 x 2 grid, row by row. Each named dimension is a
# set of process groups: a rank's `tp` group is its row (ranks 0 and 1 work on the same
# sequences and split every layer between them), its `dp` group its column (ranks 0 and 2
# hold the same TP shard of each layer and split the batch). The last dimension gets
# adjacent ranks, and torchrun numbers a node's workers consecutively (global ranks
# `[base_global_rank, base_global_rank + local_world_size)`, `SimpleElasticAgent._assign_worker_ranks`
# in `torch/distributed/elastic/agent/server/api.py`), so a TP group no larger than a
# node's GPUs is meant to keep its per-layer collectives on the node's fast link.
#
# (tp-plan)=
# ## Tensor parallelism, then FSDP
#
# The plan, in the style of torchtitan's `parallelize` functions: per block, `q`, `k`, `v`
# and the MLP's `fc` split by columns (output features: each rank computes 2 of the 4 heads
# and half of the MLP's hidden units), the two output projections by rows, so each rank's
# partial sums meet in one collective per sub-layer. Sequence parallelism splits the norms
# and the residual stream between sub-layers along the sequence instead of repeating them on
# both ranks of a TP group.
#
# %%
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def apply_tp(model, tp_mesh, sequence_parallel=True):
    """Column-wise q, k, v and fc, row-wise projections; norms and residual stream along the sequence if asked."""
    # the residual stream between sub-layers
    between = Shard(1) if sequence_parallel else Replicate()
    plan = {
        # a sub-layer needs the whole sequence: all-gather it on the way in (with sequence
        # parallelism), and hand q, k and v one DTensor, so their input gradients are summed
        # before a single collective in the backward
        "attn": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        # the partial sums of the heads: reduce-scattered along the sequence, or all-reduced
        "attn.proj": RowwiseParallel(output_layouts=between),
        "mlp": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(output_layouts=between),
    }
    if sequence_parallel:
        plan |= {"ln_1": SequenceParallel(), "ln_2": SequenceParallel()}
    for block in model.blocks:
        parallelize_module(block, tp_mesh, plan)
    # into the blocks: keep this rank's part of the sequence; out of them: gather it
    if sequence_parallel:
        parallelize_module(
            model,
            tp_mesh,
            {
                "blocks.0": PrepareModuleInput(
                    input_layouts=(Replicate(),),
                    desired_input_layouts=(Shard(1),),
                    use_local_output=True,
                ),
                "ln_f": PrepareModuleInput(
                    input_layouts=(Shard(1),),
                    desired_input_layouts=(Replicate(),),
                    use_local_output=True,
                ),
            },
        )


def apply_fsdp(model, dp_mesh):
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def parallelize(model, mesh, sequence_parallel=True):
    """TP over mesh["tp"] first, then FSDP over mesh["dp"]: the order FSDP x TP needs."""
    if mesh["tp"].size() > 1:
        apply_tp(model, mesh["tp"], sequence_parallel)
    if mesh["dp"].size() > 1:
        apply_fsdp(model, mesh["dp"])
    return model


def my_rows(mesh, step=0):
    """This rank's part of the global batch: split over dp, the same for every rank of a TP group."""
    tokens, targets = global_batch(step)
    rows = BATCH // mesh["dp"].size()
    mine = slice(mesh["dp"].get_local_rank() * rows, (mesh["dp"].get_local_rank() + 1) * rows)
    device = fsdp_guide.device()
    return tokens[mine].to(device), targets[mine].to(device)


# %% [markdown]
# TP comes first: `parallelize_module` turns each planned `Linear`'s weight into a
# `DTensor` sharded over `tp`; `fully_shard` over `dp` then shards what each rank holds
# again, along dim 0. {func}`fsdp_guide.describe_sharding` shows the result on each rank,
# for block 0 and the root's parameters:
#
# (fsdp2-fully-shard-mesh)=

# %%
from fsdp_guide import describe_sharding
from fsdp_guide.describe import ShardingTable


def what_each_rank_holds():
    # fully_shard(..., mesh=mesh["dp"])
    table = describe_sharding(parallelize(build_model(), mesh=make_mesh()))
    return ShardingTable(row for row in table if not row.name.startswith("blocks.1"))


tables = launch(what_each_rank_holds, world_size=4, output="none")
display(tables[0])  # rank 0's: an HTML table on the site, aligned text elsewhere
names = ["attn.q.weight", "attn.proj.weight", "ln_1.weight", "tok_emb.weight"]
rows = []
for rank, table in enumerate(tables):
    holds = {row.name.removeprefix("blocks.0."): row.holds for row in table}
    rows.append([f"{rank} ({rank // 2}, {rank % 2})", *(holds[name] for name in names)])
display(Table(["rank (dp, tp)", *names], rows))

# %% tags=["hide-input"] mystnb={"image": {"alt": "Two 32 by 32 weights coloured by the rank that holds each part: attn.q.weight in four bands of 8 rows, held in the order rank 0, 2, 1, 3 from the top (each dp rank's rows interleaved, a strided shard), and attn.proj.weight in four quarters, one per rank."}}
import matplotlib.pyplot as plt
import numpy as np


def owners(name, shape=(32, 32)):
    """Which rank holds each element of the weight, from the slices each rank's table names."""
    grid = np.full(shape, -1)
    for rank, table in enumerate(tables):
        holds = next(row.holds for row in table if row.name == name)
        rows, cols = (holds.strip("[]").split(", ") + [":"])[:2]
        rows = slice(*(int(x) for x in rows.split(":")))
        cols = slice(*(int(x) for x in cols.split(":"))) if cols != ":" else slice(None)
        grid[rows, cols] = rank
    return grid


fig, axes = plt.subplots(1, 2, figsize=(8, 3.6))
for ax, name in zip(axes, ["blocks.0.attn.q.weight", "blocks.0.attn.proj.weight"]):
    grid = owners(name)
    ax.imshow(grid, cmap="Pastel1", vmin=0, vmax=8)
    for rank in range(len(tables)):
        rows, cols = np.nonzero(grid == rank)
        for block in np.split(np.unique(rows), np.nonzero(np.diff(np.unique(rows)) > 1)[0] + 1):
            label = f"rank {rank}\n(dp {rank // 2}, tp {rank % 2})"
            ax.text(cols.mean(), block.mean(), label, ha="center", va="center", fontsize=7)
    ax.set(title=name.removeprefix("blocks.0."), xlabel="dim 1", ylabel="dim 0 (rows)")
fig.tight_layout()

# %% [markdown]
# - `attn.q.weight` (32 x 32, output features by rows) is split by TP into rows 0:16 (tp
#   rank 0) and 16:32 (tp rank 1); FSDP then splits *each TP shard's* rows over `dp`: rank 2
#   holds rows 8:16, not 16:24. Over `dp` alone, dp rank 0 holds rows 0:8 and 16:24
#   (interleaved, not a plain `Shard`): torch's private `_StridedShard(dim=0, sf=2)`, `sf=2`
#   being the number of TP shards of dim 0 (placements are listed by mesh dimension, though
#   TP split first). The `Shard(dim=0)` over `tp` then picks one block of rows. Gathering
#   over `dp` alone (FSDP's all-gather) rebuilds exactly this rank's TP shard.
# - `attn.proj.weight` is row-wise (split along its input features, dim 1) by TP and along
#   dim 0 by FSDP: two plain `Shard`s, a quarter each.
# - The norms are `Replicate()` over `tp` (sequence parallelism shards the activations, not
#   the norm's weights) and split over `dp`; the embeddings, left alone by the plan, live on
#   the 1D `dp` mesh only. Parameters on two meshes matter for {ref}`gradient clipping
#   <tp-clipping>`.
#
# (tp-collectives)=
# ## The collectives of one step, per mesh dimension
#
# One training step (forward, backward, AdamW step; the second step, after FSDP's lazy
# initialisation) on 4 ranks, counted with {func}`fsdp_guide.collectives.count_collectives`
# (FSDP's collectives and DTensor's for TP, by the mesh dimension whose group ran each):
# the number of each kind, and their bytes, each collective's full-size buffer (an
# all-gather's output, a reduce-scatter's input, an all-reduce's buffer) in units of *P*,
# the whole model's parameter bytes. "in the step" counts the collectives inside
# `optimizer.step()` alone (also in the step's totals). The last column is what the
# forward leaves saved for the backward on a rank ({func}`fsdp_guide.memory.saved_for_backward`),
# in KiB; a rank runs 2 sequences with FSDP alone, 8 with TP alone and 4 with both, so
# compare the last two rows with each other.

# %%
from fsdp_guide.collectives import count_collectives
from fsdp_guide.memory import measure, saved_for_backward

SETUPS = {
    "FSDP alone (dp=4)": ((4, 1), True),
    "TP alone (tp=4)": ((1, 4), True),
    "FSDP x TP (2 x 2)": ((2, 2), True),
    "FSDP x TP, no seq. parallel": ((2, 2), False),
}


def one_step_counted(shape, sequence_parallel):
    mesh = make_mesh(*shape)
    model = build_model()
    whole = whole_bytes(model)  # P, before sharding
    model = parallelize(model, mesh, sequence_parallel)
    # foreach=False: the same AdamW on every device (on CUDA AdamW defaults to foreach, which
    # fails on TP alone's mix of plain and DTensor parameters: see tp-implicit-replication)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    for step in range(2):
        with count_collectives(mesh) as seen:
            with saved_for_backward() as saved:
                _, loss = model(*my_rows(mesh, step))
            loss.backward()
            with count_collectives(mesh) as in_step:
                optimizer.step()
            optimizer.zero_grad()
    rows = [(dim, kind, n, nbytes / whole) for dim, kind, n, nbytes in seen.rows()]
    return (
        rows,
        sum(in_step.count.values()),
        measure(model).params / whole,
        saved.held_at_exit / 1024,
    )


def every_setup():
    return {name: one_step_counted(*setup) for name, setup in SETUPS.items()}


KINDS = ("all-gather", "reduce-scatter", "all-reduce")
header = ["setup", "dim", "all-gathers", "gathered / P", "reduce-scatters", "scattered / P"]
header += ["all-reduces", "reduced / P", "in the step", "params held / P", "saved, KiB"]
setups = launch(every_setup, world_size=4, output="none")[0]
table = []
for name, (rows, in_step, held, saved) in setups.items():
    for i, dim in enumerate(sorted({dim for dim, *_ in rows})):
        cells = {kind: [n, f"{size:.2f}"] for d, kind, n, size in rows if d == dim}
        first = [in_step, f"{held:.2f}", f"{saved:.0f}"]
        table.append(
            [name if i == 0 else "", dim]
            + [cell for kind in KINDS for cell in cells.get(kind, ["-", "-"])]
            + (first if i == 0 else ["", "", ""])
        )
display(Table(header, table))  # an HTML table on the site, aligned text elsewhere

# the figures the text quotes, from this run's tables (JupyterLab shows glue's roles unrendered)
from myst_nb import glue


def counted(setup, dim, kind):
    """One cell of the table above: (n, size in P)."""
    return next((n, size) for d, k, n, size in setups[setup][0] if (d, k) == (dim, kind))


FSDP, TP, BOTH, NO_SP = SETUPS  # the table's rows
moved = counted(FSDP, "dp", "all-gather")[1] + counted(FSDP, "dp", "reduce-scatter")[1]
glue("tp_fsdp_moved", moved, display=False)
glue("tp_fsdp_gathered", counted(FSDP, "dp", "all-gather")[1], display=False)
glue("tp_alone_gathers", counted(TP, "tp", "all-gather")[0], display=False)
glue("tp_alone_scatters", counted(TP, "tp", "reduce-scatter")[0], display=False)
glue("tp_alone_reduces", counted(TP, "tp", "all-reduce")[0], display=False)
glue("tp_alone_held", setups[TP][2], display=False)
glue("tp_2d_gathers", counted(BOTH, "dp", "all-gather")[0], display=False)
glue("tp_2d_gathered", counted(BOTH, "dp", "all-gather")[1], display=False)
glue("tp_2d_held", setups[BOTH][2], display=False)
glue("tp_2d_norm_reduces", counted(BOTH, "tp", "all-reduce")[0], display=False)
glue("tp_2d_norm_reduced", counted(BOTH, "tp", "all-reduce")[1], display=False)
glue("tp_nosp_reduces", counted(NO_SP, "tp", "all-reduce")[0], display=False)
glue("tp_nosp_reduced", counted(NO_SP, "tp", "all-reduce")[1], display=False)
glue("tp_saved_sp", setups[BOTH][3], display=False)
glue("tp_saved_nosp", setups[NO_SP][3], display=False)

# %% [markdown]
# The figures below are this run's, glued from the outputs (myst-nb's `glue`; in
# JupyterLab, which does not render glue's roles, read them from the outputs above).
#
# - **FSDP alone** all-gathers each of the 3 units in the forward and the 2 blocks again in the
#   backward (the root stays gathered: `FSDPState._lazy_init`,
#   `torch/distributed/fsdp/_fully_shard/_fsdp_state.py`, turns off the root's reshard after
#   forward) and reduce-scatters the 3 units' gradients: {glue:text}`tp_fsdp_moved:.1f` *P* of
#   parameters and gradients over the `dp` groups. Each rank holds a quarter.
# - **TP alone** never moves a parameter: it moves activations, {glue:text}`tp_alone_gathers`
#   all-gathers and {glue:text}`tp_alone_scatters` reduce-scatters over forward and backward,
#   each the size of one layer's input. A rank holds {glue:text}`tp_alone_held:.2f` *P*: the
#   embeddings and norms are whole on every rank. Its {glue:text}`tp_alone_reduces` small
#   all-reduces all run inside AdamW's step (the "in the step" column): the norms' gradients,
#   {ref}`partial sums <tp-partial-grads>` that the optimizer reduces each time it reads one.
# - **FSDP x TP** does both on separate groups: FSDP's collectives run over `dp` on TP-split
#   units ({glue:text}`tp_2d_gathered:.2f` *P* of all-gathers instead of
#   {glue:text}`tp_fsdp_gathered:.2f`: the blocks are half-size, the root is not split by TP);
#   TP's over `tp` on half the batch. Each rank holds {glue:text}`tp_2d_held:.2f` *P*, about a
#   third: the TP-split weights a quarter, the embeddings half. Nothing runs in the step: FSDP
#   all-reduces the norms' gradients once before it ({glue:text}`tp_2d_norm_reduces`
#   all-reduces, {glue:text}`tp_2d_norm_reduced:.2f` *P*), as it redistributes each gradient to
#   its parameter's placements before reduce-scattering it (`FSDPParam._get_grad_inner_tensor`,
#   `torch/distributed/fsdp/_fully_shard/_fsdp_param.py`).
# - **Without sequence parallelism** each sub-layer's partial sums are all-reduced (4
#   sub-layers, forward and backward: {glue:text}`tp_nosp_reduces` all-reduces). The table
#   counts full-size buffers, not bytes on the wire: with a ring algorithm a rank sends (n-1)/n
#   of the buffer for an all-gather or a reduce-scatter and twice that for an all-reduce (the
#   factors NCCL's benchmarks use, `doc/PERFORMANCE.md` in NVIDIA/nccl-tests), so the
#   {glue:text}`tp_nosp_reduces` all-reduces of {glue:text}`tp_nosp_reduced:.2f` *P* carry what
#   {glue:text}`tp_nosp_reduces` reduce-scatters and {glue:text}`tp_nosp_reduces` all-gathers of
#   {glue:text}`tp_nosp_reduced:.2f` *P* would. That is the ring's arithmetic, an expectation
#   for NCCL on GPUs, not this run's: gloo's reduce-scatter moves as much as an all-reduce
#   (measured on the {ref}`communication page <tutorial-communication>`). Sequence parallelism
#   adds two all-gathers here: out of the last block in the forward, and of the gradient at the
#   first block's input in the backward (the embeddings and final norm are outside the plan). It
#   saves activation memory, the norms' inputs and the residual stream split along the sequence:
#   {glue:text}`tp_saved_sp:.0f` KiB saved for backward against {glue:text}`tp_saved_nosp:.0f`
#   KiB. Little here: `q`, `k`, `v` and `fc` take the all-gathered, whole sequence as input in
#   both layouts, and a `Linear` saves its input for its weight's gradient.
#
# What the split buys is not on this table: with TP, each rank's matmuls are a fraction of
# the layer, so more GPUs work on one batch without the global batch growing, and FSDP's
# all-gathers shrink with the TP degree. On GPUs, TP is expected to belong inside a node
# (its collectives are on the critical path of every layer) and FSDP across nodes.

# %% [markdown]
# (tensor-parallel-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/tensor_parallel.py`.
# Four ranks form a 2 x 2 mesh named `dp` and `tp`; each feed-forward block is split column-wise
# then row-wise over `tp`, then sharded with `fully_shard` over `dp`; each TP group takes its `dp`
# rank's half of every global batch. Rank 0 prints what it holds of each weight and its placements,
# and the largest differences of its losses and weights from one process's on the whole batch. The
# tests (4 CPU ranks, `tests/test_scripts.py`) check the placements (the column-wise weight's
# `_StridedShard` over `dp`, the unplanned head on `dp` alone) and both differences, at most 1e-5.
#
# ```{literalinclude} scripts/tensor_parallel.py
# :language: python
# ```

# %% [markdown]
# (tensor-parallel-tips)=
# ## The tips behind this
#
# - {ref}`tip-tp-then-fsdp`

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("tensor_parallel")
