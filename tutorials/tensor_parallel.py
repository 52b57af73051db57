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
#   mesh dimension with their bytes;
# - that 2D training computes what one process computes, and what silently goes wrong
#   when the ranks of a TP group get different batches;
# - the trap: a 2D mesh handed to `fully_shard` alone is {term}`HSDP`, not FSDP x TP, and
#   how to tell the two apart;
# - why the norms' gradients are partial sums under TP alone, and what that costs AdamW;
# - the embedding and the output layer split by vocabulary, and loss parallel: the
#   cross-entropy computed on split logits, never gathered;
# - why the heads and the key/value heads of grouped-query attention must each divide by
#   the TP degree, and what a wrong degree raises;
# - gradient clipping when the parameters live on two meshes, `implicit_replication` when
#   plain tensors sit next to DTensors, and a 2D checkpoint loaded by a 1D FSDP run and
#   exported to one file.
#
# **What you need**: a CPU; 4 processes on gloo; about 30 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The
# worker code is written to run unchanged with one GPU per rank (NCCL): the mesh is built
# on {func}`fsdp_guide.device`'s type. Tensor parallelism is expected to pay off on GPUs
# joined by a fast link (NVLink) inside a node; this page shows what runs and what is
# exact, not speed.
# The tips it demonstrates are listed {ref}`at the end <tensor-parallel-tips>`.

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
from fsdp_guide.compare import largest_difference
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
def where_am_i():
    mesh = make_mesh()
    dp, tp = mesh.get_coordinate()
    groups = {name: dist.get_process_group_ranks(mesh.get_group(name)) for name in ("dp", "tp")}
    return dist.get_rank(), dp, tp, groups["dp"], groups["tp"]


print(f"{'rank':>4} {'dp':>3} {'tp':>3}  {'its dp group':>13} {'its tp group':>13}")
for rank, dp, tp, dp_group, tp_group in launch(where_am_i, world_size=4, output="none"):
    print(f"{rank:4} {dp:3} {tp:3}  {str(dp_group):>13} {str(tp_group):>13}")

# %% [markdown]
# The mesh is the ranks laid out as a 2 x 2 grid, row by row. Each named dimension is a
# set of process groups: a rank's `tp` group is its row (ranks 0 and 1 work on the same
# sequences and split every layer between them), its `dp` group its column (ranks 0 and 2
# hold the same TP shard of each layer and split the batch). The last dimension gets
# adjacent ranks: torchrun numbers a node's processes consecutively (a node's workers get
# global ranks `[base_global_rank, base_global_rank + local_world_size)`,
# `SimpleElasticAgent._assign_worker_ranks` in
# `torch/distributed/elastic/agent/server/api.py`), so a TP group no larger than a node's
# GPUs is meant to keep its per-layer collectives on the node's fast link.
#
# (tp-plan)=
# ## Tensor parallelism, then FSDP
#
# The plan, in the style of torchtitan's `parallelize` functions: per block, `q`, `k`,
# `v` and the MLP's `fc` split by columns (output features: each rank computes 2 of the 4
# heads, and half of the MLP's hidden units) and the two output projections by rows, so
# each rank's partial sums meet in one collective per sub-layer. With sequence
# parallelism, the norms and the residual stream between sub-layers are split along the
# sequence instead of repeated on both ranks of a TP group.
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
print(tables[0])
print()
print(
    f"{'rank (dp, tp)':14} {'attn.q.weight':>14} {'attn.proj.weight':>17} {'ln_1.weight':>12} {'tok_emb.weight':>15}"
)
for rank, table in enumerate(tables):
    holds = {row.name: row.holds for row in table}
    print(
        f"{rank} ({rank // 2}, {rank % 2}){'':7} {holds['blocks.0.attn.q.weight']:>14} "
        f"{holds['blocks.0.attn.proj.weight']:>17} {holds['blocks.0.ln_1.weight']:>12} {holds['tok_emb.weight']:>15}"
    )

# %% [markdown]
# - `attn.q.weight` (32 x 32, output features by rows) is split by TP into rows 0:16 (tp
#   rank 0) and 16:32 (tp rank 1); FSDP then splits *each TP shard's* rows over `dp`:
#   rank 2 holds rows 8:16, not 16:24. Seen over `dp` alone, dp rank 0 holds rows 0:8
#   and 16:24 (interleaved, so not a plain `Shard`): that is torch's private
#   `_StridedShard(dim=0, sf=2)`, where `sf=2` is the number of TP shards of dim 0
#   (placements are listed by mesh dimension, though TP's split was applied first). The
#   `Shard(dim=0)` over `tp` then picks one block of rows. Gathering over `dp` alone
#   (FSDP's all-gather) rebuilds exactly this rank's TP shard.
# - `attn.proj.weight` is row-wise (split along its input features, dim 1) by TP and along
#   dim 0 by FSDP: two plain `Shard`s, a quarter each.
# - The norms are `Replicate()` over `tp` (sequence parallelism shards the activations,
#   not the norm's weights) and split over `dp`; the embeddings, which the plan leaves
#   alone, live on the 1D `dp` mesh only. Parameters on two meshes matter for
#   {ref}`gradient clipping <tp-clipping>`.
#
# (tp-collectives)=
# ## The collectives of one step, per mesh dimension
#
# One training step (forward, backward, AdamW step; the second step, after FSDP's lazy
# initialisation) on 4 ranks, counted with {func}`fsdp_guide.collectives.count_collectives`,
# which sees FSDP's collectives and the ones DTensor runs for TP, and names the mesh
# dimension whose process group ran each. Bytes are each collective's full-size buffer
# (an all-gather's output, a reduce-scatter's input, an all-reduce's buffer), in units of
# *P*, the whole model's parameter bytes. The last column is what the forward leaves saved
# for the backward on a rank ({func}`fsdp_guide.memory.saved_for_backward`), in KiB; a rank
# runs 2 sequences with FSDP alone, 8 with TP alone and 4 with both, so compare the last
# two rows with each other. The column before it counts the collectives run inside
# `optimizer.step()` alone (they are also in the step's totals).

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
    # fails on TP alone's mix of plain and DTensor parameters: see "implicit replication" below)
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
print(
    f"{'':28} {'dim':4}"
    + "".join(f"{kind + 's (n, P)':>24}" for kind in KINDS)
    + f"{'in the step':>13}{'params held / P':>17}{'saved, KiB':>12}"
)
setups = launch(every_setup, world_size=4, output="none")[0]
for name, (rows, in_step, held, saved) in setups.items():
    for i, dim in enumerate(sorted({dim for dim, *_ in rows})):
        cells = {kind: f"{n:3} {size:6.2f}" for d, kind, n, size in rows if d == dim}
        print(
            f"{name if i == 0 else '':28} {dim:4}"
            + "".join(f"{cells.get(kind, '-'):>24}" for kind in KINDS)
            + (f"{in_step:13}{held:17.2f}{saved:12.0f}" if i == 0 else "")
        )

# the figures the text quotes, from this run's tables (JupyterLab shows glue's roles unrendered)
from myst_nb import glue


def counted(setup, dim, kind):
    """One cell of the table above: (n, size in P)."""
    return next((n, size) for d, k, n, size in setups[setup][0] if (d, k) == (dim, kind))


FSDP, TP, BOTH, NO_SP = SETUPS  # the table's rows
glue(
    "tp_fsdp_moved",
    counted(FSDP, "dp", "all-gather")[1] + counted(FSDP, "dp", "reduce-scatter")[1],
    display=False,
)
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
# The figures in this page's text are this run's, glued from the cells' outputs (myst-nb's
# `glue`); in JupyterLab, which does not render glue's roles, read them from the outputs above them.
#
# - **FSDP alone** all-gathers each of the 3 units in the forward and the 2 blocks again
#   in the backward (the root stays gathered: `FSDPState._lazy_init` in
#   `torch/distributed/fsdp/_fully_shard/_fsdp_state.py` turns off the root's reshard
#   after forward), and reduce-scatters the 3 units'
#   gradients: {glue:text}`tp_fsdp_moved:.1f` *P* of parameters and gradients over the `dp` groups. Each rank holds
#   a quarter.
# - **TP alone** never moves a parameter: it moves activations, {glue:text}`tp_alone_gathers` all-gathers and
#   {glue:text}`tp_alone_scatters` reduce-scatters over the forward and backward, at the size of one layer's input. A
#   rank holds {glue:text}`tp_alone_held:.2f` *P*: the embeddings and norms are whole on every rank. Its
#   {glue:text}`tp_alone_reduces` small
#   all-reduces all run inside AdamW's step (the "in the step" column): the norms'
#   gradients, {ref}`partial sums <tp-partial-grads>` that the optimizer reduces each time
#   it reads one.
# - **FSDP x TP** does both on separate groups: FSDP's collectives run over `dp` on
#   TP-split units ({glue:text}`tp_2d_gathered:.2f` *P* of all-gathers instead of
#   {glue:text}`tp_fsdp_gathered:.2f`: the blocks are half-size, the root is not split by TP); TP's run over `tp`
#   on half the batch. Each rank holds {glue:text}`tp_2d_held:.2f` *P*, about a third: the TP-split weights a
#   quarter, the embeddings half. Here nothing runs in the step: the norms' gradients are all-reduced once before
#   it ({glue:text}`tp_2d_norm_reduces` all-reduces, {glue:text}`tp_2d_norm_reduced:.2f` *P*), by FSDP, which redistributes each gradient to its parameter's
#   placements before reduce-scattering it (`FSDPParam._get_grad_inner_tensor` in
#   `torch/distributed/fsdp/_fully_shard/_fsdp_param.py`).
# - **Without sequence parallelism** each sub-layer's partial sums are all-reduced (4
#   sub-layers, forward and backward: {glue:text}`tp_nosp_reduces` all-reduces). The table counts full-size buffers,
#   not bytes on the wire: with a ring algorithm a rank sends (n-1)/n of the buffer for an
#   all-gather or a reduce-scatter and twice that for an all-reduce (the factors NCCL's
#   benchmarks use, `doc/PERFORMANCE.md` in NVIDIA/nccl-tests), so with a ring the {glue:text}`tp_nosp_reduces` all-reduces of
#   {glue:text}`tp_nosp_reduced:.2f` *P* carry what {glue:text}`tp_nosp_reduces` reduce-scatters and
#   {glue:text}`tp_nosp_reduces` all-gathers of {glue:text}`tp_nosp_reduced:.2f` *P* carry. That is the
#   ring's arithmetic, an expectation for NCCL on GPUs, not this run's: gloo's reduce-scatter
#   moves as much as an all-reduce (measured on the {ref}`communication page <tutorial-communication>`). Sequence
#   parallelism adds two all-gathers here: out of the last block in the forward, and of
#   the gradient at the first block's input in the backward (the embeddings and final
#   norm are outside the plan). What it saves is activation memory, the norms' inputs and
#   the residual stream split along the sequence: {glue:text}`tp_saved_sp:.0f` KiB saved for backward against
#   {glue:text}`tp_saved_nosp:.0f` KiB. Little here: `q`, `k`, `v` and `fc` take the all-gathered, whole sequence as
#   input in both layouts, and a `Linear` saves its input for its weight's gradient.
#
# What the split buys is not on this table: with TP, each rank's matmuls are a fraction of
# the layer, so more GPUs work on one batch without the global batch growing, and FSDP's
# all-gathers shrink with the TP degree. On GPUs, TP is expected to belong inside a node
# (its collectives are on the critical path of every layer) and FSDP across nodes.
#
# (tp-partial-grads)=
# ### TP alone: the norms' gradients are partial sums
#
# With sequence parallelism each rank of a TP group runs a norm on its own part of the
# sequence, so its gradient for the norm's weight sums over that part only: autograd
# leaves it a `DTensor` with `Partial(sum)` placement, and `p.grad.to_local()` is one
# rank's term of the sum. Compared with one process's gradient on the same batch, with
# AdamW's step counted alone, and counted again after reducing each partial gradient once:

# %%
from torch.distributed.tensor import DTensor


def partial_gradients(model):
    return [
        p
        for p in model.parameters()
        if isinstance(p.grad, DTensor) and p.grad.placements[0].is_partial()
    ]


def norm_gradients_under_tp_alone():
    mesh = make_mesh(1, 4)
    model = parallelize(build_model(), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    model(*my_rows(mesh))[1].backward()
    grad = model.blocks[0].ln_1.weight.grad
    found = {
        "placements": grad.placements,
        "partial": len(partial_gradients(model)),
        "local": grad.to_local().cpu(),
    }
    with count_collectives(mesh) as left_partial:
        optimizer.step()
    optimizer.zero_grad()
    model(*my_rows(mesh, 1))[1].backward()
    with count_collectives(mesh) as reducing:
        for p in partial_gradients(model):  # once, before the optimizer reads them
            p.grad = p.grad.redistribute(placements=[Replicate()])
    with count_collectives(mesh) as after:
        optimizer.step()
    return found | {
        "step, left partial": left_partial.rows(),
        "reducing once": reducing.rows(),
        "step, reduced": after.rows(),
    }


one = build_model()
one(*global_batch())[1].backward()
one_grad = one.blocks[0].ln_1.weight.grad
found = launch(norm_gradients_under_tp_alone, world_size=4, output="none")
print(
    f"blocks.0.ln_1.weight.grad: {found[0]['placements']}; parameters with a partial gradient: {found[0]['partial']}"
)
misses = []
for rank, on_rank in enumerate(found):
    difference = (on_rank["local"] - one_grad).abs().max()
    misses.append(difference.item())
    print(f"rank {rank}: to_local() vs one process's gradient, largest difference {difference:.1e}")
summed = sum(on_rank["local"] for on_rank in found)
print(
    f"the 4 ranks' to_local() summed: largest difference {(summed - one_grad).abs().max():.1e}"
    f" (the gradient's largest entry: {one_grad.abs().max():.1e})"
)
for what in ("step, left partial", "reducing once", "step, reduced"):
    print(f"{what:20} (dim, kind, n, bytes): {found[0][what] or 'no collective'}")
# the closest rank's (torch's min keeps a NaN)
glue("tp_partial_miss", torch.tensor(misses).min().item(), display=False)
glue("tp_grad_largest", one_grad.abs().max().item(), display=False)
glue("tp_partial_params", found[0]["partial"], display=False)
# (dim, kind, n, bytes)
glue("tp_partial_step_reduces", found[0]["step, left partial"][0][2], display=False)
glue("tp_partial_once_reduces", found[0]["reducing once"][0][2], display=False)

# %% [markdown]
# No rank's `to_local()` is the gradient (each misses it by {glue:text}`tp_partial_miss:.1e` or more, against a
# largest entry of {glue:text}`tp_grad_largest:.1e`); the 4 summed are, up to rounding. AdamW's step (the single-tensor
# implementation, `_single_tensor_adam` in `torch/optim/adam.py`) reads each gradient three
# times, in `exp_avg.lerp_(grad, ...)` and `addcmul_(grad, grad, ...)`, and DTensor
# all-reduces a `Partial` operand each time: {glue:text}`tp_partial_step_reduces` all-reduces for the
# {glue:text}`tp_partial_params` partial gradients. Redistributing each to `Replicate()` once before the step costs
# {glue:text}`tp_partial_once_reduces`, and the step then
# runs none. Until then, hand-written code that reads `p.grad.to_local()` (logging a
# gradient norm, a custom clipping) reads one rank's term. Under FSDP x TP, FSDP does
# that reduction itself (the table's 0 in the step).
#
# (tp-exact)=
# ## 2D training equals one process on the global batch, up to rounding
#
# Three AdamW steps on the 2 x 2 mesh, each `dp` rank on its half of the global batch and
# both ranks of a TP group on the same half; and one process on the whole batch:


# %%
def full_parameters(model):
    return {
        name: p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
        for name, p in model.named_parameters()
    }


def mean_over_dp(loss, mesh):
    loss = loss.detach().clone()
    dist.all_reduce(loss, group=mesh.get_group("dp"))
    return (loss / mesh["dp"].size()).item()


def train_2d(steps=3, batch_for=my_rows):
    mesh = make_mesh()
    model = parallelize(build_model(), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        _, loss = model(*batch_for(mesh, step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(mean_over_dp(loss, mesh))
    params = full_parameters(model)
    return losses, {name: p.cpu() for name, p in params.items()} if dist.get_rank() == 0 else None


def train_one_process(steps=3):
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        _, loss = model(*global_batch(step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, full_parameters(model)


def apart(params, reference):
    return largest_difference((params[name], p) for name, p in reference.items())


one_losses, one_params = train_one_process()
losses_2d, params_2d = launch(train_2d, world_size=4, output="none")[0]
print("one process  losses", [f"{x:.6f}" for x in one_losses])
print("FSDP x TP    losses", [f"{x:.6f}" for x in losses_2d])
print(f"parameters after 3 steps: largest difference {apart(params_2d, one_params):.1e}")

# %% [markdown]
# The same losses and parameters up to float32 rounding: the matmuls are split into
# partial sums that are added in a different order. Now the mistake: every rank takes its
# own quarter of the batch, as plain data parallelism over 4 ranks would, so the two ranks
# of a TP group compute one layer on different sequences.


# %%
def my_quarter(mesh, step=0):
    """Wrong under TP: a different quarter of the batch on every rank."""
    tokens, targets = global_batch(step)
    mine = slice(dist.get_rank() * 2, dist.get_rank() * 2 + 2)
    return tokens[mine].to(fsdp_guide.device()), targets[mine].to(fsdp_guide.device())


def same_in_group(tensor, group):
    """True when every rank of the group holds the same tensor: one small all-gather of a checksum."""
    checksum = tensor.double().sum().reshape(1)
    sums = [torch.empty_like(checksum) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sums, checksum, group=group)
    return all(torch.equal(s, sums[0]) for s in sums)


def batch_checks():
    mesh = make_mesh()
    return {
        name: same_in_group(batch_for(mesh)[0], mesh.get_group("tp"))
        for name, batch_for in (("dp rows", my_rows), ("rank quarters", my_quarter))
    }


wrong_losses, wrong_params = launch(train_2d, 3, my_quarter, world_size=4, output="none")[0]
print(
    "different batches in a TP group: losses",
    [f"{x:.6f}" for x in wrong_losses],
    "(no error raised)",
)
print(f"parameters after 3 steps: largest difference {apart(wrong_params, one_params):.1e}")
print("same batch across each TP group:", launch(batch_checks, world_size=4, output="none")[0])

# %% [markdown]
# Nothing fails: DTensor trusts the layouts the plan declares (the blocks' input is
# declared `Replicate()` over `tp`, and `PrepareModuleInput._prepare_input_arg` in
# `torch/distributed/tensor/parallel/style.py` wraps it with `DTensor.from_local(...,
# run_check=False)`: no check), so each TP rank keeps its half of
# the sequence of *its own* batch, and the attention gathers a sequence stitched from two
# different samples. The losses look like a model training; the parameters drift from
# what the data says. The fix is in the data loader: index it by the `dp` coordinate
# (`mesh["dp"].get_local_rank()`, and `mesh["dp"].size()` shards), never by the global
# rank. `same_in_group`, one 8-byte all-gather per step, catches the mistake in a debug
# run.
#
# (tp-hsdp-trap)=
# ## The trap: a 2D mesh passed to `fully_shard` is HSDP
#
# A user who wants FSDP x TP builds the 2 x 2 mesh and passes it to `fully_shard`,
# expecting it to use both dimensions. It does, as {term}`HSDP`: the first dimension
# replicates, the second shards. `fully_shard` requires a 2D mesh to have dimension
# names (`_validate_mesh`), but does not interpret them: `_get_mesh_info` (both in
# `torch/distributed/fsdp/_fully_shard/_fsdp_init.py`) takes dimension 0 to replicate and
# dimension 1 to shard, so `dp` here replicates and `tp` shards. (Since torch 2.12,
# `fully_shard` also takes a `dp_mesh_dims` argument that names a mesh's data-parallel
# dimensions: {ref}`below <tp-dp-mesh-dims>`.)

# %%


def hsdp_by_mistake(model, mesh):
    for block in model.blocks:
        fully_shard(block, mesh=mesh)  # the 2D mesh itself: replicate over dim 0, shard over dim 1
    return fully_shard(model, mesh=mesh)


def q_output_width(model, mesh):
    widths = []
    hook = model.blocks[0].attn.q.register_forward_hook(
        lambda m, i, out: widths.append(tuple(out.shape))
    )
    model(*my_rows(mesh))
    hook.remove()
    return widths[0]


def both_ways():
    result = {}
    for name, shard in (("FSDP x TP", parallelize), ("fully_shard(mesh=2D mesh)", hsdp_by_mistake)):
        mesh = make_mesh()
        model = build_model()
        whole = whole_bytes(model)  # P, before sharding
        model = shard(model, mesh)
        rows = {row.name: row.placement for row in describe_sharding(model)}
        width = q_output_width(model, mesh)
        with count_collectives(mesh) as seen:
            _, loss = model(*my_rows(mesh, 1))
            loss.backward()
        result[name] = (
            rows["blocks.0.attn.q.weight"],
            width,
            measure(model).params / whole,
            [(dim, kind, n) for dim, kind, n, _ in seen.rows()],
            mean_over_dp(loss, mesh),
        )
    return result


trap = launch(both_ways, world_size=4, output="none")[0]
for name, (placement, width, held, collectives, loss) in trap.items():
    print(
        f"{name}:\n  attn.q.weight  {placement}\n  q's output on a rank {width}; params held {held:.2f} P\n"
        f"  collectives (dim, kind, n) {collectives}\n  loss {loss:.6f}"
    )
glue(
    "tp_trap_gathers",
    next(n for dim, kind, n in trap["FSDP x TP"][3] if (dim, kind) == ("dp", "all-gather")),
    display=False,
)

# %% [markdown]
# Both compute the same loss (one forward and backward, no optimizer step): HSDP is data
# parallelism, correct on any batches, and here each TP-style pair feeds it the same
# batch twice. (Each counts {glue:text}`tp_trap_gathers` all-gathers
# over `dp` or `tp`, not the table's {glue:text}`tp_2d_gathers`: the forward that measured `q`'s output left the
# root gathered.) What differs:
#
# - **the placements**: `Replicate() over dp` on the first dimension is HSDP's signature;
#   FSDP x TP shows a `Shard` (or `_StridedShard`) on `dp` and a `Shard` on `tp` for every
#   planned weight;
# - **the work**: under HSDP every rank computes all 4 heads (`q`'s output is 32 wide) on
#   a batch its neighbour also computes: half the machine repeats the other half;
# - **the memory**: HSDP holds half the model per rank, FSDP x TP about a third;
# - **the collectives**: HSDP all-gathers and reduce-scatters over the second dimension
#   and all-reduces gradients over the first; nothing runs per layer on activations.
#
# For HSDP, the batch should differ across *all* ranks (it is data parallel over 4),
# otherwise half the compute repeats; for FSDP x TP, pass `mesh["dp"]` to `fully_shard`
# after `parallelize_module` over `mesh["tp"]`.

# %% [markdown]
# (tp-dp-mesh-dims)=
# ### Naming the data-parallel dimensions: `dp_mesh_dims`
#
# Since torch 2.12 ({ref}`fsdp2-map`), `fully_shard` can take the whole mesh and be told which dimensions are
# data parallel: `dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...)`, each a
# dimension's name or a tuple of names (flattened into one). The parameters must then be
# DTensors on that whole mesh, with `Replicate()` on the data-parallel dimensions (its
# docstring); `distribute_module` makes them so. Three roles for the two dimensions of one
# 2 x 2 mesh, named `x` and `y` so that nothing but `dp_mesh_dims` gives them a meaning; in
# the third, `y` is tensor parallel by placement alone (the first layer's rows and the
# second's columns split over `y`; DTensor works out the collectives). Each trains for 2
# steps against one process on the data-parallel ranks' batches:
#
# (fsdp2-fully-shard-dp-mesh-dims)=
# (fsdp2-dataparallelmeshdims)=
# (fsdp2-dataparallelmeshdims-shard)=
# (fsdp2-dataparallelmeshdims-replicate)=

# %%
import torch.nn as nn
from torch.distributed.fsdp import DataParallelMeshDims
from torch.distributed.tensor import distribute_module, distribute_tensor

ROLES = {
    "HSDP: replicate over x, shard over y": DataParallelMeshDims(replicate="x", shard="y"),
    "FSDP over both: shard over (x, y)": DataParallelMeshDims(shard=("x", "y")),
    "FSDP over x, TP over y": DataParallelMeshDims(shard="x"),
}


def small_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def small_batch(i):
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(i))


def split_over_y(name, module, mesh):
    """Tensor parallelism by placements alone: layer 0's rows and layer 2's columns over y."""
    for what, p in list(module.named_parameters(recurse=False)):
        over_y = Shard(0) if name == "0" else Shard(1) if what == "weight" else Replicate()
        module.register_parameter(
            what, nn.Parameter(distribute_tensor(p, mesh, [Replicate(), over_y]))
        )


def as_replicated(module, inputs, mesh):
    """Each rank's own batch, entered as Replicate() on every dimension: FSDP reduces the gradients over x, y."""
    return tuple(DTensor.from_local(x, mesh, [Replicate(), Replicate()]) for x in inputs)


def train_on_named_dims(roles):
    device = fsdp_guide.device()
    mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("x", "y"))
    tp = roles.replicate is None and roles.shard == "x"
    model = small_mlp().to(device)
    distribute_module(
        model, mesh, partition_fn=split_over_y if tp else None, input_fn=as_replicated
    )
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh, dp_mesh_dims=roles)
    fully_shard(model, mesh=mesh, dp_mesh_dims=roles)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = mesh["x"].get_local_rank() if tp else dist.get_rank()  # a TP pair shares its batch
    for step in range(2):
        model(small_batch(10 * step + batch).to(device)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    placements = {row.name: row.placement for row in describe_sharding(model)}
    return placements, {name: p.full_tensor().cpu() for name, p in model.named_parameters()}


def one_process_small(batches):
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        (
            sum(model(small_batch(10 * step + b)).square().mean() for b in range(batches)) / batches
        ).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach() for name, p in model.named_parameters()}


for name, roles in ROLES.items():
    # here, in the notebook: one process
    reference = one_process_small(2 if name.endswith("TP over y") else 4)
    placements, weights = launch(train_on_named_dims, roles, world_size=4, output="none")[0]
    error = largest_difference((weights[p], reference[p]) for p in reference)
    print(
        f"{name}: {roles}\n  0.weight  {placements['0.weight']}\n  2.weight  {placements['2.weight']}\n"
        f"  max |weights - one process| after 2 steps = {error:.1e}"
    )

# %% [markdown]
# The same mesh, three layouts: HSDP's `Replicate()` over `x` and `Shard(dim=0)` over `y`
# (what a 2D mesh passed alone gives, by position); FSDP over all 4 ranks, the two
# dimensions flattened into one named `x_y`; and FSDP over `x` on top of `y`'s tensor
# parallelism, with the `_StridedShard` of FSDP x TP shown above. Every layout trains as
# one process does. Passing `mesh["dp"]` after `parallelize_module` over `mesh["tp"]`, as
# this page does elsewhere, works on every supported torch; `dp_mesh_dims` is for
# parameters that are already DTensors on the whole mesh.


# %% [markdown]
# (tp-edge-layers)=
# ## The embedding and the output layer
#
# The plan above leaves the token embedding (256 x 32) and the output layer tied to it
# whole on every rank of a TP group. Both can be split by TP too, as torchtitan's plans do
# (`apply_tp` in `torchtitan/models/llama3/infra/parallelize.py`). An `nn.Embedding`
# takes `RowwiseParallel(input_layouts=Replicate())`: its rows are the vocabulary, each
# rank looks up the tokens in its half and contributes zeros for the others, summed
# across the group (`_MaskPartial` in `torch/distributed/tensor/placement_types.py`). Or
# it takes `ColwiseParallel()`: each rank holds half of every token's vector. The output
# layer takes `ColwiseParallel`: its rows are the vocabulary too, so each rank computes the
# logits of its half. Each plan on a fresh module, on a rank's 4 x 16 tokens (or
# 4 x 16 x 32 hidden states for the output layer), against the unsharded module's output
# split as the plan says it should be:

# %%


def embedding():
    return nn.Embedding(CONFIG.vocab_size, CONFIG.n_embd)


def output_layer():
    return nn.Linear(CONFIG.n_embd, CONFIG.vocab_size, bias=False)


EDGE_PLANS = {  # name: (module, plan, the layout its output should have over tp)
    "embedding, vocabulary-split": (
        embedding,
        RowwiseParallel(input_layouts=Replicate()),
        Replicate(),
    ),
    "  same, output along the sequence": (
        embedding,
        RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        Shard(1),
    ),
    "embedding, dimension-split": (embedding, ColwiseParallel(), Shard(-1)),
    "output layer, logits gathered": (
        output_layer,
        ColwiseParallel(output_layouts=Replicate()),
        Replicate(),
    ),
    "output layer, logits left split": (
        output_layer,
        ColwiseParallel(use_local_output=False),
        Shard(-1),
    ),
}


def on_a_rank(t):
    """A tensor's shape on this rank, and its placement over tp if it is a DTensor."""
    if isinstance(t, DTensor):
        return f"{tuple(t.to_local().shape)} {t.placements[0]!r}"
    return f"{tuple(t.shape)} Tensor"


def edge_layer_layouts():
    mesh = make_mesh()
    tokens, _ = my_rows(mesh)
    hidden = torch.randn(
        *tokens.shape, CONFIG.n_embd, generator=torch.Generator().manual_seed(0)
    ).to(tokens.device)
    result = {}
    for name, (make, plan, layout) in EDGE_PLANS.items():
        torch.manual_seed(0)
        module = make().to(fsdp_guide.device())
        x = tokens if isinstance(module, nn.Embedding) else hidden
        whole = module(x).detach()
        parallelize_module(module, mesh["tp"], plan)
        with count_collectives(mesh) as seen:
            out = module(x)
        local = out.to_local() if isinstance(out, DTensor) else out
        # this rank's piece
        expected = distribute_tensor(whole, mesh["tp"], [layout], src_data_rank=None).to_local()
        result[name] = (
            on_a_rank(module.weight),
            on_a_rank(out),
            seen.rows(),
            (local - expected).abs().max().item(),
        )
    return result


print(
    f"{'':34} {'weight on a rank':23} {'output on a rank':26} {'tp collectives (kind, n, bytes)':33} vs unsharded"
)
edges = launch(edge_layer_layouts, world_size=4, output="none")[0]
for name, (weight, out, rows, difference) in edges.items():
    collectives = ", ".join(f"{kind} {n} {nbytes}" for _, kind, n, nbytes in rows) or "none"
    print(f"{name:34} {weight:23} {out:26} {collectives:33} {difference:.0e}")
# (dim, kind, n, bytes)
glue("tp_emb_reduce_bytes", edges["embedding, vocabulary-split"][2][0][3], display=False)
glue("tp_logits_gather_bytes", edges["output layer, logits gathered"][2][0][3], display=False)

# %% [markdown]
# - The vocabulary-split embedding holds half the rows and all-reduces its output (a
#   rank's 4 x 16 x 32 floats, {glue:text}`tp_emb_reduce_bytes` bytes); with `output_layouts=Shard(1)` it
#   reduce-scatters it instead and hands on half the sequence, which is what a
#   sequence-parallel stack wants next. This GPT adds the position embedding, whole
#   sequence, to the token embedding's output, so the page keeps `Replicate()` there
#   and lets `blocks.0`'s `PrepareModuleInput` take the rank's half.
# - The dimension-split embedding runs no collective: each rank returns half of every
#   vector (`Shard(-1)`, returned as a plain tensor by default), which the next layer must
#   expect.
# - The output layer's `ColwiseParallel` holds half the vocabulary's rows. Gathered
#   (`output_layouts=Replicate()`), every rank gets all 256 logits of every token, one
#   all-gather of {glue:text}`tp_logits_gather_bytes` bytes for these 64 tokens; left split as a `DTensor`
#   (`use_local_output=False`), each rank holds the logits of its half of the vocabulary,
#   and nothing moves. Every row matches the unsharded module.
#
# (tp-loss-parallel)=
# ## Loss parallel: the cross-entropy on vocabulary-split logits
#
# The logits hold a value per vocabulary entry for every token (here 256, against 32
# hidden features), and gathering them to compute the loss undoes the output layer's
# split. Inside `torch.distributed.tensor.parallel.loss_parallel()`, `F.cross_entropy` accepts logits
# split along the vocabulary (`Shard(-1)`) and computes the loss from per-token maxima,
# sums of exponentials and target logits reduced across the TP group (`loss_parallel` in
# `torch/distributed/tensor/parallel/loss.py`); the `backward()` must run inside it too.
# The GPT keeps its tied weight: both plans split it by rows, each makes its own
# `DTensor` of it, and the two are tied again. One forward and backward on TP alone over
# all 4 ranks (each rank a quarter of the vocabulary), three ways, and the loss parallel
# one again under FSDP x TP; the global batch of 8 as before:

# %%
import contextlib

from torch.distributed.tensor.parallel import loss_parallel


def apply_vocab_parallel(model, tp_mesh, shard_logits=True):
    """The token embedding and the output layer split by vocabulary; logits left split (loss_parallel) or gathered."""
    # as torchtitan's apply_tp
    output_plan = ColwiseParallel(
        output_layouts=Shard(-1) if shard_logits else Replicate(), use_local_output=not shard_logits
    )
    parallelize_module(
        model,
        tp_mesh,
        {"tok_emb": RowwiseParallel(input_layouts=Replicate()), "lm_head": output_plan},
    )
    untied = model.lm_head.weight is not model.tok_emb.weight
    # each plan made its own DTensor of the tied weight: tie them again
    model.lm_head.weight = model.tok_emb.weight
    return untied


def full_gradients(model):
    return {
        name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        for name, p in model.named_parameters()
    }


def loss_with_output_plan(shape, shard_logits):
    """One forward and backward. shard_logits None: this page's plan; False: logits gathered; True: loss parallel."""
    mesh = make_mesh(*shape)
    model = build_model()
    apply_tp(model, mesh["tp"])
    untied = shard_logits is not None and apply_vocab_parallel(model, mesh["tp"], shard_logits)
    if mesh["dp"].size() > 1:
        apply_fsdp(model, mesh["dp"])
    with (
        count_collectives(mesh) as seen,
        loss_parallel() if shard_logits else contextlib.nullcontext(),
    ):
        logits, loss = model(*my_rows(mesh))
        loss.backward()  # inside loss_parallel too
    local = logits.to_local() if isinstance(logits, DTensor) else logits
    loss = mean_over_dp(loss.full_tensor() if isinstance(loss, DTensor) else loss, mesh)
    grads = {name: g.cpu() for name, g in full_gradients(model).items()}
    return (
        untied,
        model.lm_head.weight is model.tok_emb.weight,
        local.nbytes,
        logits.numel() * logits.element_size(),
        [row for row in seen.rows() if row[0] == "tp"],
        loss,
        grads if dist.get_rank() == 0 else None,
    )


OUTPUT_PLANS = {
    "TP alone, this page's plan": ((1, 4), None),
    "TP alone, logits gathered": ((1, 4), False),
    "TP alone, loss parallel": ((1, 4), True),
    "FSDP x TP, loss parallel": ((2, 2), True),
}


def every_output_plan():
    return {name: loss_with_output_plan(*setup) for name, setup in OUTPUT_PLANS.items()}


with torch.no_grad():
    # `one`: the model whose gradients the partial sums were checked against
    one_loss = one(*global_batch())[1].item()
print(f"one process on the global batch: loss {one_loss:.7f}")
print(
    f"{'':27} {'logits on a rank / full (bytes)':>32} {'tp all-gathers (n, bytes)':>26}"
    f" {'tp all-reduces (n, bytes)':>26} {'loss':>10} {'grads vs one process':>21}"
)
results = launch(every_output_plan, world_size=4, output="none")[0]
for name, (untied, tied, held, full, rows, loss, grads) in results.items():
    cells = {kind: f"{n} {nbytes}" for _, kind, n, nbytes in rows}
    difference = largest_difference((grads[n], p.grad) for n, p in one.named_parameters())
    print(
        f"{name:27} {f'{held} / {full}':>32} {cells.get('all-gather', '-'):>26} {cells.get('all-reduce', '-'):>26}"
        f" {loss:10.7f} {difference:21.1e}"
        + (f"  (untied by the plans, tied again: {tied})" if untied else "")
    )


def tp_collectives(plan, kind):
    """(n, bytes) of one plan's tp collectives of a kind, as in the table above."""
    return next((n, nbytes) for _, k, n, nbytes in results[plan][4] if k == kind)


PAGE, GATHERED, PARALLEL, _ = OUTPUT_PLANS
gathered_reduces, parallel_reduces = (
    tp_collectives(GATHERED, "all-reduce"),
    tp_collectives(PARALLEL, "all-reduce"),
)
glue("tp_logits_bytes", results[PAGE][2], display=False)  # the logits on a rank, this page's plan
glue(
    "tp_extra_gather_bytes",
    tp_collectives(GATHERED, "all-gather")[1] - tp_collectives(PAGE, "all-gather")[1],
    display=False,
)
# each all-reduce's
glue("tp_hidden_reduce_bytes", gathered_reduces[1] // gathered_reduces[0], display=False)
# each of loss parallel's own all-reduces
glue(
    "tp_lp_reduce_bytes",
    (parallel_reduces[1] - gathered_reduces[1]) // (parallel_reduces[0] - gathered_reduces[0]),
    display=False,
)

# %% [markdown]
# - With this page's plan every rank computes all the logits of all 8 sequences
#   ({glue:text}`tp_logits_bytes` bytes) from the whole output layer. Split and gathered, a rank computes a
#   quarter and all-gathers the rest: one more all-gather, of the full {glue:text}`tp_extra_gather_bytes` bytes.
#   The split adds two all-reduces of the hidden states (2 x {glue:text}`tp_hidden_reduce_bytes` bytes): the
#   embedding's output in the forward, and the output layer's input gradient in the
#   backward (`ColwiseParallel._prepare_input_fn` in `style.py` wraps the input with
#   `DTensor.from_local` as `Replicate()`, and `_FromTorchTensor.backward` in
#   `torch/distributed/tensor/_api.py` redistributes its partial gradient to that).
# - With loss parallel a rank holds a quarter of the logits and they are never
#   gathered: its all-gathers are exactly this page's plan's, and beside those two
#   all-reduces it runs three more of {glue:text}`tp_lp_reduce_bytes` bytes, one float per token: the
#   maximum and the sum of exponentials of the log-softmax (`_log_softmax` in
#   `torch/distributed/tensor/parallel/loss.py`) and the target's log-probability
#   (`_nll_loss_forward`, same file).
# - The loss and every gradient equal one process's up to float32 rounding, the tied
#   weight's included (the plans untie it; the printed `True` is the weight tied again),
#   with FSDP over `dp` on top as well. Under loss parallel the loss is a `DTensor`,
#   `Replicate()` over `tp` (`_nll_loss_forward_handler`, same file): `full_tensor()`
#   reads it.
#
# (tp-gqa)=
# ## Heads and KV heads under grouped-query attention
#
# Column-wise `q`, `k` and `v` give each rank a contiguous block of output features, and
# the attention reshapes that block into heads: the split must fall between heads. The
# GPT has as many key/value heads as query heads; with grouped-query attention (GQA) a
# model has fewer KV heads, each shared by a group of query heads, and both counts must
# divide by the TP degree. The smallest GQA attention, in the GPT's style, under the same
# plan on the `tp` dimension (2 ranks):

# %%
import torch.nn.functional as F


class GroupedQueryAttention(nn.Module):
    def __init__(self, n_embd, n_head, n_kv_head, head_dim=8):
        super().__init__()
        self.head_dim = head_dim
        self.q = nn.Linear(n_embd, n_head * head_dim, bias=False)
        self.k = nn.Linear(n_embd, n_kv_head * head_dim, bias=False)
        self.v = nn.Linear(n_embd, n_kv_head * head_dim, bias=False)
        self.proj = nn.Linear(n_head * head_dim, n_embd, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        # -1: all the heads, or this rank's share under tensor parallelism
        q, k, v = (
            t(x).view(B, T, -1, self.head_dim).transpose(1, 2) for t in (self.q, self.k, self.v)
        )
        # a KV head per group of q heads
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


HEADS = ((4, 2), (6, 2), (4, 1), (6, 3))  # (query heads, KV heads)


def gqa_under_tp():
    tp_mesh = make_mesh()["tp"]
    x = torch.randn(2, 8, CONFIG.n_embd, generator=torch.Generator().manual_seed(0)).to(
        fsdp_guide.device()
    )
    result = {}
    for n_head, n_kv_head in HEADS:
        torch.manual_seed(0)
        attention = GroupedQueryAttention(CONFIG.n_embd, n_head, n_kv_head).to(fsdp_guide.device())
        whole = attention(x)
        parallelize_module(
            attention,
            tp_mesh,
            {
                "q": ColwiseParallel(),
                "k": ColwiseParallel(),
                "v": ColwiseParallel(),
                "proj": RowwiseParallel(),
            },
        )
        try:
            outcome = f"runs; output vs unsharded {(attention(x) - whole).abs().max().item():.0e}"
        except RuntimeError as e:
            outcome = f"RuntimeError: {str(e).splitlines()[0]}"
        result[(n_head, n_kv_head)] = (tuple(attention.k.weight.to_local().shape), outcome)
    return result


print(f"{'heads':>5} {'KV heads':>8}  {'k.weight on a rank':>18}  forward with a TP degree of 2")
for (n_head, n_kv_head), (k_shape, outcome) in launch(gqa_under_tp, world_size=4, output="none")[
    0
].items():
    print(f"{n_head:5} {n_kv_head:8}  {str(k_shape):>18}  {outcome}")

# %% [markdown]
# `parallelize_module` splits the weights without looking at heads (a head is 8 rows
# here): with 1 KV head, each rank gets `k`'s rows 0:4 or 4:8, half a head, and `k`'s
# `view` into heads fails (`q`'s, 2 whole heads, passes); with 3 KV heads each rank gets
# a head and a half. 6 query heads
# over 2 KV heads works: each rank gets 3 query heads and the 1 KV head they share. The
# rule: the number of query heads and the number of KV heads must each divide by the TP
# degree (then each rank's query heads are whole groups, and their KV heads are on the
# same rank). Nothing checks it before the forward: check it where the TP degree is chosen.
#
# (tp-clipping)=
# ## Gradient clipping across both mesh dimensions
#
# `torch.nn.utils.clip_grad_norm_` computes one norm over all gradients. Here the blocks'
# gradients are DTensors on the 2D mesh and the embeddings' and final norm's on the 1D
# `dp` mesh:

# %%
from collections import defaultdict

MAX_NORM = 0.1


def clip_grad_norm_across_meshes(parameters, max_norm):
    """clip_grad_norm_ for DTensor parameters on several meshes: one norm per mesh, combined, then clip each group.

    Every parameter must be a DTensor (under FSDP2 they all are).
    """
    by_mesh = defaultdict(list)
    for p in parameters:
        if p.grad is not None:
            # torch's stack and _foreach_mul_ take one mesh per call
            by_mesh[p.grad.device_mesh].append(p)
    norms = [
        torch.nn.utils.get_total_norm([p.grad for p in group]).full_tensor()
        for group in by_mesh.values()
    ]
    total = torch.linalg.vector_norm(torch.stack(norms))
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def first_error(call):
    """'runs', or the class and first line of the RuntimeError that call() raises."""
    try:
        call()
        return "runs"
    except RuntimeError as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"


def clip_both_ways():
    mesh = make_mesh()
    model = parallelize(build_model(), mesh)
    _, loss = model(*my_rows(mesh))
    loss.backward()
    # a total norm of 0 scales by 1: harmless if it ran
    no_norm = torch.tensor(0.0, device=fsdp_guide.device())
    errors = {
        "clip_grad_norm_": first_error(
            lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        ),
        "clip_grads_with_norm_": first_error(
            lambda: torch.nn.utils.clip_grads_with_norm_(model.parameters(), MAX_NORM, no_norm)
        ),
    }
    total = clip_grad_norm_across_meshes(model.parameters(), MAX_NORM).item()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    return (
        errors,
        total,
        {name: g.cpu() for name, g in grads.items()} if dist.get_rank() == 0 else None,
    )


reference = build_model()
reference(*global_batch())[1].backward()
one_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM).item()
errors, total, clipped = launch(clip_both_ways, world_size=4, output="none")[0]
for call, error in errors.items():
    print(f"{call} on every parameter: {error}")
print(f"one process total norm {one_norm:.7f}; across meshes {total:.7f}")
print(
    f"clipped gradients vs one process's: largest difference "
    f"{largest_difference((clipped[n], p.grad) for n, p in reference.named_parameters()):.1e}"
)

# %% [markdown]
# torch's `clip_grad_norm_` stacks the per-parameter norms into one tensor, and DTensor
# refuses an operation whose operands live on different meshes; its scaling step,
# `clip_grads_with_norm_`, fails the same way over both meshes.
# Grouping the parameters by mesh, for both steps, works: each group's norm is a DTensor
# whose `full_tensor()` reduces over every dimension its gradients are split on (`dp`, or
# `dp` and `tp`), the groups' norms combine as the norm of norms, and each group is scaled
# by the same factor. The result is one process's norm, and one process's clipped
# gradients. (torchtitan sidesteps the two meshes by planning every parameter over `tp`,
# the norms, embeddings and output included: `apply_tp` in
# `torchtitan/models/llama3/infra/parallelize.py`.)
#
# (tp-implicit-replication)=
# ### TP without FSDP: plain tensors next to DTensors, and `implicit_replication`
#
# With TP alone the parameters the plan leaves alone (embeddings, the final norm) stay
# plain tensors, next to the planned DTensors. Any operation that takes both in one call
# then fails, and torch's clipping and AdamW's `foreach` implementation take all the
# parameters in one call. `foreach=True` asks for the latter here; on CUDA it is AdamW's
# default: `_default_to_fused_or_foreach` in `torch/optim/optimizer.py` picks it when every
# parameter's type is in `_foreach_supported_types`, to which
# `torch/distributed/tensor/__init__.py` appends `DTensor`.
# `torch.distributed.tensor.experimental.implicit_replication()` lets DTensor treat a
# plain tensor as `Replicate()` on the other operand's mesh, which is true here (every
# rank of the TP group holds the same embeddings and computes the same gradients for
# them):

# %%
from torch.distributed.tensor.experimental import implicit_replication


def clip_and_step_under_tp_alone():
    mesh = make_mesh(1, 4)
    model = parallelize(build_model(), mesh)
    model(*my_rows(mesh))[1].backward()
    kinds = sorted({type(p).__name__ for p in model.parameters()})
    errors = {
        "clip_grad_norm_": first_error(
            lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        ),
        "AdamW(foreach=True).step": first_error(
            torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True).step
        ),
    }
    with implicit_replication():  # the plain tensors count as Replicate() over tp
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True).step()
    total = total.full_tensor() if isinstance(total, DTensor) else total
    params = {name: p.cpu() for name, p in full_parameters(model).items()}
    return kinds, errors, total.item(), params if dist.get_rank() == 0 else None


kinds, errors, total, params = launch(clip_and_step_under_tp_alone, world_size=4, output="none")[0]
# one process: clipped above, now one step
torch.optim.AdamW(reference.parameters(), lr=1e-2).step()
print("TP alone, parameter types:", kinds)
for call, error in errors.items():
    print(f"{call:25} {error}")
difference = apart(params, full_parameters(reference))
print(
    f"under implicit_replication(): total norm {total:.7f} (one process {one_norm:.7f}); after clipping and the "
    f"step, parameters vs one process's: largest difference {difference:.1e}"
)

# %% [markdown]
# Both calls fail on the mix (clipping on every device: `_get_total_norm` in
# `torch/nn/utils/clip_grad.py` takes its `foreach` path wherever `_has_foreach_support` in
# `torch/utils/_foreach_utils.py` allows it, CPU included); under `implicit_replication()` both run and give one process's norm,
# and its parameters up to float32 rounding (where in the parameters the largest difference
# sits is not separated here; Adam's first update, `exp_avg / sqrt(exp_avg_sq)`, is about
# `lr` per entry whatever the gradient's size, so a small gradient's rounding can show as
# much as a large one's). That is also why the collectives table above passes
# `foreach=False`.
# `implicit_replication` checks nothing: a plain tensor that differs across the ranks
# (a per-rank batch, a rank's partial sum) is taken as replicated all the same
# (`OpDispatcher._try_replicate_spec_for_scalar_tensor` in
# `torch/distributed/tensor/_dispatch.py` builds the `Replicate()` spec without a
# collective). Under FSDP x TP every parameter is a DTensor, and the question does not
# arise.
#
# (tp-checkpoint)=
# ## A 2D checkpoint, loaded by a 1D FSDP run and exported to one file
#
# The 2 x 2 run saves its model and AdamW state with {func}`fsdp_guide.checkpoint.save`
# (DCP: each rank writes its shards, each recorded with its offsets and sizes in the
# global tensor). A 2-rank FSDP run without TP loads it: DCP reads whichever slices each
# new shard needs. It then exports one
# `torch.save` file with {func}`fsdp_guide.checkpoint.export_consolidated`.

# %%
import tempfile
from pathlib import Path

from fsdp_guide import checkpoint

# deleted, with what the page wrote, when the kernel exits
scratch = tempfile.TemporaryDirectory(prefix="tensor-parallel-")
run_dir = Path(scratch.name)


def train_2d_and_save(directory):
    mesh = make_mesh()
    model = parallelize(build_model(), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        model(*my_rows(mesh, step))[1].backward()
        optimizer.step()
        optimizer.zero_grad()
    checkpoint.save(directory, 2, model, optimizer)
    # gathered over dp and tp
    checkpoint.export_consolidated(model, Path(directory) / "model-2d.pt")
    optimizer_state = {
        name: optimizer.state[p]["exp_avg"].full_tensor().cpu()
        for name, p in model.named_parameters()
    }
    return {name: p.cpu() for name, p in full_parameters(model).items()}, optimizer_state


def load_on_1d_and_export(directory):
    mesh = init_device_mesh(
        fsdp_guide.device().type, (dist.get_world_size(),), mesh_dim_names=("dp",)
    )
    model = build_model()
    apply_fsdp(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = checkpoint.load(checkpoint.latest(directory), model, optimizer)
    optimizer_state = {
        name: optimizer.state[p]["exp_avg"].full_tensor().cpu()
        for name, p in model.named_parameters()
    }
    checkpoint.export_consolidated(model, Path(directory) / "model.pt")
    return step, {name: p.cpu() for name, p in full_parameters(model).items()}, optimizer_state


saved_params, saved_moments = launch(train_2d_and_save, run_dir, world_size=4, output="none")[0]
step, loaded_params, loaded_moments = launch(
    load_on_1d_and_export, run_dir, world_size=2, output="none"
)[0]
plain = GPT(CONFIG)
print(
    "exported file into a plain GPT:",
    plain.load_state_dict(torch.load(run_dir / "model.pt", weights_only=True)),
)
print(
    f"step {step}; 1D parameters equal the 2D ones exactly:",
    all(torch.equal(loaded_params[n], p) for n, p in saved_params.items()),
)
print(
    "AdamW's first moments equal exactly:",
    all(torch.equal(loaded_moments[n], m) for n, m in saved_moments.items()),
)
print(
    "exported file equals the 2D parameters exactly:",
    all(torch.equal(plain.state_dict()[n], p) for n, p in saved_params.items()),
)
exported_2d = torch.load(run_dir / "model-2d.pt", weights_only=True)
print(
    "the 2D run's own export equals them exactly:",
    all(torch.equal(exported_2d[n], p) for n, p in saved_params.items()),
)

# %% [markdown]
# Nothing in the checkpoint ties it to the mesh that wrote it: DCP stores each tensor's
# global shape and which slice every file holds, and the loading run asks for the slices
# its own placements need (here a `_StridedShard` over `dp` and a `Shard` over `tp`
# becomes a plain `Shard` over 2 ranks); a 1D checkpoint is expected to load on a 2D run
# the same way (not run here). The export's `get_model_state_dict(...,
# full_state_dict=True)` gathers over every mesh dimension: the 2D run's own export, from
# `_StridedShard` and `Shard` over two dimensions, equals the 1D run's. Bit for bit,
# because no arithmetic is involved, only copies. What does not carry over to a different number
# of ranks is each rank's RNG state: {func}`fsdp_guide.checkpoint.load` restores it only
# on the same world size, so a resumed run that draws random numbers (dropout, data
# order) continues from new streams.

# %% [markdown]
# (tp-context-parallel)=
# ## Context parallelism: not on the CPU
#
# Context parallelism (CP) splits the sequence over the ranks of a mesh dimension and runs
# attention as a ring: each rank's queries meet every rank's keys and values in turn.
# torch's `context_parallel` (`torch.distributed.tensor.experimental`) shards the buffers
# it is given along the sequence, and replaces the attention kernels inside its block.
# Here it is, on 2 ranks, around one causal attention:


# %%
def attention_split_by_sequence():
    from torch.distributed.tensor.experimental import context_parallel

    device = fsdp_guide.device()
    mesh = init_device_mesh(device.type, (2,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    # batch, heads, sequence, head dim
    q, k, v = (torch.randn(1, 2, 16, 8, device=device) for _ in range(3))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except NotImplementedError as e:
        return f"{type(e).__name__}: {e}"
    return f"ran: this rank's output {tuple(out.shape)}, half the sequence"


print(launch(attention_split_by_sequence, world_size=2, output="none")[0])

# %% [markdown]
# On the CPU it does not run: CP replaces the flash, memory-efficient and cuDNN attention
# operators (the `_scaled_dot_product_*_attention` entries of its handlers, in
# [`torch/distributed/tensor/experimental/_context_parallel/_attention.py`](https://github.com/pytorch/pytorch/blob/main/torch/distributed/tensor/experimental/_context_parallel/_attention.py)),
# which are GPU kernels, and the CPU's attention is another operator,
# `_scaled_dot_product_flash_attention_for_cpu`, which it does not handle. So this guide
# shows no CP training: on GPUs the cell above is meant to run, and a CP run belongs with
# the recorded GPU runs.
#
# (tensor-parallel-tips)=
# ## The tips behind this
#
# - {ref}`tip-tp-then-fsdp`
# - {ref}`tip-tp-same-batch`
# - {ref}`tip-2d-mesh-is-hsdp`
# - {ref}`tip-clip-across-meshes`
# - {ref}`tip-tp-checkpoint`
# - {ref}`tip-loss-parallel`
# - {ref}`tip-tp-gqa-heads`

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("tensor_parallel")
