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
# (tutorial-qlora)=
# # QLoRA: a 4-bit base under FSDP2
#
# **What you will learn**
#
# - how to load a model in 4 bits with `bitsandbytes` (NF4), add LoRA adapters with `peft`,
#   shard it with `fully_shard`, and train it on 2 ranks with the losses of one process;
# - what FSDP2 does with the packed 4-bit weights: it shards their bytes, stored as `uint8` or
#   as `bfloat16`, and what each rank then holds;
# - what each rank holds against a bf16 base, and with Accelerate's `ignored_params`, and
#   what that becomes for a 7B model as ranks are added.
#
# What breaks it is {ref}`tutorial-qlora-pitfalls`; what evaluating on a CPU does to it,
# {ref}`tutorial-qlora-cpu-repack`; saving and merging the adapters,
# {ref}`tutorial-qlora-adapters`.
#
# **What you need**: a CPU; 2 processes on gloo; `transformers`, `peft` and `bitsandbytes`
# (the package's `test` or `docs` extras);
# about 15 seconds on 2 CPU cores ({ref}`measured <measured-times>`). Nothing is
# downloaded: the "pretrained" model is a small Llama built from a config with a fixed seed,
# as in {ref}`tutorial-lora`, whose page this one extends. The worker code is written to run
# unchanged with one GPU per rank (NCCL): the model is loaded on {func}`fsdp_guide.device`.
# What is said here of GPUs is expectation, from the source lines cited, not a recorded run.
# The tips are listed {ref}`at the end <qlora-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`qlora-script` ({download}`download <scripts/qlora.py>`).

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
# ## A model in 4 bits
#
# A Llama with 2 decoder layers, saved in bf16 as checkpoints on the Hub are, then loaded as
# QLoRA loads it: each linear layer of the decoder becomes a `bitsandbytes` `Linear4bit`
# whose weight is a `Params4bit` holding NF4 codes, two per byte, in a flat column
# (`bnb_4bit_quant_storage` says which dtype carries those bytes), with one scale per 64
# weights (`absmax`) kept beside it in its `quant_state`:

# %%
from bitsandbytes.nn import Linear4bit
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


def four_bit(storage):
    """QLoRA's quantisation: NF4 codes stored as `storage`, computing in fp32 (on a CPU)."""
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_quant_storage=storage,
    )


for storage in (torch.uint8, torch.bfloat16):
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=four_bit(storage))
    layer = model.model.layers[0].self_attn.q_proj
    w = layer.weight
    print(
        f"storage {str(storage):15} {type(layer).__name__} of {layer.out_features}x{layer.in_features}: "
        f"a {type(w).__name__} {tuple(w.shape)} of {w.dtype}, {w.numel() * w.element_size()} bytes "
        f"(bf16: {layer.out_features * layer.in_features * 2}), {w.quant_state.absmax.numel()} scales"
    )

# %% [markdown]
# ## Shard it, train it, against one process
#
# Every rank loads the 4-bit model on its device, adds rank-8 LoRA adapters to the
# attention's query and value projections (the same on every rank, from one seed), shards
# each decoder layer and then the root with `fully_shard`, and trains the adapters with AdamW
# on its half of the batch, in `train()` mode. One process trains the same model, unsharded,
# on the whole batch. Each rank also counts the bytes of the 4-bit weights and of the adapters
# it holds between steps.

# %%
from fsdp_guide import launch
from fsdp_guide.compare import largest_difference

STEPS = 4
tokens = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))


def qlora_model(path, storage):
    """The 4-bit model with its adapters, on this rank's device: the same on every rank.
    `storage=None`: the bf16 model, unquantised (LoRA, as on the LoRA page)."""
    import fsdp_guide
    from peft import LoraConfig, get_peft_model

    transformers.utils.logging.disable_progress_bar()  # in this rank too
    quantised = {"quantization_config": four_bit(storage)} if storage else {"dtype": torch.bfloat16}
    model = AutoModelForCausalLM.from_pretrained(path, device_map=fsdp_guide.device(), **quantised)
    torch.manual_seed(0)  # the adapters' A: the same on every rank
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    return get_peft_model(model, config)


def shard(model, ignore_4bit=False, **options):
    from torch.distributed.fsdp import fully_shard

    if ignore_4bit:
        # Accelerate's workaround (accelerate#3987): FSDP leaves them whole on every rank
        options["ignored_params"] = {m.weight for m in model.modules() if isinstance(m, Linear4bit)}
    for layer in model.get_base_model().model.layers:
        fully_shard(layer, **options)
    return fully_shard(model, **options)


def local_bytes(params):
    return sum(
        (p.to_local() if hasattr(p, "to_local") else p).untyped_storage().nbytes() for p in params
    )


def train(path, tokens, storage=torch.uint8, sharded=True, **options):
    import fsdp_guide
    import torch.distributed as dist

    model = qlora_model(path, storage)
    rows = slice(None)
    if sharded:
        shard(model, **options)
        rows = slice(dist.get_rank(), None, dist.get_world_size())  # this rank's half
    batch = tokens[rows].to(fsdp_guide.device())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if sharded:
            dist.all_reduce(loss := loss.detach(), op=dist.ReduceOp.AVG)  # the whole batch's mean
        losses.append(loss.item())
    layers = [m for m in model.modules() if isinstance(m, Linear4bit)]
    # unquantised, the frozen linear weights (the adapters' A and B are linear layers too, trained)
    base = [m.weight for m in layers] or [
        m.weight
        for m in model.modules()
        if type(m) is torch.nn.Linear and not m.weight.requires_grad
    ]
    return {
        "losses": losses,
        "4-bit bytes": local_bytes(base),
        "frozen bytes": local_bytes(p for p in model.parameters() if not p.requires_grad),
        # one scale per 64 weights, in each layer's quant_state: an attribute, not a parameter
        "scale bytes": local_bytes(m.quant_state.absmax for m in layers),
        "adapter bytes": local_bytes(p for p in model.parameters() if p.requires_grad),
        "4-bit weight": f"{type(base[0]).__name__} {getattr(base[0], 'placements', '')}".strip(),
    }


runs = {}  # what each rank held, by case, for the comparison further down


one = launch(train, path, tokens, sharded=False, world_size=1, output="none")[0]
print(f"one process: losses {' '.join(f'{x:.4f}' for x in one['losses'])}")
for storage in (torch.uint8, torch.bfloat16):
    ranks = runs[storage] = launch(train, path, tokens, storage, world_size=2, output="none")
    difference = largest_difference(zip(ranks[0]["losses"], one["losses"]), relative=True)
    print(
        f"2 ranks, {str(storage):14}: losses {' '.join(f'{x:.4f}' for x in ranks[0]['losses'])}, "
        f"largest relative difference {difference:.1e}; the 4-bit weight a {ranks[0]['4-bit weight']}"
    )
    for rank, r in enumerate(ranks):
        print(
            f"  rank {rank} holds {r['4-bit bytes']} bytes of 4-bit weights, {r['adapter bytes']} of "
            f"adapters, {r['scale bytes']} of scales"
        )
print(
    f"one process holds {one['4-bit bytes']} bytes of 4-bit weights, {one['adapter bytes']} of "
    f"adapters, {one['scale bytes']} of scales"
)

# %% [markdown]
# The losses on 2 ranks are one process's, in either storage; each rank holds half of the
# 4-bit weights but all their scales, which live in each layer's `quant_state`, unseen by
# FSDP2. It gathers a unit's parameters of mixed dtypes as bytes (`_fsdp_collectives.py`),
# and between forwards the module's weight is a `DTensor` from which `Linear4bit.forward`
# rebuilds the `Params4bit` each time (`fix_4bit_weight_quant_state_from_module`). `uint8`
# storage needs a torch whose `fully_shard` takes a parameter that is not floating point:
# 2.9.1, the oldest this package supports, refuses it (`RuntimeError: only Tensors of
# floating point dtype can require gradients`, pytorch#177844; tested in `nox -s torch`),
# 2.13 and 2.15 take it. Stored as `bfloat16`, the codes shard on either.
#
# (qlora-memory)=
# ## What a rank holds: against bf16 LoRA, and with `ignored_params`
#
# The same model and adapters, trained the same way on 2 ranks, twice more: its base
# unquantised in bf16 (LoRA, as on {ref}`the LoRA page <lora-memory>`), and in 4 bits with
# the 4-bit weights kept out of FSDP by `ignored_params` (`shard(model, ignore_4bit=True)`
# above). Each rank counts, between steps, the bytes of every frozen parameter it holds (the
# embeddings, norms and output layer stay in bf16 in every case), of the 4-bit scales, and of
# the adapters:

# %%
from fsdp_guide.table import Table
from IPython.display import display
from myst_nb import glue

runs["bf16 LoRA"] = launch(train, path, tokens, None, world_size=2, output="none")
runs["QLoRA, uint8, ignored_params"] = launch(
    train, path, tokens, torch.uint8, ignore_4bit=True, world_size=2, output="none"
)
rows = []
for case, ranks in runs.items():
    r = ranks[0]
    difference = largest_difference(zip(r["losses"], one["losses"]), relative=True)
    rows.append(
        [
            f"QLoRA, {str(case).removeprefix('torch.')}" if isinstance(case, torch.dtype) else case,
            "(not 4-bit)" if case == "bf16 LoRA" else f"{difference:.1e}",
            r["4-bit weight"],
            f"{r['frozen bytes'] / 2**10:.0f}",
            f"{r['scale bytes'] / 2**10:.1f}",
            f"{r['adapter bytes'] / 2**10:.1f}",
        ]
    )
display(
    Table(
        [
            "2 ranks",
            "losses vs 4-bit, one process",
            "q_proj's weight",
            "frozen KiB",
            "scales KiB",
            "adapters KiB",
        ],
        rows,
    )
)
glue(
    "bf16_over_qlora",  # the scales count on QLoRA's side: every rank holds them whole
    runs["bf16 LoRA"][0]["frozen bytes"]
    / (runs[torch.uint8][0]["frozen bytes"] + runs[torch.uint8][0]["scale bytes"]),
    display=False,
)
glue(
    "ignored_over_sharded",
    runs["QLoRA, uint8, ignored_params"][0]["frozen bytes"] / runs[torch.uint8][0]["frozen bytes"],
    display=False,
)

# %% [markdown]
# Sharded, the bf16 base has a rank hold {glue:text}`bf16_over_qlora:.1f` times the frozen
# bytes and scales of the 4-bit base; on this small model the bf16 embeddings and output
# layer are much of what is left. The bf16 losses are not the 4-bit losses (another model,
# unquantised). With `ignored_params`, the losses are still one process's, the weight is a
# whole `Params4bit` on every rank, and a rank holds {glue:text}`ignored_over_sharded:.1f`
# times the frozen bytes: the workaround trades the sharding of the 4-bit weights, the
# largest part of QLoRA's model, for weights FSDP never touches. Accelerate 1.15 makes that
# trade itself for `uint8` storage, with a warning (`fsdp2_prepare_model` in
# `accelerate/utils/fsdp_utils.py`); on a torch whose `fully_shard` takes `uint8` parameters,
# sharding them is the better trade.
#
# At the size QLoRA is for, the same count from a Llama-2-7B-shaped config (built on the
# `meta` device: nothing allocated) shows what the scales, whole on every rank, do as ranks
# are added (one fp32 scale per 64 weights, without `bnb_4bit_use_double_quant`):

# %%
with torch.device("meta"):
    seven_b = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, vocab_size=32000
        )
    )
quantised = sum(
    m.weight.numel() for m in seven_b.model.layers.modules() if type(m) is torch.nn.Linear
)
rest = sum(p.numel() for p in seven_b.parameters()) - quantised  # embeddings, norms, output: bf16
for ranks in (1, 2, 8):
    bf16_bytes = (quantised + rest) * 2 / ranks
    nf4_bytes = (
        quantised / 2 + rest * 2
    ) / ranks + quantised / 64 * 4  # codes, bf16 sharded; scales whole
    print(
        f"7B, {ranks} rank(s): bf16 base {bf16_bytes / 2**30:5.2f} GiB a rank, 4-bit {nf4_bytes / 2**30:4.2f} "
        f"GiB ({bf16_bytes / nf4_bytes:.1f} times less)"
    )

# %% [markdown]
# One process holds the 4-bit model in under a third of the bf16 model's bytes; sharded over
# 8 ranks, the scales every rank holds whole are nearly half of a rank's 4-bit bytes, and the
# saving is under 2 times. `bnb_4bit_use_double_quant=True` stores the scales in 8 bits
# (with one fp32 scale per 256 of them), a quarter of these bytes.
#
# (qlora-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch, `transformers`, `peft` and
# `bitsandbytes`: {download}`scripts/qlora.py`. Every rank loads the same small Llama in 4
# bits, adds the adapters, shards it and trains on its half of the batch; rank 0 then trains
# the unsharded model on the whole batch alone and prints the largest relative difference
# between the two runs' losses, and how many bytes of 4-bit weights each rank held. The tests
# run this file under torchrun on 2 CPU ranks and check that line (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/qlora.py
# :language: python
# ```

# %% [markdown]
# (qlora-tips)=
# ## The tips behind this
#
# - {ref}`tip-qlora-uint8-storage`
# - {ref}`tip-qlora-cpu-repack`: evaluating on a CPU, in {ref}`tutorial-qlora-cpu-repack`.
# - {ref}`tip-qlora-quantise-first`: `ignored_params`, measured above.
# - {ref}`tip-lora-before-sharding`: the adapters are added before `fully_shard`, here too.
# - {ref}`tip-check-against-one-process`: the losses above.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("qlora")
