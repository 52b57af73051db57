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
#   on 2 ranks: the loss, the bytes all-gathered per step, the model states kept per rank,
#   and the activations saved for backward;
# - the two ways "FP8 used more memory than BF16" happens (activations, and a second
#   float32 master copy), and the settings that fix each;
# - where the FP8 scaling factors are synchronised across ranks, and what gradient
#   accumulation does with FP8.
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
# The model is three 128x128 Linears. FP32 shards it as it is; BF16 adds FSDP2's
# `MixedPrecisionPolicy` (compute in bfloat16, reduce gradients in float32); FP8 uses
# {func}`fsdp_guide.fp8.float8_fully_shard`: torchao's `convert_to_float8_training` with
# `enable_fsdp_float8_all_gather=True` *before* `fully_shard` (the other order is not run on
# this page), and torchao's
# `precompute_float8_dynamic_scale_for_fsdp` after every optimizer step. FP8 + BF16
# combines the last two.

# %%
import fsdp_guide
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from fsdp_guide import launch
from fsdp_guide.fp8 import float8_fully_shard
from fsdp_guide.memory import measure
from fsdp_guide.precision import record_dtypes
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

WIDTH, STEPS = 128, 12
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
MODES = ("fp32", "bf16", "fp8", "fp8+bf16")


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(WIDTH, WIDTH, bias=False),
        nn.ReLU(),
        nn.Linear(WIDTH, WIDTH, bias=False),
        nn.ReLU(),
        nn.Linear(WIDTH, WIDTH, bias=False),
    )


def build(mode, stored=torch.float32):
    model = make_model().to(stored)  # the dtype FSDP stores (and shards) the parameters in
    mp_policy = BF16 if "bf16" in mode else MixedPrecisionPolicy()
    if mode.startswith("fp8"):
        return float8_fully_shard(model, mp_policy=mp_policy)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mp_policy=mp_policy)
    return fully_shard(model, mp_policy=mp_policy)


def batch(step, rank, device, rows=32):
    """Drawn on the CPU (the same numbers on any device), then moved to ``device``."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(rows, WIDTH, generator=g)
    target = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(7)) / WIDTH**0.5
    return x.to(device), torch.tanh(x @ target).to(device)


# %% [markdown]
# Each mode trains 12 steps with AdamW. During the last step, `record_dtypes` records
# every collective (dtype, count, bytes), and {func}`fsdp_guide.memory.saved_for_backward`
# counts the bytes autograd saves for backward (float8 tensors at one byte per element);
# after it, {func}`fsdp_guide.memory.measure` counts the model states.

# %%
from fsdp_guide.memory import saved_for_backward


def train(mode):
    from fsdp_guide.fp8 import quiet_torchao

    quiet_torchao()  # each rank is a fresh process: silence torchao before importing it
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    device = fsdp_guide.device()
    model = build(mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, dist.get_rank(), device)
        with record_dtypes() as comm:
            with saved_for_backward() as saved:  # the forward: what it saves, and what it leaves
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
    # measure after a backward, so the gradients exist
    F.mse_loss(model(x).float(), y).backward()
    return dict(
        losses=losses,
        collectives=collectives,
        states=measure(model, optimizer),
        saved=saved.nbytes,
        held=saved.held_at_exit,
    )


def train_all_modes():
    return {mode: train(mode) for mode in MODES}


results = launch(train_all_modes, output="none")[0]

print(f"{'step':>4}  " + "  ".join(f"{mode:>9}" for mode in MODES))
for step in range(0, STEPS, 3):
    print(f"{step:4}  " + "  ".join(f"{results[m]['losses'][step]:9.5f}" for m in MODES))
print(f"{'last':>4}  " + "  ".join(f"{results[m]['losses'][-1]:9.5f}" for m in MODES))

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
print(f"{'mode':9} {'phase':9} {'collective':15} {'dtype':9} {'count':>5} {'bytes':>8}")
for mode in MODES:
    for (phase, kind), (dtype, count, nbytes) in sorted(results[mode]["collectives"].items()):
        if kind != "matmul":
            print(f"{mode:9} {phase:9} {kind:15} {dtype:9} {count:5} {nbytes:8}")
print("\nmatmul operands, forward | backward:")
for mode in MODES:
    matmuls = results[mode]["collectives"]
    print(f"{mode:9} {matmuls[('forward', 'matmul')][0]:14} | {matmuls[('backward', 'matmul')][0]}")

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
        model = build("fp8")
        if precompute:
            with CommDebugMode() as comm:
                precompute_float8_dynamic_scale_for_fsdp(model)
            counts["precompute_float8_dynamic_scale_for_fsdp"] = {
                str(op): n for op, n in comm.get_comm_counts().items()
            }
        with record_dtypes() as seen:
            x, _ = batch(0, dist.get_rank(), device)
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
# ## Memory: model states, and what is saved for backward

# %%
print(
    f"{'mode':9} {'params':>8} {'grads':>8} {'optimizer':>9}  {'saved in forward':>16}  {'held after forward':>18}"
)
for mode in MODES:
    states, saved, held = results[mode]["states"], results[mode]["saved"], results[mode]["held"]
    print(
        f"{mode:9} {states.params:8} {states.grads:8} {states.optimizer:9}  {saved:16}  {held:18}"
    )
glue("fp8_params", sum(p.numel() for p in make_model().parameters()), display=False)
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
    model = build(mode, stored)
    optimizer = optimizer_class(model.parameters(), lr=1e-2)
    for step in range(3):
        x, y = batch(step, dist.get_rank(), device)
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
num_params = sum(p.numel() for p in make_model().parameters())
print(
    f"{'set-up':31} {'params':>7} {'grads':>7} {'optimizer':>9} {'total':>7} "
    f"{'bytes/param':>11} {'measured/estimated':>18} {'loss':>7}"
)
for name, (_, optimizer_class, stored) in SETUPS.items():
    got, loss = measured[name]
    expected = estimate(
        num_params,
        2,
        "FULL_SHARD",
        param_dtype=stored,
        master_weights=optimizer_class is MasterWeightAdamW,
    )
    print(
        f"{name:31} {got.params:7} {got.grads:7} {got.optimizer:9} {got.total:7} "
        f"{got.total / (num_params / 2):11.0f} {got.total / expected.total:18.4f} {loss:7.4f}"
    )
    off_by.append(got.total - expected.total)
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
    x, y = batch(0, dist.get_rank(), device)

    reduce_scatters = {}

    def gradients(mode, micro_batches):
        model = build(mode)
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
        "fp8:  2 micro-batches vs 1 batch": relative(gradients("fp8", 2), fp8),
        "fp8 vs fp32, 1 batch": relative(fp8, fp32),
    }
    return differences, reduce_scatters


differences, reduce_scatters = launch(accumulation, output="none")[0]
for comparison, difference in differences.items():
    print(f"{comparison:34} relative difference {difference:.1e}")
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
# - {ref}`tip-fp8-fsdp`
# - {ref}`tip-memory-estimate`: model states per rank, estimated and measured.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("fp8")
