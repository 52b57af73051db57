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
# (tutorial-fp8)=
# # FP8 training with FSDP2 and torchao
#
# **What you will learn**
#
# - how torchao's float8 training composes with FSDP2: convert the Linears, *then* shard,
#   with the all-gather itself in float8;
# - what FP8 changes and what it does not, measured against FP32 and BF16 mixed precision
#   on 2 ranks: the loss, and the bytes all-gathered per step;
# - where the FP8 scaling factors are synchronised across ranks, and what gradient
#   accumulation does with FP8.
#
# What FP8 does to memory (the activations saved for backward, and a second float32 master
# copy) is the next page's idea: {ref}`tutorial-fp8-memory`.
#
# **What you need**: torchao; a CPU (where torch runs the float8 matmul); 2 processes on
# gloo; about 10 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The same code is written to run unchanged with one GPU per rank
# (NCCL), each rank computing on {func}`fsdp_guide.device` (its GPU `cuda:LOCAL_RANK`
# where it has one, else the CPU); torchao's float8 training then needs GPUs with float8
# matmuls: CUDA compute capability 8.9 or 9.0 and newer, the condition torch's own tests
# use for them (`evaluate_platform_supports_fp8` in
# `torch/testing/_internal/common_cuda.py`; torchao's `is_sm_at_least_89` in
# `torchao/utils.py` checks the same). The tips are listed {ref}`at the end <fp8-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`fp8-script` ({download}`download <scripts/fp8.py>`).

# %%
import sys

from fsdp_guide.fp8 import quiet_torchao

quiet_torchao()  # before importing torchao: its CUDA-kernel warnings are noise on CPU
import torch
import torchao

print(f"torch {torch.__version__}, torchao {torchao.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# {func}`fsdp_guide.fp8.quiet_torchao` silences two things, in every process that calls it
# (the notebook here, each rank in the workers below). torchao's import-time log records
# about CUDA kernels a CPU build lacks (its `torchao` and `torch.utils._pytree` loggers are
# raised to ERROR). And, through a process-wide `warnings` filter, FSDP2's `UserWarning`
# that an FSDP2-wrapped module "returned a view tensor"
# (`FSDPState._register_pre_backward_hook` in
# `torch/distributed/fsdp/_fully_shard/_fsdp_state.py`): torchao's `Float8Linear` returns
# its matmul result reshaped (`matmul_with_hp_or_float8_args.forward` in
# `torchao/float8/float8_linear.py`), and the warning is about in-place operations on such
# a view, which would skip FSDP2's pre-backward all-gather. Nothing on this page modifies a
# module's output in place. The filter is not limited to `Float8Linear`: in a script of
# your own it would hide that warning for every module, so leave it out where outputs may
# be modified in place.

# %% [markdown]
# ## Three ways to train the same model
#
# The model is {func}`fsdp_guide.fp8.three_linears`: three 128x128 Linears.
# {func}`fsdp_guide.fp8.shard_in_precision` shards it in one of four precisions. FP32 shards
# it as it is; BF16 adds FSDP2's `MixedPrecisionPolicy` (compute in bfloat16, reduce
# gradients in float32); FP8 uses {func}`fsdp_guide.fp8.float8_fully_shard`: torchao's
# `convert_to_float8_training` with `enable_fsdp_float8_all_gather=True` *before*
# `fully_shard` (the other order is not run on this page), and torchao's
# `precompute_float8_dynamic_scale_for_fsdp` after every optimizer step. FP8 + BF16
# combines the last two. Each rank's batches come from
# {func}`fsdp_guide.fp8.regression_batch`.

# %%
import fsdp_guide
import torch.distributed as dist
import torch.nn.functional as F
from fsdp_guide import launch
from fsdp_guide.fp8 import regression_batch, shard_in_precision
from fsdp_guide.precision import record_dtypes
from fsdp_guide.table import Table
from IPython.display import display

WIDTH, STEPS = 128, 12
MODES = ("fp32", "bf16", "fp8", "fp8+bf16")  # the precisions shard_in_precision takes

# %% [markdown]
# Each mode trains 12 steps with AdamW. During the last step, `record_dtypes` records
# every collective (dtype, count, bytes).


# %%
def train(mode):
    from fsdp_guide.fp8 import quiet_torchao

    quiet_torchao()  # each rank is a fresh process: silence torchao before importing it
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    device = fsdp_guide.device()
    model = shard_in_precision(mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        x, y = regression_batch(step, dist.get_rank(), device)
        with record_dtypes() as comm:
            loss = F.mse_loss(model(x).float(), y)
            loss.backward()
        optimizer.step()
        if mode.startswith("fp8"):
            precompute_float8_dynamic_scale_for_fsdp(model)
        optimizer.zero_grad()
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        losses.append(loss.item() / dist.get_world_size())
    collectives = {key: (comm.get(*key), comm.count[key], comm.nbytes[key]) for key in comm.seen}
    return dict(losses=losses, collectives=collectives)


def train_all_modes():
    return {mode: train(mode) for mode in MODES}


results = launch(train_all_modes, output="none")[0]

rows = [
    [step] + [f"{results[m]['losses'][step]:.5f}" for m in MODES] for step in range(0, STEPS, 3)
]
rows.append(["last"] + [f"{results[m]['losses'][-1]:.5f}" for m in MODES])
display(Table(["step", *MODES], rows))  # an HTML table on the site, aligned text elsewhere

# %% mystnb={"image": {"alt": "Loss per step for the same model in fp32, bf16, fp8 and fp8 with bf16: the four curves fall together."}}
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(6, 3))
for mode in MODES:
    ax.plot(results[mode]["losses"], label=mode)
ax.set(xlabel="step", ylabel="loss (mean over ranks)", title="the same model, four precisions")
ax.legend()
fig.tight_layout()

# %% [markdown]
# The four curves lie almost on top of each other (the last losses within 1%): for this
# model, FP8's rounding does not change the course of training.
#
# ## What goes over the wire
#
# The collectives of one step, per rank:

# %%
rows = [
    [mode, phase, kind, dtype, count, nbytes]
    for mode in MODES
    for (phase, kind), (dtype, count, nbytes) in sorted(results[mode]["collectives"].items())
    if kind != "matmul"
]
display(Table(["mode", "phase", "collective", "dtype", "count", "bytes"], rows))
matmuls = [
    [
        mode,
        *(results[mode]["collectives"][(phase, "matmul")][0] for phase in ("forward", "backward")),
    ]
    for mode in MODES
]
display(Table(["mode", "matmul operands, forward", "matmul operands, backward"], matmuls))

# the figures the text quotes, from this run (JupyterLab shows glue's roles unrendered)
from myst_nb import glue

glue(
    "fp8_fp32_gathered", results["fp32"]["collectives"][("forward", "all-gather")][2], display=False
)

# %% [markdown]
# The figures in this text are this run's, taken from the tables by myst-nb's `glue`; in
# JupyterLab, which does not render glue's roles, read them from the table above each paragraph.
#
# - **All-gather**: forward and backward each gather the three 64 KiB weights,
#   {glue:text}`fp8_fp32_gathered:,` bytes in FP32; half that in BF16, a quarter in FP8, one byte per element. On gloo the
#   float8 bytes travel as `uint8` (gloo rejects float8 tensors, so `float8_fully_shard`
#   reinterprets them; with NCCL it leaves them `float8_e4m3fn`, not run here).
# - **Reduce-scatter** of gradients stays in float32 in every mode: FP8 is used for the
#   matmuls (operands `float8_e4m3fn` forward; backward, `float8_e5m2` gradients with
#   `float8_e4m3fn` weights and inputs) and the weight all-gather, not for the gradient
#   reduction.
# - **All-reduce**: none in the step itself. The FP8 scaling factor of each weight comes
#   from the largest absolute value (amax) of the *whole* weight, so the ranks must
#   agree on it; `precompute_float8_dynamic_scale_for_fsdp`, after the optimizer step,
#   does it for all weights at once:


# %%
def amax_collectives():
    from fsdp_guide.fp8 import quiet_torchao
    from torch.distributed.tensor.debug import CommDebugMode

    quiet_torchao()
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    device = fsdp_guide.device()
    counts = {}
    for precompute in (False, True):
        model = shard_in_precision("fp8")
        if precompute:
            with CommDebugMode() as comm:
                precompute_float8_dynamic_scale_for_fsdp(model)
            counts["precompute_float8_dynamic_scale_for_fsdp"] = {
                str(op): n for op, n in comm.get_comm_counts().items()
            }
        with record_dtypes() as seen:
            x, _ = regression_batch(0, dist.get_rank(), device)
            F.mse_loss(model(x), torch.zeros(32, WIDTH, device=device)).backward()
        counts[f"forward+backward, scales precomputed: {precompute}"] = {
            f"{phase} {kind}": f"{seen.count[(phase, kind)]} x {seen.get(phase, kind)}"
            for phase, kind in seen.seen
            if kind == "all-reduce"
        }
    return counts


for where, counts in launch(amax_collectives, output="none")[0].items():
    print(f"{where}:\n    {counts or 'none'}")

# %% [markdown]
# Without the precomputed scales, every all-gather of a float8 weight first all-reduces
# its amax (a float32 `max`, the dtype above): one per weight in forward and again in backward.
# With them, the step has none, and one all-reduce after the optimizer step covers all
# weights. Call it after *every* step: `precompute_float8_dynamic_scale_for_fsdp` stores
# each scale on the weight's local tensor (`_precomputed_scale`), and the next all-gathers
# use it as it is: `WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather`
# (`torchao/float8/fsdp_utils.py`) casts with the stored scale whenever there is one, and
# computes a new one (with the amax all-reduce) only when there is none.
#
# ## Gradient accumulation with FP8
#
# Two micro-batches of 16 with `set_requires_gradient_sync(False)` on the first, against
# one batch of 32, compared by the relative difference of the gradients:


# %%
def accumulation():
    from fsdp_guide.fp8 import quiet_torchao

    quiet_torchao()
    device = fsdp_guide.device()
    x, y = regression_batch(0, dist.get_rank(), device)

    reduce_scatters = {}

    def gradients(mode, micro_batches):
        model = shard_in_precision(mode)
        with record_dtypes() as comm:
            for i, rows in enumerate(torch.arange(32, device=device).chunk(micro_batches)):
                model.set_requires_gradient_sync(i == micro_batches - 1)  # reduce once, at the end
                (F.mse_loss(model(x[rows]), y[rows]) / micro_batches).backward()
        reduce_scatters[
            f"{mode}, {micro_batches} micro-batch{'es' if micro_batches > 1 else ''}"
        ] = comm.count[("backward", "reduce-scatter")]
        return torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()])

    def relative(a, b):
        return ((a - b).norm() / b.norm()).item()

    fp32, fp8 = gradients("fp32", 1), gradients("fp8", 1)
    differences = {
        "fp32: 2 micro-batches vs 1 batch": relative(gradients("fp32", 2), fp32),
        "fp8: 2 micro-batches vs 1 batch": relative(gradients("fp8", 2), fp8),
        "fp8 vs fp32, 1 batch": relative(fp8, fp32),
    }
    return differences, reduce_scatters


differences, reduce_scatters = launch(accumulation, output="none")[0]
rows = [[comparison, f"{difference:.1e}"] for comparison, difference in differences.items()]
display(Table(["comparison", "relative difference"], rows))
print(
    "reduce-scatters in backward:", ", ".join(f"{run}: {n}" for run, n in reduce_scatters.items())
)

# %% [markdown]
# Accumulation works with FP8: nothing raises, and the gradients are reduced once per step,
# as many reduce-scatters for two micro-batches as for one batch (the counts above). But it
# is not equal to the large batch: with dynamic scaling each micro-batch computes its own
# scales for its inputs and output gradients, which is expected to round differently (not
# separated here: fixed scales would separate it). The difference is of the order of FP8's
# own error against FP32 for this small model (the second and third lines), not a bug; FP32
# accumulation is equal up to rounding (the first).

# %% [markdown]
# (fp8-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch and torchao: {download}`scripts/fp8.py`.
# `torchrun --nproc-per-node=2 fp8.py` converts the Linears (float8 all-gather on), then shards
# them, and trains this page's 12 AdamW steps on its batches (over gloo, a custom all-gather sends
# the float8 bytes as `uint8`). Rank 0 prints how many Linears are `Float8Linear`, the type of the
# weights they computed with (`Float8TrainingTensor`: gathered in float8), and the largest
# relative difference from the losses of float32 training in one process. The tests run this
# file under torchrun on 2 CPU ranks and check all three: 3 of 3, gathered in float8, and within
# 1% at every step (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/fp8.py
# :language: python
# ```

# %% [markdown]
# (fp8-tips)=
# ## The tips behind this
#
# - {ref}`tip-fp8-fsdp`: convert first, precompute the scales (its memory half is
#   {ref}`tutorial-fp8-memory`'s).

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("fp8")
