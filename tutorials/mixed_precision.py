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
# (tutorial-mixed-precision)=
# # Mixed precision with FSDP, made visible
#
# **What you will learn**: in which dtype the forward weights, the matmuls, the softmax,
# the gradients and their reduction actually run, measured, under
#
# - no mixed precision, autocast only, FSDP's mixed precision only, and both;
# - bfloat16 against float16;
# - a bfloat16 unit next to a float32 one, and what `output_dtype` and
#   `cast_forward_inputs` do at their boundary.
#
# **What you need**: a CPU; 2 processes on gloo, about 5 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The same code is
# written to run unchanged with one GPU per rank (NCCL): each rank computes on
# {func}`fsdp_guide.device`, its GPU `cuda:LOCAL_RANK` where it has one, else the CPU.
# Why float16 needs a gradient scaler and bfloat16 does not, shown by training: the next
# page, {ref}`tutorial-fp16-scaler`.
# The tips are listed {ref}`at the end <mixed-precision-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`mixed-precision-script` ({download}`download <scripts/mixed_precision.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# ## The three knobs
#
# - **FSDP's {term}`mixed precision policy`** (`MixedPrecisionPolicy` for FSDP2, `MixedPrecision` for
#   FSDP1) casts each unit's parameters to `param_dtype` when it gathers them, and
#   reduces gradients in `reduce_dtype`. The sharded parameters, and the optimizer step,
#   stay in float32.
# - **Autocast** (`torch.autocast`) casts per operation: matmuls to the low dtype,
#   precision-sensitive ones such as softmax to float32 on CUDA.
# - **The low dtype itself**: bfloat16 has float32's range (the same smallest normal
#   number, almost the same largest); float16 has more mantissa bits but a far smaller
#   range, which the {ref}`float16 page <tutorial-fp16-scaler>` measures, with the
#   gradient scaler it needs.

# %% [markdown]
# The model below has a matmul, a softmax and a second matmul. Each case runs one
# forward and backward on 2 ranks while {func}`fsdp_guide.precision.record_dtypes`
# records what each operation ran in.
#
# (fsdp2-fully-shard-mp-policy)=
# (fsdp2-mixedprecisionpolicy)=
# (fsdp2-mixedprecisionpolicy-param-dtype)=
# (fsdp2-mixedprecisionpolicy-reduce-dtype)=

# %%
import fsdp_guide
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from fsdp_guide import launch
from fsdp_guide.precision import record_dtypes
from fsdp_guide.table import Table
from IPython.display import display
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy, fully_shard


class Attentionish(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        torch.manual_seed(0)
        self.scores = nn.Linear(width, width, bias=False)
        self.values = nn.Linear(width, 4, bias=False)

    def forward(self, x):
        return self.values(torch.softmax(self.scores(x), dim=-1))


def shard_with_policy(model, api, low, device):
    """FSDP with param_dtype=low and reduce_dtype=float32, or without mixed precision (low=None)."""
    if api == "fsdp1":
        policy = MixedPrecision(param_dtype=low, reduce_dtype=torch.float32) if low else None
        return FSDP(model, device_id=device, mixed_precision=policy)
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low else None)
    for layer in (model.scores, model.values):
        fully_shard(layer, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


# (name, API, FSDP's param_dtype, autocast dtype)
CASES = [
    ("no mixed precision", "fsdp2", None, None),
    ("autocast bf16 only", "fsdp2", None, torch.bfloat16),
    ("FSDP bf16 only", "fsdp2", torch.bfloat16, None),
    ("FSDP1 bf16 only", "fsdp1", torch.bfloat16, None),
    ("FSDP + autocast bf16", "fsdp2", torch.bfloat16, torch.bfloat16),
    ("autocast fp16 only", "fsdp2", None, torch.float16),
    ("FSDP fp16 only", "fsdp2", torch.float16, None),
]


def dtypes_of(api, low, autocast, device):
    model = shard_with_policy(Attentionish(), api, low, device)
    seen_weight = []
    inner = model.module if isinstance(model, FSDP) else model
    inner.scores.register_forward_pre_hook(lambda m, args: seen_weight.append(m.weight.dtype))
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(dist.get_rank())).to(device)
    with (
        record_dtypes() as seen,
        torch.autocast(device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None),
    ):
        out = model(x)
        loss = F.mse_loss(out, torch.zeros_like(out))  # a loss op: CPU autocast runs it in float32
    with record_dtypes() as seen_backward:
        loss.backward()
    grad = next(model.parameters()).grad
    reduce = seen_backward.get("backward", "reduce-scatter")
    return [
        seen.get("forward", "all-gather"),
        str(seen_weight[0]).removeprefix("torch."),
        seen.get("forward", "matmul"),
        seen.get("forward", "softmax"),
        seen.get("forward", "loss"),
        seen_backward.get("backward", "matmul"),
        str(grad.dtype).removeprefix("torch."),
        reduce,
    ]


def all_cases():
    device = fsdp_guide.device()
    return [dtypes_of(api, low, autocast, device) for _, api, low, autocast in CASES]


columns = (
    "all-gather",
    "forward weight",
    "matmul",
    "softmax",
    "loss",
    "grad matmul",
    "stored grad",
    "reduce",
)
rows = [[name, *row] for (name, *_), row in zip(CASES, launch(all_cases, output="none")[0])]
display(Table(["case", *columns], rows))

# %% [markdown]
# What the table shows:
#
# - **Autocast only**: the weights stay float32 (FSDP gathers them in float32) and
#   autocast casts them at every matmul; gradients are stored and reduced in float32.
# - **FSDP's mixed precision only**: the gathered weights are bfloat16, so *every*
#   operation that touches them runs in bfloat16, the softmax and the loss included:
#   without autocast nothing raises precision-sensitive operations back to float32.
#   Gradients are computed in bfloat16, then reduced in float32 (`reduce_dtype`) and
#   stored in float32 on the float32 shard. FSDP1 does the same.
# - **Both**: the weights arrive already in bfloat16 (gathered in bfloat16: half the
#   bytes) and autocast decides per operation. The `loss` column is the difference from
#   "FSDP bf16 only": autocast runs `mse_loss` in float32 (on the CPU it is on autocast's
#   float32 list, with `cross_entropy` and others: "CPU Ops that can autocast to float32"
#   in torch.amp's documentation), where FSDP's policy alone left
#   it in bfloat16. `MixedPrecisionPolicy` casts parameters; it does not choose a dtype
#   per operation, which is why it is usually combined with autocast.
# - **float16** behaves the same way, with float16 in place of bfloat16.
#
# The table was produced on the CPU, where autocast keeps this softmax in the low dtype.
# The *Autocast Op Reference* in torch.amp's documentation lists softmax among the CUDA ops
# that autocast runs in float32, so with GPU ranks the softmax column is expected to read float32 instead. The
# device also changes autocast's *default* dtype, which is why the cells above always pass
# `dtype=`. This cell runs in the notebook itself, not on the ranks, and asks torch for
# both device types' defaults (no GPU is needed for that):

# %%
for device_type in ("cpu", "cuda"):  # cpu-only: compares both device types' defaults
    print(
        f"torch.autocast({device_type!r}) without dtype= computes in "
        f"{torch.get_autocast_dtype(device_type)}"
    )

# %% [markdown]
# The same code moved from a CPU to a GPU silently switches from bfloat16 to float16,
# which needs a gradient scaler ({ref}`mixed-precision-fp16-scaler`). Choose the dtype once, by what the hardware supports:
# {func}`fsdp_guide.precision.low_precision_dtype` gives bfloat16 on any CPU (torch
# computes bfloat16 on every CPU: natively with the AVX512-BF16 or AMX instructions where
# the CPU has them, which `torch.cpu._is_avx512_bf16_supported` and
# `torch.cpu._is_amx_tile_supported` report, otherwise emulated) and on CUDA from compute
# capability 8.0 (`torch.cuda.is_bf16_supported(including_emulation=False)`), float16
# otherwise; `fsdp_config`'s `"precision": "auto"` means the same.

# %%
from fsdp_guide.precision import low_precision_dtype

print("low_precision_dtype() here:", low_precision_dtype())
if torch.cuda.is_available():
    print(
        "CUDA compute capability",
        torch.cuda.get_device_capability(),
        "bf16 supported:",
        torch.cuda.is_bf16_supported(),
        "without emulation:",
        torch.cuda.is_bf16_supported(including_emulation=False),
    )

# %% [markdown]
# What does torch do when you ask for bfloat16 on a GPU older than Ampere (a V100, a T4)?
# It neither refuses nor falls back to float32. The two pieces of torch's source that decide,
# printed from the torch this page ran with:

# %%
import inspect

print("torch.cuda.is_bf16_supported" + str(inspect.signature(torch.cuda.is_bf16_supported)))
autocast_init = inspect.getsource(torch.amp.autocast.__init__)
print(
    "torch.autocast's only bfloat16 check on CUDA:",
    [line.strip() for line in autocast_init.splitlines() if "is_bf16_supported" in line],
)

# %% [markdown]
# `torch.cuda.is_bf16_supported()` defaults to `including_emulation=True`: on a GPU below
# compute capability 8.0 it returns True when a bfloat16 tensor can be created there
# (`torch/cuda/__init__.py`, `_check_bf16_tensor_supported`), which is expected to succeed
# on any CUDA GPU (not run here).
# `torch.autocast("cuda", dtype=torch.bfloat16)` raises only when that check is False
# (`torch/amp/autocast_mode.py`, `autocast.__init__`), so on such a GPU it runs, and the
# matmuls compute in bfloat16 without the hardware for it (emulated; not measured here, as
# no such GPU ran this page). Nothing in `torch.distributed` calls `is_bf16_supported` at
# all, so FSDP's `MixedPrecisionPolicy(param_dtype=torch.bfloat16)` does not check either.
# `low_precision_dtype()` asks
# `is_bf16_supported(including_emulation=False)` instead, so it picks float16 on those
# GPUs, which then needs a gradient scaler (the next page, {ref}`tutorial-fp16-scaler`).

# %% [markdown]
# ### Units with different policies: `output_dtype` and `cast_forward_inputs`
#
# Each unit has its own policy, and a common split keeps a precision-sensitive unit (an
# output head, a norm, a router) in float32 while the body computes in bfloat16. Two
# fields of `MixedPrecisionPolicy` decide what crosses the boundary: `cast_forward_inputs`
# (True by default) casts a unit's floating-point inputs to its `param_dtype` before its
# forward, and `output_dtype` casts its floating-point outputs. Below, a bfloat16 body and
# a float32 head (no policy), with a float32 input; each row records the dtype each unit's
# forward received and returned, or the error:
#
# (fsdp2-mixedprecisionpolicy-output-dtype)=
# (fsdp2-mixedprecisionpolicy-cast-forward-inputs)=


# %%
class Recorded(nn.Linear):
    """A linear layer that writes down the dtype of its input and of its output."""

    def forward(self, x):
        out = super().forward(x)
        self.seen.append(f"{str(x.dtype)[6:]} -> {str(out.dtype)[6:]}")
        return out


POLICIES = {
    "body bf16, head float32": MixedPrecisionPolicy(param_dtype=torch.bfloat16),
    "body bf16 with output_dtype=float32": MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, output_dtype=torch.float32
    ),
    "body bf16, output_dtype=float32, cast_forward_inputs=False": MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, output_dtype=torch.float32, cast_forward_inputs=False
    ),
}


def across_the_boundary(body_policy):
    device = fsdp_guide.device()
    torch.manual_seed(0)
    body, head = Recorded(32, 32), Recorded(32, 4)
    body.seen, head.seen = [], []
    model = nn.Sequential(body, head).to(device)
    fully_shard(body, mp_policy=body_policy)
    fully_shard(head)  # float32: no policy
    fully_shard(model)
    try:
        model(torch.randn(8, 32, device=device)).sum().backward()
        return f"body {body.seen[0]}, head {head.seen[0]}"
    except RuntimeError as error:
        return (
            f"body {body.seen or ['-']}, head {head.seen or ['-']}: {type(error).__name__}: {error}"
        )


for name, policy in POLICIES.items():
    print(f"{name}:\n    {launch(across_the_boundary, policy, output='none')[0]}")

# %% [markdown]
# The body casts its float32 input to bfloat16 and returns bfloat16, which the float32
# head cannot multiply with its weights: the first row fails in the head. With
# `output_dtype=torch.float32` the body still computes and returns bfloat16 (its row), and
# FSDP casts that output to float32 after the body's forward, so the head receives float32
# and the step runs.
# `cast_forward_inputs=False` leaves the input as it came, float32, and now the body's own
# bfloat16 weights refuse it. That setting is for a unit that casts its inputs itself, or
# runs under autocast, which casts per operation (the table above).


# %% [markdown]
# (mixed-precision-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/mixed_precision.py`.
# `torchrun --nproc-per-node=2 mixed_precision.py` shards a small model with
# `MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)` on each unit and
# trains it; rank 0 prints the dtypes it saw (bfloat16 forward weights and output, float32 shards
# and gradients) and the largest relative difference from the same training in float32 in one
# process. The tests run this file under torchrun on 2 CPU ranks and check those dtypes and that
# the difference is below 2e-2 (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/mixed_precision.py
# :language: python
# ```

# %% [markdown]
# (mixed-precision-tips)=
# ## The tips behind this
#
# - {ref}`tip-mixed-precision-dtypes`
# - {ref}`tip-mixed-precision-presets`: the `FULL`/`DEFAULT`/`PURE` configuration presets.
# - {ref}`tip-mixed-policies-boundary`: a float32 linear unit after a bfloat16 one needs
#   a cast at the boundary; the bfloat16 unit's `output_dtype` makes it.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("mixed_precision")
