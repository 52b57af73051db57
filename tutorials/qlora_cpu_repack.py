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
# (tutorial-qlora-cpu-repack)=
# # QLoRA on a CPU: one evaluation repacks the 4-bit weights
#
# **What you will learn**: that on a CPU with AVX512-BF16, `bitsandbytes` converts a 4-bit
# weight to another layout the first time it runs in `eval()` on an input that needs no
# gradient (as under `torch.no_grad()`); that under
# FSDP2 this silently changes what the model computes from the second evaluation on, and in
# any process stops the adapters' gradients in the training step after it; and the switch
# that turns it off.
#
# **What you need**: a CPU (the conversion is a CPU path); 2 processes on gloo;
# `transformers`, `peft` and `bitsandbytes` (the package's `test` or `docs` extras);
# about 10 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The model, its 4-bit loading and
# its sharding are those of {ref}`tutorial-qlora`; nothing is downloaded. What is said here of
# GPUs is expectation, from the source lines cited, not a recorded run. The tips are listed
# {ref}`at the end <qlora-cpu-repack-tips>`. Its idea as a plain torchrun script to copy:
# {ref}`qlora-cpu-repack-script` ({download}`download <scripts/qlora_cpu_repack.py>`).

# %%
import os
import sys
import tempfile
import warnings
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing is downloaded
warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm's notebook import
# peft 0.21 asks transformers 5 a deprecated question; the ranks' warnings come back here
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")

from fsdp_guide.fp8 import quiet_torchao

quiet_torchao()  # peft imports torchao, whose import logs about CUDA kernels a CPU cannot load
import logging

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
# ## The QLoRA model, sharded
#
# The small Llama of {ref}`tutorial-qlora`, saved in bf16 and loaded in 4 bits (NF4 codes
# stored as `uint8`), with rank-8 adapters on the attention's query and value projections,
# each decoder layer and then the root sharded with `fully_shard`:

# %%
from bitsandbytes.nn import Linear4bit
from fsdp_guide import launch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

scratch = tempfile.TemporaryDirectory()  # deleted, with what the page wrote, when the kernel exits
path = Path(scratch.name) / "llama"
torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
tokens = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))


def qlora_model(path):
    """The 4-bit model with its adapters, on this rank's device: the same on every rank."""
    import fsdp_guide
    from peft import LoraConfig, get_peft_model

    transformers.utils.logging.disable_progress_bar()  # in this rank too
    four_bit = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_quant_storage=torch.uint8,
    )
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=four_bit, device_map=fsdp_guide.device()
    )
    torch.manual_seed(0)  # the adapters' A: the same on every rank
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    return get_peft_model(model, config)


def shard(model):
    from torch.distributed.fsdp import fully_shard

    for layer in model.get_base_model().model.layers:
        fully_shard(layer)
    return fully_shard(model)


layer = qlora_model(path).get_base_model().model.layers[0].self_attn.q_proj
print(f"q_proj: peft's {type(layer).__name__} around a {type(layer.base_layer).__name__}")

# %% [markdown]
# (qlora-cpu-repack)=
# ## Evaluate twice, then take a step
#
# On a CPU with AVX512-BF16, `Linear4bit.forward` converts its weight once to a layout for
# its CPU kernel, its scales to bf16, and marks the `quant_state` as converted
# (`_convert_weight_packed_for_cpu` in `bitsandbytes/functional.py`), whenever the module is
# in `eval()` and its input does not require a gradient: under `torch.no_grad()` every layer,
# and in `eval()` with gradients on, any layer whose input needs none (the first layer's
# projections, fed by a frozen embedding). Under FSDP2 the converted weight is dropped when the layer is
# resharded, and the next forward gathers the original bytes again, while the mark, on the
# module's `quant_state`, stays. Each case below evaluates the same batch twice, then takes
# one training step and counts the adapters that got a gradient:

# %%
print("this CPU has AVX512-BF16:", bool(bitsandbytes.functional.has_avx512bf16()))


def evaluate_twice_then_step(path, tokens, sharded, repack=True):
    import fsdp_guide

    model = qlora_model(path)
    for layer in model.modules():
        if isinstance(layer, Linear4bit):
            if not repack:
                layer.support_avx512bf16_for_cpu = False  # never converted
    if sharded:
        shard(model)
    batch = tokens.to(fsdp_guide.device())
    model.eval()
    with torch.no_grad():
        twice = [model(input_ids=batch, labels=batch).loss.item() for _ in range(2)]
    model.train()
    model(input_ids=batch, labels=batch).loss.backward()
    adapters = [p for p in model.parameters() if p.requires_grad]
    return twice, sum(p.grad is not None for p in adapters), len(adapters)


for sharded, repack in ((False, True), (True, True), (True, False)):
    twice, with_grad, adapters = launch(
        evaluate_twice_then_step,
        path,
        tokens,
        sharded,
        repack,
        world_size=2 if sharded else 1,
        output="none",
    )[0]
    print(
        f"{'2 ranks' if sharded else 'one process':11} repack={str(repack):5}: evaluations "
        f"{twice[0]:.5f} then {twice[1]:.5f}; then {with_grad} of {adapters} adapters got a gradient"
    )

# %% [markdown]
# On this CPU (with AVX512-BF16, as printed above; on one without, every case is the last):
# in one process the two evaluations agree (and agree with the last case's to the scales'
# bf16 rounding), but the training step after them gives no adapter
# a gradient, with only a warning at backward: the converted weights go through a kernel
# with no backward (`gemv_4bit`, called from `matmul_4bit` in
# `bitsandbytes/autograd/_functions.py`), and the adapters
# on `q_proj` and `v_proj` reach the loss only through `o_proj`'s input, which gets no
# gradient; AdamW then updates nothing. On 2 ranks, the second evaluation reads the gathered
# bytes as if converted, and computes another loss, with no error. Setting
# `support_avx512bf16_for_cpu = False` on every `Linear4bit` before the first forward keeps the
# CPU on the path training uses: both evaluations agree and every adapter gets its
# gradient. On a CPU without AVX512-BF16 nothing is converted; on GPUs it should not be
# either (`x.device.type == "cpu"` is the first condition in `Linear4bit.forward`: read, not
# run here).
#
# (qlora-cpu-repack-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch, `transformers`, `peft` and
# `bitsandbytes`: {download}`scripts/qlora_cpu_repack.py`. Every rank loads the same small
# Llama in 4 bits, adds the adapters and shards it, evaluates one batch twice and takes one
# training step, once as `bitsandbytes` leaves it and once with the conversion switched off;
# rank 0 prints both evaluations and how many adapters got a gradient in each case. The tests
# run this file under torchrun on 2 CPU ranks and check those lines
# (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/qlora_cpu_repack.py
# :language: python
# ```

# %% [markdown]
# (qlora-cpu-repack-tips)=
# ## The tips behind this
#
# - {ref}`tip-qlora-cpu-repack`
# - {ref}`tip-check-against-one-process`: the first evaluation, against one process.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("qlora_cpu_repack")
