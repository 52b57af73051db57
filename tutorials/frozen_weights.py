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
# (tutorial-frozen-weights)=
# # Frozen weights under FSDP2: the dtype rule and the traffic
#
# Freezing a weight under FSDP2 removes its gradient and optimizer state, nothing else: it is still
# sharded and gathered, and FSDP2's one check of a unit's dtypes leaves it out. This page runs both.
#
# **What you will learn**
#
# - FSDP2's dtype rule: the trainable parameters of a unit share one dtype, so fp32 adapters on a
#   frozen bf16 base are fine, but not beside trained bf16 weights; three fixes, each executed, with
#   what it costs;
# - how many bytes a frozen base is all-gathered per micro-batch under gradient accumulation with
#   `reshard_after_forward=True`, `False`, kept gathered across micro-batches, and replicated
#   instead of sharded, what each holds in forward and between micro-batches, and how to choose.
#
# **What you need**: a CPU; 2 processes on gloo; `transformers`, `safetensors` and `peft`
# (the package's `test` or `docs` extras); about 20 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The frozen
# weights are those of {ref}`tutorial-lora`: a small Llama built from a config with a fixed seed,
# saved in bf16, with `peft`'s LoRA adapters; nothing is downloaded. The worker code is written to
# run unchanged with one GPU per rank (NCCL): the shards live on
# {func}`fsdp_guide.device`. The tips are listed {ref}`at the end <frozen-weights-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`frozen-weights-script` ({download}`download <scripts/frozen_weights.py>`).

# %%
import os
import sys
import tempfile
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing is downloaded

import warnings

# tqdm's notebook import: no widgets here
warnings.filterwarnings("ignore", message="IProgress not found")
# peft 0.21 asks transformers 5 a deprecated question; the ranks' warnings come back here
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")

from fsdp_guide.fp8 import quiet_torchao

quiet_torchao()  # peft imports torchao, whose import logs about CUDA kernels a CPU cannot load

import peft
import torch
import transformers

transformers.utils.logging.disable_progress_bar()
print(
    f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, "
    f"Python {sys.version.split()[0]}"
)

# %% [markdown]
# ## The frozen base and its adapters
#
# The model of {ref}`tutorial-lora`: a Llama with 4 decoder layers, saved in bf16 as checkpoints on
# the Hub are, and `add_lora`, rank-8 LoRA on the attention's query and value projections (with the
# variants the dtype section runs). {func}`fsdp_guide.hf.from_pretrained` adds the adapters (its
# `adapt`) before sharding every decoder layer and the root.

# %%
from fsdp_guide import launch
from fsdp_guide.table import Table
from IPython.display import display
from myst_nb import glue
from transformers import LlamaConfig, LlamaForCausalLM

scratch = tempfile.TemporaryDirectory()  # deleted, with what the page wrote, when the kernel exits
path = Path(scratch.name) / "llama"
torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    tie_word_embeddings=True,
)
LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def add_lora(model, cast_adapters=False, train_norms=False):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(model, config, autocast_adapter_dtype=not cast_adapters)
    for name, p in model.named_parameters():  # optionally the RMSNorm weights too
        p.requires_grad_(p.requires_grad or (train_norms and "norm" in name))
    return model


# %% [markdown]
# (lora-dtypes)=
# ## The dtype rule: one dtype among a unit's trainable parameters
#
# Many models on the Hub are stored in bf16, and `peft` keeps the adapters it adds in fp32
# (`autocast_adapter_dtype=True`, its default), because adapters trained in bf16 lose small updates.
# FSDP2 all-gathers parameters of any dtypes together (as bytes, when they differ:
# `_get_all_gather_input_metadatas` in `torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py`),
# but it reduce-scatters a unit's gradients in one dtype: at the root's first forward (FSDP2's lazy
# initialisation) it checks, for every unit, that the unit's *trainable* parameters share one dtype,
# and raises `FSDP expects uniform original parameter dtype` if not
# (`FSDPParamGroup._init_mp_dtypes` in `torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py`;
# frozen parameters are left out of the check). So a frozen bf16 base with fp32 adapters is fine in
# one unit; training anything of the base beside them (here the RMSNorm weights, a common LoRA
# variant; or `peft`'s `modules_to_save`) is not. Each decoder layer is one unit below:


# %%
def first_forward(train_norms):
    import fsdp_guide
    import torch
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    small = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    # a bf16 checkpoint, loaded
    model = LlamaForCausalLM(small).to(fsdp_guide.device(), torch.bfloat16)
    model = add_lora(model, train_norms=train_norms)
    layer = model.base_model.model.model.layers[0]
    trainable = sorted({str(p.dtype) for p in layer.parameters() if p.requires_grad})
    fully_shard(layer)
    fully_shard(model)
    try:
        model(input_ids=torch.zeros(1, 4, dtype=torch.long, device=fsdp_guide.device()))
    except Exception as error:  # noqa: BLE001 (shown, not handled)
        return trainable, f"{type(error).__name__}: {error}"
    return trainable, "runs"


for train_norms in (False, True):
    trainable, outcome = launch(first_forward, train_norms, world_size=2, output="none")[0]
    what = "LoRA, bf16 norms trained too" if train_norms else "LoRA on a frozen bf16 base"
    print(f"{what:30} trainable dtypes in the layer's unit {trainable}: {outcome}")

# %% [markdown]
# Three ways out, each run below on the bf16 checkpoint with the norms trained (first, for scale,
# plain LoRA on the frozen bf16 base): two training steps on 2 ranks, then the columns below, rank
# 0's model states by {func}`fsdp_guide.memory.measure`:
#
# 1. **Adapters in units of their own.** Each adapter module is `fully_shard`ed before its decoder
#    layer, so the layer's unit trains the bf16 norms only and each adapter unit its fp32 adapter.
#    {func}`fsdp_guide.hf.from_pretrained` does this by itself when `adapt` adds trainable
#    parameters in a dtype no other trainable parameter has. The cost: one more (small) all-gather
#    per adapter in forward and reduce-scatter in backward, and the norms train in bf16.
# 2. **One storage dtype, a mixed-precision policy for compute.** Store everything in fp32 and let
#    `MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)` cast each unit's
#    gathered parameters to bf16 for compute and reduce gradients in fp32. The cost: the frozen base
#    is stored in fp32, twice its bf16 bytes, for a base that never changes.
# 3. **Cast the adapters to bf16** (`get_peft_model(..., autocast_adapter_dtype=False)`): one dtype,
#    no extra units, the smallest memory. The cost: the adapters, their gradients and AdamW's
#    moments in bf16, whose 8 significant bits (7 stored) round away any update below 1/512 to 1/256
#    of the weight, by its value (the last line below: an update of 1/300 is lost).
#
# Upcasting only the norms to fp32 is not a fourth way with this model: Llama's RMSNorm returns
# `weight * hidden_states.to(input_dtype)` (`LlamaRMSNorm.forward` in
# `transformers/models/llama/modeling_llama.py`), so an fp32 weight turns the hidden states fp32,
# and the next bf16 linear layer refuses them.

# %%
from torch.distributed.fsdp import MixedPrecisionPolicy


def one_step_states(path, dtype, mp_policy=None, cast_adapters=False, train_norms=False):
    import functools

    import fsdp_guide
    import torch
    import torch.distributed as dist
    from fsdp_guide.hf import from_pretrained
    from fsdp_guide.memory import measure
    from fsdp_guide.precision import record_dtypes
    from torch.distributed.fsdp import FSDPModule

    torch.manual_seed(0)
    model = from_pretrained(
        path,
        dtype=dtype,
        mp_policy=mp_policy,
        adapt=functools.partial(add_lora, cast_adapters=cast_adapters, train_norms=train_norms),
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    rng = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, 4096, (2, 64), generator=rng).to(fsdp_guide.device())
    model(input_ids=tokens, labels=tokens).loss.backward()  # the first step sets FSDP up
    optimizer.step()
    optimizer.zero_grad()
    with record_dtypes() as seen:
        model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    dtypes = lambda ps: "/".join(sorted({str(p.dtype).removeprefix("torch.") for p in ps}))  # noqa: E731
    return {
        "states": measure(model, optimizer),
        "frozen dtype": dtypes(p for p in model.parameters() if not p.requires_grad),
        "trainable dtype": dtypes(trainable),
        "units": sum(isinstance(m, FSDPModule) for m in model.modules()),
        "gathers": seen.count[("forward", "all-gather")],
    }


bf16 = torch.bfloat16
fixes = {
    "LoRA on the frozen bf16 base": dict(dtype=bf16),
    "1. adapters in their own units": dict(dtype=bf16, train_norms=True),
    "2. fp32 storage, bf16 compute": dict(
        dtype=torch.float32,
        train_norms=True,
        mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32),
    ),
    "3. adapters cast to bf16": dict(dtype=bf16, cast_adapters=True, train_norms=True),
}
fixed = {
    fix: launch(one_step_states, path, world_size=2, output="none", **options)[0]
    for fix, options in fixes.items()
}
rows = []
for fix, r in fixed.items():
    states = f"{r['states'].total / 2**20:.2f}"
    rows.append([fix, r["frozen dtype"], r["trainable dtype"], r["units"], r["gathers"], states])
header = ["fix", "frozen", "trained", "units", "all-gathers per forward"]
display(Table([*header, "rank 0 model states, MiB"], rows))
weight, update = torch.tensor(1.0), torch.tensor(1 / 300)  # an update of 1/300 of a weight
print(
    f"1 + 1/300 = {(weight + update).item():.4f} in fp32, {(weight.to(bf16) + update.to(bf16)).item():.4f} in bf16"
)

# %% [markdown]
# All four run the training step. Plain LoRA keeps one unit per layer even with fp32 adapters on the
# bf16 base. With the norms trained, the first fix adds a unit per adapter module (2 projections ×
# `A`, `B` × 4 layers: the units column), each one more all-gather per forward, and keeps the memory
# of bf16; the second stores the base in fp32, about twice the model states; the third is smallest
# and least precise. Choose the first by default; the second when memory allows and the extra
# collectives matter (many small adapters, a slow network); the third only with a reason. (Norms
# trained beside the adapters are not in `peft`'s adapter file unless declared in `modules_to_save`:
# `get_peft_model_state_dict` in `peft/utils/save_and_load.py` keeps the tuner's own tensors and the
# `modules_to_save` wrappers'.)
#
# (lora-traffic)=
# ## The frozen base still travels
#
# Freezing a weight removes its gradient, not its all-gather: FSDP2 gathers every unit's parameters
# for forward, and, with `reshard_after_forward=True`, again for backward (the input gradient needs
# the weight, frozen or not). Under gradient accumulation that traffic is paid every micro-batch.
# Below, 4 micro-batches per optimizer step. Each rank counts, with
# {func}`fsdp_guide.precision.record_dtypes` (which sees every collective FSDP runs), its
# all-gathers and the bytes of the buffers they fill (a rank holds 1/N of each already and receives
# the rest), and its gradient reductions; and, with {func}`fsdp_guide.memory.measure`, the parameter
# memory it holds (shards and gathered copies): the most in forward (read as each unit starts, after
# FSDP has gathered it, and when forward ends and backward begins), and between micro-batches.
#
# - `reshard_after_forward=True` for every unit ({func}`fsdp_guide.hf.from_pretrained`'s default):
#   gathered in forward, again in backward (FSDP2's own default, `None`, does this for every unit
#   but the root, whose embedding and output layer stay gathered until backward: the `fully_shard`
#   docstring in `torch/distributed/fsdp/_fully_shard/_fully_shard.py`);
# - `reshard_after_forward=False`: gathered once per micro-batch, kept from forward to backward;
# - `False`, and kept gathered across the micro-batches too (`set_reshard_after_backward(False)`
#   until the last one): gathered once per optimizer step;
# - replicated: every rank holds the whole base as its "shard" (a 2-D mesh whose shard dimension has
#   size 1, i.e. HSDP with nothing to shard), kept from forward to backward. Over a shard group of
#   one rank FSDP2 runs no all-gather but copies each unit's parameters into a new unsharded buffer
#   (`FSDPParamGroup.unshard` and `wait_for_unshard`, their `world_size == 1` branches,
#   `torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py`).
#
# (fsdp2-fsdpmodule-set-reshard-after-backward)=

# %%
MICRO = 4


def accumulation_traffic(path, mode):
    import fsdp_guide
    import torch
    import torch.distributed as dist
    from fsdp_guide.hf import from_pretrained
    from fsdp_guide.memory import measure
    from fsdp_guide.precision import record_dtypes
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    device, world = fsdp_guide.device(), dist.get_world_size()
    if mode == "replicated":  # HSDP: replicated over the first dimension, "sharded" over 1 rank
        mesh = init_device_mesh(device.type, (world, 1), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,))
    model = from_pretrained(
        path,
        dtype=torch.float32,
        mesh=mesh,
        adapt=add_lora,
        reshard_after_forward=mode == "reshard after forward",
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    most = [0]

    def held_now(*_):  # parameter bytes held: shards and gathered copies
        most[0] = max(most[0], measure(model).params)

    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            # runs after FSDP's own, which gathers the unit
            unit.register_forward_pre_hook(held_now)
    tokens = torch.randint(
        0, 4096, (MICRO, 2, 64), generator=torch.Generator().manual_seed(dist.get_rank())
    )
    for _ in range(2):  # the second step is the one measured: the first sets FSDP up
        gathered, gathers, reductions, in_forward, between = [], 0, 0, 0, []
        for micro in range(MICRO):
            last = micro == MICRO - 1
            # adapters: reduce their gradients once, at the end
            model.set_requires_gradient_sync(last)
            if mode == "kept gathered across micro-batches":
                model.set_reshard_after_backward(last)
            batch = tokens[micro].to(device)
            most[0] = 0
            with record_dtypes() as seen:
                loss = model(input_ids=batch, labels=batch).loss
                held_now()  # the end of forward: what backward starts with
                loss.backward()
            gathered.append(
                sum(seen.nbytes[(phase, "all-gather")] for phase in ("forward", "backward"))
            )
            gathers += sum(seen.count[(phase, "all-gather")] for phase in ("forward", "backward"))
            reductions += (
                seen.count[("backward", "reduce-scatter")] + seen.count[("backward", "all-reduce")]
            )
            in_forward = max(in_forward, most[0])
            between.append(measure(model).params)
        optimizer.step()
        optimizer.zero_grad()
    base = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    held = {"in forward": in_forward, "between": max(between[:-1])}
    return dict(gathered=gathered, gathers=gathers, reductions=reductions, base=base) | held


modes = [
    "reshard after forward",
    "kept from forward to backward",
    "kept gathered across micro-batches",
    "replicated",
]
traffic = {
    mode: launch(accumulation_traffic, path, mode, world_size=2, output="none")[0] for mode in modes
}
base_mib = traffic["replicated"]["base"] / 2**20
print(
    f"frozen base: {base_mib:.2f} MiB in fp32. On rank 0, in base sizes: the bytes its all-gathers"
    f" filled in micro-batches 1 to {MICRO} and per step; the parameters it held"
)
rows = []
for mode, r in traffic.items():
    per_micro = [b / r["base"] for b in r["gathered"]]
    gathered = [f"{x:.2f}" for x in [*per_micro, sum(per_micro)]]
    held = [f"{r[when] / r['base']:.2f}" for when in ("in forward", "between")]
    rows.append([mode, *gathered, r["gathers"], r["reductions"], *held])
header = ["mode", *map(str, range(1, MICRO + 1)), "per step", "all-gathers", "reductions"]
display(Table([*header, "held in forward", "held between"], rows))
resharded, kept = traffic["reshard after forward"], traffic["kept from forward to backward"]
# micro-batch 1
glue("frozen_resharded_gathered", resharded["gathered"][0] / resharded["base"], display=False)
glue("frozen_resharded_held", resharded["in forward"] / resharded["base"], display=False)
glue("frozen_kept_gathered", kept["gathered"][0] / kept["base"], display=False)
glue("frozen_kept_held", kept["in forward"] / kept["base"], display=False)
replicated = traffic["replicated"]
glue("frozen_replicated_held", replicated["in forward"] / replicated["base"], display=False)
# per micro-batch (the table: per step)
glue("frozen_resharded_gathers", resharded["gathers"] // MICRO, display=False)
glue("frozen_reductions", resharded["reductions"], display=False)

# %% [markdown]
# Read it per micro-batch (this text's figures are this run's, glued from the output above;
# JupyterLab shows glue's roles unrendered). Resharding after forward gathers the whole base twice
# per micro-batch ({glue:text}`frozen_resharded_gathered:.2f` base sizes, forward and backward; the
# rank already held half of each buffer), in {glue:text}`frozen_resharded_gathers` all-gathers (5
# units, forward and backward), and holds the least in forward
# ({glue:text}`frozen_resharded_held:.2f`): its shards, the root (embedding and output layer) and
# one layer gathered at a time. Keeping the base from forward to backward halves the traffic
# ({glue:text}`frozen_kept_gathered:.2f`) and holds the whole base gathered beside the shards when
# forward ends ({glue:text}`frozen_kept_held:.2f`); keeping it across the micro-batches pays once
# per step, and holds those {glue:text}`frozen_kept_held:.2f` between micro-batches too. Replicated,
# nothing is all-gathered, but a rank holds the base twice when forward ends
# ({glue:text}`frozen_replicated_held:.2f`: its whole "shard" and FSDP's unsharded copy), more than
# the sharded base kept gathered; between micro-batches, once. The reductions column is the same in
# every mode by construction (`set_requires_gradient_sync(last)` in each): it shows only that FSDP
# honours the flag, {glue:text}`frozen_reductions` per optimizer step, one per unit holding adapters
# (the 4 layers, not the root); all-reduces over the replicate dimension when replicated, else
# reduce-scatters (`foreach_reduce` in `torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py`
# copies instead of reduce-scattering over a shard group of one rank).
#
# **The rule**: a frozen base costs memory *or* traffic, never neither. If the whole base fits on
# each rank next to the activations and its own shard, keep it gathered for the accumulation window;
# replicating it with FSDP (a shard group of one rank) saves the one gather per step but holds the
# base twice from forward to backward. If it does not fit, `reshard_after_forward=False` for the
# layers you can afford, and accept one gather per micro-batch; resharding every unit after forward
# is for the model that fits only sharded. In every mode, reduce the adapters' gradients once per
# step (`set_requires_gradient_sync(False)` until the last micro-batch).

# %% [markdown]
# (frozen-weights-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/frozen_weights.py`.
# Each block of its model is a frozen bf16 weight and a pair of trainable fp32 low-rank adapters,
# one FSDP unit per block. Rank 0 prints whether the first forward runs with the adapters alone
# trainable (it does), and with a bf16 norm weight trained beside them (FSDP's dtype error); then,
# on fp32 blocks, the bytes the all-gathers fill per micro-batch, in sizes of the frozen weights,
# with `reshard_after_forward=True` and `False`. The tests (2 CPU ranks, `tests/test_scripts.py`)
# check the two outcomes, and that the frozen weights are gathered about twice per micro-batch
# resharded after forward and about once kept.
#
# ```{literalinclude} scripts/frozen_weights.py
# :language: python
# ```

# %% [markdown]
# (frozen-weights-tips)=
# ## The tips behind this
#
# - {ref}`tip-lora-dtypes`
# - {ref}`tip-frozen-weight-traffic`

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("frozen_weights")
