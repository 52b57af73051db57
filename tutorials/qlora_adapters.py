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
# (tutorial-qlora-adapters)=
# # QLoRA: save the adapters from shards, merge them without losing them
#
# **What you will learn**: how to save the LoRA adapters of a model trained under FSDP2 so
# that one process loads them back into the trained model (every rank's slice of each
# adapter, gathered), what the two tempting shortcuts do instead, and why merging the adapters
# into the 4-bit base loses part of what training learned while merging into the base
# dequantised first does not.
#
# **What you need**: a CPU; 2 processes on gloo; `transformers`, `peft` and `bitsandbytes`
# (the package's `test` or `docs` extras); about 10 seconds on 2 CPU cores
# ({ref}`measured <measured-times>`). The model, its 4-bit loading and its sharding are those
# of {ref}`tutorial-qlora`, here with every unquantised tensor in fp32 so that the comparisons
# below are exact where they should be; nothing is downloaded. The worker code is written to
# run unchanged with one GPU per rank (NCCL), but no GPU run of it is recorded. The tips are
# listed {ref}`at the end <qlora-adapters-tips>`. Its idea as a plain torchrun script to copy:
# {ref}`qlora-adapters-script` ({download}`download <scripts/qlora_adapters.py>`).

# %%
import logging
import os
import sys
import tempfile
import warnings
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing is downloaded
warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm's notebook import
# peft 0.21 asks transformers 5 a deprecated question; the ranks' warnings come back here
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")
# safetensors reads a tensor's storage by torch's deprecated TypedStorage; the ranks' warnings come back here
warnings.filterwarnings("ignore", message="TypedStorage is deprecated")

from fsdp_guide.fp8 import quiet_torchao

quiet_torchao()  # peft imports torchao, whose import logs about CUDA kernels a CPU cannot load
# bitsandbytes logs at import, on a CPU with AVX512-BF16, that it could not fetch an optional
# kernel from the Hub (the `kernels` package is not installed: nothing is downloaded)
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

import bitsandbytes
import peft
import torch
import transformers

transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bars in the outputs
print(
    f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, "
    f"bitsandbytes {bitsandbytes.__version__}, Python {sys.version.split()[0]}"
)

# %% [markdown]
# ## Train on 2 ranks, then save three ways
#
# Every rank loads the 4-bit model, adds rank-8 adapters to the attention's query and value
# projections, shards each decoder layer and the root, and trains the adapters for 4 steps on
# its half of the batch. Then rank 0 saves the adapters with `peft`'s `save_pretrained`:
# as the model gives them, as rank 0's local tensors, and from the full state dict that every
# rank helps gather (`get_model_state_dict` with `full_state_dict=True`, a collective;
# `ignore_frozen_params=True` leaves out the frozen base, which `peft` would drop anyway).
# Each rank also keeps the trained model's logits on the whole batch.

# %%
from bitsandbytes.nn import Linear4bit
from fsdp_guide import launch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

scratch = tempfile.TemporaryDirectory()  # deleted, with what the page wrote, when the kernel exits
workdir = Path(scratch.name)
torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(workdir / "llama")
tokens = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))


def four_bit_model(path):
    """The base in 4 bits (NF4 codes stored as uint8), every other tensor in fp32."""
    import fsdp_guide

    transformers.utils.logging.disable_progress_bar()  # in the ranks too
    four_bit = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_quant_storage=torch.uint8,
    )
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=four_bit, dtype=torch.float32, device_map=fsdp_guide.device()
    )
    for layer in model.modules():  # evaluating on a CPU: see the QLoRA-on-a-CPU page
        if isinstance(layer, Linear4bit):
            layer.support_avx512bf16_for_cpu = False
    return model


def train_and_save(workdir, tokens):
    import fsdp_guide
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)  # the adapters' A: the same on every rank
    model = get_peft_model(
        four_bit_model(workdir / "llama"),
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    )
    for layer in model.get_base_model().model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    tokens = tokens.to(fsdp_guide.device())
    batch = tokens[dist.get_rank() :: dist.get_world_size()]  # this rank's half
    for _ in range(4):
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    saved = {}
    if dist.get_rank() == 0:
        try:  # 1. as the model gives them: DTensors
            model.save_pretrained(workdir / "as given")
            saved["as given"] = "saved"
        except RuntimeError as error:
            saved["as given"] = f"{type(error).__name__}: {error}"
        local = {name: p.to_local() for name, p in model.state_dict().items()}  # 2. rank 0's slices
        model.save_pretrained(workdir / "local slices", state_dict=local)
    # 3. every rank's slice, gathered: a collective, so every rank calls it
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    full = get_model_state_dict(model, options=options)
    if dist.get_rank() == 0:
        model.save_pretrained(workdir / "full", state_dict=full)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.cpu()
    return saved, logits


saved, trained = launch(train_and_save, workdir, tokens, world_size=2, output="none")[0]
print(f"as given: {saved['as given']}")

# %% [markdown]
# The first way fails on rank 0 before writing a tensor: `peft` takes the adapters from the
# model's state dict, which under FSDP2 holds `DTensor`s, and checks them for shared storage
# (`id_tensor_storage` in `peft/utils/other.py`, through `safetensors`' `storage_ptr`), which
# asks a `DTensor` for a data pointer it does not have. The other two wrote a file each. Each
# is loaded now into one process, on the 4-bit base, and its logits compared with those of the
# sharded model it was trained as (and, for scale, the base's own, without adapters):

# %%
from fsdp_guide.compare import largest_difference
from peft import PeftModel
from safetensors import safe_open


def adapter_shapes(folder):
    with safe_open(folder / "adapter_model.safetensors", "pt") as f:
        name = next(n for n in f.keys() if "lora_A" in n)
        return f"{name.split('base_model.model.')[-1]} {tuple(f.get_slice(name).get_shape())}"


import fsdp_guide

tokens = tokens.to(fsdp_guide.device())
with torch.no_grad():
    untrained = four_bit_model(workdir / "llama")(input_ids=tokens).logits
print(
    f"the base alone: largest logit difference from the trained model {largest_difference([(untrained, trained)]):.1e}"
)
for way in ("local slices", "full"):
    print(f"{way}: {adapter_shapes(workdir / way)}")
    try:
        model = PeftModel.from_pretrained(four_bit_model(workdir / "llama"), workdir / way).eval()
        with torch.no_grad():
            logits = model(input_ids=tokens).logits
        difference = largest_difference([(logits, trained)])
        print(f"  loads; largest logit difference from the trained model {difference:.1e}")
    except RuntimeError as error:
        print(f"  {type(error).__name__}: {str(error).strip().splitlines()[-1].strip()}")

# %% [markdown]
# Rank 0's local tensors are half of each adapter matrix (`lora_A` is 8×128; rank 0
# held rows 0 to 3): the file saves, and loading it into one process fails. Loaded back into
# the same sharded layout, such a file can load without an error and be wrong: the other
# ranks' rows revert to their initial values (the bug accelerate#4206 fixed in Accelerate's
# saving). Gathered with the full state dict, the adapters load into one process and give
# the trained model's logits. On GPUs the same
# gather runs over NCCL, and `cpu_offload=True` keeps the whole state dict off the GPU
# (expectation, not a recorded run).
#
# (qlora-adapters-merge)=
# ## Merging: into the 4-bit base, or into the base dequantised
#
# To ship one model instead of a base and an adapter, `peft`'s `merge_and_unload` adds each
# adapter's update, `B @ A * scaling`, into the weight it adapts. Into a `Linear4bit` that
# means dequantising, adding and quantising again to NF4. Dequantising the whole base first
# (`transformers`' `model.dequantize()`) gives plain linear layers, in the dtype the base was
# loaded with, for the merge to land in. Each merged model is compared with the unmerged one,
# and the first query projection's merged weight with what it should be, its 4-bit base
# dequantised plus the adapter's update (the error, as a part of the update's size):

# %%
from bitsandbytes.functional import dequantize_4bit
from fsdp_guide.table import Table
from IPython.display import display
from myst_nb import glue


def dense(layer):
    """The weight a layer computes with, in fp32 (dequantised if it is 4-bit)."""
    if isinstance(layer, Linear4bit):
        return dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()
    return layer.weight.detach().float()


unmerged = PeftModel.from_pretrained(four_bit_model(workdir / "llama"), workdir / "full").eval()
q_proj = unmerged.get_base_model().model.layers[0].self_attn.q_proj
update = q_proj.get_delta_weight("default").float()  # B @ A * scaling
base_weight = dense(q_proj.base_layer)
with torch.no_grad():
    reference = unmerged(input_ids=tokens).logits

rows = []
for into in ("4-bit base", "base dequantised to fp32", "base dequantised to bf16"):
    if into == "4-bit base":
        base = four_bit_model(workdir / "llama")
    else:
        dtype = torch.float32 if "fp32" in into else torch.bfloat16
        base = AutoModelForCausalLM.from_pretrained(
            workdir / "llama",
            quantization_config=BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype
            ),
            dtype=dtype,
            device_map=fsdp_guide.device(),
        ).dequantize()
    with warnings.catch_warnings(record=True) as caught:  # peft's, shown below without its file
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")
        merged = PeftModel.from_pretrained(base, workdir / "full").merge_and_unload().eval()
    for warning in {f"{w.category.__name__}: {w.message}" for w in caught}:
        print(f"merging into the {into}: {warning}")
    layer = merged.model.layers[0].self_attn.q_proj
    lost = (dense(layer) - base_weight - update).norm() / update.norm()
    with torch.no_grad():
        difference = largest_difference([(merged(input_ids=tokens).logits.float(), reference)])
    rows.append(
        [
            into,
            f"{type(layer).__name__} of {layer.weight.dtype}",
            f"{lost:.1e}",
            f"{difference:.1e}",
        ]
    )
    glue(f"lost_{into.split()[-1].replace('-', '_')}", float(lost), display=False)
display(
    Table(["merged into", "q_proj after", "its error / the update", "logits vs unmerged"], rows)
)
glue("update_size", float(update.norm() / base_weight.norm()), display=False)

# %% [markdown]
# Merged into the 4-bit base, the first query projection is off by
# {glue:text}`lost_base:.0%` of the adapter's update to it: quantising again computes each
# block's scale anew and rounds every merged value, base and update together, to one of
# NF4's 16 levels for its block of 64, so the merged model computes something the training
# never saw; `peft` says only that it "may get different generations". The rounding is set by
# the levels, not by the update: this page's update, after 4 steps at a learning rate of
# 1e-2, is {glue:text}`update_size:.0%` of the weight's size, and a smaller one (a lower rate)
# would lose a larger part of itself. Dequantised to fp32 first, the merged weight is the
# base plus the update to fp32 rounding (an error of {glue:text}`lost_fp32:.1e` of it) and
# the logits are the unmerged model's; in bf16, bf16's rounding of the whole weight gives
# {glue:text}`lost_bf16:.1%`, which also grows as the update shrinks. A merged, dequantised
# model is a dense model, as large as the base in that dtype: quantise it again for serving
# only knowing that this rounds the update as the 4-bit merge did.
#
# (qlora-adapters-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch, `transformers`, `peft` and
# `bitsandbytes`: {download}`scripts/qlora_adapters.py`. Every rank trains the sharded QLoRA
# model; the ranks gather the adapters with the full state dict and rank 0 saves them. Rank
# 0 then loads them into one process on the 4-bit base and prints the largest logit
# difference from the trained model, and what part of the update merging loses into the
# 4-bit base and into the base dequantised to fp32. The tests run this file under torchrun
# on 2 CPU ranks and check those lines (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/qlora_adapters.py
# :language: python
# ```

# %% [markdown]
# (qlora-adapters-tips)=
# ## The tips behind this
#
# - {ref}`tip-qlora-save-full-adapters`
# - {ref}`tip-qlora-merge-dequantised`
# - {ref}`tip-check-against-one-process`: the logits of the loaded adapters.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("qlora_adapters")
