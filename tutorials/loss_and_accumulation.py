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
# # Normalizing the loss over ranks and micro-batches
#
# **What you will learn**
#
# - why the per-rank mean loss of masked, variable-length batches gives gradients that
#   differ from one process's on the same global batch, by how much, and the fix that
#   matches one process to rounding: divide by the global token count, then undo FSDP's
#   average (times the number of ranks, or FSDP's gradient divide factor set to 1);
# - the same under gradient accumulation, with micro-batches of different token counts;
# - why FSDP's `PREMUL_SUM` fails on gloo with a divide factor of 1, and the setting that
#   avoids it;
# - the rule: count the step's real tokens once, before its first micro-batch.
#
# **What you need**: a CPU; 2 processes on gloo; about 5 seconds on 2 CPU cores ({ref}`measured <measured-times>`).
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
from fsdp_guide.table import Table
from IPython.display import display
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
rows = [
    [how, f"{logged:.6f}", f"{relative_error(grads):.1e}"]
    for how, (logged, grads) in results.items()
]
header = ["loss formed as", "logged loss", "gradient error vs one process"]
display(Table(header, rows))  # an HTML table on the site, aligned text elsewhere

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
# the others; {ref}`tutorial-no-sync` counts what that saves and costs). The micro-batches hold different
# token counts, so the usual recipe (each micro-batch's mean, divided by the number of
# micro-batches) weighs tokens unevenly twice, across micro-batches and across ranks.
# Hugging Face's `Trainer` did this until its October 2024 fix
# (<https://huggingface.co/blog/gradient_accumulation>), which passes the loss
# `num_items_in_batch`, the count over the rank's micro-batches; its
# `average_tokens_across_devices` option (on by default in transformers 5.24:
# `TrainingArguments` in `transformers/training_args.py`) sums that count over the ranks too. The fix is the same count, taken over the whole step: fetch the
# step's micro-batches, count their real tokens (one `all_reduce` per step), then divide
# every micro-batch's summed loss by it, and undo FSDP's average as above.

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
rows = [[how, f"{relative_error(grads):.1e}"] for how, (_, grads) in results[0].items()]
display(Table(["loss formed as", "gradient error vs one process"], rows))

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
# ## The rule
#
# - Sum each micro-batch's loss over its real tokens (`reduction="sum"`), and divide it by
#   the step's **global token count**: every rank's real tokens over every micro-batch of
#   the step, counted with one `all_reduce` before the first micro-batch.
# - Undo FSDP's average over the ranks: `set_gradient_divide_factor(1.0)` on every FSDP
#   module (with `set_force_sum_reduction_for_comms(True)` on gloo), or multiply the loss
#   by the number of data-parallel ranks (replicas x shards on HSDP).
# - Log the summed losses over the global count, not the mean of the ranks' means.

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

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("loss_and_accumulation")
