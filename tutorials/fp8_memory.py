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
# (tutorial-fp8-memory)=
# # FP8 memory: activations and master copies
#
# **What you will learn**
#
# - what FP8 keeps per rank, measured against FP32 and BF16 mixed precision on 2 ranks: the
#   model states, and the activations saved for backward;
# - the two ways "FP8 used more memory than BF16" happens (activations, and a second
#   float32 master copy), and the settings that fix each.
#
# It trains the {ref}`FP8 page <tutorial-fp8>`'s model in its four precisions (FP32, BF16,
# FP8, FP8 + BF16), sharded by the same package helpers; that page shows how FP8 composes
# with FSDP2.
#
# **What you need**: torchao; a CPU (where torch runs the float8 matmul); 2 processes on
# gloo; about 5 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The same code is written to run unchanged with one GPU per rank
# (NCCL), each rank computing on {func}`fsdp_guide.device` (its GPU `cuda:LOCAL_RANK`
# where it has one, else the CPU); torchao's float8 training then needs GPUs with float8
# matmuls (compute capability 8.9 and newer, as {ref}`the FP8 page <tutorial-fp8>` says).
# The tips are listed {ref}`at the end <fp8-memory-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`fp8-memory-script` ({download}`download <scripts/fp8_memory.py>`).

# %%
import sys

from fsdp_guide.fp8 import quiet_torchao

quiet_torchao()  # before importing torchao: its CUDA-kernel warnings are noise on CPU
import torch
import torchao

print(f"torch {torch.__version__}, torchao {torchao.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# ## The same model in four precisions
#
# {func}`fsdp_guide.fp8.three_linears` is the FP8 page's model, three 128x128 Linears;
# {func}`fsdp_guide.fp8.shard_in_precision` shards it as FP32, with BF16 mixed precision
# (compute in bfloat16, reduce gradients in float32), with torchao's float8 Linears
# ({func}`fsdp_guide.fp8.float8_fully_shard`), or with both; each rank's batches come from
# {func}`fsdp_guide.fp8.regression_batch`. Each precision trains 3 steps with AdamW. During
# the last step's forward, {func}`fsdp_guide.memory.saved_for_backward` counts the bytes
# autograd saves for backward (float8 tensors at one byte per element); after one more
# backward, {func}`fsdp_guide.memory.measure` counts the model states.

# %%
import fsdp_guide
import torch.distributed as dist
import torch.nn.functional as F
from fsdp_guide import launch
from fsdp_guide.fp8 import regression_batch, shard_in_precision, three_linears
from fsdp_guide.memory import measure, saved_for_backward
from fsdp_guide.table import Table
from IPython.display import display
from myst_nb import glue

STEPS = 3
MODES = ("fp32", "bf16", "fp8", "fp8+bf16")  # the precisions shard_in_precision takes


def states_and_activations(mode):
    from fsdp_guide.fp8 import quiet_torchao

    quiet_torchao()  # each rank is a fresh process: silence torchao before importing it
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    device = fsdp_guide.device()
    model = shard_in_precision(mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        x, y = regression_batch(step, dist.get_rank(), device)
        with saved_for_backward() as saved:  # the forward: what it saves, and what it leaves
            loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        optimizer.step()
        if mode.startswith("fp8"):
            precompute_float8_dynamic_scale_for_fsdp(model)
        optimizer.zero_grad()
    # measure after a backward, so the gradients exist
    F.mse_loss(model(x).float(), y).backward()
    return dict(states=measure(model, optimizer), saved=saved.nbytes, held=saved.held_at_exit)


def all_modes():
    return {mode: states_and_activations(mode) for mode in MODES}


results = launch(all_modes, output="none")[0]

# %% [markdown]
# ## Memory: model states, and what is saved for backward
#
# The figures in this text are this run's, taken from the tables by myst-nb's `glue`; in
# JupyterLab, which does not render glue's roles, read them from the table above each paragraph.

# %%
rows = []
for mode in MODES:
    states, saved, held = results[mode]["states"], results[mode]["saved"], results[mode]["held"]
    rows.append([mode, states.params, states.grads, states.optimizer, saved, held])
header = ["mode", "params", "grads", "optimizer", "saved in forward", "held after forward"]
display(Table(header, rows))
glue("fp8_params", sum(p.numel() for p in three_linears().parameters()), display=False)
# float32: 4 bytes each
glue("fp8_rank_params", results["fp32"]["states"].params // 4, display=False)

# %% [markdown]
# Model states are the same in every mode ({glue:text}`fp8_params:,` parameters:
# {glue:text}`fp8_rank_params:,` per rank, 4 bytes each): FSDP2 keeps each rank's shard in float32 and casts while it gathers (to
# bfloat16, or to float8 with the scale), so that shard *is* the master copy the
# optimizer updates. There is no second float32 copy.
#
# What differs is the activation memory. The two right-hand columns count the tensors
# autograd saves in the forward: *saved in forward* counts each when it is saved, the
# gathered weights included; *held after forward* counts what is still allocated when the
# forward ends. FSDP2 frees each unit's gathered weights after its forward (and gathers
# them again for backward), so the second column is what the forward leaves for backward:
# the activations, and in FP8 modes a few bytes of scales.
#
# **FP8 alone holds as much as FP32, and more than BF16**: `Float8Linear` keeps its input
# in the precision it arrives in, float32 here, so it holds float32 activations where BF16
# mixed precision holds bfloat16 ones. That is the first way to get "FP8 used more memory
# than BF16". The fix is to give FP8 low-precision inputs too: FP8 with the BF16 policy
# (`fp8+bf16`) holds what BF16 holds, plus the scales. It holds no less: FP8's smaller
# weights show in the first column only, and those are freed after the forward either way.
#
# ## Two master copies: the optimizer's and FSDP's
#
# The second way is the one reported when FSDP support was added to MS-AMP, an FP8
# library (Azure/MS-AMP pull request #149, "Support FSDP"): t5-3b took 28 GB with BF16,
# 40 GB with FP32 and 34 GB with FP8. The reviewer's
# diagnosis: with FSDP mixed precision on, FSDP keeps the weights in FP32, and the FP8
# optimizer keeps *its own* FP32 {term}`master weights` beside them. Two master copies.
#
# To reproduce it we need an optimizer that keeps master weights. torch has none (MS-AMP's
# and apex's need CUDA), so here is a stand-in that does what they do: step float32
# copies of the parameters, then write the result back into the parameters.


# %%
class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW on float32 master copies of the parameters, written back after each step."""

    def __init__(self, params, **kwargs):
        self.model_params = list(params)
        super().__init__([p.detach().float().clone() for p in self.model_params], **kwargs)

    @torch.no_grad()
    def step(self):
        masters = self.param_groups[0]["params"]
        for param, master in zip(self.model_params, masters):
            master.grad = param.grad.float()
        super().step()
        for param, master in zip(self.model_params, masters):
            param.copy_(master)  # rounded to the parameter's dtype
            master.grad = None

    def zero_grad(self, set_to_none=True):
        for param in self.model_params:
            param.grad = None


# %% [markdown]
# Four set-ups, each trained 3 steps on 2 ranks and measured with
# {func}`fsdp_guide.memory.measure` (which counts an optimizer's master copies as
# optimizer state) beside {func}`fsdp_guide.memory.estimate` for the same dtypes:

# %%
from fsdp_guide.memory import estimate

SETUPS = {  # name: (mode, optimizer, dtype FSDP stores the parameters in)
    "bf16, AdamW": ("bf16", torch.optim.AdamW, torch.float32),
    "fp8, master-weight AdamW": ("fp8+bf16", MasterWeightAdamW, torch.float32),
    "fp8, AdamW": ("fp8+bf16", torch.optim.AdamW, torch.float32),
    "fp8, bf16 stored, master AdamW": ("fp8+bf16", MasterWeightAdamW, torch.bfloat16),
}


def model_states(mode, optimizer_class, stored):
    from fsdp_guide.fp8 import quiet_torchao

    quiet_torchao()
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    device = fsdp_guide.device()
    model = shard_in_precision(mode, stored)
    optimizer = optimizer_class(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        x, y = regression_batch(step, dist.get_rank(), device)
        F.mse_loss(model(x).float(), y).backward()
        optimizer.step()
        precompute_float8_dynamic_scale_for_fsdp(model) if mode.startswith("fp8") else None
        optimizer.zero_grad()
    loss = F.mse_loss(model(x).float(), y)
    loss.backward()  # measure with gradients present, as inside a step
    return measure(model, optimizer), loss.item()


def all_setups():
    return {name: model_states(*setup) for name, setup in SETUPS.items()}


measured = launch(all_setups, output="none")[0]
off_by = []
num_params = sum(p.numel() for p in three_linears().parameters())
rows = []
for name, (_, optimizer_class, stored) in SETUPS.items():
    got, loss = measured[name]
    expected = estimate(
        num_params,
        2,
        "FULL_SHARD",
        param_dtype=stored,
        master_weights=optimizer_class is MasterWeightAdamW,
    )
    ratios = [f"{got.total / (num_params / 2):.0f}", f"{got.total / expected.total:.4f}"]
    rows.append([name, got.params, got.grads, got.optimizer, got.total, *ratios, f"{loss:.4f}"])
    off_by.append(got.total - expected.total)
header = ["set-up", "params", "grads", "optimizer", "total", "bytes/param", "measured/estimated"]
display(Table([*header, "loss"], rows))
print("measured - estimated, bytes, each set-up:", off_by)
master, bf16_states = (
    measured[name][0].total / (num_params / 2)
    for name in ("fp8, master-weight AdamW", "bf16, AdamW")
)
# model-state bytes per parameter, as the table's column
glue("fp8_master_bytes", master, display=False)
glue("fp8_bf16_bytes", bf16_states, display=False)
glue("fp8_master_ratio", master / bf16_states, display=False)

# %% [markdown]
# With FSDP storing float32 shards *and* an optimizer keeping float32 masters, FP8 holds
# {glue:text}`fp8_master_bytes:.0f` bytes of model states per parameter where the BF16 run holds {glue:text}`fp8_bf16_bytes:.0f`: the FP32 weights
# are there twice, once as FSDP's shard and once as the optimizer's master. The measured
# bytes are exactly what `estimate` predicts for that pair of settings (0 bytes apart, the
# line under the table). What this
# reproduces of MS-AMP's report is the cause, a second float32 copy of the weights, not its
# numbers: their 34 GB against 28 GB (1.21) is the whole GPU memory of t5-3b with MS-AMP's
# own FP8 optimizer against BF16, activations and buffers included, while
# {glue:text}`fp8_master_bytes:.0f`/{glue:text}`fp8_bf16_bytes:.0f` = {glue:text}`fp8_master_ratio:.2f` here
# is model states alone, with this page's stand-in optimizer.
#
# Either copy can go; keep exactly one float32 copy of the weights:
#
# - **FSDP's shard is the master** (`fp8, AdamW`): a plain optimizer updates FSDP's
#   float32 shard, and the `MixedPrecisionPolicy` casts it on every all-gather. This is
#   the FSDP2 recipe, and what torchao's float8 training expects.
# - **The optimizer's copy is the master** (`fp8, bf16 stored, master AdamW`): shard
#   parameters that are already bfloat16 (`model.to(torch.bfloat16)` before
#   `fully_shard`), so FSDP keeps 2 bytes per parameter and its gradients are bfloat16
#   too. This is ZeRO's accounting (2 + 2 + 12 bytes).
#
# All four take their 3 steps (the last column is the loss after them); what differs is the memory.
# The second copy does not change training either: with float32 shards, the master-weight
# optimizer's result is written back into FSDP's float32 shard unrounded, so `fp8, master-weight
# AdamW` and `fp8, AdamW` end at the same loss.

# %% [markdown]
# (fp8-memory-script)=
# ## The script to copy
#
# One float32 copy of the weights, not two, as a plain torchrun script with torch and torchao:
# {download}`scripts/fp8_memory.py`. `torchrun --nproc-per-node=2 fp8_memory.py` trains the
# float8 Linears with the BF16 policy three ways, as the table above: AdamW on FSDP's float32
# shards, the master-weight AdamW beside them, and the master-weight AdamW on bfloat16 shards.
# Rank 0 prints the model states of each in bytes per parameter (counted from the tensors each
# rank holds), and the largest difference between the losses of the first two. The tests run
# this file under torchrun on 2 CPU ranks and check 16, 20 and 16 bytes per parameter, and
# losses equal to the bit (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/fp8_memory.py
# :language: python
# ```

# %% [markdown]
# (fp8-memory-tips)=
# ## The tips behind this
#
# - {ref}`tip-fp8-fsdp`: lower the activations, keep one master copy.
# - {ref}`tip-memory-estimate`: model states per rank, estimated and measured.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("fp8_memory")
