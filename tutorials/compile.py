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
# (tutorial-compile)=
# # `torch.compile` with FSDP2
#
# **What you will learn**
#
# - where `torch.compile` goes in a sharded model: each block after `fully_shard`, each
#   block before it, or the whole model; what each compiles ({term}`graph <graph break>`
#   count, graph breaks) and how its training compares with eager;
# - why compiling a whole FSDP2 model compiles only its blocks, and what
#   `fullgraph=True` says about it;
# - `module.compile()` against `torch.compile(module)`: the state-dict names;
# - what recompiles: evaluation, `no_grad`, `reshard_after_forward`, a new sequence length;
# - activation checkpointing with compile, in each order: graphs, activations saved for
#   the backward, and the losses;
# - what `TORCH_LOGS=graph_breaks,recompiles` and `torch._dynamo.explain` report on a
#   sharded model, and why a `TorchDispatchMode` is the wrong instrument for compiled code;
# - compiled autograd with FSDP2 in torch 2.13: the hooks it leaves eager, the callback
#   and the collective it loses, and the gradients that come out wrong;
# - compiling the optimizer step on FSDP2's DTensor parameters: one graph, no collectives,
#   parameters within rounding of eager's.
#
# **What you need**: a CPU; 2 processes on gloo; about 70 seconds on 2 CPU cores ({ref}`measured <measured-times>`) with
# inductor's cache empty, as it compiles C++ (later runs reuse its on-disk cache and take
# less). The worker code
# is written to run unchanged with one GPU per rank (NCCL); on GPUs inductor generates
# Triton kernels instead, and what this page says about GPUs is what is expected there,
# not something it ran. The tips it demonstrates are listed
# {ref}`at the end <compile-tips>`.

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# The model is the package's small GPT ({class}`fsdp_guide.gpt.GPT`), 2 blocks, each block
# an FSDP unit and the root holding the embeddings, final norm and tied output head. Each
# run trains 3 AdamW steps on the same batches, and returns its losses and the full
# parameters. `CompileLog` is a `torch.compile` backend that records each graph dynamo
# hands it (the number of `linear` calls in it says what it covers: a block has 6), passes
# it on to a real backend, and counts the runs of the compiled code, so that a cell can
# check that what it measured ran compiled. `what_ran` counts FSDP's collectives (the c10d
# operators gloo and NCCL both run) and the root's end-of-backward callback, as the
# profiler records them. `CompileLog`, `torch._dynamo.reset()` and dynamo's counters are
# this page's instruments, private debugging helpers; a training script just calls
# `block.compile()` (with `mode=` or `options=` as it needs).

# %%
from collections import Counter

import fsdp_guide
import torch.distributed as dist
from fsdp_guide import launch
from fsdp_guide.collectives import collective_kind
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


def batch(step, tokens=CONFIG.block_size):
    """This rank's 2 sequences of the step's global batch (2 per rank)."""
    g = torch.Generator().manual_seed(100 + step)
    rows = torch.randint(
        CONFIG.vocab_size, (2 * dist.get_world_size(), CONFIG.block_size + 1), generator=g
    )
    mine = rows[2 * dist.get_rank() : 2 * dist.get_rank() + 2, : tokens + 1].to(fsdp_guide.device())
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
    """A torch.compile backend: note each graph (its linear calls, its inputs' types), compile
    it with `backend`, and count the calls of the compiled code in `runs`."""

    def __init__(self, backend):
        self.backend = torch._dynamo.lookup_backend(backend)
        self.graphs, self.inputs, self.runs = [], [], 0

    def __call__(self, graph_module, example_inputs):
        self.graphs.append(sum("linear" in str(node.target) for node in graph_module.graph.nodes))
        self.inputs.append(Counter(type(x).__name__ for x in example_inputs))
        compiled = self.backend(graph_module, example_inputs)

        def run(*args):
            self.runs += 1
            return compiled(*args)

        # keep the backend's calling convention
        run._boxed_call = getattr(compiled, "_boxed_call", False)
        return run


# FSDP's all-gathers and reduce-scatters, eager (c10d) or traced into a graph (functional),
# and the callback FSDP2's root queues for the end of the backward (its record_function
# name in torch's _fsdp_state.py).
COUNTED = {"all-gather": "all-gathers", "reduce-scatter": "reduce-scatters"}
ROOT_CALLBACK = "FSDP::root_post_backward_callback"
EVENTS = (*COUNTED.values(), "root's final callback")


def event_kind(name: str) -> str | None:
    return "root's final callback" if name == ROOT_CALLBACK else COUNTED.get(collective_kind(name))


def what_ran(fn):
    """Run `fn` under the profiler (which, unlike a dispatch mode, leaves compiled code running); count EVENTS."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        fn()
    return Counter(kind for event in profile.events() if (kind := event_kind(event.name)))


# %% [markdown]
# (compile-backend)=
# ## Which backend
#
# `inductor`, torch's default, generates C++ (with OpenMP) for the CPU and Triton for
# GPUs. On a CPU it needs a C++ compiler; where it has none, the first comparison below
# falls back to `aot_eager`: the same graph capture (dynamo) and autograd tracing
# (AOTAutograd), run by eager kernels. It is the only one that uses `inductor`, because
# the numbers are where inductor differs. Every other cell uses `aot_eager`: what they
# show (graphs, graph breaks, guards, FSDP's hooks and collectives, the activations saved)
# is decided by dynamo and AOTAutograd before a backend sees the graph, and inductor's C++
# compile of each graph would only add its time to this page.

# %% [markdown]
# (compile-where)=
# ## Three places to compile
#
# The same 3 training steps: eager; each block compiled after `fully_shard`; each block
# compiled before `fully_shard` (torchtitan's order: `parallelize_llama` in
# `torchtitan/models/llama3/infra/parallelize.py` compiles each block, then shards); the whole model
# compiled after sharding. `module.compile()` compiles in place (more on that
# {ref}`below <compile-names>`). Dynamo's own counters (`torch._dynamo.utils.counters`,
# private) say which frames it gave up on, and why. One more step after training is
# profiled: FSDP's collectives in it, and how many times compiled code ran in it.


# %%
def skipped_frames():
    """Why dynamo ran a frame eagerly: the last line of each reason it counted."""
    reasons = torch._dynamo.utils.counters["unimplemented"]
    return sorted(
        {reason.strip().splitlines()[0] for reason in reasons if "Skipping the frame" in reason}
        | {
            line.strip()
            for reason in reasons
            for line in reason.splitlines()
            if line.strip().startswith("graph break in loop")
        }
    )


def compiled_where(where, backend):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    log = CompileLog(backend)
    model = build_model()
    if where == "each block, before fully_shard":
        for block in model.blocks:
            block.compile(backend=log)
    shard(model)
    if where == "each block, after fully_shard":
        for block in model.blocks:
            block.compile(backend=log)
    if where == "whole model":
        model.compile(backend=log)
    losses, params = train(model)
    runs = log.runs
    ran = what_ran(lambda: model(*batch(0))[1].backward())  # one more step, profiled
    collectives = f"{ran['all-gathers']}+{ran['reduce-scatters']}"
    return losses, params, log.graphs, skipped_frames(), collectives, log.runs - runs


WHERE = ("eager", "each block, after fully_shard", "each block, before fully_shard", "whole model")


def every_place():
    """Each place compiled by inductor, or by aot_eager where inductor cannot compile for this rank's device."""
    try:
        return "inductor", {where: compiled_where(where, "inductor") for where in WHERE}
    except torch._dynamo.exc.BackendCompilerFailed as error:
        return f"aot_eager (inductor failed: {str(error).splitlines()[0]})", {
            where: compiled_where(where, "aot_eager") for where in WHERE
        }


backend, results = launch(every_place, output="none")[0]
eager_losses, eager_params, *_ = results["eager"]
print(f"backend: {backend}")
print(
    f"{'compiled':32} {'losses':>30} {'params vs eager':>16} {'graphs (linears)':>17} "
    f"{'AG+RS':>6} {'compiled runs':>14}"
)
for where, (losses, params, graphs, skipped, collectives, runs) in results.items():
    difference = largest_difference((params[name], p) for name, p in eager_params.items())
    print(
        f"{where:32} {' '.join(f'{x:.6f}' for x in losses):>30} {difference:16.1e} "
        f"{len(graphs):>6} {str(graphs):>10} {collectives:>6} {runs:>14}"
    )
    for reason in skipped:
        print(f"{'':34}dynamo: {reason}")

# %% [markdown]
# - **Each block, in either order**, compiles one graph: the block's forward (6 linears),
#   which both blocks share (same code, and dynamo makes their parameters inputs of the
#   graph, not constants in it: `inline_inbuilt_nn_modules`, always on in torch 2.13's
#   `torch/_dynamo/config.py`), with AOTAutograd deriving its backward. FSDP's hooks stay
#   outside the graph: `module.compile()` compiles the module's `_call_impl`
#   (`Module.compile` in `torch/nn/modules/module.py`), torch's own code, which dynamo does
#   not trace as a frame; the first frame it traces is `Block.forward` (the function the
#   recompilation log {ref}`below <compile-logs>` names). So there is no graph break at
#   all, and the hooks run eagerly around the graph: in the profiled step the compiled
#   graph ran twice (once per block, "compiled runs") and FSDP issued the same all-gathers
#   and reduce-scatters as eager ("AG+RS"). `fully_shard` after `compile()` adds its hooks
#   to the same untraced path, which is why the two orders behave alike.
# - **The whole model** compiles the same single graph, and nothing else: FSDP2 wraps its
#   hooks in `torch._dynamo.disable` ("skipping FSDP hooks", `_dynamo_disable` in
#   `_fsdp_common.py`), so when dynamo traces the root's `forward` into a sharded block's
#   call, the call to `disable` is a graph break (the reason dynamo gives names `disable`);
#   the break sits inside the `for block in self.blocks` loop, where dynamo cannot resume,
#   so it gives up on the root's whole frame: the embeddings, final norm, head and loss
#   run eagerly. Only the blocks, entered as frames of their own, are compiled.
# - **The numbers**: with `aot_eager` the kernels are eager's, so training is identical;
#   with `inductor`, fused kernels may round differently (the differences, if any, are in
#   the column "params vs eager").
#
# `fullgraph=True` turns a graph break into an error, which is how to check that a block
# compiles whole (torchtitan's `apply_compile` passes its `compile.fullgraph` setting to
# each block's `torch.compile`):


# %%
def fullgraph(where):
    torch._dynamo.reset()
    model = shard(build_model())
    modules = model.blocks if where == "each block" else [model]
    for module in modules:
        module.compile(backend="aot_eager", fullgraph=True)
    try:
        model(*batch(0))[1].backward()
        return "compiles"
    except torch._dynamo.exc.Unsupported as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0]}"


def both_fullgraphs():
    return {where: fullgraph(where) for where in ("each block", "whole model")}


for where, outcome in launch(both_fullgraphs, output="none")[0].items():
    print(f"fullgraph=True, {where:12} -> {outcome}")

# %% [markdown]
# (compile-measure)=
# ### Measure compiled code with the profiler, not a dispatch mode
#
# The table above counts collectives with `torch.profiler`, not with a `TorchDispatchMode`
# (this package's {func}`fsdp_guide.precision.record_dtypes`, or torch's `CommDebugMode`,
# which is one too: `torch/distributed/tensor/debug/_comm_mode.py`). The compiled blocks'
# runs per step, with one step under such a mode:

# %%
from fsdp_guide.precision import record_dtypes


def blocks_compiled_after_sharding():
    """A fresh sharded model with each block compiled (`aot_eager`), and the log of its graphs."""
    torch._dynamo.reset()
    log = CompileLog("aot_eager")
    model = shard(build_model())
    for block in model.blocks:
        block.compile(backend=log)
    return model, log


def compiled_runs_per_step():
    model, log = blocks_compiled_after_sharding()

    def runs_in_a_step():
        before = log.runs
        model(*batch(0))[1].backward()
        return log.runs - before

    runs = {"a step": runs_in_a_step()}
    with record_dtypes():
        runs["a step under a TorchDispatchMode"] = runs_in_a_step()
    runs["a step after it"] = runs_in_a_step()
    torch._dynamo.reset()
    runs["a step after torch._dynamo.reset()"] = runs_in_a_step()
    return runs


for when, runs in launch(compiled_runs_per_step, output="none")[0].items():
    print(f"{when:36} compiled block graph ran {runs}x")

# %% [markdown]
# Under the mode, the blocks ran eagerly, and they kept running eagerly after it, until
# `torch._dynamo.reset()`. Dynamo declines a frame while a dispatch mode is on the stack,
# unless the mode's `ignore_compile_internals()` says otherwise (`CatchErrorsWrapper.__call__`
# in `torch/_dynamo/convert_frame.py`; the default, `False`, is documented in
# `TorchDispatchMode.ignore_compile_internals`, `torch/utils/_python_dispatch.py`), and a
# declined frame is skipped for that code from then on (`ConvertFrameReturn`'s default
# `apply_to_code=True`, `torch/_dynamo/types.py`). So a dispatch mode measures eager code,
# and one used once leaves the model eager: count a compiled model's collectives with the
# profiler, as `what_ran` does.

# %% [markdown]
# (compile-names)=
# ## `module.compile()` keeps the names; `torch.compile(module)` does not
#
# `torch.compile(module)` returns a wrapper (`OptimizedModule`) that holds the module as
# `_orig_mod`; put back into the model, it adds that name to every parameter under it.
# `module.compile()` compiles the module in place:

# %%
import traceback

wrapped, in_place = build_model(), build_model()
for i, block in enumerate(wrapped.blocks):
    wrapped.blocks[i] = torch.compile(block)  # lazy: nothing compiles until it runs
for block in in_place.blocks:
    block.compile()
print("torch.compile(block):", list(wrapped.state_dict())[2])
print("block.compile():     ", list(in_place.state_dict())[2])
try:  # a checkpoint of the wrapped model, loaded into an eager one
    build_model().blocks[0].load_state_dict(wrapped.blocks[0].state_dict())
except RuntimeError as error:
    print("".join(traceback.format_exception_only(error)).strip())

# %% [markdown]
# A checkpoint saved from the wrapped model has `_orig_mod.` in its keys, and does not
# load into an eager model (or a differently compiled one) without renaming. DCP's
# `get_model_state_dict` drops `_orig_mod` only where its walk down a name meets the
# wrapper itself (`_get_fqns` in `torch/distributed/checkpoint/state_dict.py` checks for an
# `OptimizedModule`), so it removes the prefix when the compiled wrapper sits directly in
# the model (as torchtitan's `apply_compile` registers `torch.compile(block)` back, in
# `torchtitan/models/llama3/infra/parallelize.py`), not when it is inside another wrapper
# (`checkpoint_wrapper(torch.compile(block))`); a plain `state_dict()` and `torch.save`
# never do. `module.compile()` leaves the names and the module's type as they were; the
# wrapper is an `OptimizedModule`, not the sharded module's class, and forwards the
# attributes it lacks to the module inside (`OptimizedModule.__getattr__` in
# `torch/_dynamo/eval_frame.py`).
#
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
# whole model is compiled, as above, and run on 32 then 16 tokens, with the log's records
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
# - **The graph break log** says what the counters said above, and where: the break is at
#   FSDP2's `_dynamo_disable` wrapper (`_fsdp_common.py`), reached from the root's
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
#
# (compile-ac)=
# ## Activation checkpointing and compile, in each order
#
# The blocks wrapped with torch's `checkpoint_wrapper` (which recomputes a block's
# forward during its backward instead of saving its activations), compiled before or
# after wrapping, then sharded; with `aot_eager`. "Saved" is what the forward leaves for
# the backward ({func}`fsdp_guide.memory.saved_for_backward`).

# %%
from fsdp_guide.memory import saved_for_backward
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
print(f"{'':26} {'graphs (linears)':>17} {'saved, KiB':>11} {'params vs no checkpointing':>27}")
for order, (_, params, graphs, saved, _) in runs.items():
    difference = largest_difference((params[name], p) for name, p in reference.items())
    print(f"{order:26} {len(graphs):>6} {str(graphs):>10} {saved / 1024:11.0f} {difference:27.1e}")
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
#
# (compile-autograd)=
# ## Compiled autograd: FSDP2's hooks stay eager, and the root's callback is lost
#
# Compiled autograd traces the backward as the autograd engine would run it (hooks,
# gradient accumulation, and the backward AOTAutograd derived for each compiled region)
# into one graph, and compiles that (the comment on `compiled_autograd` in
# `torch/_dynamo/config.py`). `torch._dynamo.config.compiled_autograd = True` turns it on around
# every call of a compiled function, so for a `loss.backward()` called inside one, through
# the context manager `torch._dynamo.compiled_autograd._enable(compiler)`
# (`call_compiled_autograd` in `OptimizeContext.__init__`, `torch/_dynamo/eval_frame.py`);
# torch 2.13 has no public `enable`, so this cell calls `_enable` around an ordinary
# `loss.backward()`. One step of the sharded model, with one block (compiled autograd's
# graph grows with the blocks, and so does its compile time; one block shows a block's
# hooks and the root's alike), the block compiled, with an eager backward and with
# compiled autograd (its graphs compiled with `aot_eager` through `CompileLog`), each
# profiled by `what_ran`:

# %%
from torch._dynamo import compiled_autograd
from torch.distributed.tensor import DTensor

# the root's own (the head is tied)
ROOT_PARAMS = ("tok_emb.weight", "pos_emb.weight", "ln_f.weight", "ln_f.bias")
# compiled autograd compiles slowly on a CPU
ONE_BLOCK = GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32)


def full(grad):
    return (grad.full_tensor() if isinstance(grad, DTensor) else grad).cpu()


def one_step(autograd_backend):
    """Step 0's forward and backward (through compiled autograd when given a backend), profiled."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = shard(build_model(ONE_BLOCK))
    for block in model.blocks:
        block.compile(backend="aot_eager")
    sharded = dict(model.named_parameters())  # the DTensors an optimizer holds

    def step():
        _, loss = model(*batch(0))
        if autograd_backend is None:
            loss.backward()
        else:
            with compiled_autograd._enable(torch.compile(backend=autograd_backend)):
                loss.backward()

    ran = what_ran(step)
    return {
        "ran": dict(ran),
        "graph breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
        "break reasons": sorted(
            {r.splitlines()[0] for r in torch._dynamo.utils.counters["graph_break"]}
        ),
        "with a gradient": sum(p.grad is not None for p in sharded.values()),
        "unsharded": [name for name, p in model.named_parameters() if not isinstance(p, DTensor)],
        "grads": {name: full(p.grad) for name, p in model.named_parameters()},
    }


def eager_and_compiled_autograd():
    eager = one_step(None)
    log = CompileLog("aot_eager")
    compiled = one_step(log)
    compiled["backward graphs"] = len(log.graphs)
    return eager, compiled


ranks = launch(eager_and_compiled_autograd, output="none")
eager, compiled = ranks[0]
print(f"{'':34} {'eager backward':>15} {'compiled autograd':>18}")
for event in EVENTS:
    print(f"{event:34} {eager['ran'].get(event, 0):>15} {compiled['ran'].get(event, 0):>18}")
print(f"{'compiled autograd graphs':34} {'-':>15} {compiled['backward graphs']:>18}")
print(f"{'graph breaks':34} {eager['graph breaks']:>15} {compiled['graph breaks']:>18}")
print(
    f"{'sharded parameters with a grad':34} {eager['with a gradient']:>15} {compiled['with a gradient']:>18}"
    f"   (of {len(eager['grads'])})"
)
print(
    f"{'left unsharded after backward':34} {len(eager['unsharded']):>15} {len(compiled['unsharded']):>18}"
    f"   {', '.join(compiled['unsharded'])}"
)
for reason in compiled["break reasons"]:
    print(f"compiled autograd's graph breaks: {reason}")
blocks = largest_difference(
    (compiled["grads"][name], g) for name, g in eager["grads"].items() if name not in ROOT_PARAMS
)
print(f"block parameters' gradients vs eager: {blocks:.1e}")
for name in ROOT_PARAMS:
    # what a reduce-scatter would average
    mean = sum(rank[1]["grads"][name] for rank in ranks) / len(ranks)
    rank0 = (compiled["grads"][name] - eager["grads"][name]).abs().max().item()
    over_ranks = (mean - eager["grads"][name]).abs().max().item()
    print(f"{name:15} gradient vs eager: rank 0's {rank0:.1e}, mean over ranks {over_ranks:.1e}")

# %% [markdown]
# - **A block's hooks run, eagerly.** Compiled autograd records FSDP's tensor hooks and
#   the backward of its `RegisterPostBackwardFunction` as calls in its graph
#   (`AutogradCompilerInstance.tensor_pre_hook` and `proxy_call_backward`,
#   `torch/_dynamo/compiled_autograd.py`), but when dynamo compiles that graph, it finds
#   them marked `torch._dynamo.disable` (the same `_dynamo_disable` as in the forward):
#   each is a graph break (the reason printed), and the graph is compiled in the pieces
#   between them ("compiled autograd graphs"). The hooks run between the pieces, so the
#   block's all-gather and reduce-scatter are issued as in eager, and its gradients equal
#   eager's.
# - **The root's post-backward never runs.** The root's parameters (embeddings, final
#   norm) get their post-backward (reduce-scatter, reshard) from the callback the root
#   queues for the end of the backward: `_root_post_backward_final_callback` in
#   `_fsdp_state.py` runs `post_backward` for each group whose own hook did not run (the
#   root's input, token ids, needs no gradient, so its hook never fires). It is queued
#   with `Variable._execution_engine.queue_callback`. Dynamo can move such a call into the
#   compiled graph only when it traces it with `fullgraph=True`
#   (`AutogradEngineVariable.call_method`, `torch/_dynamo/variables/misc.py`); FSDP2 makes
#   the call inside its disabled `_pre_backward` hook, and the callback does not run (the
#   profiler counts it once in eager, never under compiled autograd). So one reduce-scatter
#   is missing, the root's parameters stay unsharded, their gradients are this rank's own
#   (the mean over ranks is eager's gradient: the reduction is what is missing), and the
#   sharded parameters an optimizer holds got no gradient: an optimizer step would skip
#   them, silently (AdamW's `_init_group`, `torch/optim/adam.py`, takes only parameters
#   whose `grad` is not `None`).
# - **Why**: torch removed FSDP2's support for compiled autograd along with dynamo tracing of
#   its hooks ([pytorch#174863](https://github.com/pytorch/pytorch/pull/174863), "FSDP2 hooks
#   are now unconditionally wrapped with `torch._dynamo.disable`";
#   [pytorch#174906](https://github.com/pytorch/pytorch/pull/174906), "remove compiled
#   autograd since we are not tracing into hooks"). Nothing in this is specific to the CPU
#   or to gloo: it is the hooks' Python. With FSDP2 in torch 2.13, compile the blocks and
#   leave the backward to the autograd engine.
#
# (compile-optimizer)=
# ## Compiling the optimizer step
#
# The optimizer step can be compiled on its own: `torch.compile(optimizer.step)`. With
# FSDP2 its parameters, gradients and AdamW's moments are DTensors. `foreach=True` is
# AdamW's default for DTensors on GPUs (`_default_to_fused_or_foreach` in
# `torch/optim/optimizer.py`; on the CPU the default is a loop over parameters), and is
# set here. Dynamo traces every param group with `capturable=True`, on any device
# (`OptimizerVariable._set_capturable`, `torch/_dynamo/variables/optimizer.py`, and "Note
# [torch.compile x capturable]" in `optimizer.py`), so the CPU traces AdamW's capturable
# branch as a GPU run does; only on a GPU does it also set the real group's flag (the
# value printed below is that one). Three steps on the one-block GPT above, eager and
# compiled, each step profiled for every collective c10d runs, of any kind
# (`collectives_in`; beside it, the same count around one all-reduce, to show it sees
# one):

# %%
# eager c10d, and the functional form graphs use
COLLECTIVE_OPS = ("c10d::", "_c10d_functional::", "c10d_functional::")


def collectives_in(fn):
    """Run `fn` under the profiler; count every collective by its op's name, not only FSDP's two."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        fn()
    return Counter(
        event.name for event in profile.events() if event.name.startswith(COLLECTIVE_OPS)
    )


def one_all_reduce():
    import torch.distributed as dist

    return collectives_in(lambda: dist.all_reduce(torch.ones(1, device=fsdp_guide.device())))


def optimizer_steps(compiled, backend="aot_eager"):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    log = CompileLog(backend)
    model = shard(build_model(ONE_BLOCK))  # the graph's size grows with the number of parameters
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    step = torch.compile(optimizer.step, backend=log) if compiled else optimizer.step
    ran = Counter()
    for i in range(STEPS):
        model(*batch(i))[1].backward()
        ran += collectives_in(step)
        optimizer.zero_grad()
    params = {name: p.full_tensor().cpu() for name, p in model.named_parameters()}
    capturable = [group["capturable"] for group in optimizer.param_groups]
    return (
        params,
        [inputs["DTensor"] for inputs in log.inputs],
        log.runs,
        dict(ran),
        sum(torch._dynamo.utils.counters["graph_break"].values()),
        capturable,
        sorted({reason.splitlines()[0] for reason in torch._dynamo.utils.counters["graph_break"]}),
    )


def both_optimizer_steps():
    return (
        optimizer_steps(compiled=False),
        optimizer_steps(compiled=True),
        optimizer_steps(compiled=True, backend="eager"),
        one_all_reduce(),
    )


eager_run, compiled_run, (dynamo_only, *_), control = launch(both_optimizer_steps, output="none")[0]
eager_params = eager_run[0]
params, inputs, runs, collectives, breaks, capturable, reasons = compiled_run
print(
    f"compiled optimizer.step: {len(inputs)} graph(s), with {inputs} DTensor inputs, for {len(params)} parameters"
)
print(
    f"  the compiled graph ran {runs}x in {STEPS} steps; graph breaks: {breaks}; capturable: {capturable}"
)
print(f"  graph breaks, by reason: {reasons}")
print(
    f"  collectives in the compiled steps: {collectives or 'none'} (around one all-reduce: {dict(control)})"
)
difference = largest_difference((params[name], p) for name, p in eager_params.items())
print(f"  parameters after {STEPS} steps vs eager AdamW: max |difference| {difference:.1e}")
print(
    f"  the same with backend='eager' (dynamo's graph run by torch's own kernels, no AOTAutograd): "
    f"{largest_difference((dynamo_only[name], p) for name, p in eager_params.items()):.1e}"
)

# %% [markdown]
# - **It compiles**, into one graph that takes DTensors as inputs, one per parameter:
#   AOTAutograd traces through tensor subclasses to the tensors inside
#   (`torch/_functorch/_aot_autograd/subclass_utils.py`), here each rank's shard, and an
#   elementwise update on `Shard(0)` needs no communication: no collective of any kind ran
#   in the compiled steps, where the same count finds the all-reduce beside them. Each
#   rank updates its own shard, as in eager.
# - **The graph break is torch's own**: its reason, printed, is a call to
#   `torch._dynamo.graph_break()`, which `_use_grad_for_differentiable` in
#   `torch/optim/optimizer.py` makes around the update (before it and after it) so that
#   AOTAutograd sees it under `no_grad` (the comment there explains the allocation it
#   saves). Only the update becomes a graph.
# - **The numbers are not eager's bit for bit**, and the last line separates where the
#   difference comes from: it is there with `backend='eager'` too, where dynamo's graph runs
#   on torch's own kernels without AOTAutograd. So it comes from the graph dynamo traces,
#   which takes AdamW's paths for compiling (the capturable branch above, and its
#   `torch.compiler.is_compiling()` branches: `_get_value` in `optimizer.py`, for one,
#   keeps the step count a tensor), not from
#   AOTAutograd or a backend's kernels. Check a compiled step against an eager one to a
#   tolerance, not bit for bit.
#
# (compile-gpu)=
# ## What to expect on GPUs (not run here)
#
# Nothing on this page ran on a GPU; this is what torch's source says should happen there.
#
# - Inductor generates Triton kernels for GPUs (`torch/_inductor/codegen/triton.py`), and
#   its scheduler fuses operations that can share a kernel (`Scheduler.fuse_nodes`,
#   `torch/_inductor/scheduler.py`): the pointwise work around the matmuls (norms, GELU,
#   residual adds), which eager launches one kernel each, is where compile is expected to
#   save time, and more so for small hidden sizes, where those launches weigh more against
#   the matmuls.
# - FSDP's all-gathers and reduce-scatters are issued by its hooks, which stay eager (the
#   profiled step above issues the same collectives compiled and eager), on the streams
#   FSDP creates for them (`FSDPCommContext.lazy_init` in `_fsdp_param_group.py`:
#   `all_gather_stream`, `reduce_scatter_stream`). So their overlap with compute is
#   expected to be eager FSDP's: compiling the blocks changes the kernels between the
#   hooks, not the communication.
# - Compiled autograd's loss of the root's final callback is in FSDP2's Python hooks, not
#   in a device's code, so it is expected on GPUs as here.
# - The first call of each graph compiles it, in every rank's process. Inductor keeps
#   compiled graphs in an on-disk cache (`fx_graph_cache`, on by default in
#   `torch/_inductor/config.py`) under `TORCHINDUCTOR_CACHE_DIR` (`cache_dir` in
#   `torch/_inductor/runtime/cache_dir_utils.py`), which later runs of the same graphs
#   reuse. Keep shapes few and fixed (or dynamic from the start) so that no step
#   recompiles in the middle of training ({ref}`compile-recompiles`).
#
# (compile-tips)=
# ## The tips behind this
#
# - {ref}`tip-compile-per-block`
# - {ref}`tip-compile-in-place`
# - {ref}`tip-compile-recompiles`
# - {ref}`tip-compile-with-checkpointing`
# - {ref}`tip-compile-measure-with-profiler`
# - {ref}`tip-compile-no-compiled-autograd`
# - {ref}`tip-compile-optimizer-step`

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("compile")
