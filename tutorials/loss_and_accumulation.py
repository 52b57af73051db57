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
# (tutorial-loss-and-accumulation)=
# # Loss normalization and gradient accumulation
#
# **What you will learn**
#
# - why the per-rank mean loss of masked, variable-length batches gives gradients that
#   differ from one process's on the same global batch, by how much, and the fix that
#   matches one process to rounding: divide by the global token count, then undo FSDP's
#   average (times the number of ranks, or FSDP's gradient divide factor set to 1);
# - the same under gradient accumulation, with micro-batches of different token counts;
# - what `set_requires_gradient_sync(False)` saves against reducing every micro-batch,
#   counted in collectives and bytes per step, and what it costs in gradient memory per
#   rank; on HSDP (a 2 x 2 mesh), what `set_requires_all_reduce(False)` saves instead;
#   and a rule for choosing, with the numbers.
#
# **What you need**: a CPU; 2 and 4 processes on gloo; about 10 seconds on 2 CPU cores ({ref}`measured <measured-times>`).
# The worker code is written to run unchanged with one GPU per rank (NCCL): the shards
# live on {func}`fsdp_guide.device`. The tips it demonstrates are listed
# {ref}`at the end <loss-and-accumulation-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`loss-and-accumulation-script` ({download}`download <scripts/loss_and_accumulation.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# ## A global batch of masked sequences
#
# Eight sequences of random lengths, padded to 32 tokens. The padding's targets are
# `-100`, `cross_entropy`'s `ignore_index`: those positions add nothing to the loss. Each of
# the 2 ranks takes 4 rows. The model is the package's small GPT
# ({class}`fsdp_guide.gpt.GPT`), 2 blocks, built with one seed on every rank.

# %%
import torch.nn.functional as F
from fsdp_guide.gpt import GPT, GPTConfig

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


tokens, targets = global_batch()
print("real tokens per row:", (targets != IGNORE).sum(1).tolist())
rank_tokens = [int((t != IGNORE).sum()) for t in targets.chunk(2)]
print("real tokens per rank:", rank_tokens)

# %% [markdown]
# The reference is one process computing the mean loss over every real token of the global
# batch, the quantity the sharded runs should reproduce:


# %%
def one_process_gradients(tokens, targets):
    """One process on all these rows: the mean loss over their real tokens, and the gradients."""
    model = build_model()
    loss, count = summed_loss(model, tokens, targets)
    (loss / count).backward()
    return (loss / count).item(), {name: p.grad.clone() for name, p in model.named_parameters()}


reference_loss, reference = one_process_gradients(tokens, targets)


def relative_error(grads, reference=reference):
    """|g - g_ref| / |g_ref| over all parameters together."""
    diff = sum(((grads[n] - reference[n]) ** 2).sum() for n in reference)
    return (diff / sum((g**2).sum() for g in reference.values())).sqrt().item()


print(f"one process: loss {reference_loss:.6f}")

# %% [markdown]
# (loss-global-count)=
# ## Per-rank mean against the global token count
#
# Each rank computes its loss on its 4 rows; FSDP then **averages** the gradients over the
# ranks (its reduce-scatter divides by the number of ranks). Three ways to form the rank's
# loss:
#
# - `per-rank mean`: the rank's summed loss over the rank's own token count, what
#   `cross_entropy`'s default `reduction="mean"` gives;
# - `global count x ranks`: over the token count of the whole global batch (one
#   `all_reduce` of the count: the {term}`global token count`), times the number of ranks
#   to undo FSDP's average;
# - `global count, divide factor 1`: over the global count, with FSDP told not to divide at
#   all (`set_gradient_divide_factor(1.0)`, the {term}`gradient divide factor`, on every
#   FSDP module; torch 2.9 to 2.15 have
#   it): the reduction is then a plain sum.
#
# The logged loss is what a training loop prints: for the per-rank mean, the usual
# average of the ranks' losses (`all_reduce` of the loss, divided by the number of ranks);
# for the other two, the summed losses over the global count.
#
# (fsdp2-fsdpmodule-set-gradient-divide-factor)=
# (fsdp2-fsdpmodule-set-force-sum-reduction-for-comms)=

# %%
import fsdp_guide
import torch.distributed as dist
from fsdp_guide import launch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard


def shard_model(mesh):
    model = build_model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def sum_over_ranks(value):
    value = value.detach().clone()
    dist.all_reduce(value)  # SUM
    return value


def set_divide_factor(model, factor, force_sum=True):
    for module in model.modules():  # the setting is per FSDP module: it does not recurse
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(factor)
            # plain SUM collectives, then a division (none for 1.0): gloo has no PREMUL_SUM
            module.set_force_sum_reduction_for_comms(force_sum)


def full_gradients(model):
    """Every parameter's whole gradient, on the CPU (an all-gather per parameter, on every rank)."""
    return {name: p.grad.full_tensor().cpu() for name, p in model.named_parameters()}


def gradients_on_two_ranks(how):
    device = fsdp_guide.device()
    model = shard_model(init_device_mesh(device.type, (dist.get_world_size(),)))
    rows = slice(4 * dist.get_rank(), 4 * dist.get_rank() + 4)
    loss_sum, count = summed_loss(model, tokens[rows].to(device), targets[rows].to(device))
    global_count = sum_over_ranks(count)  # one all_reduce of a single number
    if how == "per-rank mean":
        loss = loss_sum / count
    elif how == "global count x ranks":
        loss = loss_sum / global_count * dist.get_world_size()
    else:  # "global count, divide factor 1"
        set_divide_factor(model, 1.0)
        loss = loss_sum / global_count
    loss.backward()
    if how == "per-rank mean":  # the mean of the ranks' means
        logged = (sum_over_ranks(loss) / dist.get_world_size()).item()
    else:  # every real token once
        logged = (sum_over_ranks(loss_sum) / global_count).item()
    return logged, full_gradients(model)


WAYS = ["per-rank mean", "global count x ranks", "global count, divide factor 1"]


def every_way():
    return {how: gradients_on_two_ranks(how) for how in WAYS}


results = launch(every_way, output="none")[0]
print(f"{'loss formed as':32} {'logged loss':>12} {'gradient error vs one process':>30}")
for how, (logged, grads) in results.items():
    print(f"{how:32} {logged:12.6f} {relative_error(grads):30.1e}")

# the figures the text quotes, from this run (JupyterLab shows glue's roles unrendered)
from myst_nb import glue

glue("per_rank_error", relative_error(results["per-rank mean"][1]), display=False)
glue("per_rank_logged", results["per-rank mean"][0], display=False)
# the counts printed with the batch, and the weights they give
glue("rank0_tokens", rank_tokens[0], display=False)
glue("rank1_tokens", rank_tokens[1], display=False)
# a mean of two means: 1 / (2 x the rank's count)
glue("rank0_weight", 2 * rank_tokens[0], display=False)
glue("rank1_weight", 2 * rank_tokens[1], display=False)
glue("all_tokens", sum(rank_tokens), display=False)
glue("one_process_loss", reference_loss, display=False)
# torch's max keeps a NaN
glue(
    "global_count_error",
    torch.tensor([relative_error(results[how][1]) for how in WAYS[1:]]).max().item(),
    display=False,
)

# %% [markdown]
# `set_force_sum_reduction_for_comms(True)` is there for gloo. With a divide factor other
# than the shard group's size and a float32 or bfloat16 reduce dtype, FSDP2 otherwise
# reduce-scatters with `ReduceOp.PREMUL_SUM(1/factor)` (`_get_gradient_divide_factors` in
# `torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py`; fp16 sums and divides before
# and after instead), which NCCL has and gloo does not:


# %%
def divide_factor_without_force_sum():
    device = fsdp_guide.device()
    model = shard_model(init_device_mesh(device.type, (dist.get_world_size(),)))
    set_divide_factor(model, 1.0, force_sum=False)
    loss_sum, _ = summed_loss(model, tokens[:4].to(device), targets[:4].to(device))
    loss_sum.backward()


try:  # on gloo on purpose, even where GPUs are: its refusal is what this cell shows
    launch(divide_factor_without_force_sum, backend="gloo", output="none")
    print("reduced without an error")
except fsdp_guide.LaunchError as error:  # "rank N raised ...": whichever rank failed first
    print("a rank raised", str(error).splitlines()[0].split(" raised ", 1)[1])

# %% [markdown]
# With the sum forced, a factor of 1 costs nothing: the collective is a plain `SUM` and
# there is nothing left to divide by (`_div_if_needed` in `_fsdp_collectives.py` skips a
# factor of 1, with no branch on the backend, so the same is expected on NCCL; not run here). (Should gloo gain `PREMUL_SUM`, the
# cell above will print that it reduced without an error.) On HSDP the all-reduce between
# replicas is a plain `SUM` in either case, so one factor divides the total over every
# data-parallel rank once. `set_gradient_divide_factor` sets only its own module's unit
# (`FSDPModule.set_gradient_divide_factor` in `_fully_shard.py`), hence the loop over every
# FSDP module.
#
# The figures below are this run's, glued from the table above (myst-nb's `glue`, whose
# roles JupyterLab does not render: read them from the table there).
#
# The per-rank mean's gradient is {glue:text}`per_rank_error:.0%` away from one process's. FSDP averages the two
# ranks' means, and a mean of means weighs each of rank 0's {glue:text}`rank0_tokens` tokens by
# 1/{glue:text}`rank0_weight` and each of rank 1's {glue:text}`rank1_tokens` by 1/{glue:text}`rank1_weight`,
# where one process weighs every token by 1/{glue:text}`all_tokens`. Its logged loss,
# the mean of the ranks' means, is slightly off too ({glue:text}`per_rank_logged:.6f` against
# {glue:text}`one_process_loss:.6f`). Divided by the global count, both ways of undoing FSDP's average
# agree with one process to float32 rounding (errors up to {glue:text}`global_count_error:.0e` in the table): the
# same numbers, added in another order.
#
# The error comes from the spread of token counts between ranks: larger batches shrink the
# spread relative to the count but do not remove it. Packing sequences removes it only when
# every rank then has the same number of tokens that count (prompt masking in fine-tuning
# breaks that). Nothing fails: training follows a different, length-weighted objective.
#
# (loss-accumulation)=
# ## Under gradient accumulation
#
# Now each rank runs its 4 rows as 2 micro-batches of 2 rows, accumulating gradients
# ({term}`gradient accumulation`), and
# FSDP reduces only after the last micro-batch (`set_requires_gradient_sync(False)` before
# the others; the next section counts what that saves). The micro-batches hold different
# token counts, so the usual recipe (each micro-batch's mean, divided by the number of
# micro-batches) weighs tokens unevenly twice, across micro-batches and across ranks.
# Hugging Face's `Trainer` did this until its October 2024 fix
# (<https://huggingface.co/blog/gradient_accumulation>), which passes the loss
# `num_items_in_batch`, the count over the rank's micro-batches; its
# `average_tokens_across_devices` option (on by default in transformers 5.24:
# `TrainingArguments` in `transformers/training_args.py`) sums that count over the ranks too. The fix is the same count, taken over the whole step: fetch the
# step's micro-batches, count their real tokens (one `all_reduce` per step), then divide
# every micro-batch's summed loss by it, and undo FSDP's average as above.
#
# (fsdp2-fsdpmodule-set-requires-gradient-sync)=

# %%
MICRO = 2  # micro-batches per rank per step


def accumulated_gradients(how):
    device = fsdp_guide.device()
    model = shard_model(init_device_mesh(device.type, (dist.get_world_size(),)))
    rows = slice(4 * dist.get_rank(), 4 * dist.get_rank() + 4)
    micro_batches = list(zip(tokens[rows].chunk(MICRO), targets[rows].chunk(MICRO)))
    counts = [int((t != IGNORE).sum()) for _, t in micro_batches]
    # the whole step's tokens
    global_count = sum_over_ranks(torch.tensor(sum(counts), device=device))
    if how == "global count, divide factor 1":
        set_divide_factor(model, 1.0)
    for i, (x, y) in enumerate(micro_batches):
        model.set_requires_gradient_sync(i == MICRO - 1)  # reduce after the last micro-batch only
        loss_sum, count = summed_loss(model, x.to(device), y.to(device))
        if how == "micro-batch mean / micro-batches":
            loss = loss_sum / count / MICRO
        else:
            loss = loss_sum / global_count
        loss.backward()
    return counts, full_gradients(model)


def every_accumulation():
    return {
        how: accumulated_gradients(how)
        for how in ("micro-batch mean / micro-batches", "global count, divide factor 1")
    }


results = launch(every_accumulation, output="none")
print(
    "real tokens per micro-batch, rank 0:",
    results[0]["global count, divide factor 1"][0],
    "rank 1:",
    results[1]["global count, divide factor 1"][0],
)
print(f"{'loss formed as':36} {'gradient error vs one process':>30}")
for how, (_, grads) in results[0].items():
    print(f"{how:36} {relative_error(grads):30.1e}")

glue(
    "accumulated_mean_error",
    relative_error(results[0]["micro-batch mean / micro-batches"][1]),
    display=False,
)

# %% [markdown]
# Four micro-batches of different token counts (printed above), weighted equally by the usual recipe: its
# gradient is {glue:text}`accumulated_mean_error:.0%` away from one process's, further than the per-rank mean's
# {glue:text}`per_rank_error:.0%` (this run's, glued from the tables). Counting
# the step's tokens first gives one process's gradient again, to rounding.
#
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
    print(
        f"{'':30} {'all-gathers':>15} {'reduce-scatters':>15} {'all-reduces':>15}   "
        f"{'gradients held / P after':>24}  {'gradient error':>14}"
    )
    print(
        f"{'':30}"
        + f" {'count   bytes/P':>15}" * 3
        + f"   {'micro-batch 1, 2, 3, 4':>24}  {'vs one process':>14}"
    )
    for mode, (traffic, held, grads) in measured.items():
        cells = " ".join(
            f"{traffic[k][0]:6} {traffic[k][1]:8.2f}"
            for k in ("all-gather", "reduce-scatter", "all-reduce")
        )
        error = relative_error(grads, step_reference)
        print(f"{mode:30} {cells}   {' '.join(f'{h:5.2f}' for h in held):>24}  {error:14.1e}")


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
# - **Gradient memory rises from P/2 to P per rank**: from the first micro-batch to the
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
# - Either way, divide each micro-batch's summed loss by the step's **global token count**,
#   counted before the first micro-batch, and undo FSDP's average (divide factor 1, or
#   times the number of data-parallel ranks: replicas x shards on HSDP).

# %% [markdown]
# (loss-and-accumulation-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/loss_and_accumulation.py`.
# `torchrun --nproc-per-node=2 loss_and_accumulation.py` trains on padded sequences, each rank its
# rows as 2 micro-batches with the gradient sync off until the last, every micro-batch's summed
# loss divided by the step's global token count and multiplied by the number of ranks. Rank 0
# prints the largest loss difference from one process trained on the whole batches; the tests run
# it on 2 CPU ranks and check that it is at most 1e-5 (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/loss_and_accumulation.py
# :language: python
# ```

# %% [markdown]
# (loss-and-accumulation-tips)=
# ## The tips behind this
#
# - {ref}`tip-loss-global-token-count`
# - {ref}`tip-accumulation-no-sync`

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("loss_and_accumulation")
