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
#   the backward, and the losses.
#
# **What you need**: a CPU; 2 processes on gloo; about 60 seconds on 2 CPU cores the
# first time (inductor compiles C++; later runs reuse its on-disk cache). The worker code
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
# hands it (the number of `linear` calls in it says what it covers: a block has 6) and
# passes it on to a real backend. It, `torch._dynamo.reset()` and dynamo's counters are
# this page's instruments, private debugging helpers; a training script just calls
# `block.compile()` (with `mode=` or `options=` as it needs).

# %%
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fsdp_guide
from fsdp_guide import launch
from fsdp_guide.gpt import GPT, GPTConfig

CONFIG = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)
STEPS = 3


def build_model():
    torch.manual_seed(0)
    model = GPT(CONFIG)
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
    rows = torch.randint(CONFIG.vocab_size, (2 * dist.get_world_size(), CONFIG.block_size + 1), generator=g)
    mine = rows[2 * dist.get_rank():2 * dist.get_rank() + 2, :tokens + 1].to(fsdp_guide.device())
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
    params = {name.replace("_checkpoint_wrapped_module.", ""): p.full_tensor().cpu()
              for name, p in model.named_parameters()}
    return losses, params


class CompileLog:
    """A torch.compile backend: note each graph (its linear calls), then compile it with `backend`."""

    def __init__(self, backend):
        self.backend = torch._dynamo.lookup_backend(backend)
        self.graphs = []

    def __call__(self, graph_module, example_inputs):
        self.graphs.append(sum("linear" in str(node.target) for node in graph_module.graph.nodes))
        return self.backend(graph_module, example_inputs)

# %% [markdown]
# (compile-backend)=
# ## Which backend
#
# `inductor`, torch's default, generates C++ (with OpenMP) for the CPU and Triton for
# GPUs. On a CPU it needs a C++ compiler; where it has none, this page falls back to
# `aot_eager`: the same graph capture (dynamo) and autograd tracing (AOTAutograd), run by
# eager kernels. Each rank tries `inductor` on a tiny function on its own device (rank
# 0's answer is used: here every rank is on the same machine):

# %%
def pick_backend():
    """inductor where it compiles for this rank's device, else aot_eager."""
    try:
        torch.compile(lambda x: x * 2 + 1, backend="inductor")(torch.ones(4, device=fsdp_guide.device()))
        return "inductor", "it compiled a test function"
    except torch._dynamo.exc.BackendCompilerFailed as error:
        return "aot_eager", str(error).splitlines()[0]
    finally:
        torch._dynamo.reset()


BACKEND, why = launch(pick_backend, output="none")[0]
print(f"backend for the cells below that say BACKEND: {BACKEND} ({why})")

# %% [markdown]
# (compile-where)=
# ## Three places to compile
#
# The same 3 training steps: eager; each block compiled after `fully_shard`; each block
# compiled before `fully_shard` (torchtitan's order: compile, then shard); the whole model
# compiled after sharding. `module.compile()` compiles in place (more on that
# {ref}`below <compile-names>`). Dynamo's own counters (`torch._dynamo.utils.counters`,
# private) say which frames it gave up on, and why.

# %%
from fsdp_guide.precision import record_dtypes


def skipped_frames():
    """Why dynamo ran a frame eagerly: the last line of each reason it counted."""
    reasons = torch._dynamo.utils.counters["unimplemented"]
    return sorted({reason.strip().splitlines()[0] for reason in reasons if "Skipping the frame" in reason}
                  | {line.strip() for reason in reasons for line in reason.splitlines()
                     if line.strip().startswith("graph break in loop")})


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
    with record_dtypes() as seen:  # one more step: FSDP's collectives
        model(*batch(0))[1].backward()
    collectives = sum(n for (_, kind), n in seen.count.items() if kind in ("all-gather", "reduce-scatter"))
    return losses, params, log.graphs, skipped_frames(), collectives


WHERE = ("eager", "each block, after fully_shard", "each block, before fully_shard", "whole model")


def every_place(backend):
    return {where: compiled_where(where, backend) for where in WHERE}


results = launch(every_place, BACKEND, output="none")[0]
eager_losses, eager_params, *_ = results["eager"]
print(f"backend: {BACKEND}")
print(f"{'compiled':32} {'losses':>30} {'params vs eager':>16} {'graphs (linears)':>17} {'collectives':>12}")
for where, (losses, params, graphs, skipped, collectives) in results.items():
    difference = max((params[name] - p).abs().max().item() for name, p in eager_params.items())
    print(f"{where:32} {' '.join(f'{x:.6f}' for x in losses):>30} {difference:16.1e} "
          f"{len(graphs):>6} {str(graphs):>10} {collectives:12}")
    for reason in skipped:
        print(f"{'':34}dynamo: {reason}")

# %% [markdown]
# - **Each block, in either order**, compiles one graph: the block's forward (6 linears),
#   which both blocks share (same code, and their parameters are inputs to the graph, not
#   constants in it), with AOTAutograd deriving its backward. FSDP's hooks stay outside
#   the graph: the first frame dynamo traces is `Block.forward`, while the hooks run in
#   `Module._call_impl`, torch's own code, which it does not trace as a frame of its own.
#   So there is no graph break at all, the hooks run eagerly around the graph, and the
#   collectives are eager's. `fully_shard` after `compile()` adds its hooks to the same
#   untraced path, which is why the two orders behave alike.
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
# compiles whole (torchtitan compiles each block that way):

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
# (compile-names)=
# ## `module.compile()` keeps the names; `torch.compile(module)` does not
#
# `torch.compile(module)` returns a wrapper (`OptimizedModule`) that holds the module as
# `_orig_mod`; put back into the model, it adds that name to every parameter under it.
# `module.compile()` compiles the module in place:

# %%
wrapped, in_place = build_model(), build_model()
for i, block in enumerate(wrapped.blocks):
    wrapped.blocks[i] = torch.compile(block)  # lazy: nothing compiles until it runs
for block in in_place.blocks:
    block.compile()
print("torch.compile(block):", list(wrapped.state_dict())[2])
print("block.compile():     ", list(in_place.state_dict())[2])
print("an eager checkpoint into the wrapped model:",
      str(wrapped.load_state_dict(build_model().state_dict(), strict=False).missing_keys[:1]), "missing")

# %% [markdown]
# A checkpoint saved from the wrapped model has `_orig_mod.` in its keys, and does not
# load into an eager model (or a differently compiled one) without renaming. DCP's
# `get_model_state_dict` removes the prefix when the compiled wrapper sits directly in
# the model (torchtitan registers `torch.compile(block)` back into the model and relies on
# that), but not when it is inside another wrapper (`checkpoint_wrapper(torch.compile(block))`
# keeps it); a plain `state_dict()` and `torch.save` never do. `module.compile()` leaves
# the names and the module's type as they were: it is still an `FSDPModule` to
# `isinstance`, where the wrapper is not (its attributes, `reshard()` included, are
# forwarded to the module inside).
#
# (compile-recompiles)=
# ## What recompiles
#
# Each block compiled after `fully_shard`, with `aot_eager`: which graphs dynamo makes
# (and when a {term}`recompilation` makes a new one) is decided by dynamo's guards, and the backend rarely adds
# any (inductor can add shape guards). The count is the graphs compiled so far. The
# forward in `eval()` with gradients enabled is there only to tell the two guards apart:
# evaluate under `no_grad`.

# %%
def recompilations():
    torch._dynamo.reset()
    log = CompileLog("aot_eager")
    model = shard(build_model())
    for block in model.blocks:
        block.compile(backend=log)
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
#   `torch._dynamo.config.recompile_limit` (8) graphs per code object (and module
#   instance); past that it warns and runs the frame eagerly from then on, silently slow
#   unless `fail_on_recompile_limit_hit` is set. The blocks here share one budget.
# - `reshard_after_forward` changes nothing in the graph: FSDP's resharding happens in its
#   hooks, outside it.
# - A new sequence length recompiles once, with that dimension made dynamic (symbolic);
#   later lengths reuse the dynamic graph. To avoid the first static graph, compile with
#   `dynamic=True` (every dimension symbolic, batch included), or mark the dimension with
#   `torch._dynamo.mark_dynamic` on the block's input where the model's forward makes it
#   (marking the token batch does not reach a graph that starts inside the blocks); or
#   pad batches to a few fixed lengths.
#
# (compile-ac)=
# ## Activation checkpointing and compile, in each order
#
# The blocks wrapped with torch's `checkpoint_wrapper` (which recomputes a block's
# forward during its backward instead of saving its activations), compiled before or
# after wrapping, then sharded; with `aot_eager`. "Saved" is what the forward leaves for
# the backward ({func}`fsdp_guide.memory.saved_for_backward`).

# %%
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from fsdp_guide.memory import saved_for_backward

ORDERS = ("no checkpointing, eager", "checkpointing, eager", "checkpoint, then compile",
          "compile, then checkpoint")


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
    return losses, params, log.graphs, saved.held_at_exit


def every_order():
    return {order: checkpointed(order) for order in ORDERS}


runs = launch(every_order, output="none")[0]
_, reference, *_ = runs["no checkpointing, eager"]
print(f"{'':26} {'graphs (linears)':>17} {'saved, KiB':>11} {'params vs no checkpointing':>27}")
for order, (losses, params, graphs, saved) in runs.items():
    difference = max((params[name] - p).abs().max().item() for name, p in reference.items())
    print(f"{order:26} {len(graphs):>6} {str(graphs):>10} {saved / 1024:11.0f} {difference:27.1e}")

# %% [markdown]
# - **Checkpoint, then compile** (torchtitan's order: checkpointing, compile, then FSDP):
#   dynamo traces the wrapper's `torch.utils.checkpoint` call as one higher-order
#   operator (the block's linears sit in a subgraph, so the top level counts none), and
#   AOTAutograd's partitioner recomputes the checkpointed region in the compiled
#   backward. The partitioner keeps only the block's input; the extra 9 KiB over eager
#   checkpointing is a snapshot of the CPU generator's state per block (about 5 KiB each),
#   saved so that the recomputed attention, an operator with a dropout argument, replays
#   the same random stream. Eager checkpointing keeps its RNG state too, as a Python
#   attribute that `saved_tensors_hooks` does not see. (A CUDA generator's state is a few
#   bytes.)
# - **Compile, then checkpoint**: the wrapper is eager and calls the compiled block twice,
#   in the forward and again in the backward's recomputation; the block's graph is the
#   same as without checkpointing. It saves what eager checkpointing saves.
# - Both train exactly as eager does with `aot_eager`. On GPUs, the first order is
#   expected to be the one that lets inductor fuse the recomputation into the backward's
#   kernels, and torchtitan applies it; the second recomputes with the compiled forward.
#
# (compile-gpu)=
# ## What to expect on GPUs (not run here)
#
# - Inductor generates Triton kernels and fuses the pointwise work around the matmuls
#   (norms, GELU, residual adds, the transposing copies around the attention), where eager launches one
#   kernel each: that is where compile is expected to save time, more for small hidden
#   sizes, where those kernels weigh more.
# - FSDP's all-gathers and reduce-scatters stay in its eager hooks, on their own CUDA
#   streams, so their overlap with compute is expected to be eager FSDP's: compiling the
#   blocks does not change the communication (this page measures the same collectives).
# - The first step pays the compile (seconds to minutes, per distinct graph and rank);
#   inductor caches compiled kernels on disk (`TORCHINDUCTOR_CACHE_DIR`), and later runs
#   of the same graphs reuse them. Keep shapes few and fixed (or dynamic from the start)
#   so that no step recompiles in the middle of training.
#
# (compile-tips)=
# ## The tips behind this
#
# - {ref}`tip-compile-per-block`
# - {ref}`tip-compile-in-place`
# - {ref}`tip-compile-recompiles`
# - {ref}`tip-compile-with-checkpointing`

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("compile")
