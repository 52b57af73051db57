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
# (tutorial-mfu)=
# # MFU, computed right
#
# **What you will learn**
#
# - what {term}`MFU` (model FLOPs utilisation) is: tokens per second x FLOPs per token /
#   (accelerators x peak FLOP/s);
# - the FLOPs per token of a transformer, 6 per matmul parameter plus attention's, checked
#   against torch's own count (`torch.utils.flop_counter.FlopCounterMode`);
# - a measured run of {ref}`the LLM recipe <tutorial-llm>` over a peak: on a GPU the datasheet's
#   dense one, on a CPU an estimate;
# - a published MFU reproduced from its throughput, and three ways to get it wrong.
#
# **What you need**: a CPU; 2 processes on gloo; transformers, for one cell that builds
# Llama 3.1 8B's shapes without their memory; about 10 seconds on 2 CPU cores ({ref}`measured <measured-times>`).
# The same code is written to run unchanged with one GPU per rank (NCCL): each rank computes on
# {func}`fsdp_guide.device`, its GPU `cuda:LOCAL_RANK` where it has one, else the CPU, and the
# recipe then prints its MFU over the GPU's dense bf16 peak itself
# (`model_flops_utilisation` in `fsdp_guide.recipes.train_llm`, with {func}`fsdp_guide.mfu.mfu`).
# The tips it demonstrates are listed {ref}`at the end <mfu-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`mfu-script` ({download}`download <scripts/mfu.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# ## FLOPs per token: 6N, plus attention
#
# A forward and backward pass does 6 FLOPs per token for every parameter that takes part in
# a matmul: 2 in the forward (a multiply and an add), 4 in the backward (the gradients of
# the input and of the weight). Attention's own two matmuls, the scores and the weighted
# values, have no parameters: they add 12 x layers x heads x head size x sequence length
# ({func}`fsdp_guide.mfu.flops_per_token`). The input embedding is a lookup, not a matmul;
# the recipe's output head, tied to the token embedding, is one
# ({func}`fsdp_guide.mfu.matmul_parameters`). On the recipe's GPT, against what torch's FLOP
# counter counts in one forward and backward of one process:

# %%
from fsdp_guide.gpt import GPT
from fsdp_guide.mfu import flops_per_token, matmul_parameters, mfu
from fsdp_guide.recipes.train_llm import TrainConfig
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

config = TrainConfig(steps=10, log_every=10, progress=False)
gpt = GPT(config.model_config())
gpt.init_weights()
shape = dict(
    n_layers=config.n_layer,
    n_heads=config.n_head,
    head_dim=config.n_embd // config.n_head,
    seq_len=config.block_size,
)
per_token = flops_per_token(gpt, **shape)
print(
    f"parameters {sum(p.numel() for p in gpt.parameters()):,}; in matmuls {matmul_parameters(gpt):,} "
    f"(the position embedding is a lookup); 6N {6 * matmul_parameters(gpt):,} + attention "
    f"{per_token - 6 * matmul_parameters(gpt):,} = {per_token:,} FLOPs per token"
)

tokens = torch.randint(0, 256, (2, config.block_size + 1))
# the math kernel: its matmuls are ones the counter sees (it has no formula for the CPU's fused one)
with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
    _, loss = gpt(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
counted = counter.get_total_flops() / tokens[:, 1:].numel()
print(f"FlopCounterMode, forward and backward: {counted:,.0f} FLOPs per token")
print(f"counted / formula: {counted / per_token:.4f}")

from myst_nb import glue

glue("mfu_counted_ratio", counted / per_token, display=False)

# %% [markdown]
# The formula and the count agree to {glue:text}`mfu_counted_ratio:.3f` (the ratio, printed
# above). What the formula has and the counter does not are the few parameters of the layer
# norms, counted as if they were matmuls; the attention term counts the whole T x T of
# scores, as torch does, though the causal mask makes half of them unneeded (by convention:
# PaLM's appendix B, torchtitan). Recomputation by activation checkpointing is not counted:
# it is work the hardware does, not work the model needs.
#
# ## A measured run, over a peak
#
# The recipe, briefly (10 steps on 2 ranks), with its log: on a CPU it says why it computes no
# MFU. A CPU has no dense bf16 tensor-core peak to divide by, and the recipe trains in fp32 there:

# %%
from fsdp_guide import launch
from fsdp_guide.recipes.train_llm import train

run = launch(train, config, world_size=2, output="all")[0]
print(f"the run: {run['tokens_per_s']:,.0f} tokens/s over both ranks, computed in {run['dtype']}")

# %% [markdown]
# For a figure of the same kind on a CPU, the peak can be estimated: what a large fp32
# matrix multiplication reaches on each rank, the two ranks multiplying at the same time as
# they trained (the harness that times it is folded):

# %% tags=["hide-input"]
import time

import fsdp_guide


def matmul_flops(n=512, repeats=20):
    """The FLOP/s a rank's n x n fp32 matmuls reach, the best of ``repeats``: a peak for this rank."""
    device = fsdp_guide.device()
    a, b = (torch.randn(n, n, device=device) for _ in range(2))
    best = float("inf")
    for _ in range(repeats):
        torch.distributed.barrier()  # both ranks multiply at once, as they trained
        start = time.perf_counter()
        (a @ b).sum().item()  # .item(): waits for an accelerator too
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


peaks = launch(matmul_flops, world_size=2, output="none")
peak = min(peaks)
achieved = run["tokens_per_s"] * per_token / 2  # per rank
utilisation = mfu(run["tokens_per_s"], per_token, peak, devices=2)
print("a 512 x 512 fp32 matmul on each rank: " + ", ".join(f"{p / 1e9:.1f} GFLOP/s" for p in peaks))
print(
    f"training: {achieved / 1e9:.2f} GFLOP/s per rank of the model's own FLOPs; "
    f"MFU over that estimate {utilisation:.1%}"
)
glue("mfu_cpu_estimate", utilisation, display=False)

# %% [markdown]
# A model this small keeps the CPU busy with everything but its matmuls: the layer norms,
# the softmax, the optimizer, the collectives, Python. It uses
# {glue:text}`mfu_cpu_estimate:.0%` of what the matmuls alone reach (printed above); the
# estimate is a measurement of this machine under this page's load, not a datasheet's figure,
# so the number varies from run to run. On GPUs the same formula takes the datasheet's dense
# peak, and it can be checked against a published run.
#
# (llm-mfu)=
# ## How much of a GPU a run uses: a published MFU, and three ways to get it wrong
#
# On a GPU the recipe prints its MFU (`model_flops_utilisation` in the recipe, with
# {func}`fsdp_guide.mfu.mfu`) over the dense bf16 peak of the GPU it names. Three mistakes
# are common, each giving a number that looks plausible. Here they are on the one
# published run this page can check against: torchtitan's Llama 3.1 8B on 8 H100s
# with FSDP, 5,762 tokens per second per GPU (Table 1 of its
# [December 2024 benchmark](https://github.com/pytorch/torchtitan/blob/820504e20d1149fbf0b98c567af24c4b0433b22d/benchmarks/llama3_h100_202412_torchtitan.md)),
# at a sequence length of 8192 (`seq_len` in `train_configs/llama3_8b.toml` at the
# torchtitan commit the benchmark names, 9dec370). The text above its tables says that
# the runs without Float8, on 8 or 128 GPUs, "achieve 33% to 39% MFU", computed with the
# H100 SXM's peak (its footnote 2; `get_peak_flops` in that commit returns 989e12). The
# model is built on the {term}`meta device` from Llama 3.1 8B's configuration, to count
# its parameters without allocating them:

# %%
import warnings

from fsdp_guide.fp8 import quiet_torchao

quiet_torchao()  # transformers imports torchao, whose import logs about CUDA kernels a CPU cannot load
# tqdm's notebook import: no widgets here
warnings.filterwarnings("ignore", message="IProgress not found")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

llama_3_1_8b = LlamaConfig(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=False,
)
with torch.device("meta"):
    llama = LlamaForCausalLM(llama_3_1_8b)
llama_shape = dict(n_layers=32, n_heads=32, head_dim=128, seq_len=8192)
llama_per_token = flops_per_token(llama, **llama_shape)
print(
    f"parameters {sum(p.numel() for p in llama.parameters()):,}; in matmuls {matmul_parameters(llama):,} "
    f"(the input embedding is a lookup); FLOPs per token {llama_per_token / 1e9:.1f} G"
)

tokens_per_s, h100 = 5_762, 989e12  # per GPU; the H100 SXM's dense bf16 peak, FLOP/s
ways = {
    "right: whole model, attention, dense peak": mfu(tokens_per_s, llama_per_token, h100),
    "the sparse peak the datasheet headlines": mfu(tokens_per_s, llama_per_token, 2 * h100),
    "a rank's shard of the parameters (1/8)": mfu(
        tokens_per_s, flops_per_token(matmul_parameters(llama) // 8, **llama_shape), h100
    ),
    "6N alone, attention left out": mfu(tokens_per_s, 6 * matmul_parameters(llama), h100),
}
for way, value in ways.items():
    print(f"{way:42} MFU {value:6.1%}")
print(
    f"attention's share of the FLOPs per token: {1 - 6 * matmul_parameters(llama) / llama_per_token:.0%}"
)
glue("llm_mfu_right", ways["right: whole model, attention, dense peak"], display=False)

# %% [markdown]
# The right way gives the published figure's lower end ({glue:text}`llm_mfu_right:.1%`, printed above; torchtitan's other
# three runs give the rest of its range, checked in `tests/test_mfu.py`). The sparse peak halves it; a rank's shard
# (what a parameter's local tensor holds under FSDP: count a DTensor's `numel()`, the whole
# parameter's, not its `to_local()`'s) divides the matmul term by the number of ranks; and
# leaving attention out loses its share (printed last), which grows with the sequence
# length. The formula itself is the one `FlopCounterMode` confirmed at the top of the page.

# %% [markdown]
# (mfu-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/mfu.py`.
# A small GPT sharded with `fully_shard` trains a few steps, then times ten; its FLOPs per
# token by the formula, 6N plus attention, are checked on rank 0 against `FlopCounterMode`'s
# count of one forward and backward of an unsharded copy; the MFU is the achieved FLOP/s
# over a peak: the accelerator's dense peak for the dtype it computes in (fp32 here), given
# with `--peak-tflops`, or without it an estimate from a timed matmul on each rank. The
# tests run this file under torchrun on 2 CPU ranks and check that the count is within 2%
# of the formula and that the MFU is a finite fraction between 0 and 1
# (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/mfu.py
# :language: python
# ```

# %% [markdown]
# (mfu-tips)=
# ## The tips behind this
#
# - {ref}`tip-mfu`: MFU from the whole model, with attention, over the dense peak.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("mfu")
