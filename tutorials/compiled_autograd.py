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
# (tutorial-compiled-autograd)=
# # Past the compiled blocks: compiled autograd and the compiled optimizer step
#
# **What you will learn**
#
# - compiled autograd with FSDP2 in torch 2.13: the hooks it leaves eager, the callback
#   and the collective it loses, and the gradients that come out wrong;
# - compiling the optimizer step on FSDP2's DTensor parameters: one graph, no collectives,
#   parameters within rounding of eager's.
#
# **What you need**: a CPU; 2 processes on gloo; about 20 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The same code is
# written to run unchanged with one GPU per rank (NCCL): each rank computes on
# {func}`fsdp_guide.device`, its GPU `cuda:LOCAL_RANK` where it has one, else the CPU;
# what this page says about GPUs is what is expected there, not something it ran.
# It follows {ref}`tutorial-compile`, which compiles each block of a sharded model and
# leaves the backward and the optimizer step eager; this page compiles those two.
# The tips are listed {ref}`at the end <compiled-autograd-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`compiled-autograd-script` ({download}`download <scripts/compiled_autograd.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# The setup (hidden; click to show) is {ref}`tutorial-compile`'s: the package's small GPT
# ({class}`fsdp_guide.gpt.GPT`), each block an FSDP unit and the root holding the
# embeddings, final norm and tied output head; `batch(step)`, this rank's 2 sequences of
# a step's global batch. `CompileLog` is a `torch.compile` backend that records each graph
# dynamo hands it (with its inputs' types), passes it on to a real backend, and counts
# the runs of the compiled code. `what_ran` counts FSDP's collectives (the c10d operators
# gloo and NCCL both run) and the root's end-of-backward callback, as the profiler records
# them. It compiles with `aot_eager`: what it shows (graphs, graph breaks, FSDP's hooks and
# collectives) is decided by dynamo and AOTAutograd before a backend sees a graph, and
# inductor's C++ compile of each graph would only add its time to this page.

# %% tags=["hide-input"]
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


def batch(step):
    """This rank's 2 sequences of the step's global batch (2 per rank)."""
    g = torch.Generator().manual_seed(100 + step)
    rows = torch.randint(
        CONFIG.vocab_size, (2 * dist.get_world_size(), CONFIG.block_size + 1), generator=g
    )
    mine = rows[2 * dist.get_rank() : 2 * dist.get_rank() + 2].to(fsdp_guide.device())
    return mine[:, :-1], mine[:, 1:]


class CompileLog:
    """A torch.compile backend: note each graph's inputs' types, compile it with `backend`,
    and count the calls of the compiled code in `runs`."""

    def __init__(self, backend):
        self.backend = torch._dynamo.lookup_backend(backend)
        self.graphs, self.inputs, self.runs = [], [], 0

    def __call__(self, graph_module, example_inputs):
        self.graphs.append(graph_module)
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
rows = [[event, eager["ran"].get(event, 0), compiled["ran"].get(event, 0)] for event in EVENTS]
rows.append(["compiled autograd graphs", "-", compiled["backward graphs"]])
rows.append(["graph breaks", eager["graph breaks"], compiled["graph breaks"]])
of = len(eager["grads"])
rows.append(
    [
        "sharded parameters with a grad",
        f"{eager['with a gradient']} of {of}",
        f"{compiled['with a gradient']} of {of}",
    ]
)
rows.append(["left unsharded after backward", len(eager["unsharded"]), len(compiled["unsharded"])])
display(Table(["one step", "eager backward", "compiled autograd"], rows))
print(f"left unsharded by compiled autograd's backward: {', '.join(compiled['unsharded'])}")
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
#   them marked `torch._dynamo.disable` (the same `_dynamo_disable` that breaks the
#   forward of a whole compiled model, {ref}`compile-where`):
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

# %% [markdown]
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

# %% [markdown]
# (compiled-autograd-gpu)=
# ## What to expect on GPUs (not run here)
#
# Nothing on this page ran on a GPU; this is what torch's source says should happen there.
#
# - Compiled autograd's loss of the root's final callback is in FSDP2's Python hooks, not
#   in a device's code, so it is expected on GPUs as here.
# - The compiled optimizer step's graph is decided by dynamo and AOTAutograd, before a
#   backend sees it: on GPUs it is expected to take DTensors and run no collective, as
#   here; there, dynamo also sets the real param group's `capturable` flag (the value
#   printed above is the CPU's, `False`).

# %% [markdown]
# (compiled-autograd-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone:
# {download}`scripts/compiled_autograd.py`. What a training script compiles with FSDP2 in
# torch 2.13: each block (in place), and the optimizer step, `torch.compile(optimizer.step)`
# over AdamW with `foreach=True`; the backward stays with the autograd engine. It trains 3
# steps beside the same model eager, checks after each backward that every sharded parameter
# has its gradient (what compiled autograd loses), and counts with the profiler the
# collectives the forwards and backwards ran (FSDP's) and those the compiled steps ran. It
# compiles with `aot_eager`, so that it runs in seconds on a CPU; a training script leaves
# out `backend=` to get inductor. The tests run this file under torchrun on 2 CPU ranks and
# check that every parameter had its gradient, that the count saw FSDP's collectives and
# the compiled steps ran none, and that the parameters end within rounding of eager AdamW's
# (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/compiled_autograd.py
# :language: python
# ```

# %% [markdown]
# (compiled-autograd-tips)=
# ## The tips behind this
#
# - {ref}`tip-compile-no-compiled-autograd`
# - {ref}`tip-compile-optimizer-step`

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("compiled_autograd")
