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
# (tutorial-tp-gradients)=
# # A TP model's gradients: partial sums, two meshes, plain tensors
#
# **What you will learn**
#
# - why the norms' gradients are partial sums under TP alone, and what that costs AdamW;
# - gradient clipping when the parameters live on two meshes (FSDP x TP);
# - `implicit_replication` when plain tensors sit next to DTensors (TP alone).
#
# **What you need**: a CPU; 4 processes on gloo; about 10 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The
# worker code is written to run unchanged with one GPU per rank (NCCL): the mesh is built
# on {func}`fsdp_guide.device`'s type.
# The tips it demonstrates are listed {ref}`at the end <tp-gradients-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`tp-gradients-script` ({download}`download <scripts/tp_gradients.py>`).

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
# (tp-partial-grads)=
# ## TP alone: the norms' gradients are partial sums
#
# With sequence parallelism each rank of a TP group runs a norm on its own part of the
# sequence, so its gradient for the norm's weight sums over that part only: autograd
# leaves it a `DTensor` with `Partial(sum)` placement, and `p.grad.to_local()` is one
# rank's term of the sum. Compared with one process's gradient on the same batch, with
# AdamW's step counted alone, and counted again after reducing each partial gradient once:

# %%
from fsdp_guide.collectives import count_collectives
from myst_nb import glue
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
# that reduction itself (the {ref}`collectives table <tp-collectives>`'s 0 in the step).
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


def apart(params, reference):
    return largest_difference((params[name], p) for name, p in reference.items())


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
# much as a large one's). That is also why the {ref}`collectives table <tp-collectives>` passes
# `foreach=False`.
# `implicit_replication` checks nothing: a plain tensor that differs across the ranks
# (a per-rank batch, a rank's partial sum) is taken as replicated all the same
# (`OpDispatcher._try_replicate_spec_for_scalar_tensor` in
# `torch/distributed/tensor/_dispatch.py` builds the `Replicate()` spec without a
# collective). Under FSDP x TP every parameter is a DTensor, and the question does not
# arise.

# %% [markdown]
# (tp-gradients-script)=
# ## The script to copy
#
# This page's clipping as a plain torchrun script, with torch alone: {download}`scripts/tp_gradients.py`.
# Four ranks form a 2 x 2 mesh named `dp` and `tp`; the blocks are split by TP over `tp` and
# sharded over `dp`, the output head over `dp` alone, so the gradients live on two meshes. Rank 0
# prints the error `clip_grad_norm_` raises, then the total norm of the clipping grouped by mesh
# against one process's, and the largest difference between the clipped gradients. The tests run
# this file under torchrun on 4 CPU ranks and check the error, the norm (to 1e-5 of it) and the
# gradients (1e-6) (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/tp_gradients.py
# :language: python
# ```

# %% [markdown]
# (tp-gradients-tips)=
# ## The tips behind this
#
# - {ref}`tip-tp-then-fsdp`
# - {ref}`tip-clip-across-meshes`

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("tp_gradients")
