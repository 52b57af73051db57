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
# (tutorial-fsdp2-controls)=
# # Prefetching and unsharding by hand
#
# **What you will learn**
#
# - in which order FSDP2 starts its all-gathers, and how `set_modules_to_forward_prefetch`
#   and `unshard(async_op=True)` with its `UnshardHandle` start them earlier;
# - how `set_unshard_in_backward(False)` saves the all-gather of a unit whose parameters
#   backward does not need (an embedding), with the gradients unchanged.
#
# **What you need**: a CPU; 2 processes on gloo; about 5 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The same code
# is written to run unchanged with one GPU per rank (NCCL). Every public FSDP2 name, and
# the page that executes it, is in {ref}`fsdp2-map`. The tips it demonstrates are listed
# {ref}`at the end <fsdp2-controls-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`fsdp2-controls-script` ({download}`download <scripts/fsdp2_controls.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# ## A small model, one unit per layer
#
# An embedding, three linear layers and an output layer, each its own FSDP unit, and the
# whole model the root. The same seed builds the same model on every rank.

# %%
import fsdp_guide
import torch.nn as nn
from fsdp_guide import launch
from fsdp_guide.compare import largest_difference

WIDTH, VOCAB, LAYERS, BATCH = 32, 64, 3, 8


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(VOCAB, WIDTH),
        *[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)],
        nn.Linear(WIDTH, VOCAB),
    )


def shard(model):
    from torch.distributed.fsdp import fully_shard

    for unit in model:
        fully_shard(unit)
    return fully_shard(model)


def tokens(step):
    """The step's batch, the same on every rank; each rank takes its half with `my_half`."""
    return torch.randint(0, VOCAB, (BATCH, 6), generator=torch.Generator().manual_seed(step))


def my_half(batch):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    return batch[rank * len(batch) // world : (rank + 1) * len(batch) // world]


def loss_of(model, batch):
    # flat ids: every unit returns a new tensor
    logits = model(batch.reshape(-1)).view(*batch.shape, VOCAB)
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


# %% [markdown]
# ## When each all-gather starts
#
# FSDP2 marks what it does with the profiler's labels: `FSDP::pre_forward (i)` when unit
# `i`'s forward begins, `FSDP::all_gather (i)` when its all-gather is issued. Sorted by start
# time on the host they give the order of issue. Three ways to run the same forward:
#
# - by default, each unit gathers its parameters when its forward begins;
# - `set_modules_to_forward_prefetch([next unit])` on each unit issues the next unit's
#   all-gather right after its own;
# - `unshard(async_op=True)` issues a unit's all-gather by hand and returns an
#   `UnshardHandle`; `handle.wait()` waits for it. Called before the forward (here, before
#   the batch is moved to the device), the first unit's gather no longer waits for the step.
#
# (fsdp2-fsdpmodule-set-modules-to-forward-prefetch)=
# (fsdp2-fsdpmodule-unshard)=
# (fsdp2-unshardhandle)=
# (fsdp2-unshardhandle-wait)=


# %%
def forward_issue_order(how):
    from torch.profiler import ProfilerActivity, profile

    device = fsdp_guide.device()
    model = shard(make_model().to(device))
    if how == "forward prefetch":
        for i in range(len(model) - 1):
            model[i].set_modules_to_forward_prefetch([model[i + 1]])
    batch = my_half(tokens(0))
    model(batch.reshape(-1).to(device))  # lazy initialisation out of the way
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        if how == "unshard(async_op=True)":
            handle = model[0].unshard(async_op=True)  # an UnshardHandle
            on_device = batch.reshape(-1).to(device)  # work done while the gather is in flight
            handle.wait()
        else:
            on_device = batch.reshape(-1).to(device)
        model(on_device)
    events = sorted(
        (e.time_range.start, e.name)
        for e in prof.events()
        if e.name.startswith(("FSDP::pre_forward (", "FSDP::all_gather ("))
        and not e.name.endswith("()")
    )
    short = {"FSDP::pre_forward": "F", "FSDP::all_gather": "AG"}
    return " ".join(
        short[name.split(" (")[0]] + name.split(" (")[1].rstrip(")") for _, name in events
    )


ORDERS = {
    how: launch(forward_issue_order, how, world_size=2, output="none")[0]
    for how in ("default", "forward prefetch", "unshard(async_op=True)")
}
for how, order in ORDERS.items():
    print(f"{how:24} {order}")

# %% tags=["hide-input"] mystnb={"image": {"alt": "The order of issue in one forward, one row per way to run it (default, forward prefetch, unshard with async_op): each unit's forward start and all-gather as boxes left to right in the order the host issued them, the all-gathers shaded."}}
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(10, 2.4))
for row, order in enumerate(ORDERS.values()):
    events = order.split()
    for x, event in enumerate(events):
        gather = event.startswith("AG")
        ax.add_patch(
            plt.Rectangle((x - 0.42, row - 0.3), 0.84, 0.6, color="tab:blue" if gather else "0.85")
        )
        ax.text(
            x,
            row,
            event,
            ha="center",
            va="center",
            fontsize=8,
            color="white" if gather else "black",
        )
ax.set(
    xlim=(-0.6, max(len(o.split()) for o in ORDERS.values()) - 0.4), ylim=(len(ORDERS) - 0.4, -0.6)
)
ax.set_yticks(range(len(ORDERS)), list(ORDERS))
ax.set_xticks([])
ax.set_xlabel(
    "order of issue on the host (F: a unit's forward begins, AG: its all-gather; not to time)"
)
for side in ("top", "right", "bottom"):
    ax.spines[side].set_visible(False)
fig.tight_layout()

# %% [markdown]
# `F`*i*: unit *i*'s forward begins; `AG`*i*: its all-gather is issued (both as the host
# records them).
# By default every `AG`*i* follows its own `F`*i*. With forward prefetching each unit
# issues the next one's gather before the next forward begins (`AG1` before `F1`). With
# `unshard(async_op=True)`, `AG0` is issued before the forward begins at all, and unit
# 0's forward does not gather again.
#
# This is the order of issue, not overlap, which this page does not measure: here gloo's
# collectives run on the same CPU cores as the compute. What to expect on a GPU, from
# torch's source rather than a run: the default already overlaps, because the host runs
# ahead of the device's kernels and issues unit 1's gather (on its own stream) while unit
# 0's kernels still run. `set_modules_to_forward_prefetch`'s docstring says so: a list of
# the next unit alone "gives the same all-gather overlap behavior as the default overlap
# behavior, except the prefetched all-gather is issued earlier from the CPU"; a list of
# two or more overlaps more, with more memory reserved. Issuing earlier pays when the host
# would otherwise reach the next unit late, because a unit blocks it until the device
# catches up (a `.item()` or `.tolist()` on a device result): torchtitan's `apply_fsdp`
# prefetches explicitly only with expert parallelism, "as D2H syncs in EP could
# interfere with implicit prefetching in FSDP".
#
# Backward prefetching (`set_modules_to_backward_prefetch`) is measured on the
# {ref}`communication page <tutorial-communication>`, one and two units ahead.
#
# ## A gather backward does not need
#
# The gradient of an embedding's weight needs the token ids and the gradient of its output,
# not the weight itself; yet FSDP gathers every unit again for its backward. Counted with
# {func}`fsdp_guide.collectives.count_collectives` over one step, with and without
# `set_unshard_in_backward(False)` on the embedding, and the gradients compared with one
# process that trains on the whole batch:
#
# (fsdp2-fsdpmodule-set-unshard-in-backward)=


# %%
def gradients(unshard_embedding_in_backward):
    from fsdp_guide.collectives import count_collectives

    device = fsdp_guide.device()
    model = shard(make_model().to(device))
    model[0].set_unshard_in_backward(unshard_embedding_in_backward)
    with count_collectives() as seen:
        loss_of(model, my_half(tokens(0)).to(device)).backward()
    gathers = sum(n for (_, kind), n in seen.count.items() if kind == "all-gather")
    return gathers, [p.grad.full_tensor().cpu() for p in model.parameters()]


def one_process_gradients():
    model = make_model().to(fsdp_guide.device())
    loss_of(model, tokens(0).to(fsdp_guide.device())).backward()
    return [p.grad.cpu() for p in model.parameters()]


reference = launch(one_process_gradients, world_size=1, output="none")[0]
for setting in (True, False):
    gathers, grads = launch(gradients, setting, world_size=2, output="none")[0]
    error = largest_difference(zip(grads, reference))
    print(
        f"set_unshard_in_backward({setting!s:5}) on the embedding: {gathers} all-gathers in the step, "
        f"max |gradient - one process| = {error:.1e}"
    )

# %% [markdown]
# One all-gather fewer per step, and the same gradients: the embedding's gradient is
# computed from the ids alone and reduce-scattered as before. It pays when the embedding
# is large, as an LLM's with a large vocabulary is. It is wrong
# for a unit whose backward needs its weights (a linear layer's input gradient is the
# output gradient times the weight), and an embedding tied to the output layer shares its
# weight with a unit that does need it ({ref}`fsdp2-controls-tied-weights`).
#
# (fsdp2-controls-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/fsdp2_controls.py`.
# `torchrun --nproc-per-node=2 fsdp2_controls.py` shards the same five-unit model, has each unit
# prefetch the next one in forward and the embedding skip its backward gather, and reads the
# profiler's `FSDP::` labels to print the order in which the forward's all-gathers were issued and
# how many all-gathers one training step issued, with and without `set_unshard_in_backward(False)`.
# It then trains 5 SGD steps and prints the largest difference from one process. The tests run it
# under torchrun on 2 CPU ranks and check that each unit's gather is issued before the forward of
# the unit ahead of it, that the step issues one all-gather fewer, and that the difference is at
# most 1e-5 (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/fsdp2_controls.py
# :language: python
# ```

# %% [markdown]
# (fsdp2-controls-tips)=
# ## The tips behind this
#
# - FSDP2 issues a unit's all-gather when its forward begins; prefetch the next unit
#   explicitly, or start the first gather before the step: {ref}`tip-fsdp2-forward-prefetch`.
# - A unit whose backward needs no weights (an embedding that is not tied) can skip its
#   backward gather: {ref}`tip-unshard-in-backward`.
#
# Every public FSDP2 name, and where it is executed: {ref}`fsdp2-map`.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("fsdp2_controls")
