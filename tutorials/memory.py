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
# (tutorial-memory)=
# # How much memory does each rank need? A model checked against ZeRO
#
# **What you will learn**
#
# - the ZeRO paper's accounting of model states (parameters, gradients, optimizer
#   state), reproduced by {func}`fsdp_guide.memory.estimate` for its Figure 1;
# - how to count what a rank really holds with {func}`fsdp_guide.memory.measure`, and
#   that the two agree on real ranks, up to FSDP's padding;
# - where FSDP's `SHARD_GRAD_OP` differs from ZeRO stage 2;
# - where `CPUOffloadPolicy` puts each rank's states, and what it needs.
#
# **What you need**: a CPU; 2 and 4 processes on gloo; about 10 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The same code is
# written to run unchanged with one GPU per rank (NCCL): each rank computes on
# {func}`fsdp_guide.device`, its GPU `cuda:LOCAL_RANK` where it has one, else the CPU.
# The tips are listed {ref}`at the end <memory-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`memory-script` ({download}`download <scripts/memory.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# ## The ZeRO paper's Figure 1
#
# A 7.5-billion-parameter model on 64 devices, fp16 parameters and gradients (2 bytes
# each), and mixed-precision Adam, which keeps an fp32 master copy, momentum and
# variance: K = 12 bytes per parameter. DDP keeps all of it on every device; ZeRO stage
# 2 (`SHARD_GRAD_OP`) shards gradients and optimizer state; stage 3 (`FULL_SHARD`) shards
# the parameters too.

# %%
from fsdp_guide.memory import estimate
from fsdp_guide.table import Table
from IPython.display import display

zero, rows = {}, []
for strategy in ("DDP", "SHARD_GRAD_OP", "FULL_SHARD"):
    m = estimate(
        7.5e9, 64, strategy, param_dtype=torch.float16, optimizer="adam", master_weights=True
    )
    zero[strategy] = float(m.total / 1e9)
    parts = [m.params / 1e9, m.grads / 1e9, m.optimizer / 1e9]
    rows.append([strategy, *(f"{gb:.2f}" for gb in parts), f"{m.total / 1e9:.1f}"])
print("GB per device:")
display(Table(["strategy", "params", "grads", "optimizer", "total"], rows))

# the figures the text quotes, from this run (JupyterLab shows glue's roles unrendered)
from myst_nb import glue

glue("mem_zero_ddp", zero["DDP"], display=False)
glue("mem_zero_stage2", zero["SHARD_GRAD_OP"], display=False)
glue("mem_zero_stage3", zero["FULL_SHARD"], display=False)

# %% [markdown]
# The figures in this text are this run's, taken from the outputs by myst-nb's `glue`; in
# JupyterLab, which does not render glue's roles, read them from the output above each paragraph.
#
# {glue:text}`mem_zero_ddp:.0f` GB, {glue:text}`mem_zero_stage2:.1f` GB and
# {glue:text}`mem_zero_stage3:.1f` GB: the paper's numbers for the baseline, P<sub>os+g</sub> and
# P<sub>os+g+p</sub>. (Its stage 1, which shards only the optimizer state, has no FSDP
# counterpart.) The estimate is model states only: activations, temporary buffers and the gathered
# parameters of the unit being computed come on top.
#
# (memory-measured)=
# ## Estimated against measured, on real ranks
#
# A small transformer (4 encoder layers of width 126, on purpose not a multiple of 4),
# each layer its own FSDP unit, trained one step with Adam in fp32 under every strategy,
# on 2 and then 4 ranks.
# `measure` counts this rank's distinct tensor storages: parameters (its shard of each),
# their gradients, and the optimizer's moment tensors. Each table gives the model states of a
# rank in MB, estimated and measured, then measured / estimated for the parameters, the
# gradients and the optimizer state; "in step" is `SHARD_GRAD_OP` measured again between
# forward and backward.

# %%
import fsdp_guide
import torch.distributed as dist
import torch.nn as nn
from fsdp_guide import launch, shard
from fsdp_guide.memory import measure


def transformer():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=126, nhead=3, dim_feedforward=510, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)


def one_step(model, optimizer, device):
    model(torch.randn(2, 16, 126).to(device)).square().mean().backward()
    optimizer.step()


def compare(strategy, api, device):
    from torch.nn.parallel import DistributedDataParallel as DDP

    config = {"sharding_strategy": strategy, "min_params": 100_000, "mixed_precision": "FULL"}
    if api == "ddp":
        model = DDP(transformer().to(device))
    else:
        model = shard(transformer(), config, api=api)  # shard puts it on fsdp_guide.device()
    optimizer = torch.optim.Adam(model.parameters())
    one_step(model, optimizer, device)
    num_params = sum(p.numel() for p in transformer().parameters())
    rows = [
        (
            strategy,
            api,
            estimate(num_params, dist.get_world_size(), strategy),
            measure(model, optimizer),
        )
    ]
    if strategy == "SHARD_GRAD_OP":  # measure again between forward and backward
        optimizer.zero_grad()
        model(torch.randn(2, 16, 126).to(device))
        rows.append(("  in step", api, rows[0][2], measure(model, optimizer)))
    return rows


def compare_all():
    device = fsdp_guide.device()
    cases = [("DDP", "ddp")] + [
        (s, api) for s in ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD") for api in ("fsdp2", "fsdp1")
    ]
    return [row for strategy, api in cases for row in compare(strategy, api, device)]


# both launches first: their ranks' warnings come out before the tables, not inside one
results = {n: launch(compare_all, world_size=n, output="none")[0] for n in (2, 4)}
for world_size in (2, 4):
    rows = []
    for strategy, api, est, got in results[world_size]:
        ratios = [got.params / est.params, got.grads / est.grads, got.optimizer / est.optimizer]
        totals = [f"{est.total / 1e6:.3f}", f"{got.total / 1e6:.3f}"]
        rows.append([strategy.strip(), api, *totals, *(f"{r:.4f}" for r in ratios)])
    print(f"{world_size} ranks:")
    header = ["strategy", "API", "estimated", "measured", "params", "grads", "optimizer"]
    display(Table(header, rows))


def params_ratio(world_size, strategy, api):
    """Measured / estimated parameters in one row of the tables above."""
    return next(
        float(got.params / est.params)
        for s, a, est, got in results[world_size]
        if (s, a) == (strategy, api)
    )


glue("mem_fsdp2_padding", params_ratio(4, "FULL_SHARD", "fsdp2") - 1, display=False)
glue("mem_fsdp1_padding", params_ratio(4, "FULL_SHARD", "fsdp1") - 1, display=False)
glue("mem_in_step_2", params_ratio(2, "  in step", "fsdp2"), display=False)
glue("mem_in_step_4", params_ratio(4, "  in step", "fsdp1"), display=False)
glue("mem_in_step_4_fsdp2", params_ratio(4, "  in step", "fsdp2"), display=False)

# %% [markdown]
# For DDP, `NO_SHARD` and `FULL_SHARD` the measurement is the estimate, up to padding: FSDP makes
# all shards equal, and the padding is real memory. FSDP2 pads each parameter's first dimension to
# a multiple of the world size (on 4 ranks, 126 and 510 rows become 128 and 512:
# {glue:text}`mem_fsdp2_padding:.1%` here; on 2 ranks nothing), FSDP1 pads each unit's flat
# parameter once ({glue:text}`mem_fsdp1_padding:.2%`).
#
# The `FutureWarning`s printed above the tables come from FSDP1's `NO_SHARD` rows: torch
# deprecates FSDP1's `NO_SHARD` and recommends `DistributedDataParallel` for it (the
# warning is raised in `_init_core_state`, `torch/distributed/fsdp/_init_utils.py`). It is
# measured here only to compare; as the table shows, it holds what DDP holds, up to
# FSDP1's padding.
#
# `SHARD_GRAD_OP` is the exception, and instructive. Between steps FSDP keeps only the shards, so
# at rest it holds exactly what `FULL_SHARD` holds: 1/N of the parameters. From forward to
# backward it keeps every unit's gathered parameters, and then holds the full parameters *and* its
# shard of them: 1 + 1/N of ZeRO stage 2's figure ({glue:text}`mem_in_step_2:.1f` on 2 ranks;
# {glue:text}`mem_in_step_4:.2f` on 4 with FSDP1, {glue:text}`mem_in_step_4_fsdp2:.2f` with FSDP2's padding;
# grads not yet produced). ZeRO's stage 2 has no such extra copy because its fp32 master weights
# are part of the optimizer state (K); in FSDP the fp32 shard *is* the master copy (the
# {ref}`FP8 memory tutorial <tutorial-fp8-memory>` shows that FSDP2 keeps no other, and what happens when the
# optimizer keeps one too).

# %% mystnb={"image": {"alt": "Stacked bars of model-state memory measured per rank, in MB, split into parameters, gradients and optimizer state, for each strategy and API, on 2 ranks (left) and 4 ranks (right)."}}
import matplotlib.pyplot as plt

fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), sharey=True)
for ax, world_size in zip(axes, (2, 4)):
    rows = [(f"{s.strip()}\n{api}", got) for s, api, _, got in results[world_size]]
    labels = [label for label, _ in rows]
    bottom = [0.0] * len(rows)
    for part in ("params", "grads", "optimizer"):
        values = [getattr(got, part) / 1e6 for _, got in rows]
        ax.bar(labels, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_title(f"measured per rank, {world_size} ranks")
    ax.tick_params(axis="x", labelsize=7)
axes[0].set_ylabel("MB")
axes[0].legend()
fig.tight_layout()

# %% [markdown]
# ## Offloading to the CPU: `CPUOffloadPolicy`
#
# `fully_shard(..., offload_policy=CPUOffloadPolicy())` keeps each rank's shards of the
# parameters, their gradients and the optimizer state in CPU memory: per its docstring,
# FSDP copies the shards to the device before each all-gather, copies the reduced
# gradients back, and the optimizer steps on the CPU. `OffloadPolicy()`, the default,
# offloads nothing. Below, after one step, the device of each, under the default, under
# `CPUOffloadPolicy(pin_memory=False)`, and under `CPUOffloadPolicy()` with its default
# `pin_memory=True`:
#
# (fsdp2-fully-shard-offload-policy)=
# (fsdp2-cpuoffloadpolicy)=
# (fsdp2-offloadpolicy)=

# %%
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard


def devices(tensors):
    return ", ".join(sorted({str(t.device) for t in tensors}))


def where_states_live(policy):
    device = fsdp_guide.device()
    model = transformer().to(device)
    try:
        for layer in model.layers:
            fully_shard(layer, offload_policy=policy)
        fully_shard(model, offload_policy=policy)
    except RuntimeError as error:
        return {"fully_shard": f"{type(error).__name__}: {error}"}
    gathered = []  # after FSDP's own pre-forward hook: the gathered weight the layer computes with
    model.layers[0].register_forward_pre_hook(
        lambda layer, args: gathered.append(layer.linear1.weight)
    )
    optimizer = torch.optim.Adam(model.parameters())
    one_step(model, optimizer, device)
    moments = [t for state in optimizer.state.values() for t in state.values() if t.dim() > 0]
    return {
        "batch": str(device),
        "gathered for forward": devices(gathered[:1]),
        "parameter shards": devices(p.to_local() for p in model.parameters()),
        "gradients": devices(p.grad.to_local() for p in model.parameters()),
        "optimizer state": devices(m.to_local() for m in moments),
        "measure": str(measure(model, optimizer)),
    }


for policy in (OffloadPolicy(), CPUOffloadPolicy(pin_memory=False), CPUOffloadPolicy()):
    print(f"{policy}:")
    for what, where in launch(where_states_live, policy, world_size=2, output="none")[0].items():
        print(f"    {what:22} {where}")

# %% [markdown]
# On these CPU ranks every row reads `cpu` under every policy: there is no other memory to
# offload from, so offloading moves nothing here and this cell shows no saving (the
# measured totals are equal). What the cell shows is where to look; with GPU ranks, the
# same code is meant to print `cuda:N` for every device row without offloading, and, with
# `CPUOffloadPolicy`, `cpu` for the shards, the gradients and the optimizer state, with
# only the gathered parameters on the GPU (per the docstring; no GPU run of this page is
# recorded, see the box below). The default `pin_memory=True` pins the parameter and
# gradient shards (page-locked memory, for faster copies that can overlap compute; its
# docstring); pinning needs an
# accelerator, and on this CPU-only torch `fully_shard` refuses when it makes the shards:
# the third case. Offloading costs a host-to-device copy of every shard before each
# all-gather and a device-to-host copy of every gradient, and an optimizer step on the
# CPU: it is for a model whose sharded states do not fit in device memory.


# %% [markdown]
# (memory-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/memory.py`.
# After one training step with AdamW, each rank counts the bytes of the parameters, gradients and
# optimizer moments it holds, from the storages of its shards, and rank 0 prints each as a
# fraction of ZeRO-3's estimate, their total divided by the number of ranks. The tests run this
# file under torchrun on 2 CPU ranks and check that all three fractions are 1
# (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/memory.py
# :language: python
# ```

# %% [markdown]
# (memory-tips)=
# ## The tips behind this
#
# - {ref}`tip-memory-estimate`
# - {ref}`tip-fsdp-config`: the strategies come from one dictionary.
# - {ref}`tip-cpu-offload`: what offloading costs, and `pin_memory` on a CPU-only torch.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("memory")
