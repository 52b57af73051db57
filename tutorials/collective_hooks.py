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
# (tutorial-collective-hooks)=
# # Taking over FSDP2's collectives
#
# **What you will learn**
#
# - how to give FSDP2 your own all-gather and reduce-scatter, and the buffer they must never
#   hand out twice; a process group of the reduce-scatter's own;
# - how many reduce-scatters stay in flight, and the three controls that change it
#   (`set_reduce_scatter_max_input_buffers`, `set_is_last_backward`, `share_comm_ctx`);
# - a reduction of your own after FSDP's (`set_all_reduce_hook`), and the divide factor's
#   old name.
#
# **What you need**: a CPU; 2 and 4 processes on gloo; about 5 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The same code is
# written to run unchanged with one GPU per rank (NCCL): each rank computes on
# {func}`fsdp_guide.device`, its GPU `cuda:LOCAL_RANK` where it has one, else the CPU. What
# FSDP sends, and when, is {ref}`tutorial-communication`; the tips are {ref}`at the end <collective-hooks-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`collective-hooks-script` ({download}`download <scripts/collective_hooks.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %%
# Four Linears, each its own unit; one process on all ranks' batches is every gradient's reference
import fsdp_guide
import torch.distributed as dist
import torch.nn as nn
from fsdp_guide import launch
from fsdp_guide.compare import largest_difference
from myst_nb import glue

WIDTH, LAYERS = 512, 4


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)))


def shard(model, device, mesh=None):
    """Each Linear its own unit, then the root; resharded after forward (FULL_SHARD)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mesh is None:  # all ranks, on the rank's device type
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def batch_of(rank):
    return torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(rank))


def one_process_gradients(ranks=2):
    """The gradients of the mean of the ranks' losses, in one process: what FSDP's should equal."""
    device = fsdp_guide.device()
    model = make_model().to(device)
    (sum(model(batch_of(r).to(device)).square().mean() for r in range(ranks)) / ranks).backward()
    return [p.grad.cpu() for p in model.parameters()]


# %% [markdown]
# ## Your own all-gather and reduce-scatter
#
# FSDP2's two collectives are objects of the abstract classes in
# `torch/distributed/fsdp/_fully_shard/_fsdp_api.py`: `allocate(size, *, dtype, device)`,
# where FSDP gets its buffers (the all-gather's output; the reduce-scatter's input and
# output), and `__call__`, the collective. torch's own `SymmMemAllGather` and
# `SymmMemReduceScatter` (`set_symm_mem_for_comm`) are such objects, allocating from NCCL's
# symmetric memory. The two below call torch's collectives and write each call down; the
# reduce-scatter can also make the mistake a pool of buffers invites, the same buffer for
# every call of a size. Each rank's gradient shards are checked against one process on
# both ranks' batches; last, `set_separate_reduce_scatter_group()` on top:
#
# (fsdp2-fsdpmodule-set-custom-all-gather)=
# (fsdp2-fsdpmodule-set-custom-reduce-scatter)=
# (fsdp2-fsdpmodule-set-separate-reduce-scatter-group)=

# %%
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter  # the protocols


class RecordedAllGather(AllGather):
    """torch's all-gather into a fresh buffer, with each call written down."""

    def __init__(self, calls):
        self.calls = calls

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls.append(("all-gather", group.group_desc, output_tensor.nbytes))
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class RecordedReduceScatter(ReduceScatter):
    """torch's reduce-scatter, each call written down; `pooled` keeps one buffer per size and dtype."""

    def __init__(self, calls, pooled=False):
        self.calls, self.pooled, self.pool = calls, pooled, {}

    def allocate(self, size, *, dtype, device):
        if not self.pooled:
            return torch.empty(*size, dtype=dtype, device=device)
        # the mistake: a buffer handed out again and again
        if (tuple(size), dtype) not in self.pool:
            self.pool[tuple(size), dtype] = torch.empty(*size, dtype=dtype, device=device)
        return self.pool[tuple(size), dtype]

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls.append(("reduce-scatter", group.group_desc, input_tensor.nbytes))
        return dist.reduce_scatter_single(
            output_tensor, input_tensor, group=group, op=op, async_op=async_op
        )


COMMS = (
    "torch's default",
    "recorded",
    "recorded, one buffer per size",
    "recorded + separate reduce-scatter group",
)


def with_comms(setting, reference):
    device, rank = fsdp_guide.device(), dist.get_rank()
    model = shard(make_model(), device)
    calls = []
    if setting != "torch's default":
        gather = RecordedAllGather(calls)
        reduce = RecordedReduceScatter(calls, pooled=setting.endswith("one buffer per size"))
        for unit in model:  # one object for every unit, as a pool of buffers would be
            unit.set_custom_all_gather(gather)
            unit.set_custom_reduce_scatter(reduce)
    if setting.endswith("separate reduce-scatter group"):
        model.set_separate_reduce_scatter_group()  # every unit below the root too
    model(batch_of(rank).to(device)).square().mean().backward()
    # which unit's gradient (from one process) each unit's shard equals
    mine = [r.to(device).chunk(dist.get_world_size())[rank] for r in reference]
    equals = [
        min(range(len(mine)), key=lambda j: (p.grad.to_local() - mine[j]).abs().max().item())
        for p in model.parameters()
    ]
    error = largest_difference(
        (p.grad.to_local(), mine[j]) for p, j in zip(model.parameters(), equals)
    )
    totals = {}
    for kind, group, nbytes in calls:
        n, total = totals.get((kind, group), (0, 0))
        totals[kind, group] = (n + 1, total + nbytes)
    return totals, equals, error


def every_comm(reference):
    return {setting: with_comms(setting, reference) for setting in COMMS}


reference = launch(one_process_gradients, world_size=1, output="none")[0]
comms = launch(every_comm, reference, world_size=2, output="none")[0]
for setting, (totals, equals, error) in comms.items():
    calls = "; ".join(
        f"{n} {kind} on {group!r}, {total / 2**20:.0f} MiB"
        for (kind, group), (n, total) in totals.items()
    )
    print(
        f"{setting}:\n    calls seen: {calls or 'none (not recorded)'}\n"
        f"    unit i's gradient equals one process's gradient of unit {equals}, max |difference| = {error:.1e}"
    )


# %% [markdown]
# The recorded calls are the step's: each unit gathered twice (forward and backward) and
# reduce-scattered once, 1 MiB each, as {ref}`tutorial-communication` counts them. With a
# buffer handed out again, every unit's gradient is unit 0's, the last one reduced,
# silently: a new gradient is a view of the reduce-scatter's output
# (`torch.as_strided(reduce_output, ...)` in `foreach_reduce`, `_fsdp_collectives.py`), so
# the output must be a fresh buffer each time. The all-gather's output is copied into the
# parameters; no setting here reuses it, so reuse there is not shown (on GPUs, FSDP's note
# on overlapping the next copy-in, `_fsdp_param_group.py`, expects each output in different
# memory). `set_separate_reduce_scatter_group()` runs the reduce-scatters on a process group
# of their own over the same ranks (`group_desc="fsdp_reduce_scatter"`): one NCCL
# communicator runs one collective at a time, so per its docstring a second lets a
# reduce-scatter progress on a GPU while the next all-gather is in flight (not measured).
#
# ## Reduce-scatters in flight
#
# FSDP keeps each reduce-scatter's input buffer until a later unit reclaims it. Before a
# unit's reduce-scatter, once it holds `max_input_buffers` of them (1 by default), it makes
# the compute stream wait for the oldest; the profiler marks each such wait
# `FSDP::post_backward_rs_wait`. On gloo the collective has finished by then (it is issued
# without `async_op`, so `reduce_scatter_single` waits for it): the waits cost nothing here,
# and show where FSDP is expected to wait on a GPU. Three controls change that pipeline,
# counted over one backward after the first step:
#
# - `set_reduce_scatter_max_input_buffers(n)` holds up to *n* buffers in flight: fewer
#   waits, more memory. It is read when FSDP initialises, at the first forward; the largest
#   value set on any unit applies to the whole root;
# - `set_is_last_backward(False)` tells FSDP that another backward follows before the
#   optimizer step (torch's pipeline stages call it for every microbatch, with
#   `set_requires_gradient_sync(False)`, `torch/distributed/pipelining/stage.py`). Used
#   alone, as here, each backward reduce-scatters, the last reduce-scatters stay in flight,
#   and FSDP keeps the order of the forwards it has seen (`post_forward_order`, which
#   backward prefetching reads) across backwards. The setting stays until changed;
# - `share_comm_ctx([root_1, root_2])` makes two FSDP roots (pipeline stages' chunks) share
#   one pipeline of reduce-scatters and, on GPUs, one set of streams (its docstring: less
#   memory fragmentation across streams; not measured here).
#
# (fsdp2-fsdpmodule-set-reduce-scatter-max-input-buffers)=
# (fsdp2-fsdpmodule-set-is-last-backward)=
# (fsdp2-share-comm-ctx)=


# %%
def reduce_scatter_waits(step):
    """The units whose reduce-scatter waited for an earlier one (profiler markers), in one backward."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    waits = sorted(
        (e.time_range.start, e.name)
        for e in prof.events()
        if e.name.startswith("FSDP::post_backward_rs_wait (")
    )
    return [int(name.rsplit("(", 1)[1].rstrip(")")) for _, name in waits]


def max_input_buffers(n, after_first_step=False):
    device = fsdp_guide.device()
    model, x = shard(make_model(), device), batch_of(dist.get_rank()).to(device)
    if not after_first_step:
        model.set_reduce_scatter_max_input_buffers(n)
    model(x).sum().backward()  # the first step initialises FSDP
    if after_first_step:
        model.set_reduce_scatter_max_input_buffers(n)
    return reduce_scatter_waits(lambda: model(x).sum().backward())


def microbatches():
    """Three backwards before one optimizer step, only the last marked as last; FSDP's record of forwards after each."""
    device = fsdp_guide.device()
    model, x = shard(make_model(), device), batch_of(dist.get_rank()).to(device)
    model(x).sum().backward()
    waits, kept = [], []
    for microbatch in range(3):
        model.set_is_last_backward(microbatch == 2)
        waits.append(reduce_scatter_waits(lambda: model(x).sum().backward()))
        kept.append(len(model._get_fsdp_state()._comm_ctx.post_forward_order))  # private
    return waits, kept


def two_roots(shared):
    from torch.distributed.fsdp import share_comm_ctx

    device = fsdp_guide.device()
    model, x = make_model().to(device), batch_of(dist.get_rank()).to(device)
    first, second = shard(model[:2], device), shard(model[2:], device)  # units 0-1, 2-3
    if shared:
        share_comm_ctx([first, second])
    second(first(x)).sum().backward()
    return reduce_scatter_waits(lambda: second(first(x)).sum().backward())


def every_pipeline():
    return {
        "default (max_input_buffers=1)": max_input_buffers(1),
        "max_input_buffers=2, set before the first step": max_input_buffers(2),
        "max_input_buffers=4, set after the first step": max_input_buffers(
            4, after_first_step=True
        ),
        "set_is_last_backward(False, False, True)": microbatches(),
        "two roots, each its own context": two_roots(shared=False),
        "two roots, share_comm_ctx": two_roots(shared=True),
    }


pipelines = launch(every_pipeline, world_size=2, output="none")[0]
for setting, result in pipelines.items():
    if setting.startswith("set_is_last_backward"):
        waits, kept = result
        print(
            f"{setting:48} waits before units, per backward: {waits}; forwards FSDP keeps after each: {kept}"
        )
    else:
        print(f"{setting:48} waits before units: {result}")

_, kept = pipelines["set_is_last_backward(False, False, True)"]
glue("forwards_kept_first", kept[0], display=False)
glue("forwards_kept_second", kept[1], display=False)


# %% [markdown]
# Each wait sits before the reduce-scatter of the unit listed; units reduce in backward
# order, 3 to 0. By default every unit but the first to reduce (3) waits for the one
# reduced just before it; two buffers in flight leave unit 2 unwaited. Set after the first
# step, the cap changed nothing: FSDP reads it once (`FSDPState._init_shared_state`).
# Under `set_is_last_backward(False)` the next backward's unit 3 also waits, for the buffer
# the previous backward left in flight, and FSDP's record of forwards grows,
# {glue:text}`forwards_kept_first` then {glue:text}`forwards_kept_second`, until the
# backward marked last clears it. Only a backward marked last waits for the
# pending reductions when it ends (`finalize_backward`, from
# `_root_post_backward_final_callback`): on GPUs an unmarked one could let the optimizer
# step read gradients still being reduced (per the source; not run here). With two roots
# in their own contexts, unit 1 reduces first in its root and waits for nothing, unit 0
# waits for it; sharing one context, unit 1 waits for the other root's unit 2. Unit 0's
# reduce-scatter runs in the end-of-backward callback (its input needs no gradient, so no
# post-backward hook), after the other root's callback has released the shared buffers.
#
# ## A reduction FSDP does not do: the all-reduce hook
#
# `set_all_reduce_hook(hook)` calls `hook(output)` with each unit's flat reduce-scatter
# output (the all-reduce's under HSDP), which for float32 and bfloat16 the collective has
# already averaged over FSDP's group. Where FSDP divides by hand (float16, or forced sum
# reduction: `_get_gradient_divide_factors`), it divides by a pre-factor before the
# reduce-scatter and the rest after the hook (float16: about √N each way, all before for
# N = 2; forced sum in float32: all after), so a float16 hook on more than 2 ranks sees a
# partly divided sum. The hook changes `output` in place (the gradient shards are views of
# it), is set on each unit (it does not recurse), and is for a reduction over a group FSDP
# does not manage. Below, 4 ranks as 2 groups of 2: FSDP shards over each group
# (`mesh["shard"]`) and the hook averages over the replicas by hand, what HSDP does itself.
# The reference is one process on all 4 ranks' batches:
#
# (fsdp2-fsdpmodule-set-all-reduce-hook)=


# %%
def replicas_by_hand(hook):
    from torch.distributed.device_mesh import init_device_mesh

    device = fsdp_guide.device()
    mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("replicate", "shard"))
    model = shard(make_model(), device, mesh["shard"])  # FSDP over each group of 2
    replicas, reduced = mesh["replicate"].get_group(), []

    def average_over_replicas(output):  # this rank's gradient shard, already averaged over "shard"
        reduced.append(output.numel())
        dist.all_reduce(output, op=dist.ReduceOp.AVG, group=replicas)

    if hook:
        for unit in model:
            unit.set_all_reduce_hook(average_over_replicas)
    model(batch_of(dist.get_rank()).to(device)).square().mean().backward()
    return reduced, [p.grad.full_tensor().cpu() for p in model.parameters()]  # full over "shard"


reference4 = launch(one_process_gradients, 4, world_size=1, output="none")[0]
for hook in (False, True):
    ranks = launch(replicas_by_hand, hook, world_size=4, output="none")
    error = largest_difference((g, r) for _, grads in ranks for g, r in zip(grads, reference4))
    apart = largest_difference(zip(ranks[0][1], ranks[2][1]))
    print(
        f"hook: {hook!s:5} elements it reduced per call (rank 0): {ranks[0][0] or 'none'}; "
        f"replica groups' gradients differ by {apart:.1e}; max |gradient - one process| = {error:.1e}"
    )

# %% [markdown]
# Without the hook each group of 2 averages only its own batches: the two groups' gradients
# differ, and neither is the 4-rank mean. With it each call reduces one unit's shard
# (512 x 512 / 2 elements), and every rank holds one process's gradients. The hook owns its
# reduction: FSDP averages only over its own group, so a hook summing over 2 replicas would
# leave gradients twice the mean. On a GPU it runs on FSDP's all-reduce stream, or the
# `stream=` passed (per the docstring). Native HSDP: {ref}`2D exactness page <tp-hsdp-trap>`.
#
# ## `set_gradient_divide_factor` and its old name, `set_reduce_scatter_divide_factor`
#
# `set_reduce_scatter_divide_factor` is the old name of `set_gradient_divide_factor`
# ({ref}`tutorial-loss-and-accumulation` uses the new one): it warns and calls it. Both,
# with a factor of 1 (a sum over the 2 ranks, not a mean). A factor other than the group's
# size asks for `ReduceOp.PREMUL_SUM` in float32, which gloo refuses (shown there), so
# `set_force_sum_reduction_for_comms` sums and divides separately:
#
# (fsdp2-fsdpmodule-set-reduce-scatter-divide-factor)=

# %%
import warnings


def summed_gradients(old_name):
    device = fsdp_guide.device()
    model = shard(make_model(), device)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for unit in model:
            if old_name:
                unit.set_reduce_scatter_divide_factor(1.0)
            else:
                unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
    model(batch_of(dist.get_rank()).to(device)).square().mean().backward()
    grads = [p.grad.full_tensor().cpu() for p in model.parameters()]
    return {f"{w.category.__name__}: {w.message}" for w in warned}, grads


(warned, old), (_, new) = (
    launch(summed_gradients, old_name, world_size=2, output="none")[0] for old_name in (True, False)
)
print("set_reduce_scatter_divide_factor(1.0) warned:", warned)
print(
    f"max |old name - new name| = {largest_difference(zip(old, new)):.1e}; "
    f"max |gradient - 2 x one process's mean| = {largest_difference((a, 2 * r) for a, r in zip(new, reference)):.1e}"
)


# %% [markdown]
# (collective-hooks-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/collective_hooks.py`.
# Its reduce-scatter sums where FSDP asks for a mean, so each gradient is that of the sum of
# the ranks' losses, checked against one process; then it hands one output buffer out again,
# and every unit holds unit 0's. The tests run it on 2 CPU ranks and check both
# (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/collective_hooks.py
# :language: python
# ```

# %% [markdown]
# (collective-hooks-tips)=
# ## The tips behind this
#
# - {ref}`tip-custom-comms`: a custom reduce-scatter must hand out a fresh output buffer.
# - {ref}`tip-reduce-scatters-in-flight`: set the buffer cap before the first forward, and
#   mark the last backward before an optimizer step.
# - {ref}`tip-all-reduce-hook`: an all-reduce hook owns its reduction, averaging included.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("collective_hooks")
