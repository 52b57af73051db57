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
# (tutorial-compile-recompiles)=
# # What recompiles a sharded model, and what dynamo's logs say
#
# **What you will learn**
#
# - what recompiles FSDP2's compiled blocks: evaluation, `no_grad`,
#   `reshard_after_forward`, a new sequence length; and what `dynamic=True` and
#   `mark_dynamic` change;
# - what `TORCH_LOGS=graph_breaks,recompiles` and `torch._dynamo.explain` report on a
#   sharded model, and which of the two to believe about what runs eagerly.
#
# **What you need**: a CPU; 2 processes on gloo; about 15 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The same code is
# written to run unchanged with one GPU per rank (NCCL): each rank computes on
# {func}`fsdp_guide.device`, its GPU `cuda:LOCAL_RANK` where it has one, else the CPU.
# It follows {ref}`tutorial-compile`, which shows where to compile (each block, after
# `fully_shard`) and why compiling the whole model compiles only the blocks.
# The tips are listed {ref}`at the end <compile-recompiles-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`compile-recompiles-script` ({download}`download <scripts/compile_recompiles.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# The setup (hidden; click to show) is the previous page's: the package's small GPT
# ({class}`fsdp_guide.gpt.GPT`), 2 blocks, each block an FSDP unit and the root holding
# the embeddings, final norm and tied output head; `batch(step, tokens)`, this rank's 2
# sequences of a step's global batch, cut to `tokens`; and `CompileLog`, a `torch.compile`
# backend that records the graphs dynamo hands it (by their `linear` calls: a block has 6)
# and passes them on to `aot_eager`. It uses `aot_eager` throughout: which graphs dynamo
# makes, and what it logs, is decided before a backend sees a graph, and inductor's C++
# compile of each graph would only add its time to this page.

# %% tags=["hide-input"]
import fsdp_guide
import torch.distributed as dist
from fsdp_guide import launch
from fsdp_guide.gpt import GPT, GPTConfig
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

CONFIG = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)


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


def batch(step, tokens=CONFIG.block_size):
    """This rank's 2 sequences of the step's global batch (2 per rank)."""
    g = torch.Generator().manual_seed(100 + step)
    rows = torch.randint(
        CONFIG.vocab_size, (2 * dist.get_world_size(), CONFIG.block_size + 1), generator=g
    )
    mine = rows[2 * dist.get_rank() : 2 * dist.get_rank() + 2, : tokens + 1].to(fsdp_guide.device())
    return mine[:, :-1], mine[:, 1:]


class CompileLog:
    """A torch.compile backend: note each graph's linear calls, and compile it with `backend`."""

    def __init__(self, backend):
        self.backend = torch._dynamo.lookup_backend(backend)
        self.graphs = []

    def __call__(self, graph_module, example_inputs):
        self.graphs.append(sum("linear" in str(node.target) for node in graph_module.graph.nodes))
        return self.backend(graph_module, example_inputs)


def blocks_compiled_after_sharding():
    """A fresh sharded model with each block compiled (`aot_eager`), and the log of its graphs."""
    torch._dynamo.reset()
    log = CompileLog("aot_eager")
    model = shard(build_model())
    for block in model.blocks:
        block.compile(backend=log)
    return model, log


# %% [markdown]
# (compile-recompiles)=
# ## What recompiles
#
# Each block compiled after `fully_shard`, with `aot_eager`: which graphs dynamo makes
# (and when a {term}`recompilation` makes a new one) is decided by the guards dynamo
# records while it traces. The count is the graphs compiled so far. The
# forward in `eval()` with gradients enabled is there only to tell the two guards apart:
# evaluate under `no_grad`.


# %%
def recompilations():
    model, log = blocks_compiled_after_sharding()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(tokens=CONFIG.block_size):
        model(*batch(0, tokens))[1].backward()
        optimizer.step()
        optimizer.zero_grad()

    events = []
    step()
    events.append(("train step 1", len(log.graphs)))
    step()
    events.append(("train step 2", len(log.graphs)))
    model.eval()
    model(*batch(0))
    events.append(("model.eval(), a forward", len(log.graphs)))
    with torch.no_grad():
        model(*batch(0))
    events.append(("model.eval() under no_grad", len(log.graphs)))
    model.train()
    step()
    events.append(("model.train(), a step", len(log.graphs)))
    model.set_reshard_after_forward(False)  # recurses into every FSDP module below the root
    step()
    events.append(("reshard_after_forward=False", len(log.graphs)))
    for tokens in (16, 24, 8):
        step(tokens)
        events.append((f"a step on {tokens} tokens", len(log.graphs)))
    return events


for event, graphs in launch(recompilations, output="none")[0]:
    print(f"{event:30} {graphs} graph(s)")

# %% [markdown]
# - The first step compiles once for both blocks. `eval()` alone recompiles nothing here:
#   dynamo guards on what the traced code reads, and nothing in this block reads
#   `self.training` (no dropout). `no_grad` changes the grad mode, which every graph is
#   guarded on: one more graph. Back in training the first graph is reused: dynamo keeps
#   each graph it compiled and picks the one whose guards pass. It compiles up to
#   `recompile_limit` graphs per code object (8 in `torch/_dynamo/config.py`); past that
#   it logs a warning and runs the frame eagerly (`_compile` in
#   `torch/_dynamo/convert_frame.py`), unless `fail_on_recompile_limit_hit` (config.py)
#   makes it an error. The blocks share one code object, and so one budget: their graphs
#   are the same ones.
# - `reshard_after_forward` changes nothing in the graph: FSDP's resharding happens in its
#   hooks, outside it.
# - A new sequence length recompiles once, with that dimension made dynamic (symbolic);
#   later lengths reuse the dynamic graph. torch's two ways to start dynamic are
#   `dynamic=True` (every dimension symbolic, batch included) and
#   `torch._dynamo.mark_dynamic` on the tensor a compiled frame receives (marking the
#   token batch does not reach a graph that starts inside the blocks). Both, run on the
#   same lengths (the mark made by a small eager module around each compiled block,
#   standing in for a line in the model's forward):


# %%
class MarkSequenceDynamic(torch.nn.Module):
    """Calls the block after marking its input's sequence dimension dynamic, eagerly, outside the compiled frame."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        torch._dynamo.mark_dynamic(x, 1)
        return self.block(x)


def graphs_over_lengths(remedy):
    torch._dynamo.reset()
    log = CompileLog("aot_eager")
    model = shard(build_model())
    for i, block in enumerate(model.blocks):
        block.compile(backend=log, dynamic=True if remedy == "dynamic=True" else None)
        if remedy == "mark_dynamic":
            model.blocks[i] = MarkSequenceDynamic(block)
    counts = []
    for tokens in (32, 16, 24, 8):
        model(*batch(0, tokens))[1].backward()
        counts.append(len(log.graphs))
    return counts


def every_remedy():
    return {
        remedy: graphs_over_lengths(remedy) for remedy in ("none", "dynamic=True", "mark_dynamic")
    }


for remedy, counts in launch(every_remedy, output="none")[0].items():
    print(f"{remedy:13} graphs after steps on 32, 16, 24, 8 tokens: {counts}")

# %% [markdown]
# Neither saves a graph on these FSDP-sharded blocks: `dynamic=True` compiles more graphs,
# not fewer, and the mark leaves the count as it was. (The frame dynamo compiles begins
# inside the block, after FSDP's pre-forward hook, which it does not trace; why the mark
# does not take, and why `dynamic=True` makes its extra graphs, this page does not
# establish: `TORCH_LOGS=recompiles`, below, is the tool to ask.) What the counts do
# show: without either, one recompilation at the first new length, then reuse of its
# dynamic graph for every other length. To have none, pad batches to one length.
#
# (compile-logs)=
# ## What dynamo reports: `TORCH_LOGS` and `explain`
#
# `TORCH_LOGS=graph_breaks,recompiles` in a script's environment logs each graph break
# and each recompilation with its reason; `torch._logging.set_logs(graph_breaks=True,
# recompiles=True)` turns on the same two logs from inside a rank (its docstring, in
# `torch/_logging/_internal.py`, lists them, and notes that a set `TORCH_LOGS` takes
# precedence: `set_logs` then does nothing). Here the
# whole model is compiled, as on {ref}`the previous page <compile-where>`, and run on 32 then 16 tokens, with the log's records
# kept (a handler on the `torch._dynamo` logger) and trimmed to the lines that say what
# and where; then `torch._dynamo.explain` runs the same sharded model.

# %%
import logging
import re


def dynamo_log(run):
    """The lines dynamo logs while `run()` runs, as TORCH_LOGS=graph_breaks,recompiles would."""
    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.extend(self.format(record).splitlines())

    keep = Keep()
    torch._logging.set_logs(graph_breaks=True, recompiles=True)
    logging.getLogger("torch._dynamo").addHandler(keep)
    try:
        run()
    finally:
        logging.getLogger("torch._dynamo").removeHandler(keep)
        torch._logging.set_logs()
    return lines


def what_dynamo_reports():
    torch._dynamo.reset()
    model = shard(build_model())
    model.compile(backend="aot_eager")
    log = dynamo_log(lambda: [model(*batch(0, tokens))[1].backward() for tokens in (32, 16)])
    explained = torch._dynamo.explain(shard(build_model()))(*batch(0))
    return log, {
        "graphs": explained.graph_count,
        "graph breaks": explained.graph_break_count,
        "break reasons": len(explained.break_reasons),
        "ops per graph": [len(ops) for ops in explained.ops_per_graph],
        "linears per graph": [
            sum("linear" in str(op) for op in ops) for ops in explained.ops_per_graph
        ],
    }


KEEP = (
    "Graph break in user code",
    "Attempted to call function marked as skipped",
    "graph break in loop",
    "frame skipped",
    "Skipping the function",
    'fsdp_guide/gpt.py", line',
    "Recompiling function",
    "mismatch",
)


def trimmed(lines):
    """The lines that say what and where, with this machine's install paths cut."""
    lines = [re.sub(r"[^\s(\"']*/(site-packages|src)/", "", line) for line in lines]
    kept = [i for i, line in enumerate(lines) if any(key in line for key in KEEP)]
    # and the line of code it names
    kept += [i + 1 for i in kept if lines[i].strip().startswith("File ")]
    return [lines[i] for i in sorted(set(kept))]


log, explained = launch(what_dynamo_reports, output="none")[0]
print("TORCH_LOGS=graph_breaks,recompiles, trimmed:")
print("\n".join(trimmed(log)))
print("\ntorch._dynamo.explain(model):", explained)

# %% [markdown]
# - **The graph break log** says what dynamo's counters said on
#   {ref}`the previous page <compile-where>`, and where: the break is at FSDP2's `_dynamo_disable` wrapper (`_fsdp_common.py`), reached from the root's
#   `x = block(x)`; dynamo could not resume inside the loop, so it skipped the root's
#   whole `forward` and ran it eagerly.
# - **The recompilation log** names the frame compiled, `Block.forward` (`gpt.py`), and the
#   guard that failed: the input's sequence dimension, 32 when compiled, now 16.
# - **`explain` counts one graph and no graph break**, for the same model. It counts the
#   graphs its backend is handed and takes graph breaks as their number less one
#   (`explain` in `torch/_dynamo/eval_frame.py`); a frame dynamo gave up on hands it
#   nothing. Here the one graph is a block's (6 linears), and the root's skipped
#   frame does not appear at all. To find what runs eagerly, read the graph break log (or
#   compile with `fullgraph=True`), not `explain`'s count.

# %% [markdown]
# (compile-recompiles-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone:
# {download}`scripts/compile_recompiles.py`. Each block of a small sharded model is compiled
# in place; the script counts the graphs dynamo compiles (with a backend that counts them)
# after a training step on 32 tokens, a forward under `no_grad`, a step on 32 tokens again,
# and steps on 16, 24 and 8 tokens, and logs each recompilation's reason with
# `torch._logging.set_logs(recompiles=True)`, as `TORCH_LOGS=recompiles` would. It compiles
# with `aot_eager`, so that it runs in seconds on a CPU; the graphs and guards are dynamo's,
# whatever the backend. The tests run this file under torchrun on 2 CPU ranks and check the
# counts: one graph more under `no_grad`, the first graph reused in training again, one
# recompilation at the first new length, and none after it (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/compile_recompiles.py
# :language: python
# ```

# %% [markdown]
# (compile-recompiles-tips)=
# ## The tips behind this
#
# - {ref}`tip-compile-recompiles`
# - {ref}`tip-compile-per-block`: `fullgraph=True`, not `explain`'s count, says that a block
#   compiles whole.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("compile_recompiles")
