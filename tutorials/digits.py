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
# (tutorial-digits)=
# # A first real model: handwritten digits with FSDP
#
# **What you will learn**: the classic first FSDP program, on real data: a small
# convolutional network trained on handwritten digits by 2 ranks, each reading its own
# part of every epoch through a `DistributedSampler`, with the training log summed over
# ranks; and the same run with FSDP1 and FSDP2.
#
# **What you need**: a CPU; 2 processes on gloo; about 20 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The
# code is written to run unchanged with one GPU per rank (NCCL). The data are the 1,797
# 8x8 digits that ship inside scikit-learn: nothing is downloaded. The tips it uses are
# listed {ref}`at the end <digits-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`digits-script` ({download}`download <scripts/digits.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %%
from fsdp_guide.data import digits

train_set, test_set = digits()
print(
    f"{len(train_set)} training and {len(test_set)} test images of shape "
    f"{tuple(train_set[0][0].shape)}; classes {sorted(set(test_set.tensors[1].tolist()))}"
)

# the figures the text quotes, from this run (JupyterLab shows glue's roles unrendered)
from myst_nb import glue

glue("digits_train_images", len(train_set), display=False)

# %% [markdown]
# ## The model and one epoch
#
# The network is the one of PyTorch's MNIST examples, scaled to 8x8 images. Each rank
# builds it with the same seed, then `shard` makes its own FSDP unit of every submodule
# whose parameters not yet in a unit number at least `min_params` (its rule:
# `shard` and `_plan_units` in `src/fsdp_guide/config.py`). With `min_params` 10,000 and
# the parameter counts printed below, that is `conv2` and `fc1`; the rest stays in the
# root unit. {ref}`The fsdp_config tutorial <tutorial-fsdp-config>` explains the dictionary.
#
# Each rank computes on the device that {func}`fsdp_guide.device` names: its own GPU
# (`cuda:LOCAL_RANK`) where each rank has one, else the CPU (as here). `shard` moves the
# model there; the loops move every batch of images and labels there, and the sums that
# `all_reduce` adds up are made there too (torch.distributed's backend table lists NCCL for
# GPU tensors only).

# %%
import fsdp_guide
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from fsdp_guide import launch, shard
from fsdp_guide.compare import largest_difference
from torch.utils.data import DataLoader, DistributedSampler


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(64 * 4 * 4, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = F.relu(self.fc1(torch.flatten(self.dropout1(x), 1)))
        return F.log_softmax(self.fc2(self.dropout2(x)), dim=1)


print(
    "parameters per module:",
    ", ".join(
        f"{name} {sum(p.numel() for p in module.parameters()):,}"
        for name, module in Net().named_children()
        if any(True for _ in module.parameters())
    ),
)


def summed_over_ranks(values, device):
    """Sums of per-rank numbers (losses, counts) over all ranks."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def train_epoch(model, loader, optimizer, device):
    model.train()
    loss_sum = count = 0
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        optimizer.zero_grad()
        loss = F.nll_loss(model(images), labels)
        loss.backward()
        optimizer.step()
        loss_sum, count = loss_sum + loss.item() * len(labels), count + len(labels)
    return summed_over_ranks([loss_sum, count], device)


@torch.no_grad()
def test(model, loader, device):
    model.eval()
    loss_sum = correct = count = 0
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        output = model(images)
        loss_sum += F.nll_loss(output, labels, reduction="sum").item()
        correct += (output.argmax(dim=1) == labels).sum().item()
        count += len(labels)
    return summed_over_ranks([loss_sum, correct, count], device)


# %% [markdown]
# The figures in this text are this run's, taken from the outputs by myst-nb's `glue`; in
# JupyterLab, which does not render glue's roles, read them from the output above each paragraph
# (the images each rank reads: from the output below this one).
#
# `DistributedSampler` shuffles the indices of the training set (anew each epoch, by
# `set_epoch`) and gives rank r every second one, starting at r. {glue:text}`digits_train_images` is odd, so with the
# default `drop_last=False` it first pads the list by repeating its first index
# (`DistributedSampler.__iter__` in `torch/utils/data/distributed.py`): each rank reads {glue:text}`digits_rank_images`
# images an epoch, and one image is read twice. FSDP averages the gradients of the two
# ranks, so a step averages over 2 × 16 images, as a batch of 32 would. It is not bit for
# bit the run of one process with batches of 32, though: that process would read {glue:text}`digits_train_images`
# images an epoch, not {glue:text}`digits_read_images`, and draw its dropout masks from one random stream, not two.
# Every rank computes its own loss and counts; `all_reduce` sums them, and the function
# returns the whole history to the notebook, which prints it.


# %%
def train_digits(api, epochs=5):
    device = fsdp_guide.device()  # this rank's GPU, or the CPU
    train_set, test_set = digits()
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    train_loader = DataLoader(train_set, batch_size=16, sampler=train_sampler)
    test_loader = DataLoader(
        test_set, batch_size=180, sampler=DistributedSampler(test_set, shuffle=False)
    )
    torch.manual_seed(0)  # the same initial model on every rank
    model = shard(Net(), {"min_params": 10_000, "mixed_precision": "FULL"}, api=api)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    history = []
    for epoch in range(1, epochs + 1):
        train_sampler.set_epoch(epoch)
        train_loss, n_train = train_epoch(model, train_loader, optimizer, device)
        test_loss, correct, n_test = test(model, test_loader, device)
        scheduler.step()
        history.append(
            dict(
                epoch=epoch,
                train_loss=train_loss / n_train,
                test_loss=test_loss / n_test,
                correct=int(correct),
                total=int(n_test),
                train_images=int(n_train),
            )
        )
    return history


fsdp2 = launch(train_digits, "fsdp2", output="none")[0]
for h in fsdp2:
    print(f"Train Epoch: {h['epoch']} \tLoss: {h['train_loss']:.6f}")
    print(
        f"Test set: Average loss: {h['test_loss']:.4f}, Accuracy: {h['correct']}/{h['total']} "
        f"({100 * h['correct'] / h['total']:.2f}%)"
    )
assert fsdp2[-1]["correct"] / fsdp2[-1]["total"] >= 0.97
print("\nFSDP2: at least 97% test accuracy")
read = fsdp2[0]["train_images"]  # training images read in an epoch, summed over the 2 ranks
print(f"training images read an epoch: {read} ({read // 2} per rank)")
glue("digits_read_images", read, display=False)
glue("digits_rank_images", read // 2, display=False)

# %% [markdown]
# ## The same run with FSDP1
#
# Only the `api` argument changes. FSDP1 wraps the same units in
# `FullyShardedDataParallel`; the arithmetic is the same, so the two runs should agree to
# rounding:

# %%
fsdp1 = launch(train_digits, "fsdp1", output="none")[0]
final = fsdp1[-1]
print(
    f"FSDP1 final: Test set: Average loss: {final['test_loss']:.4f}, Accuracy: "
    f"{final['correct']}/{final['total']} ({100 * final['correct'] / final['total']:.2f}%)"
)
print(
    "largest |train loss FSDP1 - FSDP2| over the epochs: "
    f"{largest_difference((a['train_loss'], b['train_loss']) for a, b in zip(fsdp1, fsdp2)):.1e}"
)

# %% mystnb={"image": {"alt": "Two panels over training epochs: train and test loss for FSDP1 and FSDP2 falling together, and test accuracy rising to about 97 percent for both."}}
import matplotlib.pyplot as plt

fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(9, 3.2))
for name, history, style in (("FSDP2", fsdp2, "-"), ("FSDP1", fsdp1, "--")):
    epochs = [h["epoch"] for h in history]
    loss_ax.plot(epochs, [h["train_loss"] for h in history], style, label=f"{name} train")
    loss_ax.plot(epochs, [h["test_loss"] for h in history], style, label=f"{name} test")
    acc_ax.plot(epochs, [100 * h["correct"] / h["total"] for h in history], style, label=name)
loss_ax.set(xlabel="epoch", ylabel="loss", title="loss")
acc_ax.set(xlabel="epoch", ylabel="%", title="test accuracy")
acc_ax.axhline(97, color="grey", lw=0.8)
loss_ax.legend()
acc_ax.legend()
fig.tight_layout()

# %% [markdown]
# (digits-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script: {download}`scripts/digits.py` (torch and
# scikit-learn). `torchrun --nproc-per-node=2 digits.py` trains the page's network for 5 epochs,
# each rank on its share of every epoch through a `DistributedSampler` (with twice the page's batch,
# to be quick); rank 0 prints the test accuracy summed over the ranks, and that of the gathered
# weights tested in one process. The tests run this file under torchrun on 2 CPU ranks and check
# that the accuracy is at least 97%, the same both ways (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/digits.py
# :language: python
# ```

# %% [markdown]
# (digits-tips)=
# ## The tips behind this
#
# - {ref}`tip-print-from-parent`: the ranks return their history; the notebook prints.
# - {ref}`tip-init-before-sharding`: each rank seeds and builds the whole model, then
#   shards it.
# - {ref}`tip-optimizer-after-sharding`: the optimizer is built from the sharded model.
# - {ref}`tip-fsdp-config`: the units come from one dictionary.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("digits")
