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
# # LoRA on a sharded model
#
# **What you will learn**
#
# - how to add LoRA adapters with `peft` to a pretrained model and shard it with FSDP2,
#   and what each rank then holds, measured against full fine-tuning and against
#   {func}`fsdp_guide.memory.estimate`;
# - that LoRA training on 2 ranks computes what one process computes;
# - how to export the adapters in `peft`'s format, and a merged model, and reload both in
#   one process.
#
# What frozen weights constrain and cost under FSDP2 (one dtype among a unit's trainable
# parameters; the all-gathers of a frozen base) is {ref}`tutorial-frozen-weights`.
#
# **What you need**: a CPU; 2 processes on gloo; `transformers`, `safetensors` and `peft`
# (the package's `test` or `docs` extras); about 10 seconds on 2 CPU cores ({ref}`measured <measured-times>`). Nothing is
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
from fsdp_guide.table import Table
from IPython.display import display


def one_step_states(path, lora, dtype):
    import fsdp_guide
    import torch
    import torch.distributed as dist
    from fsdp_guide.hf import from_pretrained
    from fsdp_guide.memory import measure

    given = []  # what adapt is called on, each time

    def adapt(model):  # add_lora, recording what each call is given
        given.append(parameters_of(model, path))
        return add_lora(model)

    torch.manual_seed(0)
    model = from_pretrained(path, dtype=dtype, adapt=adapt if lora else None)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    tokens = torch.randint(
        0, 4096, (2, 64), generator=torch.Generator().manual_seed(dist.get_rank())
    )
    tokens = tokens.to(fsdp_guide.device())
    model(input_ids=tokens, labels=tokens).loss.backward()  # the first step sets FSDP up
    optimizer.step()
    return {
        "states": measure(model, optimizer),
        "all DTensors": all(hasattr(p, "to_local") for p in model.parameters()),
        "params": sum(p.numel() for p in model.parameters()),
        "trainable": sum(p.numel() for p in trainable),
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
print("\nfp32 model states on rank 0 after one AdamW step, MiB:")
rows = []
for how, ranks in fp32.items():
    s = ranks[0]["states"]
    rows.append([how, *(f"{x / 2**20:.2f}" for x in (s.params, s.grads, s.optimizer, s.total))])
display(Table(["fine-tuning", "params", "grads", "optimizer", "total"], rows))
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
# model, and gathers the other half for every forward ({ref}`lora-traffic` counts it). What changes
# is the rest. The frozen base has no gradients and no optimizer state;
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
pairs = enumerate(zip(sharded_losses, single_losses))
rows = [[step, f"{a:.6f}", f"{b:.6f}"] for step, (a, b) in pairs]
display(Table(["step", "loss, 2 ranks", "loss, 1 process"], rows))
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
# - {ref}`tip-check-against-one-process`: the losses above.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("lora")
