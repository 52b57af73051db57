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
# (tutorial-no-sync)=
# # Skipping the gradient sync during accumulation
#
# **What you will learn**
#
# - what `set_requires_gradient_sync(False)` on all but the last micro-batch of a step
#   saves against FSDP's default of reducing after every micro-batch, counted in
#   collectives and bytes per step, and what it costs: every rank holds the whole model's
#   gradients, unsharded, until the reduction;
# - that the all-gathers do not change, and that the gradients stay one process's;
# - on HSDP (a 2 x 2 mesh), what `set_requires_all_reduce(False)` saves instead, at no
#   memory cost; and a rule for choosing, with the numbers.
#
# **What you need**: a CPU; 2 and 4 processes on gloo; about 5 seconds on 2 CPU cores ({ref}`measured <measured-times>`).
# The same code is written to run unchanged with one GPU per rank (NCCL): the shards
# live on {func}`fsdp_guide.device`. The loss is normalised as
# {ref}`tutorial-loss-and-accumulation` shows. The tips it demonstrates are listed
# {ref}`at the end <no-sync-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`no-sync-script` ({download}`download <scripts/no_sync.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# The setup of {ref}`tutorial-loss-and-accumulation`, repeated: the package's small GPT
# ({class}`fsdp_guide.gpt.GPT`), 2 blocks, one FSDP unit per block and the root; rows of
# random lengths padded to 32 tokens, the padding's targets `-100` (ignored); every
# micro-batch's summed loss divided by the step's {term}`global token count`, with FSDP's
# {term}`gradient divide factor` set to 1 ({ref}`loss-accumulation` shows why), so the
# gradients are one process's.

# %%
import fsdp_guide
import torch.distributed as dist
import torch.nn.functional as F
from fsdp_guide import launch
from fsdp_guide.gpt import GPT, GPTConfig
from fsdp_guide.table import Table
from IPython.display import display
from myst_nb import glue  # the figures the text quotes, from the run
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

CONFIG = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)
ROWS, IGNORE = 8, -100


def global_batch(seed=0):
    """Token rows and next-token targets; a row's padding has target IGNORE."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(CONFIG.vocab_size, (ROWS, CONFIG.block_size + 1), generator=g)
    lengths = torch.randint(2, CONFIG.block_size + 1, (ROWS,), generator=g)
    targets = tokens[:, 1:].clone()
    targets[torch.arange(CONFIG.block_size) >= lengths[:, None]] = IGNORE
    return tokens[:, :-1], targets


def build_model():
    torch.manual_seed(0)
    model = GPT(CONFIG)
    model.init_weights()
    return model


def summed_loss(model, tokens, targets):
    """The loss summed over the real tokens, and how many there are."""
    logits, _ = model(tokens)
    loss = F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum"
    )
    return loss, (targets != IGNORE).sum()


def one_process_gradients(tokens, targets):
    """One process on all these rows: the mean loss over their real tokens, and the gradients."""
    model = build_model()
    loss, count = summed_loss(model, tokens, targets)
    (loss / count).backward()
    return (loss / count).item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def relative_error(grads, reference):
    """|g - g_ref| / |g_ref| over all parameters together."""
    diff = sum(((grads[n] - reference[n]) ** 2).sum() for n in reference)
    return (diff / sum((g**2).sum() for g in reference.values())).sqrt().item()


def shard_model(mesh):
    model = build_model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def sum_over_ranks(value):
    value = value.detach().clone()
    dist.all_reduce(value)  # SUM
    return value


def set_divide_factor(model, factor):
    for module in model.modules():  # the setting is per FSDP module: it does not recurse
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(factor)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def full_gradients(model):
    """Every parameter's whole gradient, on the CPU (an all-gather per parameter, on every rank)."""
    return {name: p.grad.full_tensor().cpu() for name, p in model.named_parameters()}


# %% [markdown]
# (loss-accumulation-traffic)=
# ## What skipping the gradient sync saves, and costs
#
# Four micro-batches per step (each rank with rows of its own), measured two ways:
#
# - `sync every micro-batch`: FSDP's default, every backward reduce-scatters the
#   gradients, and each rank accumulates sharded gradients;
# - `no sync until the last`: `set_requires_gradient_sync(False)` for the first three, so
#   FSDP keeps **unsharded** gradients on every rank and reduces them once (the
#   {term}`gradient sync` is off).
#
# {func}`fsdp_guide.precision.record_dtypes` counts FSDP's collectives and the bytes of the
# tensors it hands them, per step, in units of the model's parameter bytes *P*;
# {func}`fsdp_guide.memory.measure` counts the gradient bytes rank 0 holds after each
# micro-batch (the sharded `.grad`s, and what FSDP accumulates outside them, as the
# unsharded gradients it keeps while sync is off).
# These are what FSDP asks the backend to move, which does not depend on the backend
# (expected the same on NCCL; not run here); what crosses the
# wire depends on the backend's algorithm (gloo's reduce-scatter moves as much as an
# all-reduce: {ref}`tutorial-communication`).
#
# (fsdp2-fsdpmodule-set-requires-gradient-sync)=
# (fsdp2-fsdpmodule-set-requires-all-reduce)=

# %%
STEP_MICRO = 4  # micro-batches per rank per step


def accumulation_costs(mode, mesh_shape):
    from fsdp_guide.memory import measure
    from fsdp_guide.precision import record_dtypes

    device = fsdp_guide.device()
    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    model = shard_model(init_device_mesh(device.type, mesh_shape, mesh_dim_names=names))
    set_divide_factor(model, 1.0)  # the loss below is already over the global count
    P = sum(p.numel() * p.element_size() for p in model.parameters())  # whole (unsharded) bytes
    # 8 rows of its own: 4 micro-batches of 2
    step_tokens, step_targets = global_batch(seed=1 + dist.get_rank())
    global_count = sum_over_ranks(torch.tensor(int((step_targets != IGNORE).sum()), device=device))
    held = []
    with record_dtypes() as seen:
        for i, (x, y) in enumerate(
            zip(step_tokens.chunk(STEP_MICRO), step_targets.chunk(STEP_MICRO))
        ):
            last = i == STEP_MICRO - 1
            if mode == "no sync until the last":
                model.set_requires_gradient_sync(last)
            elif mode == "no all-reduce until the last":
                # HSDP: reduce-scatter every time, all-reduce once
                model.set_requires_all_reduce(last)
            loss_sum, _ = summed_loss(model, x.to(device), y.to(device))
            (loss_sum / global_count).backward()
            held.append(measure(model).grads / P)
    traffic = {
        kind: (
            sum(seen.count[(phase, kind)] for phase in ("forward", "backward")),
            sum(seen.nbytes[(phase, kind)] for phase in ("forward", "backward")) / P,
        )
        for kind in ("all-gather", "reduce-scatter", "all-reduce")
    }
    return traffic, held, full_gradients(model)


def costs(modes, mesh_shape):
    return {mode: accumulation_costs(mode, mesh_shape) for mode in modes}


def print_costs(measured, world):
    # every rank's rows of the step
    batches = [global_batch(seed=1 + rank) for rank in range(world)]
    _, step_reference = one_process_gradients(
        torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])
    )
    kinds = ("all-gather", "reduce-scatter", "all-reduce")
    rows = []
    for mode, (traffic, held, grads) in measured.items():
        counts = [cell for k in kinds for cell in (traffic[k][0], f"{traffic[k][1]:.2f}")]
        error = relative_error(grads, step_reference)
        rows.append([mode, *counts, " ".join(f"{h:.2f}" for h in held), f"{error:.1e}"])
    header = ["mode", *(name for k in kinds for name in (f"{k}s", f"{k} bytes/P"))]
    print(
        "gradients held / P: after micro-batches 1, 2, 3, 4; error: the final gradients', vs one process's"
    )
    display(Table([*header, "gradients held / P", "error"], rows))


measured = launch(costs, ["sync every micro-batch", "no sync until the last"], (2,), output="none")[
    0
]
print_costs(measured, world=2)

(synced, held_synced, _), (unsynced, held_unsynced, _) = (
    measured["sync every micro-batch"],
    measured["no sync until the last"],
)
glue("gathers_per_micro_batch", synced["all-gather"][0] / STEP_MICRO, display=False)
glue("gathered_per_micro_batch", synced["all-gather"][1] / STEP_MICRO, display=False)  # in P
glue("scatters_synced", synced["reduce-scatter"][0], display=False)
glue("scattered_synced", synced["reduce-scatter"][1], display=False)
glue("scatters_unsynced", unsynced["reduce-scatter"][0], display=False)
glue("scattered_unsynced", unsynced["reduce-scatter"][1], display=False)
glue("held_synced", max(held_synced), display=False)
glue("held_unsynced", max(held_unsynced), display=False)

# %% tags=["hide-input"] mystnb={"image": {"alt": "The gradients a rank holds after each of the 4 micro-batches of a step, in units of the parameters' bytes, syncing every micro-batch and not syncing until the last: synced, it holds its shard's worth after each; unsynced, it holds the whole unsharded gradient until the last micro-batch's reduce-scatter shards it."}}
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(6, 2.6))
for mode, (_, held, _) in measured.items():
    ax.plot(range(1, len(held) + 1), held, "o-", label=mode)
ax.set(
    xlabel="after micro-batch",
    ylabel="gradients held / P",
    ylim=(0, 1.15),
    xticks=range(1, STEP_MICRO + 1),
)
ax.set_title("gradients held on a rank, 2 ranks")
ax.legend(fontsize=8, loc="lower left")
fig.tight_layout()

# %% [markdown]
# Per step of 4 micro-batches on 2 ranks, P the parameters' bytes:
#
# - **All-gathers do not change**: 3 units gathered in every forward and the 2 blocks
#   again in every backward (the root, with the embeddings, stays gathered from its forward
#   to its backward: FSDP2 does not reshard the root after forward, `FSDPState._lazy_init`
#   in `torch/distributed/fsdp/_fully_shard/_fsdp_state.py`), {glue:text}`gathers_per_micro_batch:g` all-gathers and
#   {glue:text}`gathered_per_micro_batch:.2f` P per micro-batch (this run's figures, glued from the table above,
#   here and below). Turning off the sync does
#   not turn off resharding: for that,
#   `set_reshard_after_backward(False)` (and `reshard_after_forward=False`), at the cost of
#   holding the parameters unsharded too ({ref}`lora-traffic` measures it).
# - **Reduce-scatters fall from {glue:text}`scatters_synced` per step to {glue:text}`scatters_unsynced`**: one per unit (3) per backward that
#   reduces, so *M* x 3 become 3, and the {glue:text}`scattered_synced:.0f` *P* of gradients handed to them per step
#   become {glue:text}`scattered_unsynced:.0f` *P*.
# - **Gradient memory rises from {glue:text}`held_synced:.1f` *P* to {glue:text}`held_unsynced:.1f` *P* per rank**: from the first micro-batch to the
#   reduction, every rank holds the whole model's gradients, unsharded, where the default
#   holds only its shard (1/N of them on N ranks).
# - The final gradients are one process's, to rounding, either way (each micro-batch's
#   summed loss over the global count, FSDP's divide factor 1): accumulating before or
#   after the reduction adds the same numbers.
#
# (loss-hsdp)=
# ## HSDP: skip the all-reduce, keep the reduce-scatter
#
# On a 2 x 2 mesh (4 ranks: 2 replicas, each sharded over 2 ranks), FSDP reduces a
# gradient in two steps: a reduce-scatter inside the shard group, then an all-reduce of the
# shard across the replicas, typically between nodes, over the slower network.
# `set_requires_all_reduce(False)` keeps the first and skips the second until the last
# micro-batch, so the gradients stay sharded:

# %%
hsdp_modes = ["sync every micro-batch", "no all-reduce until the last", "no sync until the last"]
hsdp = launch(costs, hsdp_modes, (2, 2), world_size=4, output="none")[0]
print_costs(hsdp, world=4)

(synced, _, _), (reduced_once, held_reduced_once, _) = (
    hsdp["sync every micro-batch"],
    hsdp["no all-reduce until the last"],
)
glue("hsdp_reduces_synced", synced["all-reduce"][0], display=False)
glue("hsdp_reduced_synced", synced["all-reduce"][1], display=False)
glue("hsdp_reduces_once", reduced_once["all-reduce"][0], display=False)
glue("hsdp_reduced_once", reduced_once["all-reduce"][1], display=False)
glue("hsdp_held_reduced_once", max(held_reduced_once), display=False)

# %% [markdown]
# Per step on the 2 x 2 mesh:
#
# - **Syncing every micro-batch** all-reduces across replicas after every backward: {glue:text}`hsdp_reduces_synced`
#   all-reduces per step (3 units x 4), each of the rank's shard of a unit's gradients,
#   *P*/2 per micro-batch in all.
# - **`set_requires_all_reduce(False)`** all-reduces after the last micro-batch only: {glue:text}`hsdp_reduces_once`
#   instead of {glue:text}`hsdp_reduces_synced`, {glue:text}`hsdp_reduced_once:.1f` *P* instead of {glue:text}`hsdp_reduced_synced:.0f` *P*; the reduce-scatters inside each replica stay,
#   and the gradients held stay sharded, *P*/2 per rank (FSDP sums the reduce-scattered
#   shards until the all-reduce).
# - **`set_requires_gradient_sync(False)`** removes both until the last micro-batch, and
#   holds P per rank: the whole model's gradients.
#
# ## The rule
#
# With *M* micro-batches per step, *U* FSDP units, *N* ranks sharding, and *P* bytes of
# parameters; the bytes handed to the collectives per step, each collective counted once per
# unit (*M* x *U* of them, or *U*), and fp32 throughout as here:
#
# | | reduce-scatter per step | cross-replica all-reduce per step (HSDP) | gradients held per rank |
# |---|---|---|---|
# | sync every micro-batch | *M* x *P* | *M* x *P*/*N* | *P*/*N* |
# | `set_requires_all_reduce(False)` (HSDP) | *M* x *P* | *P*/*N* | *P*/*N* |
# | `set_requires_gradient_sync(False)` | *P* | *P*/*N* | *P* |
#
# Measured above with *M* = 4, *U* = 3 and *N* = 2: {glue:text}`scatters_synced` reduce-scatters per step
# ({glue:text}`scattered_synced:.0f` *P*) became {glue:text}`scatters_unsynced` ({glue:text}`scattered_unsynced:.0f` *P*) and the
# gradients held went from {glue:text}`held_synced:.1f` *P* to {glue:text}`held_unsynced:.1f` *P*; on HSDP,
# {glue:text}`hsdp_reduces_synced` all-reduces ({glue:text}`hsdp_reduced_synced:.0f` *P*) became {glue:text}`hsdp_reduces_once`
# ({glue:text}`hsdp_reduced_once:.1f` *P*), the gradients held staying at {glue:text}`hsdp_held_reduced_once:.1f` *P*.
#
# With mixed precision the bytes change by dtype: all-gathers move `param_dtype`,
# reductions the reduce dtype. While the sync is off, FSDP accumulates the unsharded
# gradients in the reduce dtype when it differs from `param_dtype`, and otherwise in
# `param_dtype` itself (`FSDPParam.to_accumulated_grad_if_needed` in
# `torch/distributed/fsdp/_fully_shard/_fsdp_param.py`): in torch 2.13, with
# `param_dtype=torch.bfloat16` and no `reduce_dtype`, *M* micro-batches are summed in bf16. Set
# `reduce_dtype=torch.float32` when accumulating without sync; the gradients held are then
# 4 bytes per parameter.
#
# - Turn the **gradient sync** off when the unsharded gradients (*P* per rank, what one
#   process would hold, in the reduce dtype) fit beside everything else: it divides the
#   reduce-scatter traffic by *M*. It costs *N* times the gradient memory FSDP otherwise
#   holds: where the model's unsharded parameters would not fit on one rank, its unsharded
#   gradients will not either. With LoRA the gradients are the adapters' only, and it is
#   nearly free.
# - On **HSDP**, turn the **all-reduce** off, at no memory cost: it removes *M* - 1 of the
#   *M* all-reduces between replicas, typically the slow inter-node ones.
# - Either way, divide each micro-batch's summed loss by the step's **global token count**
#   ({ref}`loss-accumulation`): skipping a sync changes when FSDP reduces, not what.

# %% [markdown]
# (no-sync-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/no_sync.py`.
# `torchrun --nproc-per-node=2 no_sync.py` trains a small MLP of 3 FSDP units, each rank its rows
# as 4 micro-batches, twice: reducing after every micro-batch, then with the gradient sync off
# until the last. `torch.profiler` counts the reduce-scatters of a step, and rank 0 compares each
# run's weights with one process trained on the whole batches. The tests run it on 2 CPU ranks
# and check 12 reduce-scatters per step against 3, and both runs' weights within 1e-5 of one
# process's (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/no_sync.py
# :language: python
# ```

# %% [markdown]
# (no-sync-tips)=
# ## The tips behind this
#
# - {ref}`tip-accumulation-no-sync`

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("no_sync")
