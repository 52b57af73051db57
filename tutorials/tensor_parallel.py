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
# - gradient clipping when the parameters live on two meshes, and a 2D checkpoint loaded
#   by a 1D FSDP run and exported to one file.
#
# **What you need**: a CPU; 4 processes on gloo; about 30 seconds on 2 CPU cores. The
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
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fsdp_guide
from fsdp_guide import launch
from fsdp_guide.gpt import GPT, GPTConfig

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
# adjacent ranks: with torchrun's numbering, adjacent ranks share a node, so a TP group
# no larger than a node's GPUs keeps its per-layer collectives on the node's fast link.
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
    between = Shard(1) if sequence_parallel else Replicate()  # the residual stream between sub-layers
    plan = {
        # a sub-layer needs the whole sequence: all-gather it on the way in (with sequence
        # parallelism), and hand q, k and v one DTensor, so their input gradients are summed
        # before a single collective in the backward
        "attn": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
        "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
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
    if sequence_parallel:  # into the blocks: keep this rank's part of the sequence; out of them: gather it
        parallelize_module(model, tp_mesh, {
            "blocks.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                           use_local_output=True),
            "ln_f": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                       use_local_output=True)})


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

# %%
from fsdp_guide import describe_sharding
from fsdp_guide.describe import ShardingTable


def what_each_rank_holds():
    table = describe_sharding(parallelize(build_model(), make_mesh()))
    return ShardingTable(row for row in table if not row.name.startswith("blocks.1"))


tables = launch(what_each_rank_holds, world_size=4, output="none")
print(tables[0])
print()
print(f"{'rank (dp, tp)':14} {'attn.q.weight':>14} {'attn.proj.weight':>17} {'ln_1.weight':>12} {'tok_emb.weight':>15}")
for rank, table in enumerate(tables):
    holds = {row.name: row.holds for row in table}
    print(f"{rank} ({rank // 2}, {rank % 2}){'':7} {holds['blocks.0.attn.q.weight']:>14} "
          f"{holds['blocks.0.attn.proj.weight']:>17} {holds['blocks.0.ln_1.weight']:>12} {holds['tok_emb.weight']:>15}")

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
# two rows with each other.

# %%
from fsdp_guide.collectives import count_collectives
from fsdp_guide.memory import measure, saved_for_backward

SETUPS = {"FSDP alone (dp=4)": ((4, 1), True), "TP alone (tp=4)": ((1, 4), True),
          "FSDP x TP (2 x 2)": ((2, 2), True), "FSDP x TP, no seq. parallel": ((2, 2), False)}


def one_step_counted(shape, sequence_parallel):
    mesh = make_mesh(*shape)
    model = build_model()
    whole = whole_bytes(model)  # P, before sharding
    model = parallelize(model, mesh, sequence_parallel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        with count_collectives(mesh) as seen:
            with saved_for_backward() as saved:
                _, loss = model(*my_rows(mesh, step))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    rows = [(dim, kind, n, nbytes / whole) for dim, kind, n, nbytes in seen.rows()]
    return rows, measure(model).params / whole, saved.held_at_exit / 1024


def every_setup():
    return {name: one_step_counted(*setup) for name, setup in SETUPS.items()}


KINDS = ("all-gather", "reduce-scatter", "all-reduce")
print(f"{'':28} {'dim':4}" + "".join(f"{kind + 's (n, P)':>24}" for kind in KINDS)
      + f"{'params held / P':>17}{'saved, KiB':>12}")
for name, (rows, held, saved) in launch(every_setup, world_size=4, output="none")[0].items():
    for i, dim in enumerate(sorted({dim for dim, *_ in rows})):
        cells = {kind: f"{n:3} {size:6.2f}" for d, kind, n, size in rows if d == dim}
        print(f"{name if i == 0 else '':28} {dim:4}" + "".join(f"{cells.get(kind, '-'):>24}" for kind in KINDS)
              + (f"{held:17.2f}{saved:12.0f}" if i == 0 else ""))

# %% [markdown]
# - **FSDP alone** all-gathers each of the 3 units in the forward and the 2 blocks again
#   in the backward (the root stays gathered), and reduce-scatters the 3 units'
#   gradients: 2.7 *P* of parameters and gradients over the `dp` groups. Each rank holds
#   a quarter.
# - **TP alone** never moves a parameter: it moves activations, 5 all-gathers and 4
#   reduce-scatters each way (forward and backward), at the size of one layer's input.
#   A rank holds 0.45 *P*: the embeddings and norms are whole on every rank. The 24 small
#   all-reduces are the norms' gradients: sequence parallelism leaves them `Partial(sum)`
#   (each rank summed over its part of the sequence), and AdamW's step, reading each of
#   the 8 three times, all-reduces it each time. Reducing them once before the step
#   (`p.grad = p.grad.redistribute(placements=[Replicate()])` for each partial gradient)
#   leaves 8. Until then, `p.grad.to_local()` is a partial sum: hand-written logging or
#   clipping that reads it is wrong.
# - **FSDP x TP** does both on separate groups: FSDP's collectives run over `dp` on
#   TP-split units (1.01 *P* of all-gathers instead of 1.74: the blocks are half-size, the
#   root is not split by TP); TP's run over `tp` on half the batch. Each rank holds
#   0.32 *P*, about a third: the TP-split weights a quarter, the embeddings half. Here the
#   norms' gradients are all-reduced once, in FSDP's backward (8 all-reduces, 0.01 *P*).
# - **Without sequence parallelism** each sub-layer's partial sums are all-reduced (4
#   all-reduces each way). The table counts full-size buffers, not bytes on the wire:
#   with a ring algorithm a rank sends (n-1)/n of the buffer for an all-gather or a
#   reduce-scatter and twice that for an all-reduce, so the 8 all-reduces of 0.49 *P*
#   carry what 8 reduce-scatters and 8 all-gathers of 0.49 *P* carry. Sequence
#   parallelism adds two all-gathers here: out of the last block in the forward, and of
#   the gradient at the first block's input in the backward (the embeddings and final
#   norm are outside the plan). What it saves is activation memory, the norms' inputs and
#   the residual stream split along the sequence: 260 KiB saved for backward against 277
#   KiB. Little here, because each projection keeps its all-gathered input whole for its
#   backward, and that dominates this small model.
#
# What the split buys is not on this table: with TP, each rank's matmuls are a fraction of
# the layer, so more GPUs work on one batch without the global batch growing, and FSDP's
# all-gathers shrink with the TP degree. On GPUs, TP is expected to belong inside a node
# (its collectives are on the critical path of every layer) and FSDP across nodes.
#
# (tp-exact)=
# ## 2D training equals one process on the global batch, up to rounding
#
# Three AdamW steps on the 2 x 2 mesh, each `dp` rank on its half of the global batch and
# both ranks of a TP group on the same half; and one process on the whole batch:

# %%
def full_parameters(model):
    return {name: p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
            for name, p in model.named_parameters()}


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


def largest_difference(params, reference):
    return max((params[name] - p).abs().max().item() for name, p in reference.items())


one_losses, one_params = train_one_process()
losses_2d, params_2d = launch(train_2d, world_size=4, output="none")[0]
print("one process  losses", [f"{x:.6f}" for x in one_losses])
print("FSDP x TP    losses", [f"{x:.6f}" for x in losses_2d])
print(f"parameters after 3 steps: largest difference {largest_difference(params_2d, one_params):.1e}")

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
    return {name: same_in_group(batch_for(mesh)[0], mesh.get_group("tp"))
            for name, batch_for in (("dp rows", my_rows), ("rank quarters", my_quarter))}


wrong_losses, wrong_params = launch(train_2d, 3, my_quarter, world_size=4, output="none")[0]
print("different batches in a TP group: losses", [f"{x:.6f}" for x in wrong_losses], "(no error raised)")
print(f"parameters after 3 steps: largest difference {largest_difference(wrong_params, one_params):.1e}")
print("same batch across each TP group:", launch(batch_checks, world_size=4, output="none")[0])

# %% [markdown]
# Nothing fails: DTensor trusts the layouts the plan declares (the blocks' input is
# declared `Replicate()` over `tp`, and is not checked), so each TP rank keeps its half of
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
# names, but does not interpret them: `dp` here replicates and `tp` shards. (torch 2.13
# adds a `dp_mesh_dims` argument that names a mesh's data-parallel dimensions; this page
# keeps to passing `mesh["dp"]`, which every torch version it supports accepts.)

# %%
from torch.distributed.fsdp import FSDPModule


def hsdp_by_mistake(model, mesh):
    for block in model.blocks:
        fully_shard(block, mesh=mesh)  # the 2D mesh itself: replicate over dim 0, shard over dim 1
    return fully_shard(model, mesh=mesh)


def q_output_width(model, mesh):
    widths = []
    hook = model.blocks[0].attn.q.register_forward_hook(lambda m, i, out: widths.append(tuple(out.shape)))
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
        result[name] = (rows["blocks.0.attn.q.weight"], width, measure(model).params / whole,
                        [(dim, kind, n) for dim, kind, n, _ in seen.rows()], mean_over_dp(loss, mesh))
    return result


for name, (placement, width, held, collectives, loss) in launch(both_ways, world_size=4, output="none")[0].items():
    print(f"{name}:\n  attn.q.weight  {placement}\n  q's output on a rank {width}; params held {held:.2f} P\n"
          f"  collectives (dim, kind, n) {collectives}\n  loss {loss:.6f}")

# %% [markdown]
# Both train, and to the same loss: HSDP is data parallelism, correct on any batches,
# and here each TP-style pair feeds it the same batch twice. (Each counts 4 all-gathers
# over `dp` or `tp`, not the table's 5: the forward that measured `q`'s output left the
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
            by_mesh[p.grad.device_mesh].append(p)  # torch's stack and _foreach_mul_ take one mesh per call
    norms = [torch.nn.utils.get_total_norm([p.grad for p in group]).full_tensor() for group in by_mesh.values()]
    total = torch.linalg.vector_norm(torch.stack(norms))
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def clip_both_ways():
    mesh = make_mesh()
    model = parallelize(build_model(), mesh)
    _, loss = model(*my_rows(mesh))
    loss.backward()
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        error = "no error"
    except RuntimeError as e:
        error = str(e).splitlines()[0]
    total = clip_grad_norm_across_meshes(model.parameters(), MAX_NORM).item()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    return error, total, {name: g.cpu() for name, g in grads.items()} if dist.get_rank() == 0 else None


reference = build_model()
reference(*global_batch())[1].backward()
one_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM).item()
error, total, clipped = launch(clip_both_ways, world_size=4, output="none")[0]
print("clip_grad_norm_ on every parameter:", error)
print(f"one process total norm {one_norm:.7f}; across meshes {total:.7f}")
print(f"clipped gradients vs one process's: largest difference "
      f"{max((clipped[n] - p.grad).abs().max().item() for n, p in reference.named_parameters()):.1e}")

# %% [markdown]
# torch's `clip_grad_norm_` stacks the per-parameter norms into one tensor, and DTensor
# refuses an operation whose operands live on different meshes; its scaling step
# (`_foreach_mul_` in `clip_grads_with_norm_`) fails the same way over both meshes.
# Grouping the parameters by mesh, for both steps, works: each group's norm is a DTensor whose `full_tensor()` reduces over every
# dimension its gradients are split on (`dp`, or `dp` and `tp`), the groups' norms combine
# as the norm of norms, and each group is scaled by the same factor. The result is one
# process's norm, and one process's clipped gradients. (torchtitan sidesteps the two
# meshes by planning every parameter, embeddings and output included, over `tp`.)
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

run_dir = Path(tempfile.mkdtemp(prefix="tensor-parallel-"))


def train_2d_and_save(directory):
    mesh = make_mesh()
    model = parallelize(build_model(), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        model(*my_rows(mesh, step))[1].backward()
        optimizer.step()
        optimizer.zero_grad()
    checkpoint.save(directory, 2, model, optimizer)
    optimizer_state = {name: optimizer.state[p]["exp_avg"].full_tensor().cpu() for name, p in model.named_parameters()}
    return {name: p.cpu() for name, p in full_parameters(model).items()}, optimizer_state


def load_on_1d_and_export(directory):
    mesh = init_device_mesh(fsdp_guide.device().type, (dist.get_world_size(),), mesh_dim_names=("dp",))
    model = build_model()
    apply_fsdp(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = checkpoint.load(checkpoint.latest(directory), model, optimizer)
    optimizer_state = {name: optimizer.state[p]["exp_avg"].full_tensor().cpu() for name, p in model.named_parameters()}
    checkpoint.export_consolidated(model, Path(directory) / "model.pt")
    return step, {name: p.cpu() for name, p in full_parameters(model).items()}, optimizer_state


saved_params, saved_moments = launch(train_2d_and_save, run_dir, world_size=4, output="none")[0]
step, loaded_params, loaded_moments = launch(load_on_1d_and_export, run_dir, world_size=2, output="none")[0]
plain = GPT(CONFIG)
print("exported file into a plain GPT:", plain.load_state_dict(torch.load(run_dir / "model.pt", weights_only=True)))
print(f"step {step}; 1D parameters equal the 2D ones exactly:",
      all(torch.equal(loaded_params[n], p) for n, p in saved_params.items()))
print("AdamW's first moments equal exactly:", all(torch.equal(loaded_moments[n], m) for n, m in saved_moments.items()))
print("exported file equals the 2D parameters exactly:",
      all(torch.equal(plain.state_dict()[n], p) for n, p in saved_params.items()))

# %% [markdown]
# Nothing in the checkpoint ties it to the mesh that wrote it: DCP stores each tensor's
# global shape and which slice every file holds, and the loading run asks for the slices
# its own placements need (here a `_StridedShard` over `dp` and a `Shard` over `tp`
# becomes a plain `Shard` over 2 ranks); a 1D checkpoint is expected to load on a 2D run
# the same way (not run here). The export's `get_model_state_dict(...,
# full_state_dict=True)` gathers over every mesh dimension. Bit for bit, because no
# arithmetic is involved, only copies. What does not carry over to a different number
# of ranks is each rank's RNG state: {func}`fsdp_guide.checkpoint.load` restores it only
# on the same world size, so a resumed run that draws random numbers (dropout, data
# order) continues from new streams.
#
# (tensor-parallel-tips)=
# ## The tips behind this
#
# - {ref}`tip-tp-then-fsdp`
# - {ref}`tip-tp-same-batch`
# - {ref}`tip-2d-mesh-is-hsdp`
# - {ref}`tip-clip-across-meshes`
# - {ref}`tip-tp-checkpoint`

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("tensor_parallel")
