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
# (tutorial-deepspeed-zero)=
# # From DeepSpeed ZeRO to FSDP2, step for step
#
# **What you will learn**: that one model trained with DeepSpeed ZeRO-1, -2 and -3 and with
# FSDP2 gives the same losses bit for bit in float32 (on 2 ranks); what DeepSpeed's bf16
# does that FSDP2 must be told to do for the two to agree (and what goes wrong without its
# float32 master weights); which `ds_config` keys have an FSDP2 setting; and how a ZeRO
# checkpoint becomes a DCP one that the guide's recipe resumes exactly.
#
# **What you need**: a CPU; 2 processes on gloo; DeepSpeed (`pip install deepspeed`, this
# page's extra: the package does not need it); about 20 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The code is written to run unchanged with one GPU
# per rank (NCCL), on {func}`fsdp_guide.device`; no GPU run of it is recorded. The tips:
# {ref}`at the end <deepspeed-zero-tips>`. Its idea as a plain torchrun script to copy:
# {ref}`deepspeed-zero-script` ({download}`download <scripts/deepspeed_zero.py>`).

# %%
import sys

import deepspeed
import torch

print(f"torch {torch.__version__}, DeepSpeed {deepspeed.__version__}, Python {sys.version[:6]}")

# %% [markdown]
# The model is the guide's small GPT ({class}`fsdp_guide.gpt.GPT`), built whole on every rank from
# one seed. FSDP2 shards each block, then the root; DeepSpeed takes the whole model and the
# same torch `AdamW`. Each rank draws its own rows, the same ones in both runs.
#
# On a CPU, DeepSpeed compiles a C++ extension with g++ when its communication starts
# (`deepspeed_shm_comm`), and its own Adam another (`fused_adam`), once per machine, then
# cached in `~/.cache/torch_extensions` (timed by `bench/deepspeed_builds.py`). Neither is
# needed: the op serves inference's all-reduce only (`deepspeed/comm/torch.py`), so
# `on_the_rank_device` marks it unavailable (DeepSpeed 0.19's `__compatible_ops__`, read by
# `build_shm_op`), and a torch optimizer, passed in, replaces DeepSpeed's.

# %%
import warnings
from types import SimpleNamespace

warnings.filterwarnings("ignore", message=".*is deprecated. Please use")  # DeepSpeed's calls

import deepspeed.ops
import fsdp_guide
import torch.distributed as dist
from deepspeed.accelerator import set_accelerator
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
from deepspeed.utils import safe_get_full_fp32_param
from fsdp_guide.gpt import GPT, GPTConfig
from torch.distributed.fsdp import MixedPrecisionPolicy as Policy
from torch.distributed.fsdp import fully_shard

CONFIG = GPTConfig(block_size=32, n_layer=2, n_head=4, n_embd=64)
STEPS, ROWS = 8, 4  # each rank's rows per step


def on_the_rank_device():  # before deepspeed.initialize: returns its args
    device = fsdp_guide.device()
    if device.type == "cpu":  # cpu-only: else DeepSpeed takes any visible GPU
        set_accelerator(CPU_Accelerator())
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # initialize builds none
    return SimpleNamespace(device_rank=device.index or 0)  # the engine's device


def build(rounded_to_bf16=False):
    torch.manual_seed(0)  # the same weights on every rank and in every run
    model = GPT(CONFIG).to(fsdp_guide.device())
    model.init_weights()
    if rounded_to_bf16:  # where DeepSpeed's bf16 starts its float32 master weights
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.bfloat16())
    return model


def flat(tensors):
    return torch.cat([t.detach().float().flatten() for t in tensors])


def batches():
    g = torch.Generator().manual_seed(100 + dist.get_rank())  # this rank's rows
    size = (ROWS, CONFIG.block_size + 1)
    return [torch.randint(256, size, generator=g).to(fsdp_guide.device()) for _ in range(STEPS)]


def adamw(model, lr):
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))


def train_fsdp2(lr=3e-3, policy=None, bf16_weights=False, rounded=False):
    model = build(rounded)
    if bf16_weights:  # the weights themselves in bf16: no float32 copy anywhere
        model = model.bfloat16()
    start = flat(model.parameters())
    for block in [*model.blocks, model]:
        fully_shard(block, mp_policy=policy or Policy())
    optimizer, losses = adamw(model, lr), []
    for tokens in batches():
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    weights = flat(p.full_tensor() for p in model.parameters())
    return dict(losses=losses, weights=weights, moved=(weights != start).float().mean())


def train_zero(stage, lr=3e-3, bf16=False):
    args = on_the_rank_device()
    model, start = build(), flat(build(rounded_to_bf16=bf16).parameters())
    config = {
        "train_micro_batch_size_per_gpu": ROWS,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,  # DeepSpeed's default clips at 1.0; FSDP2 clips only when asked
        "bf16": {"enabled": bf16},
    }  # with a torch optimizer passed in, DeepSpeed builds none of its own (no fused_adam)
    engine, *_ = deepspeed.initialize(args, model, optimizer=adamw(model, lr), config=config)
    losses = []
    for tokens in batches():
        _, loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    weights = flat(safe_get_full_fp32_param(p) for p in engine.module.parameters())  # gathered
    built = deepspeed.comm.comm.cdb.shm_comm_op is not None  # built? (DeepSpeed 0.19's internals)
    moved = (weights != start).float().mean()
    return dict(losses=losses, weights=weights, moved=moved, shm_op_built=built)


# %% [markdown]
# (deepspeed-zero-float32)=
# ## Float32: the same losses, bit for bit
#
# Each ZeRO stage against FSDP2, {glue:text}`ds_steps` steps, the loss each step on rank 0:

# %%
from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT
from fsdp_guide import launch
from fsdp_guide.table import Table
from myst_nb import glue


def float32_runs():
    return {"FSDP2": train_fsdp2(), **{f"ZeRO-{s}": train_zero(s) for s in (1, 2, 3)}}


ranks = launch(float32_runs, output="none")
fp32 = ranks[0]
Table(
    ["step", *fp32],
    [[s + 1, *(f"{r['losses'][s]:.7f}" for r in fp32.values())] for s in range(STEPS)],
)

# %%
every_stage_equal = all(
    run["losses"] == runs["FSDP2"]["losses"]
    and torch.equal(run["weights"], runs["FSDP2"]["weights"])
    for runs in ranks
    for run in runs.values()
)
print("every stage's losses and final weights equal FSDP2's on both ranks:", every_stage_equal)
print("the losses fell:", fp32["FSDP2"]["losses"][-1] < fp32["FSDP2"]["losses"][0])
built = any(runs[f"ZeRO-{s}"]["shm_op_built"] for runs in ranks for s in (1, 2, 3))
print("DeepSpeed built its shared-memory extension:", built)
print("DeepSpeed's gradient_clipping when the config leaves it out:", GRADIENT_CLIPPING_DEFAULT)
glue("ds_clip_default", GRADIENT_CLIPPING_DEFAULT, display=False)
glue("ds_steps", STEPS, display=False)
glue("ds_fp32_equal", "equal" if every_stage_equal else "not equal", display=False)

# %% [markdown]
# Equal ({glue:text}`ds_fp32_equal`), on these 2 ranks: the stages differ in what each rank
# keeps (ZeRO-1 the optimizer's state, ZeRO-2 that and the gradients, ZeRO-3 the weights
# too, split from each flattened parameter where FSDP2 splits each parameter along its
# first dimension), not in the arithmetic: both average each gradient over the ranks (a sum
# of two numbers has one order) and run the same `AdamW`. With more ranks, or NCCL on GPUs,
# expect the last bits to differ (the libraries group their sums differently). So when a
# migration's float32 losses differ from the first step by more than rounding, look for a
# difference in the run (data, seed, a setting) first: DeepSpeed clips gradients at
# {glue:text}`ds_clip_default` unless its config says otherwise (printed above); FSDP2
# clips only where you call `clip_grad_norm_`.
#
# (deepspeed-zero-bf16)=
# ## bf16: what DeepSpeed does, and FSDP2 must be told
#
# DeepSpeed's `"bf16": {"enabled": true}` casts the parameters to bf16, computes in them,
# averages the gradients in bf16, and keeps a float32 copy of the weights (the master
# weights) that the optimizer updates. FSDP2's `MixedPrecisionPolicy(param_dtype=bf16)`
# keeps the sharded weights in float32 and casts a copy to bf16 for forward and backward;
# `reduce_dtype` is the dtype the gradients are averaged in (left out, `param_dtype`). The
# final weights of five FSDP2 runs against ZeRO-2's with bf16, at a small learning rate
# (`bf16_runs`' `lr`) where precision shows:

# %%
bf16, f32 = torch.bfloat16, torch.float32
BF16_RUNS = {  # MixedPrecisionPolicy(param_dtype, reduce_dtype)
    "weights in bf16 (no float32 copy)": dict(bf16_weights=True),
    "policy(bf16, float32)": dict(policy=Policy(bf16, f32)),
    "policy(bf16, bf16)": dict(policy=Policy(bf16, bf16)),
    "policy(bf16, float32), from bf16-rounded weights": dict(
        policy=Policy(bf16, f32), rounded=True
    ),
    "policy(bf16, bf16), from bf16-rounded weights": dict(policy=Policy(bf16, bf16), rounded=True),
}


def bf16_runs(lr=3e-5):
    zero = train_zero(2, lr=lr, bf16=True)
    update = (zero["weights"] - flat(build(rounded_to_bf16=True).parameters())).norm()
    found = {"ZeRO-2, bf16": {"distance": 0.0, "moved": zero["moved"]}}
    for name, kwargs in BF16_RUNS.items():
        run = train_fsdp2(lr=lr, **kwargs)
        same = torch.equal(run["weights"], zero["weights"]) and run["losses"] == zero["losses"]
        distance = float((run["weights"] - zero["weights"]).norm() / update)
        found[name] = {"distance": distance, "moved": run["moved"], "bit-equal": same}
    return found


bf16_found = launch(bf16_runs, output="none")
found = bf16_found[0]
columns = ["run", "distance to ZeRO-2's weights / its update", "weights that moved"]
same = {
    n: all(b[n]["bit-equal"] for b in bf16_found) if n in BF16_RUNS else "(itself)" for n in found
}
rows = [[n, f"{r['distance']:.2g}", f"{r['moved']:.0%}", same[n]] for n, r in found.items()]
names = list(BF16_RUNS)
glue("ds_bf16_moved", float(found[names[0]]["moved"]) * 100, display=False)
glue("ds_bf16_params_distance", found[names[0]]["distance"], display=False)
glue("ds_mp_distance", found[names[1]]["distance"], display=False)
glue("ds_mp_rounded_distance", found[names[3]]["distance"], display=False)
Table([*columns, "losses and weights bit-equal to ZeRO-2's"], rows)

# %% [markdown]
# - **Weights in bf16** (`model.bfloat16()` before `fully_shard`, the case of a loss that
#   would not fall in [Hugging Face's post on moving between DeepSpeed and
#   FSDP](https://huggingface.co/blog/deepspeed-to-fsdp-and-back)): only
#   {glue:text}`ds_bf16_moved:.0f`% of the weights moved at all in {glue:text}`ds_steps`
#   steps: an update under half a bf16 step of the weight rounds back to the weight. It
#   lands {glue:text}`ds_bf16_params_distance:.2f` of an update away from DeepSpeed's.
# - **`MixedPrecisionPolicy`** keeps the float32 weights, and every update counts. It
#   lands {glue:text}`ds_mp_distance:.2f` of an update away, and nearly all of that is
#   where it starts: DeepSpeed casts the parameters to bf16, then copies them to float32
#   for its master weights, so they start from the bf16-rounded weights. Started from
#   those, FSDP2 lands {glue:text}`ds_mp_rounded_distance:.4f` of an update away.
# - **Bit-equal** takes the other rounding too: the gradients averaged in bf16, as
#   `reduce_dtype` left out does (DeepSpeed's `communication_data_type` sets its dtype).
#   Match both to check a migration against the old run step for step; then prefer the
#   float32 weights as they are and `reduce_dtype=torch.float32`, which rounds less (the
#   recipe's choice).
#
# (deepspeed-zero-map)=
# ## `ds_config`, key by key
#
# | `ds_config` | FSDP2 | shown |
# |---|---|---|
# | `zero_optimization.stage` 1, 2 | no FSDP2 form: it shards the weights too, gathering them for the forward and again for the backward; `reshard_after_forward=False` keeps them gathered in between, as ZeRO-2 never drops them. The same numbers | executed above; {ref}`reshard_after_forward <fsdp2-fully-shard-reshard-after-forward>` |
# | `zero_optimization.stage` 3 | `fully_shard` each block, then the root | executed above |
# | `zero_hpz_partition_size` (ZeRO++'s second, smaller-group copy of the weights for the backward) | `reshard_after_forward=` an int: after the forward, resharded over that many ranks | {ref}`reshard_after_forward <fsdp2-fully-shard-reshard-after-forward>` |
# | `mics_shard_size` (MiCS) | HSDP: a 2-D mesh, sharded within a group, replicated across | {ref}`cluster` |
# | `zero.Init` | build on the meta device, shard, then `to_empty` and initialise | {ref}`tutorial-deterministic-init` |
# | `bf16.enabled` | `MixedPrecisionPolicy(param_dtype=torch.bfloat16)`, float32 weights kept | executed above |
# | `communication_data_type` | `MixedPrecisionPolicy(reduce_dtype=...)` | executed above |
# | `prescale_gradients`, `gradient_predivide_factor` | no setting: these split the average's division into a part before the reduction and a part after, and FSDP2 splits it itself where the reduction is in float16; `set_gradient_divide_factor` changes the whole divisor, which these keys do not | {ref}`set_gradient_divide_factor <fsdp2-fsdpmodule-set-gradient-divide-factor>`; torch's `_get_gradient_divide_factors` (`_fsdp_collectives.py`) |
# | `fp16.enabled` (with its loss scaler) | `param_dtype=torch.float16` and `torch.amp.GradScaler` | {ref}`tutorial-fp16-scaler` |
# | `gradient_clipping` | `torch.nn.utils.clip_grad_norm_` on the `DTensor` parameters, which FSDP2 calls only when you do; DeepSpeed clips at {glue:text}`ds_clip_default` when the config leaves it out (printed above; the runs above set 0, off) | executed below (the recipe clips at its `clip`) |
# | `gradient_accumulation_steps` | a loop of micro-batches, each loss divided by their number. ZeRO-2 and -3 reduce-scatter every micro-batch's gradients, as FSDP2 does by default; ZeRO-1 reduces at the last, as `set_requires_gradient_sync(False)` on all but the last does (unsharded gradients held between) | {ref}`tutorial-loss-and-accumulation` |
# | `offload_param` with `offload_optimizer` | `offload_policy=CPUOffloadPolicy()`: weights, gradients and the optimizer step on the CPU | {ref}`CPUOffloadPolicy <fsdp2-cpuoffloadpolicy>` |
# | `offload_optimizer` alone (ZeRO-Offload), NVMe offload | no equivalent | the policy's fields, {ref}`OffloadPolicy <fsdp2-offloadpolicy>` |
# | `reduce_bucket_size`, `allgather_bucket_size` | no equivalent: FSDP2 gathers and reduces one unit at a time; the units you shard are the buckets | {ref}`tutorial-communication` |
# | `stage3_prefetch_bucket_size` | no size: `set_modules_to_forward_prefetch` / `set_modules_to_backward_prefetch` name the units to fetch early | {ref}`tutorial-fsdp2-controls` |
# | `contiguous_gradients`, `overlap_comm` | no setting: each unit's gradients are reduce-scattered from one buffer; on GPUs the reduce-scatter is expected to overlap the backward on its own stream | {ref}`tutorial-communication` |
# | `stage3_gather_16bit_weights_on_model_save` | `get_model_state_dict(..., StateDictOptions(full_state_dict=True))`, which under a bf16 policy gives the float32 weights: cast them to save 16-bit | {ref}`finetune-hf-export` |
# | `train_micro_batch_size_per_gpu` | the batch you feed each rank | executed above |

# %% [markdown]
# (deepspeed-zero-convert)=
# ## A ZeRO checkpoint, resumed by the recipe
#
# The recipe's run ({func}`fsdp_guide.recipes.train_llm.train`: its model, data, AdamW,
# schedule and clipping) trains with ZeRO-3 for {glue:text}`ds_recipe_steps` steps and saves
# a ZeRO checkpoint after {glue:text}`ds_saved_at`. DeepSpeed's `ds_to_universal` turns it
# into a file per parameter: the float32 weights and Adam's moments (flat, without Adam's
# step count: the engine's steps not skipped). Rank 0 reads them; DCP's
# `set_model_state_dict` and `set_optimizer_state_dict` send each rank its shards; the
# schedule comes from the engine's file; `fsdp_guide.checkpoint` saves, and the recipe
# resumes. Beside it, a resume from the weights alone (all that `zero_to_fp32` keeps):

# %%
import dataclasses
import subprocess
import tempfile
from pathlib import Path

from fsdp_guide import checkpoint
from fsdp_guide.recipes import train_llm
from torch.distributed.checkpoint import state_dict as dcp

RECIPE = train_llm.TrainConfig(
    n_layer=2, block_size=32, batch_size=8, steps=8, precision="fp32", log_every=4, progress=False
)
SAVED_AT = 4
TAG = f"step{SAVED_AT}"  # the ZeRO checkpoint's folder


def deepspeed_recipe_run(out):
    """The recipe's run with ZeRO-3; saves a ZeRO checkpoint after SAVED_AT steps."""
    args = on_the_rank_device()
    torch.manual_seed(RECIPE.seed)
    model = GPT(RECIPE.model_config()).to(fsdp_guide.device())
    model.init_weights()  # the recipe's weights, bit for bit (its init_sharded's promise)
    optimizer, scheduler = train_llm.build_optimizer(model, RECIPE)
    config = {
        "train_micro_batch_size_per_gpu": RECIPE.batch_size // dist.get_world_size(),
        "zero_optimization": {"stage": 3},
        "gradient_clipping": RECIPE.clip,
    }
    engine, *_ = deepspeed.initialize(
        args, model, optimizer=optimizer, lr_scheduler=scheduler, config=config
    )
    batches, losses, norms = train_llm.make_batches(RECIPE), [], []
    for step in range(1, RECIPE.steps + 1):
        _, loss = engine(*(t.to(fsdp_guide.device()) for t in next(batches)))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
        norms.append(float(engine.get_global_grad_norm()))  # before clipping
        if step == SAVED_AT:
            engine.save_checkpoint(out / "zero", tag=TAG)
    losses = torch.stack(losses)
    dist.all_reduce(losses)  # the recipe reports the loss averaged over the ranks
    return (losses / dist.get_world_size()).tolist(), norms


def to_recipe_checkpoint(universal, out, with_moments=True):
    """ds_to_universal's files -> the recipe's sharded model and optimizer -> its checkpoint."""
    model = train_llm.shard_model(RECIPE, fsdp_guide.device(), torch.float32)
    optimizer, scheduler = train_llm.build_optimizer(model, RECIPE)
    engine_state = torch.load(next(universal.glob("*model_states.pt")), weights_only=True)
    scheduler.load_state_dict(engine_state["lr_scheduler"])  # where DeepSpeed's run left it
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr  # the next step's rate: a scheduler's load leaves the optimizer's alone

    def saved(name, what, shape):  # ZeRO-3's files: flat, and no step count
        return torch.load(universal / "zero" / name / f"{what}.pt", weights_only=True).view(shape)

    weights, state = {}, {}
    if dist.get_rank() == 0:  # rank 0 reads each tensor whole; the load sends each rank its shard
        step = torch.tensor(float(engine_state["global_steps"] - engine_state["skipped_steps"]))
        for name, p in model.named_parameters():  # the tied head once, as DeepSpeed saved it
            weights[name] = saved(name, "fp32", p.shape)
            moments = {k: saved(name, k, p.shape) for k in ("exp_avg", "exp_avg_sq")}
            state[name] = {"step": step.clone(), **moments}
    options = dcp.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    # strict=False: the tied head (lm_head.weight) is the embedding, loaded under its one name
    dcp.set_model_state_dict(model, weights, options=dataclasses.replace(options, strict=False))
    if with_moments:
        groups = [{**g, "params": list(state)} for g in optimizer.state_dict()["param_groups"]]
        moments = {"state": state, "param_groups": groups} if dist.get_rank() == 0 else {}
        dcp.set_optimizer_state_dict(model, optimizer, moments, options=options)
    data = train_llm.make_batches(RECIPE)
    data.load_state_dict({"seed": RECIPE.seed, "position": SAVED_AT})
    settings, where = train_llm.RunSettings(RECIPE), out / ("recipe" if with_moments else "weights")
    return checkpoint.save(
        where, SAVED_AT, model, optimizer, scheduler=scheduler, data=data, settings=settings
    )


def resume(path):
    return train_llm.train(dataclasses.replace(RECIPE, resume=str(path)))["losses"]


with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp)
    zero_losses, norms = launch(deepspeed_recipe_run, out, output="none")[0]
    folders = ["--input_folder", out / "zero" / TAG, "--output_folder", out / "universal"]
    convert = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", *folders]
    subprocess.run(convert, check=True, capture_output=True)
    path = launch(to_recipe_checkpoint, out / "universal", out, output="none")[0]
    resumed_losses = launch(resume, path, output="none")[0]  # its log names the temporary folder
    weights_only = launch(to_recipe_checkpoint, out / "universal", out, False, output="none")[0]
    afresh_losses = launch(resume, weights_only, output="none")[0]

# %%
columns = ["step", "ZeRO-3, uninterrupted", "the recipe, resumed", "weights only, Adam afresh"]
resumed = [""] * SAVED_AT + [f"{loss:.7f}" for loss in resumed_losses]
afresh = [""] * SAVED_AT + [f"{loss:.7f}" for loss in afresh_losses]
rows = [[s + 1, f"{zero_losses[s]:.7f}", resumed[s], afresh[s]] for s in range(RECIPE.steps)]
Table(columns, rows)

# %%
resumed_exactly = resumed_losses == zero_losses[SAVED_AT:]
print("the resumed steps' losses equal ZeRO-3's:", resumed_exactly)
later = zip(afresh_losses[1:], zero_losses[SAVED_AT + 1 :])
afresh_parts = afresh_losses[0] == zero_losses[SAVED_AT] and all(a != b for a, b in later)
print("weights only: the first resumed step's loss equal, the later ones not:", afresh_parts)
print(f"ZeRO-3's gradient norms before clipping: {', '.join(f'{n:.3f}' for n in norms)}")
clipped = [s + 1 for s, n in enumerate(norms) if n > RECIPE.clip]
print(f"clipped at {RECIPE.clip} on steps: {clipped}")
glue("ds_resumed", "equal" if resumed_exactly else "not equal", display=False)
glue("ds_recipe_steps", RECIPE.steps, display=False)
glue("ds_saved_at", SAVED_AT, display=False)

# %% [markdown]
# Equal ({glue:text}`ds_resumed`): the recipe continues ZeRO-3's run as if it had never
# stopped, with clipping at work on every step (each norm above the recipe's `clip`,
# printed). What carries it over: the float32 weights, Adam's moments and step count, the
# schedule at the saved step (and the optimizer's rate: loading a scheduler's state leaves
# `lr` alone), and the data at the next batch. From the weights alone, the first resumed
# step's loss is equal (the weights are), the next ones are not.
#
# From a ZeRO-1 or -2 checkpoint that a plain DeepSpeed engine saved, `ds_to_universal`
# needs `--inject_missing_state` (Megatron-DeepSpeed writes the state it checks for); its
# ZeRO-3 path reads no such flag (`main` in `deepspeed/checkpoint/ds_to_universal.py`).
#
# (deepspeed-zero-script)=
# ## The script to copy
#
# {download}`scripts/deepspeed_zero.py`, torch and DeepSpeed alone: ZeRO-1, -2 and -3 against
# FSDP2 in float32, and ZeRO-2's bf16 against FSDP2 with DeepSpeed's two roundings. The tests
# run it under torchrun on 2 CPU ranks and check that each is equal (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/deepspeed_zero.py
# :language: python
# ```

# %% [markdown]
# (deepspeed-zero-tips)=
# ## The tips behind this
#
# - {ref}`tip-deepspeed-float32-equal`
# - {ref}`tip-deepspeed-bf16-master`

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("deepspeed_zero")
