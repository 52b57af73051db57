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
# (tutorial-quickstart)=
# # Quickstart: shard a model on two processes and prove nothing changed
#
# **What you will learn**
#
# - how to run real multi-process training from a notebook cell with {func}`fsdp_guide.launch`;
# - how to shard a model with FSDP2 (`fully_shard`, one call per layer, then the root) and with FSDP1
#   (`FullyShardedDataParallel`), and what each rank then holds;
# - how to give every rank its own slice of each global batch (data parallelism);
# - how to check that sharded training computes exactly what one process computes on the whole batch.
#
# **What you need**: a CPU is enough. The notebook starts 2 processes that talk over gloo on
# 127.0.0.1; the same code is written to run unchanged with one GPU per rank (NCCL), because every
# rank asks {func}`fsdp_guide.device` where to compute. It runs in about 5 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The tips it demonstrates are listed {ref}`at the end <quickstart-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`quickstart-script` ({download}`download <scripts/quickstart.py>`).
#
# This page was executed with (where its ranks ran is in the box at the end of the page):

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# ## A model, some data, and a single-process baseline
#
# A small network and a synthetic regression task. Every batch is a pure function of
# its step number, so any process can rebuild exactly the same global batch.

# %%
import torch.nn as nn
import torch.nn.functional as F

GLOBAL_BATCH, STEPS, LR = 64, 40, 1e-2


class MLP(nn.Module):
    def __init__(self, dim=16, hidden=64, out=4):
        super().__init__()
        sizes = [dim, hidden, hidden, out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = F.gelu(layer(x))
        return self.layers[-1](x)


def build_model():
    torch.manual_seed(0)  # same seed: every rank builds the same weights
    return MLP()


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 16, generator=g)
    targets = [x[:, :4].sum(1), x[:, 4:8].prod(1), x[:, 8:].sin().sum(1), x.norm(dim=1)]
    y = torch.stack(targets, dim=1)
    return x, y


def train_single_process():
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


baseline = train_single_process()
print(f"single process: loss {baseline[0]:.4f} -> {baseline[-1]:.4f}")

# %% [markdown]
# ## Training with FSDP2 on two ranks
#
# The function below is what **each rank** runs. {func}`fsdp_guide.launch` starts the
# processes, initialises the process group (`torch.distributed` is ready when the
# function starts) and ships the function to them by value, which is why it can be
# defined right here in a notebook cell.
#
# Each rank builds the full model with the same seed, then `fully_shard` splits every
# parameter along its first dimension: each rank keeps one half, as a `DTensor`, on the
# rank's device. Each rank trains on its half of every global batch; FSDP all-gathers the
# parameters for the forward and backward of each layer and reduce-scatters (averages) the
# gradients. In backward, a unit also starts the all-gather of the next unit to run
# (`FSDPParamGroup.pre_backward` calls `_backward_prefetch`, in
# `torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py`), so two layers can be
# unsharded at once.
#
# The rank's device comes from one rule, {func}`fsdp_guide.device`: the rank's own GPU
# (`cuda:LOCAL_RANK`) where each rank has one, else the CPU (as on the machine that executed
# this page). The batch is built on the CPU, so its numbers do not depend on the device, then
# moved there with `.to(device)`, inputs and targets alike; so is the tensor that carries the
# loss through `all_reduce` (torch.distributed's backend table lists NCCL for GPU tensors
# only). What a rank returns to the notebook is plain Python numbers.
#
# (fsdp2-fully-shard)=
# (fsdp2-fully-shard-module)=

# %%
import fsdp_guide
import torch.distributed as dist
from fsdp_guide import launch
from fsdp_guide.compare import largest_difference
from torch.distributed.fsdp import fully_shard


def my_slice(x):
    return x.chunk(dist.get_world_size())[dist.get_rank()]


def mean_over_ranks(value, device):
    t = torch.tensor([value], device=device)  # collectives take tensors on the rank's device
    dist.all_reduce(t)  # gloo has no AVG: sum, then divide
    return t.item() / dist.get_world_size()


def train_steps(model, device):
    """Train a sharded model, each rank on its slice of every global batch."""
    # Built after sharding, so it holds (and updates) the shards.
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x.to(device), y.to(device)
        loss = F.mse_loss(model(my_slice(x)), my_slice(y))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(mean_over_ranks(loss.item(), device))
        if step % 10 == 0:
            print(f"step {step:2d}  loss {losses[-1]:.4f}")
    return losses


def train_fsdp2():
    device = fsdp_guide.device()  # this rank's GPU, or the CPU
    model = build_model()
    full = {name: tuple(p.shape) for name, p in model.named_parameters()}
    for layer in model.layers:
        fully_shard(layer)  # one unit per layer: gathered for its forward and backward
    fully_shard(model)  # the root: whatever is left, and the schedule
    local = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    losses = train_steps(model, device)
    rows = len(my_slice(torch.arange(GLOBAL_BATCH)))
    placement = sorted({str(p.placements) for p in model.parameters()})  # every parameter's
    return dict(full=full, local=local, losses=losses, rows=rows, placement=placement)


fsdp2 = launch(train_fsdp2, world_size=2, output="rank0")

# %% [markdown]
# Each line above was printed by rank 0 while it trained (`output="rank0"`; the default
# streams every rank, each line prefixed with its rank). The results below are the two
# ranks' return values, printed here in the notebook: the parameters are sharded in
# halves, and each rank trained on half of every global batch.

# %%
from fsdp_guide.table import Table  # shown as an HTML table on the site, aligned text elsewhere
from IPython.display import display

rank0, rank1 = fsdp2
print(f"the placements of the parameters, each a DTensor: {rank0['placement']}")
rows = [
    [name, full, rank0["local"][name], rank1["local"][name]] for name, full in rank0["full"].items()
]
display(Table(["parameter", "full shape", "rank 0 holds", "rank 1 holds"], rows))
print(
    f"rows of each {GLOBAL_BATCH}-sample batch: "
    f"rank 0 trained on {rank0['rows']}, rank 1 on {rank1['rows']}"
)

# %% [markdown]
# ## Sharding changes memory, not math
#
# The loss each step is averaged over the two ranks, so it is the loss of the whole
# global batch. Compare it with the single-process run:


# %%
def max_abs_difference(a, b):
    # a NaN anywhere shows as NaN (Python's max would skip it)
    return largest_difference(zip(a, b, strict=True))


diff2 = max_abs_difference(rank0["losses"], baseline)
print(f"FSDP2 on 2 ranks vs 1 process, {STEPS} steps: max |loss difference| = {diff2:.2e}")
assert diff2 <= 1e-5

# %% [markdown]
# The difference is float32 rounding: the sharded run's loss is the mean of the two ranks'
# half-batch means, and its gradients are summed per rank and then across ranks, where one
# process takes one mean and one sum over the whole batch; the additions come in another
# order. (Which of the two makes the largest difference is not separated here.)
#
# ## The same with FSDP1
#
# FSDP1 wraps modules instead of changing them in place. An `auto_wrap_policy` makes
# each `nn.Linear` its own FSDP unit. FSDP1 flattens each unit's parameters into one
# 1-D `FlatParameter` and shards that, so a rank's shard is a flat slice, not a block
# of rows. FSDP1 is given the rank's device (`device_id`) and moves the model there. On a
# CPU-only machine `device_id` is required: without it, `_init_device_handle`
# (`torch/distributed/fsdp/_init_utils.py`) looks for an accelerator and raises "FSDP needs
# a non-CPU accelerator device". With GPUs it is optional: a model already on its GPU needs
# none, while a CPU model passed without it is not moved, only warned about
# (`_move_module_to_device`, same file), and must be moved before training. The training
# loop is the same `train_steps` as above.

# %%
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


def train_fsdp1():
    device = fsdp_guide.device()
    model = FSDP(
        build_model(),
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),  # one unit per Linear
        device_id=device,
    )
    local = {name: tuple(p.shape) for name, p in model.named_parameters()}
    return {"local": local, "losses": train_steps(model, device)}


fsdp1 = launch(train_fsdp1, world_size=2, output="none")
for name, shape in fsdp1[0]["local"].items():
    name = name.replace("_fsdp_wrapped_module.", "")
    print(f"rank 0 holds {name}: {shape}")
diff1 = max_abs_difference(fsdp1[0]["losses"], baseline)
print(f"FSDP1 on 2 ranks vs 1 process, {STEPS} steps: max |loss difference| = {diff1:.2e}")
assert diff1 <= 1e-5

# %% [markdown]
# Each layer's weight and bias (for example 16·64 + 64 = 1088 numbers) became one flat
# parameter, and each rank holds half of it.
#
# ## The three loss curves
#
# They lie on top of each other:

# %% mystnb={"image": {"alt": "Loss per step on a log scale for one process on the whole batch, FSDP2 on 2 ranks and FSDP1 on 2 ranks: the three curves lie on top of each other."}}
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(6, 3.2))
ax.plot(baseline, color="black", linewidth=3, alpha=0.3, label="1 process, whole batch")
ax.plot(rank0["losses"], "o", markersize=3, label="FSDP2, 2 ranks")
ax.plot(fsdp1[0]["losses"], "x", markersize=4, label="FSDP1, 2 ranks")
ax.set(
    xlabel="step",
    ylabel="MSE loss (global batch)",
    yscale="log",
    title="Sharded training = single-process training",
)
ax.legend()
fig.tight_layout()

# %% [markdown]
# (quickstart-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/quickstart.py`.
# `torchrun --nproc-per-node=2 quickstart.py` starts the ranks; each sets up its process group and
# its device, shards the model and trains on its slice of every batch, and rank 0 prints the
# largest difference from the same training in one process. The tests run this file under
# torchrun on 2 CPU ranks and check that the difference is at most 1e-5 (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/quickstart.py
# :language: python
# ```

# %% [markdown]
# (quickstart-tips)=
# ## What this showed, and the tips behind it
#
# - The training function was defined in this notebook and ran on two real processes:
#   {ref}`tip-launch-from-notebook`.
# - Every rank built the model from the same seed *before* sharding, so the shards fit
#   together into the single-process model: {ref}`tip-init-before-sharding`.
# - The optimizer was built after sharding, over the sharded parameters: {ref}`tip-optimizer-after-sharding`.
# - Each rank trained on its own slice of each batch, and the loss matched one process on
#   the whole batch: {ref}`tip-check-against-one-process`.
# - The ranks printed only rank 0's progress; the results were returned to the notebook
#   and printed here: {ref}`tip-print-from-parent`.
#
# How FSDP1 and FSDP2 shard (and why FSDP1's shards are flat) is explained in
# {ref}`fsdp-how-it-works`.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("quickstart")
