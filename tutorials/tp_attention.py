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
# (tutorial-tp-attention)=
# # Attention split two ways: GQA heads under TP, and context parallelism
#
# **What you will learn**
#
# - why the heads and the key/value heads of grouped-query attention must each divide by
#   the TP degree, and what a wrong degree raises;
# - context parallelism, attention split along the sequence, and why it does not run on the CPU.
#
# **What you need**: a CPU; 2 processes on gloo; about 5 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The
# worker code is written to run unchanged with one GPU per rank (NCCL): the mesh is built
# on {func}`fsdp_guide.device`'s type.
# The tips it demonstrates are listed {ref}`at the end <tp-attention-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`tp-attention-script` ({download}`download <scripts/tp_attention.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# (tp-gqa)=
# ## Heads and KV heads under grouped-query attention
#
# Column-wise `q`, `k` and `v` give each rank a contiguous block of output features, and
# the attention reshapes that block into heads: the split must fall between heads. The
# GPT has as many key/value heads as query heads; with grouped-query attention (GQA) a
# model has fewer KV heads, each shared by a group of query heads, and both counts must
# divide by the TP degree. The smallest GQA attention, in the style of the package's GPT
# ({class}`fsdp_guide.gpt.GPT`), under the {ref}`plan's <tp-plan>` column-wise `q`, `k`, `v` and
# row-wise projection, on a TP degree of 2:

# %%
import fsdp_guide
import torch.nn as nn
import torch.nn.functional as F
from fsdp_guide import launch
from fsdp_guide.table import Table
from IPython.display import display
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

N_EMBD = 32  # the model width


class GroupedQueryAttention(nn.Module):
    def __init__(self, n_embd, n_head, n_kv_head, head_dim=8):
        super().__init__()
        self.head_dim = head_dim
        self.q = nn.Linear(n_embd, n_head * head_dim, bias=False)
        self.k = nn.Linear(n_embd, n_kv_head * head_dim, bias=False)
        self.v = nn.Linear(n_embd, n_kv_head * head_dim, bias=False)
        self.proj = nn.Linear(n_head * head_dim, n_embd, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        # -1: all the heads, or this rank's share under tensor parallelism
        q, k, v = (
            t(x).view(B, T, -1, self.head_dim).transpose(1, 2) for t in (self.q, self.k, self.v)
        )
        # a KV head per group of q heads
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


HEADS = ((4, 2), (6, 2), (4, 1), (6, 3))  # (query heads, KV heads)


def gqa_under_tp():
    tp_mesh = init_device_mesh(fsdp_guide.device().type, (2,), mesh_dim_names=("tp",))
    x = torch.randn(2, 8, N_EMBD, generator=torch.Generator().manual_seed(0)).to(
        fsdp_guide.device()
    )
    result = {}
    for n_head, n_kv_head in HEADS:
        torch.manual_seed(0)
        attention = GroupedQueryAttention(N_EMBD, n_head, n_kv_head).to(fsdp_guide.device())
        whole = attention(x)
        parallelize_module(
            attention,
            tp_mesh,
            {
                "q": ColwiseParallel(),
                "k": ColwiseParallel(),
                "v": ColwiseParallel(),
                "proj": RowwiseParallel(),
            },
        )
        try:
            outcome = f"runs; output vs unsharded {(attention(x) - whole).abs().max().item():.0e}"
        except RuntimeError as e:
            outcome = f"RuntimeError: {str(e).splitlines()[0]}"
        k_shape = tuple(attention.k.weight.to_local().shape)
        result[(n_head, n_kv_head)] = (k_shape, outcome, fsdp_guide.describe_sharding(attention))
    return result


per_rank = launch(gqa_under_tp, world_size=2, output="none")
rows = [[*heads, k_shape, outcome] for heads, (k_shape, outcome, _) in per_rank[0].items()]
display(Table(["heads", "KV heads", "k.weight on a rank", "forward with a TP degree of 2"], rows))

# %% tags=["hide-input"] mystnb={"image": {"alt": "The k weight of each of the four attentions, its rows coloured by the TP rank that holds them and a line between its KV heads of 8 rows: with 2 KV heads each rank holds one whole head; with 1, each holds half of it; with 3, the split falls inside the second head."}}
import matplotlib.pyplot as plt
from fsdp_guide.describe import draw_sharding

fig, axes = plt.subplots(1, len(HEADS), figsize=(10, 3.2))
for ax, heads in zip(axes, HEADS):
    draw_sharding([rank[heads][2] for rank in per_rank], "k.weight", ax=ax)
    for boundary in range(8, heads[1] * 8, 8):  # a KV head is head_dim = 8 rows
        ax.axhline(boundary, color="black", linewidth=2, linestyle="--")
    ax.set_title(f"{heads[0]} heads, {heads[1]} KV heads", fontsize=9)
fig.suptitle("k.weight's rows by TP rank; dashed: between KV heads (8 rows each)", fontsize=10)
fig.tight_layout()

# %% [markdown]
# `parallelize_module` splits the weights without looking at heads (a head is 8 rows
# here): with 1 KV head, each rank gets `k`'s rows 0:4 or 4:8, half a head, and `k`'s
# `view` into heads fails (`q`'s, 2 whole heads, passes); with 3 KV heads each rank gets
# a head and a half. 6 query heads
# over 2 KV heads works: each rank gets 3 query heads and the 1 KV head they share. The
# rule: the number of query heads and the number of KV heads must each divide by the TP
# degree (then each rank's query heads are whole groups, and their KV heads are on the
# same rank). Nothing checks it before the forward: check it where the TP degree is chosen.

# %% [markdown]
# (tp-context-parallel)=
# ## Context parallelism: not on the CPU
#
# Context parallelism (CP) splits the sequence over the ranks of a mesh dimension and runs
# attention as a ring: each rank's queries meet every rank's keys and values in turn.
# torch's `context_parallel` (`torch.distributed.tensor.experimental`) shards the buffers
# it is given along the sequence, and replaces the attention kernels inside its block.
# Here it is, on 2 ranks, around one causal attention:


# %%
def attention_split_by_sequence():
    from torch.distributed.tensor.experimental import context_parallel

    device = fsdp_guide.device()
    mesh = init_device_mesh(device.type, (2,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    # batch, heads, sequence, head dim
    q, k, v = (torch.randn(1, 2, 16, 8, device=device) for _ in range(3))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except NotImplementedError as e:
        return f"{type(e).__name__}: {e}"
    return f"ran: this rank's output {tuple(out.shape)}, half the sequence"


print(launch(attention_split_by_sequence, world_size=2, output="none")[0])

# %% [markdown]
# On the CPU it does not run: CP replaces the flash, memory-efficient and cuDNN attention
# operators (the `_scaled_dot_product_*_attention` entries of its handlers, in
# [`torch/distributed/tensor/experimental/_context_parallel/_attention.py`](https://github.com/pytorch/pytorch/blob/main/torch/distributed/tensor/experimental/_context_parallel/_attention.py)),
# which are GPU kernels, and the CPU's attention is another operator,
# `_scaled_dot_product_flash_attention_for_cpu`, which it does not handle. So this guide
# shows no CP training: on GPUs the cell above is meant to run, and a CP run belongs with
# the recorded GPU runs.

# %% [markdown]
# (tp-attention-script)=
# ## The script to copy
#
# This page's GQA rule as a plain torchrun script, with torch alone: {download}`scripts/tp_attention.py`.
# A grouped-query attention is split over 2 ranks (`q`, `k`, `v` column-wise, the projection
# row-wise) for four pairs of head counts. Rank 0 prints, for each, whether both counts divide
# by the number of ranks, what it holds of `k`'s weight, and the largest difference from the
# unsharded output or the error the forward raises. The tests run this file under torchrun on 2
# CPU ranks and check that the two pairs that divide run (1e-5 from the unsharded output) and
# that the two that do not raise the `view`'s `RuntimeError` (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/tp_attention.py
# :language: python
# ```

# %% [markdown]
# (tp-attention-tips)=
# ## The tips behind this
#
# - {ref}`tip-tp-gqa-heads`

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("tp_attention")
