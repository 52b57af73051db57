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
# (tutorial-lora)=
# # LoRA and frozen weights with FSDP2
#
# **What you will learn**
#
# - how to add LoRA adapters with `peft` to a pretrained model and shard it with FSDP2,
#   and what each rank then holds, measured against full fine-tuning and against
#   {func}`fsdp_guide.memory.estimate`;
# - FSDP2's dtype rule: the trainable parameters of a unit share one dtype, so fp32
#   adapters on a frozen bf16 base are fine, but not beside trained bf16 weights; three
#   fixes, each executed, with what it costs;
# - how many bytes the frozen base is all-gathered per micro-batch under gradient
#   accumulation with `reshard_after_forward=True`, `False`, kept gathered across
#   micro-batches, and replicated instead of sharded, what each holds in forward and
#   between micro-batches, and how to choose;
# - that LoRA training on 2 ranks computes what one process computes;
# - how to export the adapters in `peft`'s format, and a merged model, and reload both in
#   one process.
#
# **What you need**: a CPU; 2 processes on gloo; `transformers`, `safetensors` and `peft`
# (the package's `test` or `docs` extras); about 25 seconds on 2 CPU cores ({ref}`measured <measured-times>`). Nothing is
# downloaded: the "pretrained" model is a small Llama built from a config with a fixed
# seed, as in {ref}`tutorial-finetune-hf`. The worker code is written to run unchanged with
# one GPU per rank (NCCL): the shards live on {func}`fsdp_guide.device`. The tips are
# listed {ref}`at the end <lora-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`lora-script` ({download}`download <scripts/lora.py>`).

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
# ## A pretrained model, and the adapters
#
# A Llama with 4 decoder layers, saved in bf16 as checkpoints on the Hub are. `add_lora` is
# what every rank will apply: rank-8 LoRA on the attention's query and value projections,
# `peft`'s defaults otherwise (`A` random, `B` zero, so training starts from the
# pretrained model's outputs: `LoraLayer.reset_lora_parameters` in
# `peft/tuners/lora/layer.py`).

# %%
from transformers import LlamaConfig, LlamaForCausalLM

scratch = tempfile.TemporaryDirectory()  # deleted, with what the page wrote, when the kernel exits
workdir = Path(scratch.name)
path = workdir / "llama"
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


def add_lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    )


print(sorted(f.name for f in path.iterdir()))

# %% [markdown]
# (lora-memory)=
# ## LoRA, then shard: what each rank holds
#
# {func}`fsdp_guide.hf.from_pretrained` takes the function as `adapt`: it builds the model
# on the `meta` device, applies `add_lora` *before* sharding (to a CPU copy of that
# structure, allocated but never written, because `peft`'s initialisers need real tensors:
# `_adapted` in `src/fsdp_guide/hf.py`; `fully_shard` manages the
# parameters the module holds when it is called, `_get_managed_states` in
# `torch/distributed/fsdp/_fully_shard/_fsdp_init.py`: adapters added afterwards would be
# neither sharded nor reduced), shards every decoder layer and the root, and loads the
# pretrained weights into the base. The adapters start from rank 0's values, which rank 0
# makes as one process would: it loads the whole pretrained model with `transformers`, in
# the dtype asked for, on its CPU, and runs `adapt` on it (`_added_values` in
# `src/fsdp_guide/hf.py`). The worker records every call of `adapt`. One optimizer step
# later, {func}`fsdp_guide.memory.measure` counts the model states each rank holds; full
# fine-tuning of the same model is measured the same way.

# %%
from fsdp_guide import launch
from fsdp_guide.compare import largest_difference


def one_step_states(path, lora, dtype, mp_policy=None, cast_adapters=False, train_norms=False):
    import fsdp_guide
    import torch
    import torch.distributed as dist
    from fsdp_guide.hf import from_pretrained
    from fsdp_guide.memory import measure
    from fsdp_guide.precision import record_dtypes
    from torch.distributed.fsdp import FSDPModule

    given = []  # what adapt is called on, each time

    def adapt(model):  # LoRA as add_lora adds it; the variants of the dtype section below
        from peft import LoraConfig, get_peft_model

        given.append(parameters_of(model, path))  # for the page: what each call is given
        config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
        model = get_peft_model(model, config, autocast_adapter_dtype=not cast_adapters)
        # optionally the RMSNorm weights too, in the base's dtype
        for name, p in model.named_parameters():
            p.requires_grad_(p.requires_grad or (train_norms and "norm" in name))
        return model

    torch.manual_seed(0)
    model = from_pretrained(path, dtype=dtype, mp_policy=mp_policy, adapt=adapt if lora else None)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    tokens = torch.randint(
        0, 4096, (2, 64), generator=torch.Generator().manual_seed(dist.get_rank())
    )
    tokens = tokens.to(fsdp_guide.device())
    model(input_ids=tokens, labels=tokens).loss.backward()  # the first step sets FSDP up
    optimizer.step()
    optimizer.zero_grad()
    with record_dtypes() as seen:
        model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    dtypes = lambda ps: "/".join(sorted({str(p.dtype).removeprefix("torch.") for p in ps}))  # noqa: E731
    return {
        "states": measure(model, optimizer),
        "all DTensors": all(hasattr(p, "to_local") for p in model.parameters()),
        "params": sum(p.numel() for p in model.parameters()),
        "trainable": sum(p.numel() for p in trainable),
        "frozen dtype": dtypes(p for p in model.parameters() if not p.requires_grad),
        "trainable dtype": dtypes(trainable),
        "units": sum(isinstance(m, FSDPModule) for m in model.modules()),
        "gathers": seen.count[("forward", "all-gather")],
        "adapt given": given,
    }


def parameters_of(model, path):
    """The bytes, dtype and device of model's parameters, and whether it holds the pretrained embedding."""
    import torch
    from safetensors import safe_open

    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        saved = f.get_tensor("model.embed_tokens.weight")
    embedding = model.get_input_embeddings().weight
    return (
        sum(p.numel() * p.element_size() for p in model.parameters()),
        str(embedding.dtype).removeprefix("torch."),
        embedding.device.type,
        torch.equal(embedding, saved.to(embedding.dtype)),
    )


fp32 = {
    "full fine-tuning": launch(
        one_step_states, path, False, torch.float32, world_size=2, output="none"
    ),
    "LoRA": launch(one_step_states, path, True, torch.float32, world_size=2, output="none"),
}
lora = fp32["LoRA"][0]
print(
    f"LoRA: {lora['params'] / 1e6:.2f}M parameters, {lora['trainable']:,} trainable "
    f"({lora['trainable'] / lora['params']:.2%}); every parameter sharded (a DTensor): {lora['all DTensors']}"
)
print(
    f"\nfp32 model states on rank 0 after one AdamW step, MiB: {'params':>7} {'grads':>7} {'optimizer':>9} "
    f"{'total':>7}"
)
for how, ranks in fp32.items():
    s = ranks[0]["states"]
    print(
        f"{how:50} {s.params / 2**20:7.2f} {s.grads / 2**20:7.2f} {s.optimizer / 2**20:9.2f} "
        f"{s.total / 2**20:7.2f}"
    )
print("\nwhat adapt was called on, each time, per rank (the model without its adapters):")
for rank, r in enumerate(fp32["LoRA"]):
    for nbytes, dtype, where, pretrained in r["adapt given"]:
        print(
            f"rank {rank}: {nbytes / 2**20:5.2f} MiB of {dtype} parameters on the {where}; "
            f"the pretrained weights: {pretrained}"
        )

# the figures the text quotes, from this run (JupyterLab shows glue's roles unrendered)
from myst_nb import glue

glue(
    "lora_loaded_mib",
    next(n for n, _, _, pretrained in lora["adapt given"] if pretrained) / 2**20,
    display=False,
)
glue("lora_kept_mib", lora["states"].params / 2**20, display=False)

# %% [markdown]
# The figures in this text are this run's, taken from the outputs by myst-nb's `glue`; in
# JupyterLab, which does not render glue's roles, read them from the output above each paragraph.
#
# `adapt` ran once on each rank on the model's structure (its parameters allocated, never
# loaded), and once more on rank 0, on the whole pretrained model in fp32 on the CPU:
# {glue:text}`lora_loaded_mib:.2f` MiB, about twice the {glue:text}`lora_kept_mib:.2f` MiB
# of parameters a rank keeps. That is the full copy
# {ref}`tutorial-finetune-hf` measures when every rank loads the model, here on rank 0 alone,
# briefly (only the adapters' values are kept from it): a base that does not fit in rank 0's
# CPU memory in the loading dtype cannot be loaded this way. LoRA's own initial values do
# not depend on the weights (`A` from the random generator, `B` zeros:
# `LoraLayer.reset_lora_parameters` in `peft/tuners/lora/layer.py`); methods that compute
# them from the weights (DoRA, PiSSA) need the loaded model.
#
# With LoRA every parameter is still sharded, frozen or not: each rank keeps half the
# model. What changes is the rest. The frozen base has no gradients and no optimizer state;
# only the adapters, under 1% of the parameters, have both. Full fine-tuning with AdamW holds four
# copies of the model's bytes (parameters, gradients, two moments); LoRA holds one, plus
# three copies of the adapters.
#
# {func}`fsdp_guide.memory.estimate` predicts this if you give it the two parts as what
# they are: the adapters as a model that trains, the base as parameters only.

# %%
from fsdp_guide.memory import estimate

adapters = estimate(lora["trainable"], 2, "FULL_SHARD", optimizer="adamw")
base = estimate(lora["params"] - lora["trainable"], 2, "FULL_SHARD", optimizer="adamw").params
full = fp32["full fine-tuning"][0]["params"]  # the model without adapters
predicted = {
    "full fine-tuning": estimate(full, 2, "FULL_SHARD", optimizer="adamw").total,
    "LoRA": base + adapters.total,
}
for how, ranks in fp32.items():
    measured = ranks[0]["states"].total
    print(
        f"{how:17} measured {measured / 2**20:6.2f} MiB, estimated {predicted[how] / 2**20:6.2f} MiB "
        f"({measured / predicted[how] - 1:+.1%})"
    )

# %% [markdown]
# (lora-dtypes)=
# ## The dtype rule: one dtype among a unit's trainable parameters
#
# Many models on the Hub are stored in bf16, and `peft` keeps the adapters it adds in fp32
# (`autocast_adapter_dtype=True`, its default), because adapters trained in bf16 lose small
# updates. FSDP2 all-gathers parameters of any dtypes together (as bytes, when they differ:
# `_get_all_gather_input_metadatas` in
# `torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py`), but it
# reduce-scatters a unit's gradients in one dtype: at the root's first forward (FSDP2's lazy
# initialisation) it checks, for every unit, that the unit's *trainable* parameters share
# one dtype, and raises `FSDP expects uniform original parameter dtype` if not
# (`FSDPParamGroup._init_mp_dtypes` in
# `torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py`; frozen parameters are left
# out of the check). So a frozen bf16 base with fp32 adapters is fine in one unit; training
# anything of the base beside them (here the RMSNorm weights, a common LoRA variant; or
# `peft`'s `modules_to_save`) is not. Each decoder layer is one unit below:


# %%
def first_forward(train_norms):
    import fsdp_guide
    import torch
    from peft import LoraConfig, get_peft_model
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
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():
        p.requires_grad_(p.requires_grad or (train_norms and "norm" in name))
    layer = model.base_model.model.model.layers[0]
    trainable = sorted(
        str(dtype) for dtype in {p.dtype for p in layer.parameters() if p.requires_grad}
    )
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
# Three ways out, each run below on the bf16 checkpoint with the norms trained, with the
# same one-step measurement (and, first, plain LoRA on the frozen bf16 base, for scale):
#
# 1. **Adapters in units of their own.** Each adapter module is `fully_shard`ed before its
#    decoder layer, so the layer's unit trains the bf16 norms only and each adapter unit
#    its fp32 adapter. {func}`fsdp_guide.hf.from_pretrained` does this by itself when
#    `adapt` adds trainable parameters in a dtype no other trainable parameter has. The
#    cost: one more (small) all-gather per adapter in forward and reduce-scatter in
#    backward, and the norms train in bf16.
# 2. **One storage dtype, a mixed-precision policy for compute.** Store everything in fp32
#    and let `MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`
#    cast each unit's gathered parameters to bf16 for compute and reduce gradients in fp32.
#    The cost: the frozen base is stored in fp32, twice its bf16 bytes, for a base that
#    never changes.
# 3. **Cast the adapters to bf16** (`get_peft_model(..., autocast_adapter_dtype=False)`):
#    one dtype, no extra units, the smallest memory. The cost: the adapters, their
#    gradients and AdamW's moments in bf16, whose 8 significant bits (7 stored) round away
#    any update smaller than 1/512 to 1/256 of the weight, depending on its value (the
#    last line below: an update of 1/300 is lost).
#
# Upcasting only the norms to fp32 is not a fourth way with this model: Llama's RMSNorm
# returns `weight * hidden_states.to(input_dtype)` (`LlamaRMSNorm.forward` in
# `transformers/models/llama/modeling_llama.py`), so an fp32 weight turns the hidden states
# fp32, and the next bf16 linear layer refuses them.

# %%
from torch.distributed.fsdp import MixedPrecisionPolicy

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
    fix: launch(one_step_states, path, True, world_size=2, output="none", **options)[0]
    for fix, options in fixes.items()
}
print(
    f"{'':32} {'frozen':>8} {'trained':>16} {'units':>5} {'all-gathers per forward':>23} "
    f"{'rank 0 model states, MiB':>25}"
)
for fix, r in fixed.items():
    print(
        f"{fix:32} {r['frozen dtype']:>8} {r['trainable dtype']:>16} {r['units']:5} {r['gathers']:23} "
        f"{r['states'].total / 2**20:25.2f}"
    )
weight, update = torch.tensor(1.0), torch.tensor(1 / 300)  # an update of 1/300 of a weight
print(
    f"\n1 + 1/300 = {(weight + update).item():.4f} in fp32, {(weight.to(bf16) + update.to(bf16)).item():.4f} in bf16"
)

# %% [markdown]
# All four run the training step. Plain LoRA keeps one unit per layer even with fp32 adapters on the bf16
# base. With the norms trained, the first fix adds a unit per adapter module (2
# projections × `A`, `B` × 4 layers: the units column), each one more all-gather per forward, and keeps the
# memory of bf16; the second stores the base in fp32, about twice the model states; the
# third is smallest and least precise. Choose the first by default; the second when
# memory allows and the extra collectives matter (many small adapters, a slow network);
# the third only with a reason. (Norms trained beside the adapters are not in `peft`'s
# adapter file unless declared in `modules_to_save`: `get_peft_model_state_dict` in
# `peft/utils/save_and_load.py` keeps the tuner's own tensors and the `modules_to_save`
# wrappers'.)
#
# (lora-traffic)=
# ## The frozen base still travels
#
# Freezing a weight removes its gradient, not its all-gather: FSDP2 gathers every unit's
# parameters for forward, and, with `reshard_after_forward=True`, again for backward (the
# input gradient needs the weight, frozen or not). Under gradient accumulation that
# traffic is paid every micro-batch. Below, 4 micro-batches per optimizer step. Each rank
# counts, with {func}`fsdp_guide.precision.record_dtypes` (which sees every collective FSDP
# runs), its all-gathers and the bytes of the buffers they fill (a rank holds 1/N of each
# already and receives the rest), and its gradient reductions; and, with
# {func}`fsdp_guide.memory.measure`, the parameter memory it holds (its shards, and the
# gathered copies): the most during forward (read as each unit starts, after FSDP has
# gathered it, and at the end of forward, when backward begins), and between micro-batches.
#
# - `reshard_after_forward=True` for every unit ({func}`fsdp_guide.hf.from_pretrained`'s
#   default): gathered in forward, again in backward (FSDP2's own default, `None`, does this
#   for every unit but the root, whose embedding and output layer stay gathered until
#   backward: the `fully_shard` docstring in `torch/distributed/fsdp/_fully_shard/_fully_shard.py`);
# - `reshard_after_forward=False`: gathered once per micro-batch, kept from forward to
#   backward;
# - `False`, and kept gathered across the micro-batches too (`set_reshard_after_backward(False)`
#   until the last one): gathered once per optimizer step;
# - replicated: every rank holds the whole base as its "shard" (a 2-D mesh whose shard
#   dimension has size 1, i.e. HSDP with nothing to shard), kept from forward to backward.
#   For a shard group of one rank FSDP2 runs no all-gather; it copies each unit's
#   parameters into a new unsharded buffer instead (`FSDPParamGroup.unshard` and
#   `wait_for_unshard`, their `world_size == 1` branches, in
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
    return {
        "gathered": gathered,
        "gathers": gathers,
        "reductions": reductions,
        "base": base,
        "in forward": in_forward,
        "between": max(between[:-1]),
    }


modes = [
    "reshard after forward",
    "kept from forward to backward",
    "kept gathered across micro-batches",
    "replicated",
]
traffic = {
    mode: launch(accumulation_traffic, path, mode, world_size=2, output="none")[0] for mode in modes
}
print(
    f"frozen base: {traffic['replicated']['base'] / 2**20:.2f} MiB in fp32. On rank 0, in base sizes: the bytes "
    f"its all-gathers filled; the parameters it held"
)
print(
    f"{'micro-batch:':36} {'':5}"
    + "".join(f"{i:5}" for i in range(1, MICRO + 1))
    + f" {'per step':>9} {'all-gathers':>11} {'reductions':>10} {'held: in forward':>16} {'between':>7}"
)
for mode, r in traffic.items():
    per_micro = [b / r["base"] for b in r["gathered"]]
    print(
        f"{mode:36} {'':>5}" + "".join(f"{x:5.2f}" for x in per_micro) + f" {sum(per_micro):9.2f} "
        f"{r['gathers']:11} {r['reductions']:10} {r['in forward'] / r['base']:16.2f} {r['between'] / r['base']:7.2f}"
    )
resharded, kept = traffic["reshard after forward"], traffic["kept from forward to backward"]
# micro-batch 1
glue("lora_resharded_gathered", resharded["gathered"][0] / resharded["base"], display=False)
glue("lora_resharded_held", resharded["in forward"] / resharded["base"], display=False)
glue("lora_kept_gathered", kept["gathered"][0] / kept["base"], display=False)
glue("lora_kept_held", kept["in forward"] / kept["base"], display=False)
glue(
    "lora_replicated_held",
    traffic["replicated"]["in forward"] / traffic["replicated"]["base"],
    display=False,
)
# per micro-batch (the table: per step)
glue("lora_resharded_gathers", resharded["gathers"] // MICRO, display=False)
glue("lora_reductions", resharded["reductions"], display=False)

# %% [markdown]
# Read it per micro-batch. Resharding after forward gathers the whole base twice per
# micro-batch ({glue:text}`lora_resharded_gathered:.2f` base sizes, forward and backward; of each gathered buffer the rank
# already held half), in {glue:text}`lora_resharded_gathers` all-gathers (5 units, forward and backward), and holds the
# least in forward ({glue:text}`lora_resharded_held:.2f`): its shards, the root (embedding and output layer) and one layer
# gathered at a time. Keeping the base from forward to backward halves the traffic ({glue:text}`lora_kept_gathered:.2f`),
# and holds the whole base gathered beside the shards when forward ends ({glue:text}`lora_kept_held:.2f`). Keeping it
# across the micro-batches pays it once per step, and holds those {glue:text}`lora_kept_held:.2f` between micro-batches
# too. Replicated, nothing is all-gathered, but a rank holds the base twice when forward ends
# ({glue:text}`lora_replicated_held:.2f`: its whole "shard" and FSDP's unsharded copy of it), more than the sharded base kept
# gathered; between micro-batches, once. The reductions column is the same in every mode by
# the worker's construction (`set_requires_gradient_sync(last)` in each): it shows only that
# FSDP honours the flag, {glue:text}`lora_reductions` per optimizer step, one per unit that holds adapters (the 4
# layers, not the root); the replicated mode's are all-reduces over the replicate
# dimension, the others' reduce-scatters (`foreach_reduce` in
# `torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py` copies instead of
# reduce-scattering over a shard group of one rank).
#
# **The rule**: a frozen base costs memory *or* traffic, never neither. If the whole base
# fits on each rank next to the activations and its own shard, keep it gathered for the
# accumulation window; replicating it with FSDP (a shard group of one rank) saves the one
# gather per step but holds the base twice from forward to backward. If it does not fit, `reshard_after_forward=False`
# for the layers you can afford, and accept one gather per micro-batch; resharding every
# unit after forward is for the model that fits only sharded. In every mode, reduce the
# adapters' gradients once per step (`set_requires_gradient_sync(False)` until the last
# micro-batch).
#
# ## LoRA on 2 ranks computes what one process computes
#
# Five AdamW steps of LoRA on 2 ranks, each on half of the batch, against `peft` on the
# whole model in one process. The ranks are seeded differently (0 and 1) and the one process
# like rank 0: {func}`fsdp_guide.hf.from_pretrained` gives every rank rank 0's adapters, so
# the runs agree only if it does.

# %%
STEPS = 5
batch = torch.randint(0, 4096, (4, 32), generator=torch.Generator().manual_seed(1))


def train_lora(path, batch, out):
    import fsdp_guide
    import torch
    import torch.distributed as dist
    from fsdp_guide.hf import from_pretrained, save_pretrained

    device = fsdp_guide.device()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)  # seeded apart: every rank still starts from rank 0's adapters
    model = from_pretrained(path, dtype=torch.float32, adapt=add_lora)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    mine = batch[rank::world].to(device)
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(mean := loss.detach().clone(), op=dist.ReduceOp.AVG)
        losses.append(mean.item())
    save_pretrained(model, out)  # a peft model: its adapters, in peft's format
    with torch.no_grad():
        logits = model(input_ids=batch.to(device)).logits
    return losses, logits.cpu()


adapter_dir = workdir / "adapter"
(sharded_losses, sharded_logits), _ = launch(
    train_lora, path, batch, adapter_dir, world_size=2, output="none"
)

from transformers import AutoModelForCausalLM

torch.manual_seed(0)  # rank 0's seed
single = add_lora(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
optimizer = torch.optim.AdamW([p for p in single.parameters() if p.requires_grad], lr=1e-2)
single_losses = []
for _ in range(STEPS):
    loss = single(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    single_losses.append(loss.item())
print("step  2 ranks      1 process")
for step, (a, b) in enumerate(zip(sharded_losses, single_losses)):
    print(f"{step:4}  {a:.6f}  {b:.6f}")
print(
    f"largest relative difference: {largest_difference(zip(sharded_losses, single_losses), relative=True):.0e}"
)

# %% [markdown]
# The same losses to fp32 rounding: the base is frozen, the adapters move the same way on
# 2 ranks as in one process.
#
# (lora-export)=
# ## Export: the adapters, and a merged model
#
# {func}`fsdp_guide.hf.save_pretrained` on a `peft` model gathers only the tensors `peft`
# saves (`get_peft_model_state_dict`: here the adapters, not the frozen base) to rank 0 and
# writes them with `peft`'s own `save_pretrained` ({glue:text}`lora_adapter_file_kib:.0f` KiB below: the
# {glue:text}`lora_trainable:,` fp32 adapter values are {glue:text}`lora_adapter_kib:.0f` KiB): a directory `PeftModel.from_pretrained` loads onto the base. Merging
# the adapters into the base weights is `peft`'s `merge_and_unload`, done once, in one
# process, on the reloaded model; the result is an ordinary `transformers` model.

# %%
from peft import PeftModel

adapter_kib = (adapter_dir / "adapter_model.safetensors").stat().st_size / 2**10
print(
    "adapter directory:", sorted(f.name for f in adapter_dir.iterdir()), f"({adapter_kib:.0f} KiB)"
)
glue("lora_adapter_file_kib", adapter_kib, display=False)
glue("lora_trainable", lora["trainable"], display=False)  # printed with the parameter counts above
glue("lora_adapter_kib", lora["trainable"] * 4 / 2**10, display=False)  # fp32: 4 bytes a value
reloaded = PeftModel.from_pretrained(
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), adapter_dir
)
with torch.no_grad():
    logits = reloaded(input_ids=batch).logits
print(
    "base + reloaded adapters: logits equal the sharded model's:",
    torch.equal(logits, sharded_logits),
    f"(largest difference {(logits - sharded_logits).abs().max().item():.1e})",
)

merged_dir = workdir / "merged"
reloaded.merge_and_unload().save_pretrained(merged_dir)
merged = AutoModelForCausalLM.from_pretrained(merged_dir)
with torch.no_grad():
    merged_logits = merged(input_ids=batch).logits
print(
    "merged model, loaded by transformers alone:",
    type(merged).__name__,
    f"largest difference from the sharded model's logits {(merged_logits - sharded_logits).abs().max().item():.1e}",
)

# %% [markdown]
# The adapters reload to the same numbers (here, on the CPU like the ranks; with the ranks
# on GPUs and the reload on the CPU, the kernels differ, and the logits are expected to
# differ by rounding). With each weight stored as `torch.nn.Linear` stores it (out × in),
# the merged model computes `x (W + sBA)ᵀ`, with `s = lora_alpha / r = 2`, where the adapted
# one computes `xWᵀ + s(xAᵀ)Bᵀ`: the same function, rounded in another order, hence differences at fp32's
# last digits rather than none.

# %% [markdown]
# (lora-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch, `transformers` and `peft`:
# {download}`scripts/lora.py`. Every rank builds the same small Llama, adds the adapters, then
# shards it, one unit per decoder layer and the root, and trains the adapters alone on its slice
# of the batch; rank 0 prints how many parameters train (all of them shards), then the largest
# relative difference from the same training in one process. The tests run this file under
# torchrun on 2 CPU ranks and check that every trainable parameter is a shard and that the
# difference is at most 1e-5, the page's "fp32 rounding" (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/lora.py
# :language: python
# ```

# %% [markdown]
# (lora-tips)=
# ## The tips behind this
#
# - {ref}`tip-lora-before-sharding`
# - {ref}`tip-lora-dtypes`
# - {ref}`tip-frozen-weight-traffic`
# - {ref}`tip-check-against-one-process`: the losses above.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("lora")
