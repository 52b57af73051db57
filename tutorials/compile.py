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
# # `torch.compile` on a sharded model: where to compile, and how to check it
#
# **What you will learn**
#
# - where `torch.compile` goes in a sharded model: each block after `fully_shard`, each
#   block before it, or the whole model; what each compiles ({term}`graph <graph break>`
#   count, graph breaks) and how its training compares with eager;
# - why compiling a whole FSDP2 model compiles only its blocks, and what
#   `fullgraph=True` says about it;
# - why a `TorchDispatchMode` is the wrong instrument for compiled code, and the profiler
#   the right one;
# - `module.compile()` against `torch.compile(module)`: the state-dict names.
#
# **What you need**: a CPU; 2 processes on gloo; about 30 seconds on 2 CPU cores ({ref}`measured <measured-times>`) with
# inductor's cache empty, as it compiles C++ (later runs reuse its on-disk cache and take
# less). The worker code
# is written to run unchanged with one GPU per rank (NCCL); on GPUs inductor generates
# Triton kernels instead, and what this page says about GPUs is what is expected there,
# not something it ran. The tips it demonstrates are listed
# {ref}`at the end <compile-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`compile-script` ({download}`download <scripts/compile.py>`).
#
# The pages after this one take the same compiled blocks further: what recompiles them and
# what dynamo's logs report ({ref}`tutorial-compile-recompiles`), activation checkpointing
# with compile ({ref}`tutorial-compile-checkpointing`), and compiled autograd and the
# compiled optimizer step ({ref}`tutorial-compiled-autograd`).

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
# operators gloo and NCCL both run), as the profiler records them. `CompileLog`,
# `torch._dynamo.reset()` and dynamo's counters are this page's instruments, private
# debugging helpers; a training script just calls `block.compile()` (with `mode=` or
# `options=` as it needs).

# %%
from collections import Counter

import fsdp_guide
import torch.distributed as dist
from fsdp_guide import launch
from fsdp_guide.collectives import collective_kind
from fsdp_guide.compare import largest_difference
from fsdp_guide.gpt import GPT, GPTConfig
from fsdp_guide.table import Table
from IPython.display import display
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
    return losses, {name: p.full_tensor().cpu() for name, p in model.named_parameters()}


class CompileLog:
    """A torch.compile backend: note each graph's linear calls, compile it with `backend`,
    and count the calls of the compiled code in `runs`."""

    def __init__(self, backend):
        self.backend = torch._dynamo.lookup_backend(backend)
        self.graphs, self.runs = [], 0

    def __call__(self, graph_module, example_inputs):
        self.graphs.append(sum("linear" in str(node.target) for node in graph_module.graph.nodes))
        compiled = self.backend(graph_module, example_inputs)

        def run(*args):
            self.runs += 1
            return compiled(*args)

        # keep the backend's calling convention
        run._boxed_call = getattr(compiled, "_boxed_call", False)
        return run


# FSDP's all-gathers and reduce-scatters, eager (c10d) or traced into a graph (functional)
COUNTED = {"all-gather": "all-gathers", "reduce-scatter": "reduce-scatters"}


def what_ran(fn):
    """Run `fn` under the profiler (which, unlike a dispatch mode, leaves compiled code running); count COUNTED."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        fn()
    return Counter(
        kind for event in profile.events() if (kind := COUNTED.get(collective_kind(event.name)))
    )


# %% [markdown]
# (compile-backend)=
# ## Which backend
#
# `inductor`, torch's default, generates C++ (with OpenMP) for the CPU and Triton for
# GPUs. On a CPU it needs a C++ compiler; where it has none, the first comparison below
# falls back to `aot_eager`: the same graph capture (dynamo) and autograd tracing
# (AOTAutograd), run by eager kernels. It is the only one that uses `inductor`, because
# the numbers are where inductor differs. Every other cell uses `aot_eager`: what they
# show (graphs, graph breaks, FSDP's hooks and collectives) is decided by dynamo and
# AOTAutograd before a backend sees the graph, and inductor's C++ compile of each graph
# would only add its time to this page. (The pages after this one use `aot_eager`
# throughout, for the same reason.)

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
rows = []
for where, (losses, params, graphs, _, collectives, runs) in results.items():
    difference = largest_difference((params[name], p) for name, p in eager_params.items())
    losses = " ".join(f"{x:.6f}" for x in losses)
    rows.append([where, losses, f"{difference:.1e}", len(graphs), str(graphs), collectives, runs])
header = [
    "compiled",
    "losses",
    "params vs eager",
    "graphs",
    "linears per graph",
    "AG+RS",
    "compiled runs",
]
display(Table(header, rows))
for where, (_, _, _, skipped, _, _) in results.items():
    for reason in skipped:  # the frames dynamo ran eagerly, and why
        print(f"{where}, dynamo: {reason}")

# %% [markdown]
# - **Each block, in either order**, compiles one graph: the block's forward (6 linears),
#   which both blocks share (same code, and dynamo makes their parameters inputs of the
#   graph, not constants in it: `inline_inbuilt_nn_modules`, always on in torch 2.13's
#   `torch/_dynamo/config.py`), with AOTAutograd deriving its backward. FSDP's hooks stay
#   outside the graph: `module.compile()` compiles the module's `_call_impl`
#   (`Module.compile` in `torch/nn/modules/module.py`), torch's own code, which dynamo does
#   not trace as a frame; the first frame it traces is `Block.forward` (the function the
#   recompilation log on {ref}`the next page <compile-logs>` names). So there is no graph break at
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

# %% [markdown]
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
# - The first call of each graph compiles it, in every rank's process. Inductor keeps
#   compiled graphs in an on-disk cache (`fx_graph_cache`, on by default in
#   `torch/_inductor/config.py`) under `TORCHINDUCTOR_CACHE_DIR` (`cache_dir` in
#   `torch/_inductor/runtime/cache_dir_utils.py`), which later runs of the same graphs
#   reuse. Keep shapes few and fixed (or dynamic from the start) so that no step
#   recompiles in the middle of training ({ref}`compile-recompiles`).

# %% [markdown]
# (compile-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/compile.py`.
# A small model of blocks is sharded, each block an FSDP unit, and each block is then compiled
# in place with `fullgraph=True` (an error, were there a graph break); it trains 3 steps beside
# the same model eager, and a backend that counts the graphs it is handed says how many were
# compiled. The script compiles with `aot_eager`, so that it runs in seconds on a CPU; a
# training script leaves out `backend=` to get inductor. The tests run this file under
# torchrun on 2 CPU ranks and check that the blocks compiled into one graph, that the
# profiled step ran the same collectives as eager, and that the losses equal eager's
# (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/compile.py
# :language: python
# ```

# %% [markdown]
# (compile-tips)=
# ## The tips behind this
#
# - {ref}`tip-compile-per-block`
# - {ref}`tip-compile-in-place`
# - {ref}`tip-compile-measure-with-profiler`

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("compile")
