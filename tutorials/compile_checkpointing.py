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
# (tutorial-compile-checkpointing)=
# # Activation checkpointing and `torch.compile`, in each order
#
# **What you will learn**
#
# - the two orders of `checkpoint_wrapper` and `torch.compile` on FSDP2's blocks
#   (checkpoint, then compile; compile, then checkpoint): the graphs each compiles, the
#   activations each saves for the backward, and the losses;
# - what the compiled order saves beyond eager checkpointing, and why.
#
# **What you need**: a CPU; 2 processes on gloo; about 5 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The same code is
# written to run unchanged with one GPU per rank (NCCL): each rank computes on
# {func}`fsdp_guide.device`, its GPU `cuda:LOCAL_RANK` where it has one, else the CPU.
# It follows {ref}`tutorial-compile`, which shows where to compile (each block, after or
# before `fully_shard`). The tips are listed {ref}`at the end <compile-checkpointing-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`compile-checkpointing-script` ({download}`download <scripts/compile_checkpointing.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# The setup (hidden; click to show) is {ref}`tutorial-compile`'s: the package's small GPT
# ({class}`fsdp_guide.gpt.GPT`), 2 blocks, each block an FSDP unit and the root holding
# the embeddings, final norm and tied output head; `train` runs 3 AdamW steps on the same
# batches and returns the losses and the full parameters; `CompileLog` is a
# `torch.compile` backend that records the graphs dynamo hands it (by their `linear`
# calls: a block has 6) and passes them on to `aot_eager`. It uses `aot_eager`: the
# graphs, and what AOTAutograd saves for the backward, are decided before a backend sees
# a graph, and inductor's C++ compile of each graph would only add its time to this page.

# %% tags=["hide-input"]
import fsdp_guide
import torch.distributed as dist
from fsdp_guide import launch
from fsdp_guide.compare import largest_difference
from fsdp_guide.gpt import GPT, GPTConfig
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

CONFIG = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)
STEPS = 3


def build_model(config=CONFIG):
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    return model


def shard(model):
    mesh = init_device_mesh(fsdp_guide.device().type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def batch(step):
    """This rank's 2 sequences of the step's global batch (2 per rank)."""
    g = torch.Generator().manual_seed(100 + step)
    rows = torch.randint(
        CONFIG.vocab_size, (2 * dist.get_world_size(), CONFIG.block_size + 1), generator=g
    )
    mine = rows[2 * dist.get_rank() : 2 * dist.get_rank() + 2].to(fsdp_guide.device())
    return mine[:, :-1], mine[:, 1:]


def train(model, steps=STEPS):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        _, loss = model(*batch(step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    # checkpoint_wrapper adds "_checkpoint_wrapped_module." to the parameter names under it
    # (not to its state_dict() keys): compare by the plain model's names
    params = {
        name.replace("_checkpoint_wrapped_module.", ""): p.full_tensor().cpu()
        for name, p in model.named_parameters()
    }
    return losses, params


class CompileLog:
    """A torch.compile backend: note each graph's linear calls, and compile it with `backend`."""

    def __init__(self, backend):
        self.backend = torch._dynamo.lookup_backend(backend)
        self.graphs = []

    def __call__(self, graph_module, example_inputs):
        self.graphs.append(sum("linear" in str(node.target) for node in graph_module.graph.nodes))
        return self.backend(graph_module, example_inputs)


# %% [markdown]
# (compile-ac)=
# ## Activation checkpointing and compile, in each order
#
# The blocks wrapped with torch's `checkpoint_wrapper` (which recomputes a block's
# forward during its backward instead of saving its activations), compiled before or
# after wrapping, then sharded; with `aot_eager`. "Saved" is what the forward leaves for
# the backward ({func}`fsdp_guide.memory.saved_for_backward`).

# %%
from fsdp_guide.memory import saved_for_backward
from fsdp_guide.table import Table
from IPython.display import display
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

ORDERS = (
    "no checkpointing, eager",
    "checkpointing, eager",
    "checkpoint, then compile",
    "compile, then checkpoint",
)


def checkpointed(order):
    torch._dynamo.reset()
    log = CompileLog("aot_eager")
    model = build_model()
    for i, block in enumerate(model.blocks):
        if order == "compile, then checkpoint":
            block.compile(backend=log)
        if order != "no checkpointing, eager":
            block = checkpoint_wrapper(block)
        if order == "checkpoint, then compile":
            block.compile(backend=log)
        model.blocks[i] = block
    shard(model)
    losses, params = train(model)
    with saved_for_backward() as saved:
        _, loss = model(*batch(0))
    loss.backward()
    return losses, params, log.graphs, saved.held_at_exit, saved.kinds


def every_order():
    return {order: checkpointed(order) for order in ORDERS}


runs = launch(every_order, output="none")[0]
_, reference, *_ = runs["no checkpointing, eager"]
rows = []
for order, (_, params, graphs, saved, _) in runs.items():
    difference = largest_difference((params[name], p) for name, p in reference.items())
    rows.append([order, len(graphs), str(graphs), f"{saved / 1024:.0f}", f"{difference:.1e}"])
header = ["order", "graphs", "linears per graph", "saved, KiB", "params vs no checkpointing"]
display(Table(header, rows))
print(
    f"the CPU generator's state: {torch.get_rng_state().numel() / 1024:.1f} KiB, "
    f"a {str(torch.get_rng_state().dtype).removeprefix('torch.')} tensor of {torch.get_rng_state().numel()}"
)
print(
    f"each block's input on a rank: {[2, CONFIG.block_size, CONFIG.n_embd]} (2 sequences, as `batch` gives)"
)
for order in ("checkpointing, eager", "checkpoint, then compile"):
    kinds = ", ".join(
        f"{n} x {dtype} {list(shape)}" for (dtype, shape), n in sorted(runs[order][4].items())
    )
    print(f"saved for backward, {order}: {kinds}")

# the figures the text quotes, from this run (JupyterLab shows glue's roles unrendered)
from myst_nb import glue

glue(
    "compile_ac_extra_kib",
    (runs["checkpoint, then compile"][3] - runs["checkpointing, eager"][3]) / 1024,
    display=False,
)

# %% [markdown]
# The figures in this text are this run's, taken from the outputs by myst-nb's `glue`; in
# JupyterLab, which does not render glue's roles, read them from the output above each paragraph.
#
# - **Checkpoint, then compile** (torchtitan's order: "compile after AC wrapping and
#   before FSDP", a comment in `parallelize_llama`, `torchtitan/models/llama3/infra/parallelize.py`):
#   dynamo traces the wrapper's `torch.utils.checkpoint` call as one higher-order
#   operator (the block's linears sit in a subgraph, so the top level counts none), and
#   AOTAutograd's partitioner recomputes the checkpointed region in the compiled
#   backward. The saved tensors, listed by dtype and shape under the table, show what the
#   compiled backward keeps beyond eager checkpointing: the blocks' gathered weights
#   (whose memory FSDP frees after the forward and gathers again for the backward, so
#   they count 0 bytes at the end of the forward), and two `uint8` tensors the size of
#   the CPU generator's state, one per block: the extra {glue:text}`compile_ac_extra_kib:.0f` KiB. They are saved so
#   that the recomputed attention replays the same random stream: the partitioner's
#   `functionalize_rng_ops` (`torch/_functorch/partitioners.py`) wraps every operator tagged
#   `torch.Tag.nondeterministic_seeded`, which the CPU attention kernel
#   (`aten._scaled_dot_product_flash_attention_for_cpu`) is, in `run_and_save_rng_state`,
#   whose CPU form saves `torch.get_rng_state()` (`torch/_prims/rng_prims.py`). Eager
#   checkpointing keeps its RNG state too, but in a local variable of
#   `_checkpoint_without_reentrant_generator` (`torch/utils/checkpoint.py`), not as a
#   saved tensor, so `saved_tensors_hooks` do not see it.
# - **Compile, then checkpoint**: the wrapper is eager and, as non-reentrant checkpointing
#   does, runs the block it wraps (here the compiled one) in the forward and again in the
#   backward's recomputation (`torch/utils/checkpoint.py`); the block's graph is the
#   same as without checkpointing. It saves what eager checkpointing saves.
# - Both train exactly as eager does with `aot_eager`. On GPUs, the first order is
#   expected to be the one that lets inductor fuse the recomputation into the backward's
#   kernels, since the recomputation is inside the compiled backward; the second
#   recomputes with the compiled forward, outside it.

# %% [markdown]
# (compile-checkpointing-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone:
# {download}`scripts/compile_checkpointing.py`. Each block of a small model is wrapped with
# `checkpoint_wrapper`, then compiled, then sharded (torchtitan's order), and trains 3
# steps beside the same model with eager checkpointing; a backend that counts the graphs
# it is handed says how many were compiled, and `saved_tensors_hooks` count the bytes the
# forward saves for the backward, with and without checkpointing. It compiles with
# `aot_eager`, so that it runs in seconds on a CPU; a training script leaves out `backend=`
# to get inductor. The tests run this file under torchrun on 2 CPU ranks and check that
# one graph was compiled, that checkpointing saved less than half as much, and that the
# losses equal eager checkpointing's (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/compile_checkpointing.py
# :language: python
# ```

# %% [markdown]
# (compile-checkpointing-tips)=
# ## The tips behind this
#
# - {ref}`tip-compile-with-checkpointing`

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("compile_checkpointing")
