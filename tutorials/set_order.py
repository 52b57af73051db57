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
# (tutorial-set-order)=
# # Collectives in the order of a set: wrong sums under torchrun, right ones in the notebook
#
# **What you will learn**
#
# - why collectives issued while iterating a `set` of strings pair different values on
#   ranks started by torchrun: wrong sums, with no error and no hang;
# - why the notebook's ranks agree by accident, and how to see torchrun's behaviour in a
#   notebook (`FSDP_GUIDE_WARM=0`);
# - the fix, an order every rank shares (`sorted(...)`, a list, `named_parameters()`), checked.
#
# It belongs with {ref}`the hangs <tutorial-debugging-hangs>`: the same pairing by order,
# where the sizes happen to agree.
#
# **What you need**: a CPU; 2 processes on gloo; about 5 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The same code is
# written to run unchanged with one GPU per rank (NCCL): each rank computes on
# {func}`fsdp_guide.device`, its GPU `cuda:LOCAL_RANK` where it has one, else the CPU.
# The tips are listed {ref}`at the end <set-order-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`set-order-script` ({download}`download <scripts/set_order.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# (debugging-hangs-set-order)=
# ## Wrong sums with no error
#
# Python orders a `set` of strings (and a `dict` built from one) by their hashes, and
# each interpreter hashes strings with its own random seed (unless
# [`PYTHONHASHSEED`](https://docs.python.org/3/using/cmdline.html#envvar-PYTHONHASHSEED) is
# set). torchrun starts each rank as a new interpreter (its agent's `_start_workers` calls
# `start_processes`, which runs a script entry point through `subprocess.Popen`, in
# `torch/distributed/elastic/`), so two ranks iterating the same set of parameter names
# visit them in different orders, and collectives issued in that order are paired by
# position, name against name: mixed-up sums when their sizes agree, as below.
# {func}`fsdp_guide.launch` forks its ranks from one server (warm launches), and a fork
# keeps its parent's hash seed: the same code runs right here and goes wrong under
# torchrun. Below, each rank
# all-reduces one value per name, iterating a set, first with cold ranks (new
# interpreters, as torchrun starts them), then warm:

# %%
import contextlib
import os

from fsdp_guide import launch
from fsdp_guide.launcher import launches


def reduce_per_name(in_order):
    """All-reduce one value per parameter name, in the order of a set of names, or sorted."""
    import fsdp_guide
    import torch
    import torch.distributed as dist

    names = {f"blocks.{i}.weight" for i in range(16)}
    # every rank adds the same per name
    value = {name: float(i) for i, name in enumerate(sorted(names))}
    order = sorted(names) if in_order else list(names)
    summed = {}
    for name in order:
        total = torch.tensor([value[name]], device=fsdp_guide.device())
        dist.all_reduce(total)
        summed[name] = total.item()
    return order, all(summed[name] == dist.get_world_size() * value[name] for name in names)


@contextlib.contextmanager
def as_torchrun_starts_them():
    """Cold ranks, each a new interpreter with a hash seed of its own (PYTHONHASHSEED=random, its default)."""
    saved = {name: os.environ.get(name) for name in ("FSDP_GUIDE_WARM", "PYTHONHASHSEED")}
    os.environ.update(FSDP_GUIDE_WARM="0", PYTHONHASHSEED="random")
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def show(how, results):
    (order0, right0), (order1, right1) = results
    warm = all(rank["warm"] for rank in launches()[-1]["ranks"])
    print(
        f"{how:34} warm={warm!s:5}  same order on both ranks: {order0 == order1!s:5}  "
        f"every sum right: {right0 and right1}"
    )
    return order0, order1


with as_torchrun_starts_them():
    cold_orders = show(
        "set order, cold (as torchrun)", launch(reduce_per_name, False, world_size=2, output="none")
    )
show("set order, warm (forked)", launch(reduce_per_name, False, world_size=2, output="none"))
with as_torchrun_starts_them():
    show("sorted, cold (as torchrun)", launch(reduce_per_name, True, world_size=2, output="none"))

# %% tags=["hide-input"] mystnb={"image": {"alt": "The 16 all-reduces of the cold ranks in the order each rank issued them, a row per rank, each box the number of the parameter name it summed; the collectives pair by position, and the boxes where the two ranks summed different names are red."}}
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(10, 1.8))
for position, names in enumerate(zip(*cold_orders), start=1):
    paired_wrong = names[0] != names[1]
    for rank, name in enumerate(names):
        colour = "tab:red" if paired_wrong else "0.85"
        ax.add_patch(plt.Rectangle((position - 0.45, rank - 0.35), 0.9, 0.7, facecolor=colour))
        number = name.split(".")[1]  # blocks.<n>.weight
        ax.text(
            position,
            rank,
            number,
            ha="center",
            va="center",
            color="white" if paired_wrong else "black",
        )
ax.set(xlim=(0.4, len(cold_orders[0]) + 0.6), ylim=(1.5, -0.5))
ax.set_yticks([0, 1], ["rank 0", "rank 1"])
ax.set_xticks(range(1, len(cold_orders[0]) + 1))
ax.set_xlabel(
    "all-reduce number (each box: n of the blocks.n.weight it sums; red: paired with another name)"
)
ax.set_title("cold ranks, iterating a set: the collectives pair by position, not by name")
fig.tight_layout()

# %% [markdown]
# Cold ranks visit the 16 names in different orders and sum the wrong values together,
# with no error; the warm ranks of the notebook agree by accident of the fork. Iterating
# `sorted(names)` (or a list, or a module's `named_parameters()`, which follow definition
# order: `_named_members` in `torch/nn/modules/module.py` walks the module's `_modules` and
# `_parameters`, dicts kept in insertion order) gives every rank the same order however it
# was started. To see the torchrun behaviour in a notebook, run with `FSDP_GUIDE_WARM=0`,
# which starts every launch cold.

# %% [markdown]
# (set-order-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/set_order.py`.
# Its ranks are started by torchrun, each a new interpreter, as on a cluster. After one
# training step of a sharded model, each rank all-reduces the squared norm of its shard of
# each parameter's gradient, one collective per name, to log each parameter's gradient norm:
# once iterating a `set` of the names, once `sorted`. Rank 0 prints, for each, whether the
# ranks visited the names in the same order and how many of the norms differ from those of
# the gathered gradients. The tests run this file under torchrun on 2 CPU ranks and check
# that the set's order differs between the ranks and gives wrong norms, and that the sorted
# order gives every norm right (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/set_order.py
# :language: python
# ```

# %% [markdown]
# (set-order-tips)=
# ## The tips behind this
#
# - {ref}`tip-hangs-same-collectives`

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("set_order")
