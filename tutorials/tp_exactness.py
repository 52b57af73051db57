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
# (tutorial-tp-exactness)=
# # 2D training equals one process, and a 2D mesh alone is HSDP
#
# **What you will learn**
#
# - that FSDP x TP on a 2 x 2 mesh computes what one process computes on the global batch,
#   and what silently goes wrong when the ranks of a TP group get different batches;
# - the trap: a 2D mesh handed to `fully_shard` alone is {term}`HSDP`, not FSDP x TP, and
#   how to tell the two apart;
# - `dp_mesh_dims`, which names the data-parallel dimensions of a whole mesh.
#
# **What you need**: a CPU; 4 processes on gloo; about 10 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The
# worker code is written to run unchanged with one GPU per rank (NCCL): the mesh is built
# on {func}`fsdp_guide.device`'s type. The tips it demonstrates are listed {ref}`at the end <tp-exactness-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`tp-exactness-script` ({download}`download <scripts/tp_exactness.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# The setup of {ref}`the tensor-parallel plan <tp-plan>`, repeated (unfold the cell to read it):
# the package's small GPT ({class}`fsdp_guide.gpt.GPT`), a global batch of 8 sequences, the 2 x 2
# mesh named `dp` and `tp`, TP with sequence parallelism over `tp`, then `fully_shard` over `dp`;
# `my_rows` gives each `dp` rank its half of the batch, the same half on both ranks of a TP group.

# %% tags=["hide-input"]
import fsdp_guide
import torch.distributed as dist
from fsdp_guide import launch
from fsdp_guide.compare import largest_difference
from fsdp_guide.gpt import GPT, GPTConfig
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

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


def apply_tp(model, tp_mesh):
    """Column-wise q, k, v and fc, row-wise projections; norms and residual stream along the sequence."""
    plan = {
        sub: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        for sub in ("attn", "mlp")  # a sub-layer gathers the whole sequence on its way in
    }
    plan |= {"ln_1": SequenceParallel(), "ln_2": SequenceParallel()}
    plan |= {f"attn.{name}": ColwiseParallel() for name in ("q", "k", "v")}
    plan |= {"mlp.fc": ColwiseParallel()}
    plan |= {name: RowwiseParallel(output_layouts=Shard(1)) for name in ("attn.proj", "mlp.proj")}
    for block in model.blocks:
        parallelize_module(block, tp_mesh, plan)
    # into the blocks: keep this rank's part of the sequence; out of them: gather it
    edges = {
        "blocks.0": PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        ),
        "ln_f": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
    }
    parallelize_module(model, tp_mesh, edges)


def apply_fsdp(model, dp_mesh):
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def parallelize(model, mesh):
    """TP over mesh["tp"] first, then FSDP over mesh["dp"]: the order FSDP x TP needs."""
    if mesh["tp"].size() > 1:
        apply_tp(model, mesh["tp"])
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


def full_parameters(model):
    return {
        name: p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
        for name, p in model.named_parameters()
    }


# %% [markdown]
# (tp-exact)=
# ## 2D training equals one process on the global batch, up to rounding
#
# Three AdamW steps on the 2 x 2 mesh, each `dp` rank on its half of the global batch and
# both ranks of a TP group on the same half; and one process on the whole batch:


# %%
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
losses = [f"{x:.6f}" for x in wrong_losses]
print("different batches in a TP group: losses", losses, "(no error raised)")
print(f"parameters after 3 steps: largest difference {apart(wrong_params, one_params):.1e}")
print("same batch across each TP group:", launch(batch_checks, world_size=4, output="none")[0])

# %% [markdown]
# Nothing fails: DTensor trusts the layouts the plan declares (the blocks' input is
# declared `Replicate()` over `tp`, and `PrepareModuleInput._prepare_input_arg` in
# `torch/distributed/tensor/parallel/style.py` wraps it with `DTensor.from_local(...,
# run_check=False)`: no check), so each TP rank keeps its half of the sequence of *its
# own* batch, and the attention gathers a sequence stitched from two different samples.
# The losses look like a model training; the parameters drift from what the data says.
# The fix is in the data loader: index it by the `dp` coordinate (`mesh["dp"].get_local_rank()`,
# and `mesh["dp"].size()` shards), never by the global rank. `same_in_group`, one 8-byte
# all-gather per step, catches the mistake in a debug run.
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
from fsdp_guide import describe_sharding
from fsdp_guide.collectives import count_collectives
from fsdp_guide.memory import measure
from myst_nb import glue


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
        whole = sum(p.nbytes for p in model.parameters())  # P, before sharding
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
gathers = next(n for dim, kind, n in trap["FSDP x TP"][3] if (dim, kind) == ("dp", "all-gather"))
glue("tp_trap_gathers", gathers, display=False)

# %% [markdown]
# Both compute the same loss (one forward and backward, no optimizer step): HSDP is data
# parallelism, correct on any batches, and here each TP-style pair feeds it the same batch
# twice. (Each counts {glue:text}`tp_trap_gathers` all-gathers over `dp` or `tp`, one fewer than
# the {ref}`collectives table <tp-collectives>` counts for FSDP x TP: the forward that
# measured `q`'s output left the root gathered.) What differs:
#
# - **the placements**: `Replicate() over dp` on the first dimension is HSDP's signature;
#   FSDP x TP shows, for every planned weight, `Shard` (or `_StridedShard`) on `dp`, `Shard` on `tp`;
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
# (tp-dp-mesh-dims)=
# ### Naming the data-parallel dimensions: `dp_mesh_dims`
#
# Since torch 2.12 ({ref}`fsdp2-map`), `fully_shard` can take the whole mesh and be told
# which dimensions are data parallel: `dp_mesh_dims=DataParallelMeshDims(shard=...,
# replicate=...)`, each a dimension's name or a tuple of names (flattened into one). The
# parameters must then be DTensors on that whole mesh, `Replicate()` on the data-parallel
# dimensions (its docstring), as `distribute_module` makes them. Three roles for the two
# dimensions of one 2 x 2 mesh, named `x` and `y` so that only `dp_mesh_dims` gives them a
# meaning; in the third, `y` is tensor parallel by placement alone (layer 0's rows and
# layer 2's columns split over `y`; DTensor works out the collectives). Each trains 2 steps
# against one process on the data-parallel ranks' batches:
#
# (fsdp2-fully-shard-dp-mesh-dims)=
# (fsdp2-dataparallelmeshdims)=
# (fsdp2-dataparallelmeshdims-shard)=
# (fsdp2-dataparallelmeshdims-replicate)=

# %%
import torch.nn as nn
from torch.distributed.fsdp import DataParallelMeshDims
from torch.distributed.tensor import DTensor, distribute_module, distribute_tensor

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
        p = nn.Parameter(distribute_tensor(p, mesh, [Replicate(), over_y]))
        module.register_parameter(what, p)


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
        loss = sum(model(small_batch(10 * step + b)).square().mean() for b in range(batches))
        (loss / batches).backward()
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
# parallelism, with FSDP x TP's `_StridedShard` ({ref}`tp-plan`). Every layout trains as one
# process does. `dp_mesh_dims` is for parameters already DTensors on the whole mesh; these
# pages' `mesh["dp"]` after `parallelize_module` over `mesh["tp"]` works on every supported torch.

# %% [markdown]
# (tp-exactness-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/tp_exactness.py`.
# A small model split by TP over `tp` and sharded over `dp` on 4 ranks trains with data by the `dp`
# coordinate, then by the global rank (raising nothing); then the 2D mesh goes to `fully_shard` alone
# (HSDP). Rank 0 prints each run's largest weight difference from one process, and HSDP's placements.
# The tests run it on 4 CPU ranks and check the right split and HSDP (1e-5), the drift of the wrong
# one (a hundred times more), and HSDP's `(Replicate(), Shard(dim=0))` (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/tp_exactness.py
# :language: python
# ```

# %% [markdown]
# (tp-exactness-tips)=
# ## The tips behind this
#
# - {ref}`tip-tp-same-batch`
# - {ref}`tip-2d-mesh-is-hsdp`

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("tp_exactness")
