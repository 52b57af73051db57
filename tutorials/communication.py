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
# (tutorial-communication)=
# # Communication, measured: what FSDP sends, and when
#
# **What you will learn**
#
# - how many bytes each collective really moves, measured on the wire, against the
#   textbook (ring) figures, and a surprise about gloo's reduce-scatter;
# - how many collectives and bytes one training step costs, and what each rank holds, with
#   DDP, `replicate` (DDP on FSDP2's machinery), `SHARD_GRAD_OP` and `FULL_SHARD`, and why
#   the textbook says FSDP moves 1.5 times what DDP moves;
# - the order of FSDP2's collectives in a step, as the profiler records it, and how
#   backward prefetching and `reshard_after_forward` change it;
# - how to take over FSDP2's collectives: your own all-gather and reduce-scatter (and the
#   buffer they must never reuse), a process group of the reduce-scatter's own, how many
#   reduce-scatters stay in flight (`set_reduce_scatter_max_input_buffers`,
#   `set_is_last_backward`, `share_comm_ctx`), and a reduction of your own after FSDP's
#   (`set_all_reduce_hook`).
#
# **What you need**: Linux (the bytes are read from the loopback interface's counter);
# 2 and 4 processes on gloo; about 15 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The tips it demonstrates are listed
# {ref}`at the end <communication-tips>`; every public FSDP2 name, and the page that
# executes it, is in {ref}`fsdp2-map`.
#
# The byte counts are CPU on purpose: they come from the loopback interface, which the
# ranks' gloo traffic crosses, and they measure gloo's own algorithms. Those launches pass
# `backend="gloo"`, and a gloo-only group keeps {func}`fsdp_guide.device` (the rank's GPU
# `cuda:LOCAL_RANK` where each rank has one, else the CPU) on the CPU even on a GPU
# machine. With GPU ranks, NCCL moves the tensors over its own transports (NVLink, PCIe,
# shared memory or the network) rather than this counter, with its own algorithms, so the
# byte columns below would not apply. The collective order and the sections after it are
# not tied to the CPU: they are written to run unchanged with one GPU per rank (NCCL).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# ## One collective at a time
#
# The ranks talk over the loopback interface, so the kernel's count of bytes sent on `lo`
# is the traffic of all ranks together, TCP/IP headers and acknowledgements included
# (`lo` carries packets of up to its MTU, printed below from `/sys/class/net/lo/mtu`, so
# these are a small part of the count). Rank 0 reads the counter, then a barrier lets
# every rank start one collective of *S* = 4 MiB, and after a second barrier (every rank has then received, so
# every rank has sent, its part) rank 0 reads it again. No rank can start the collective
# before rank 0's first read: they wait for rank 0 in the barrier that follows it (their
# own part of that barrier they may send earlier, a few bytes). The barriers' own bytes
# are measured the same way around nothing, and subtracted. The counter is the whole
# machine's, so nothing else may send meanwhile: the site's build runs the cells that read
# it (tagged `alone`) while no other page's cell runs.

# %% tags=["alone"]
from pathlib import Path

import fsdp_guide
import torch.distributed as dist
from fsdp_guide import launch
from fsdp_guide.compare import largest_difference

S = 4 * 2**20  # bytes of the full tensor: 1M float32


def loopback_bytes():
    return int(Path("/sys/class/net/lo/statistics/tx_bytes").read_text())


def sent_around(fn):
    """Bytes on lo from rank 0's first read to its second: fn() and the barriers around it."""
    dist.barrier()  # the previous traffic is over
    # no rank starts fn before this: all wait for rank 0 in the next barrier
    before = loopback_bytes()
    dist.barrier()
    fn()
    dist.barrier()  # every rank has received its part, so every rank has sent its part
    return loopback_bytes() - before


def measured(fn, warm_up=True, repeats=3):
    """Bytes all ranks sent during fn(), over S: less the barriers' own, measured around nothing.

    The loopback counter is the whole machine's: other processes' traffic (a notebook
    kernel's messages) only ever adds to it, so the least of a few windows is the one
    closest to the ranks' own bytes.
    """
    if warm_up:
        fn()  # once before, so connections and buffers exist
    least = min(sent_around(fn) for _ in range(repeats))
    return (least - min(sent_around(lambda: None) for _ in range(repeats))) / S


def one_collective_each():
    device = fsdp_guide.device()  # the CPU: launched with backend="gloo"
    n, world = S // 4, dist.get_world_size()

    def ones(size):
        return torch.ones(size, device=device)

    def empty(size):
        return torch.empty(size, device=device)

    return {
        "all-reduce": measured(lambda: dist.all_reduce(ones(n))),
        # torch 2.13's names; all_gather_into_tensor and reduce_scatter_tensor before it (now deprecated)
        "all-gather": measured(lambda: dist.all_gather_single(empty(n), ones(n // world))),
        "reduce-scatter": measured(lambda: dist.reduce_scatter_single(empty(n // world), ones(n))),
    }


# x (N - 1) S in all: the optimal algorithms
RING = {"all-reduce": 2, "all-gather": 1, "reduce-scatter": 1}
print(f"lo's MTU: {int(Path('/sys/class/net/lo/mtu').read_text()) // 1024} KiB")
print(f"{'ranks':>5}  {'collective':15} {'sent by all ranks / S':>22} {'ring optimum':>13}")
for world in (2, 4):
    measured_bytes = launch(one_collective_each, world_size=world, backend="gloo", output="none")[0]
    for name, value in measured_bytes.items():
        print(f"{world:5}  {name:15} {value:22.2f} {RING[name] * (world - 1):13}")

# %% [markdown]
# All-reduce and all-gather move what the ring algorithms need, compared column by column
# in the table above (the headers and acknowledgements come on top): an all-gather sends
# each shard to every other rank, (*N* - 1) *S* in all; an all-reduce is a reduce-scatter
# plus an all-gather, twice that. **gloo's reduce-scatter moves as much as an
# all-reduce**: it is not the bandwidth-optimal ring algorithm. On CPU with gloo, FSDP's
# gradient reduction therefore costs as much as DDP's. NCCL has its own reduce-scatter
# algorithms, so this surprise belongs to gloo, not to FSDP; what NCCL moves was not
# measured here.
#
# ## One training step
#
# Four 512 x 512 Linears, *P* = 4 MiB of float32 parameters, one step of SGD on 2 ranks,
# with DDP, with `replicate` and with FSDP2's two strategies. `replicate`
# (`torch.distributed._composable.replicate_with_fsdp`) is DDP rebuilt on FSDP2's
# machinery: each call makes a unit, as `fully_shard` does, whose parameters are
# replicated DTensors instead of sharded ones. It is a **private, experimental API**: its
# module name starts with an underscore, and its signature changed within the supported
# range (torch 2.9 took a 2-D mesh and a `device_mesh` argument; this is 2.13's). DDP's
# all-reduces are counted with a communication hook (they run inside DDP's C++ reducer),
# the others' collectives with {func}`fsdp_guide.precision.record_dtypes`. After the
# measured step, one more backward leaves gradients to count what a rank holds between
# steps, its local part of each parameter and each gradient:
#
# (fsdp2-fully-shard-reshard-after-forward)=

# %% tags=["alone"]
import torch.nn as nn

WIDTH, LAYERS = 512, 4
P = LAYERS * WIDTH * WIDTH * 4


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)))


def wrap(model, strategy, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    if strategy == "DDP":
        return DDP(model.to(device))
    # an explicit mesh: fully_shard's default mesh takes the machine's accelerator even when
    # the group is gloo-only
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    if strategy == "replicate":  # private and experimental: torch 2.13's signature
        from torch.distributed._composable.replicate_with_fsdp import replicate

        for layer in model:
            replicate(layer, mesh=mesh)
        return replicate(model, mesh=mesh)
    for layer in model:
        fully_shard(layer, mesh=mesh, reshard_after_forward=strategy == "FULL_SHARD")
    return fully_shard(model, mesh=mesh, reshard_after_forward=strategy == "FULL_SHARD")


def held(tensors):
    """Bytes this rank holds of these tensors: a DTensor's local part, a plain tensor whole."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def one_step(strategy):
    from fsdp_guide.precision import record_dtypes
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    device = fsdp_guide.device()  # the CPU: launched with backend="gloo"
    model = wrap(make_model(), strategy, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    buckets = []
    if strategy == "DDP":

        def counting_hook(state, bucket):  # count, then all-reduce as DDP would
            buckets.append(bucket.buffer().numel() * bucket.buffer().element_size())
            return allreduce_hook(None, bucket)

        model.register_comm_hook(None, counting_hook)
    x = torch.randn(8, WIDTH).to(device)

    def step():
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # the first step builds DDP's buckets and FSDP's state
    buckets.clear()
    with record_dtypes() as seen:
        # one step: the counts below are per step
        wire = measured(step, warm_up=False, repeats=1) * S / P
    counts = {}
    for (_phase, kind), n in seen.count.items():
        if kind in ("all-gather", "reduce-scatter", "all-reduce"):
            counts[kind] = counts.get(kind, 0) + n
    if buckets:
        counts["all-reduce"] = len(buckets)
    step_buckets = list(buckets)
    model(x).sum().backward()  # the gradients of one more step, held until the next zero_grad
    holds = held(model.parameters()) / P, held(p.grad for p in model.parameters()) / P
    return counts, wire, step_buckets, holds


# the textbook (ring) volume in units of P, summed over N = 2 ranks
TEXTBOOK = {"DDP": 2, "replicate": 2, "SHARD_GRAD_OP": 2, "FULL_SHARD": 3}


def every_strategy():
    return {strategy: one_step(strategy) for strategy in TEXTBOOK}


steps = launch(every_strategy, backend="gloo", output="none")[0]
print(
    f"{'strategy':14} {'collectives per step':30} {'sent / P':>9} {'vs DDP':>7} {'textbook vs DDP':>16}"
    f" {'params held / P':>16} {'grads held / P':>15}"
)
for strategy, (counts, wire, _, (params, grads)) in steps.items():
    described = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
    print(
        f"{strategy:14} {described:30} {wire:9.2f} {wire / steps['DDP'][1]:7.2f} "
        f"{TEXTBOOK[strategy] / TEXTBOOK['DDP']:16.2f} {params:16.2f} {grads:15.2f}"
    )
print(
    "the gradient buckets DDP all-reduced, in order:",
    ", ".join(f"{nbytes / 2**20:.2f} MiB" for nbytes in steps["DDP"][2]),
)

from myst_nb import glue  # the figures the text below quotes, from this run

glue("ddp_buckets", len(steps["DDP"][2]), display=False)
glue("shard_grad_op_gathers", steps["SHARD_GRAD_OP"][0]["all-gather"], display=False)
glue("shard_grad_op_scatters", steps["SHARD_GRAD_OP"][0]["reduce-scatter"], display=False)
glue("full_shard_gathers", steps["FULL_SHARD"][0]["all-gather"], display=False)
# the "vs DDP" column
glue("shard_grad_op_vs_ddp", steps["SHARD_GRAD_OP"][1] / steps["DDP"][1], display=False)
glue("full_shard_vs_ddp", steps["FULL_SHARD"][1] / steps["DDP"][1], display=False)

# %% [markdown]
# The figures in these paragraphs are this run's, taken from the table by myst-nb's `glue`; in
# JupyterLab, which does not render glue's roles, read them from the table above.
#
# - **DDP** all-reduces the gradients in buckets, {glue:text}`ddp_buckets` here (their sizes are printed below
#   the table): by default DDP caps its first bucket at 1 MiB and the others at 25 MiB
#   (`dist._DEFAULT_FIRST_BUCKET_BYTES` in `torch/nn/parallel/distributed.py`;
#   `kDefaultFirstBucketBytes` and `kDefaultBucketBytesCap` in torch's installed header
#   `torch/include/torch/csrc/distributed/c10d/reducer.hpp`), so one layer's 1 MiB
#   gradient fills the first bucket and the other three layers share the next: 2 *P* in
#   all. Every rank holds the whole model and its whole gradient, and the buckets besides:
#   DDP copies the gradients into them unless `gradient_as_bucket_view=True` makes the
#   gradients views of them (DDP's documentation of that argument). The two "held" columns
#   count parameters and gradients only: DDP's buckets are not in them.
# - **`replicate`** holds the parameters and gradients DDP holds (the two columns), as
#   DTensors placed `Replicate()`, and moves what DDP moves, in one all-reduce per unit
#   instead of per bucket: FSDP2's units are its buckets. Its arguments are
#   `fully_shard`'s data-parallel ones (`mp_policy`, `offload_policy`, `ignored_params`,
#   `dp_mesh_dims`), and its units are `FSDPModule`s. Its name says it may change without
#   notice: a training script that needs plain data parallelism is safer with DDP, and one
#   that needs replication across nodes with sharding inside them passes a 2-D mesh to
#   `fully_shard` ({ref}`tip-2d-mesh-is-hsdp`).
# - **`SHARD_GRAD_OP`** gathers each layer once (forward; the parameters stay gathered for
#   backward) and reduce-scatters each layer's gradients: {glue:text}`shard_grad_op_gathers` + {glue:text}`shard_grad_op_scatters` collectives. The textbook
#   volume equals DDP's (a reduce-scatter plus an all-gather *is* an all-reduce), but on
#   gloo the reduce-scatter costs an all-reduce, so it moves {glue:text}`shard_grad_op_vs_ddp:.1f` times DDP.
# - **`FULL_SHARD`** gathers every layer again in backward: {glue:text}`full_shard_gathers` all-gathers. The textbook
#   says 1.5 times DDP (two all-gathers and one reduce-scatter instead of one all-reduce);
#   on gloo it is {glue:text}`full_shard_vs_ddp:.1f` times. That extra all-gather is the price of holding 1/*N* of the
#   parameters between uses ({ref}`tutorial-memory` measures what it buys). Both FSDP2
#   strategies hold 1/*N* of the parameters and gradients between steps: they differ in
#   what stays gathered during the step.
#
# ## The order of collectives in a step
#
# The profiler records FSDP2's own markers: `FSDP::all_gather (i)` for unit *i*'s
# all-gather, `FSDP::post_backward_reduce (i)` for its reduce-scatter. It records the
# host's events only (`ProfilerActivity.CPU`): the order in which each rank issues its
# work, which with GPU ranks would be the order of launch, the kernels running later on
# CUDA streams. This launch uses the default backend, so the code is written to run
# unchanged with one GPU per rank; here it ran on gloo. Three settings: the default,
# backward prefetching two units ahead instead of one (`set_modules_to_backward_prefetch`),
# and `reshard_after_forward=False`:
#
# (fsdp2-fsdpmodule-set-modules-to-backward-prefetch)=


# %%
def timeline(setting):
    from torch.profiler import ProfilerActivity, profile

    device = fsdp_guide.device()
    strategy = "SHARD_GRAD_OP" if setting == "reshard_after_forward=False" else "FULL_SHARD"
    model = wrap(make_model(), strategy, device)
    if setting == "prefetch two units ahead":
        for i, layer in enumerate(model):  # the default is one unit ahead
            layer.set_modules_to_backward_prefetch([model[j] for j in (i - 1, i - 2) if j >= 0])
    x = torch.randn(8, WIDTH).to(device)
    model(x).sum().backward()  # lazy initialisation out of the way
    # the host's events: the order of issue
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(x).sum().backward()
    events = []
    for e in prof.events():
        if (
            e.name.startswith(
                ("FSDP::all_gather (", "FSDP::post_backward_reduce (", "FSDP::pre_backward (")
            )
            or e.name == "aten::mm"
        ):
            events.append((e.name, e.time_range.start, e.time_range.end))
    return sorted(events, key=lambda e: e[1])


def order(events):
    """The step as a sequence: AGi all-gather, Bi backward of unit i begins, RSi reduce-scatter."""
    short = {
        "FSDP::all_gather": "AG",
        "FSDP::post_backward_reduce": "RS",
        "FSDP::pre_backward": "B",
    }
    tokens = []
    for name, _, _ in events:
        if name != "aten::mm":
            kind, unit = name.rsplit(" (", 1)
            tokens.append(short[kind] + unit.rstrip(")"))
    return " ".join(tokens)


SETTINGS = ("default (FULL_SHARD)", "prefetch two units ahead", "reshard_after_forward=False")


def every_setting():
    return {setting: timeline(setting) for setting in SETTINGS}


timelines = launch(every_setting, output="none")[0]
for setting, events in timelines.items():
    print(f"{setting}:\n    {order(events)}")

# %% [markdown]
# Read the default line from the left: forward gathers units 0 to 3 (`AG0` ... `AG3`).
# Backward starts at unit 3 (`B3`), gathers it again (`AG3`) and already gathers unit 2
# (`AG2`). The line leaves out the matmuls; that both all-gathers are issued before unit 3
# computes its gradients is in torch's source: `FSDPParamGroup.pre_backward`
# (`torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py`), which runs as the `B3`
# marker, unshards its own unit and then calls `_backward_prefetch`, which unshards the
# unit that ran just before it in forward. That is backward prefetching, one unit ahead,
# written so that on a GPU the next all-gather runs while this unit computes (expected,
# not measured here). Then unit 3's gradients are reduce-scattered (`RS3`), and so on
# down to unit 0.
#
# Prefetching two units ahead issues `AG2` and `AG1` as soon as unit 3's backward begins,
# and every later unit then finds its parameters already gathered: more all-gathers in
# flight (on a GPU, expected to give more overlap and to hold more memory at once; not
# measured here). FSDP2 has no switch to turn prefetching off: each unit's list of units
# to prefetch in backward starts empty (`_states_to_backward_prefetch` in
# `FSDPState.__init__`, `torch/distributed/fsdp/_fully_shard/_fsdp_state.py`), and an
# empty list means the default, one unit ahead (`FSDPState._pre_backward` passes
# `default_prefetch` to `FSDPParamGroup.pre_backward`). FSDP1's `backward_prefetch=None`
# does turn it off (`_get_handle_to_prefetch` in `torch/distributed/fsdp/_runtime_utils.py`
# prefetches only for `BACKWARD_PRE` or `BACKWARD_POST`), and then each unit's all-gather
# is issued only when its own backward begins; on a GPU that is expected to stall the
# computation while it runs (not measured here). With `reshard_after_forward=False` the
# backward all-gathers are gone altogether: the parameters stayed gathered from forward
# (more memory, fewer collectives).
#
# The same default step as a picture (rank 0, here on the CPU with gloo). The profiler
# records the host's events, when each operation was issued and how long its call took on
# the host, so the point is the order, not the gaps:

# %% mystnb={"image": {"alt": "Timeline of one FSDP2 FULL_SHARD step on rank 0, in milliseconds since the forward began, with three lanes: all-gathers and reduce-scatters, each labelled with its unit number, and the matmuls between them."}}
import matplotlib.pyplot as plt

LANES = {
    "FSDP::all_gather": ("all-gather", 2, "tab:blue"),
    "aten::mm": ("matmul", 1, "tab:gray"),
    "FSDP::post_backward_reduce": ("reduce-scatter", 0, "tab:orange"),
}
events = timelines["default (FULL_SHARD)"]
t0 = events[0][1]
fig, ax = plt.subplots(figsize=(10, 2.6))
for name, start, end in events:
    kind = name.rsplit(" (", 1)[0]
    if kind not in LANES:
        continue
    label, lane, color = LANES[kind]
    ax.broken_barh(
        [((start - t0) / 1000, max((end - start) / 1000, 0.02))], (lane - 0.4, 0.8), color=color
    )
    if kind != "aten::mm":
        ax.text((start - t0) / 1000, lane + 0.45, name.rsplit(" (", 1)[1].rstrip(")"), fontsize=7)
ax.set_yticks([lane for _, lane, _ in LANES.values()], [label for label, _, _ in LANES.values()])
ax.set(
    xlabel="ms since the forward began",
    title="FSDP2 FULL_SHARD, one step on rank 0 (numbers: unit)",
)
fig.tight_layout()

# %% [markdown]
# ## Taking over FSDP2's collectives
#
# FSDP2 lets you replace what it calls for its two collectives, and change how it runs
# them. The calls are objects of the two abstract classes in
# `torch/distributed/fsdp/_fully_shard/_fsdp_api.py`: `allocate(size, *, dtype, device)`,
# where FSDP gets its buffers (for the all-gather, its output; for the reduce-scatter,
# both its input and its output), and `__call__`, the collective itself. torch's own
# `SymmMemAllGather` and `SymmMemReduceScatter`, which `set_symm_mem_for_comm` installs,
# are such objects: they allocate from symmetric memory for NCCL. The two below call
# torch's collectives and write each call down; the reduce-scatter can also make the
# mistake a pool of buffers invites: handing a buffer out again while it is still in use,
# here the same buffer for every call of a size. Each
# rank's gradient shards are checked against one process that trains on both ranks'
# batches. Then `set_separate_reduce_scatter_group()` on top of the recording comms:
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


def batch_of(rank):
    return torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(rank))


def one_process_gradients(ranks=2):
    model = make_model().to(fsdp_guide.device())
    (
        sum(model(batch_of(r).to(fsdp_guide.device())).square().mean() for r in range(ranks))
        / ranks
    ).backward()
    return [p.grad.cpu() for p in model.parameters()]


COMMS = (
    "torch's default",
    "recorded",
    "recorded, one buffer per size",
    "recorded + separate reduce-scatter group",
)


def with_comms(setting, reference):
    device, rank = fsdp_guide.device(), dist.get_rank()
    model = wrap(make_model(), "FULL_SHARD", device)
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
for setting, (totals, equals, error) in launch(every_comm, reference, world_size=2, output="none")[
    0
].items():
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
# reduce-scattered once, 1 MiB each, as in the table above. With a buffer handed out
# again, every unit's gradient is unit 0's, the last one reduced (backward reduces unit 3
# first), silently: a new gradient in the parameters' dtype is a view of the
# reduce-scatter's output (`torch.as_strided(reduce_output, ...)` in `foreach_reduce`,
# `_fsdp_collectives.py`), so the output must be a fresh buffer each time. The all-gather's
# output is copied into the parameters; no setting here reuses it (`RecordedAllGather`
# allocates a new tensor every time), so this page does not show what reuse would do
# there. On GPUs, FSDP's note on overlapping the next copy-in (`_fsdp_param_group.py`)
# expects each all-gather output in different memory. With
# `set_separate_reduce_scatter_group()` the reduce-scatters run on a process group of their
# own, created by FSDP (`group_desc="fsdp_reduce_scatter"`), over the same ranks. Per the
# method's docstring, one NCCL communicator runs one collective at a time, and a second one
# is meant to let a reduce-scatter progress on a GPU while the next all-gather is in flight
# (not measured here, where gloo runs both on the same two CPU cores).
#
# ### Reduce-scatters in flight
#
# FSDP keeps each reduce-scatter's input buffer until a later unit reclaims it. Before a
# unit's reduce-scatter, once it holds `max_input_buffers` of them (1 by default), it makes
# the compute stream wait for the oldest; the profiler marks each such wait
# `FSDP::post_backward_rs_wait`. On gloo the collective has finished by then (the
# reduce-scatter is issued without `async_op`, and `reduce_scatter_single` in
# `torch/distributed/distributed_c10d.py` then waits for it), so these waits cost nothing
# here: the counts show where FSDP is expected to wait on a GPU. Three controls
# change that pipeline, counted with the markers over one backward (the first step, which
# initialises FSDP, is not counted):
#
# - `set_reduce_scatter_max_input_buffers(n)` holds up to *n* buffers in flight: fewer
#   waits, more memory. It is read when FSDP initialises, at the first forward, and the
#   largest value set on any unit applies to the whole root;
# - `set_is_last_backward(False)` tells FSDP that another backward follows before the
#   optimizer step. torch's pipeline stages call it for every microbatch's backward,
#   together with `set_requires_gradient_sync(False)`, and reduce once at the end
#   (`torch/distributed/pipelining/stage.py`). Used alone, as here, each backward
#   reduce-scatters, and FSDP leaves the last reduce-scatters in flight and keeps the order
#   of the forwards it has seen (`post_forward_order`, which backward prefetching reads)
#   across backwards. The setting stays until changed;
# - `share_comm_ctx([root_1, root_2])` makes two FSDP roots share one communication
#   context: one pipeline of reduce-scatters and, on GPUs, one set of streams. It is meant
#   for pipeline parallelism, where each stage's model chunk is its own root; its
#   docstring names the memory it is meant to save on GPUs, fragmentation across streams
#   (not measured here).
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


def max_input_buffers(n, set_after_first_step=False):
    device = fsdp_guide.device()
    model, x = wrap(make_model(), "FULL_SHARD", device), batch_of(dist.get_rank()).to(device)
    if not set_after_first_step:
        model.set_reduce_scatter_max_input_buffers(n)
    model(x).sum().backward()  # the first step initialises FSDP
    if set_after_first_step:
        model.set_reduce_scatter_max_input_buffers(n)
    return reduce_scatter_waits(lambda: model(x).sum().backward())


def microbatches():
    """Three backwards before one optimizer step, only the last marked as last; FSDP's record of forwards after each."""
    device = fsdp_guide.device()
    model, x = wrap(make_model(), "FULL_SHARD", device), batch_of(dist.get_rank()).to(device)
    model(x).sum().backward()
    waits, kept = [], []
    for microbatch in range(3):
        model.set_is_last_backward(microbatch == 2)
        waits.append(reduce_scatter_waits(lambda: model(x).sum().backward()))
        # private: FSDP's own list
        kept.append(len(model._get_fsdp_state()._comm_ctx.post_forward_order))
    return waits, kept


def two_roots(shared):
    from torch.distributed.fsdp import share_comm_ctx

    device = fsdp_guide.device()
    model, x = make_model().to(device), batch_of(dist.get_rank()).to(device)
    # units 0-1, 2-3
    first, second = (wrap(model[:2], "FULL_SHARD", device), wrap(model[2:], "FULL_SHARD", device))
    if shared:
        share_comm_ctx([first, second])
    second(first(x)).sum().backward()
    return reduce_scatter_waits(lambda: second(first(x)).sum().backward())


def every_pipeline():
    return {
        "default (max_input_buffers=1)": max_input_buffers(1),
        "max_input_buffers=2, set before the first step": max_input_buffers(2),
        "max_input_buffers=4, set after the first step": max_input_buffers(
            4, set_after_first_step=True
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
# reduced just before it. Two buffers in flight leave unit 2 unwaited. The cap set after the first step changed
# nothing: FSDP reads it once, when it initialises (`FSDPState._init_shared_state` in
# `_fsdp_state.py`); set it before the first forward. Under `set_is_last_backward(False)`
# the next backward's first unit (3) also waits, for the buffer the previous backward left
# in flight, and FSDP's record of forwards grows, {glue:text}`forwards_kept_first` and {glue:text}`forwards_kept_second` (glued from the
# line above), until the backward marked last
# clears it. Only a backward marked last waits for the pending reductions when it ends
# (`finalize_backward`, called from `_root_post_backward_final_callback` in
# `_fsdp_state.py`): on GPUs, where the reductions run on their own stream, unmarked,
# an optimizer step could read gradients still being reduced (per the source; not run
# here), so mark the last backward before the step. With two roots, each in its own
# context, unit 1 is the first to reduce in its root's pipeline and waits for nothing,
# and unit 0 waits for it. Sharing one context, unit 1's reduce-scatter waits for unit
# 2's, which belongs to the other root: one pipeline of buffers. Unit 0's reduce-scatter
# runs in FSDP's end-of-backward callback (its input needs no gradient, so FSDP registers
# no post-backward hook for it), after the other root's callback has released the shared
# buffers, so it finds none to wait for.
#
# ### A reduction FSDP does not do: the all-reduce hook
#
# `set_all_reduce_hook(hook)` calls `hook(output)` with each unit's flat reduce-scatter
# output (the all-reduce's under HSDP). For float32 and bfloat16 the collective has
# already averaged it over FSDP's group. Where FSDP divides by hand instead (float16, or
# forced sum reduction: `_get_gradient_divide_factors` in torch's `_fsdp_collectives.py`),
# `foreach_reduce` divides by a pre-factor before the reduce-scatter and by the rest after
# the hook (for float16, about √N each way, against overflow and underflow, torch's
# comment says: for N = 2 all of it before; forced sum reduction in float32 divides after
# the hook only), so a float16 hook on more than 2 ranks sees a partly divided sum. The hook must change `output` in place: the
# gradient shards are views of it. It is set on each unit (it does not recurse), and it is
# for a reduction over a group FSDP does not manage. Below, 4
# ranks as 2 groups of 2: FSDP shards over each group of 2 (`mesh["shard"]`), and the hook
# averages the shards over the other dimension, the replicas, by hand, what HSDP does
# itself (its `replicate` dimension). The reference is one process on all 4 ranks' batches:
#
# (fsdp2-fsdpmodule-set-all-reduce-hook)=


# %%
def replicas_by_hand(hook):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = fsdp_guide.device()
    mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("replicate", "shard"))
    model = make_model().to(device)
    for layer in model:
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
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
# (512 x 512 / 2 elements), and every rank holds one process's gradients. The hook owns
# its reduction: FSDP averages only over the group it reduced over, so the hook averages
# too; a hook that summed over 2 replicas would leave gradients twice the mean. It runs on FSDP's all-reduce stream, or the `stream=` passed on a GPU (per the
# docstring). Native HSDP is on the {ref}`tensor parallelism page <tutorial-tensor-parallel>`.
#
# ### The divide factor's old name
#
# `set_reduce_scatter_divide_factor` is the old name of `set_gradient_divide_factor`
# ({ref}`tutorial-loss-and-accumulation` uses the new one): it warns and calls it. Both,
# with a factor of 1 (a sum, not a mean, over the 2 ranks; for float32 and bfloat16 a
# factor that is not the group's size asks for `ReduceOp.PREMUL_SUM`,
# `_get_gradient_divide_factors` in `torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py`,
# which gloo refuses, {ref}`tutorial-loss-and-accumulation` shows the error; so
# `set_force_sum_reduction_for_comms` sums and divides separately):
#
# (fsdp2-fsdpmodule-set-reduce-scatter-divide-factor)=

# %%
import warnings


def summed_gradients(old_name):
    device = fsdp_guide.device()
    model = wrap(make_model(), "FULL_SHARD", device)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for unit in model:
            if old_name:
                unit.set_reduce_scatter_divide_factor(1.0)
            else:
                unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
    model(batch_of(dist.get_rank()).to(device)).square().mean().backward()
    return {f"{w.category.__name__}: {w.message}" for w in warned}, [
        p.grad.full_tensor().cpu() for p in model.parameters()
    ]


(warned, old), (_, new) = (
    launch(summed_gradients, old_name, world_size=2, output="none")[0] for old_name in (True, False)
)
print("set_reduce_scatter_divide_factor(1.0) warned:", warned)
print(
    f"max |old name - new name| = {largest_difference(zip(old, new)):.1e}; "
    f"max |gradient - 2 x one process's mean| = {largest_difference((a, 2 * r) for a, r in zip(new, reference)):.1e}"
)


# %% [markdown]
# (communication-tips)=
# ## The tips behind this
#
# - {ref}`tip-communication-volume`: FSDP trades memory for communication; measure both.
# - {ref}`tip-memory-estimate`: what the extra all-gathers buy.
# - {ref}`tip-2d-mesh-is-hsdp`: replication across nodes with sharding inside them, from
#   `fully_shard` rather than the private `replicate`.
# - {ref}`tip-custom-comms`: a custom reduce-scatter must hand out a fresh output buffer.
# - {ref}`tip-reduce-scatters-in-flight`: set the buffer cap before the first forward, and
#   mark the last backward before an optimizer step.
# - {ref}`tip-all-reduce-hook`: an all-reduce hook owns its reduction, averaging included.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("communication")
