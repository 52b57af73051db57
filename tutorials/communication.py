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
#   backward prefetching and `reshard_after_forward` change it.
#
# **What you need**: Linux (the bytes are read from the loopback interface's counter);
# 2 and 4 processes on gloo; about 5 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The same code is
# written to run unchanged with one GPU per rank (NCCL), except the byte columns (below). The
# tips are listed {ref}`at the end <communication-tips>`; every public FSDP2 name, and the
# page that executes it, is in {ref}`fsdp2-map`. Taking over FSDP2's collectives (your own
# all-gather and reduce-scatter, an all-reduce hook) is the next page,
# {ref}`tutorial-collective-hooks`.
# Its idea as a plain torchrun script to copy: {ref}`communication-script` ({download}`download <scripts/communication.py>`).
#
# The byte counts are CPU on purpose: they come from the loopback interface, which the
# ranks' gloo traffic crosses, and measure gloo's own algorithms. Those launches pass
# `backend="gloo"`, which keeps {func}`fsdp_guide.device` on the CPU even on a GPU machine;
# NCCL moves tensors over its own transports (NVLink, PCIe, shared memory, the network),
# with its own algorithms, so the byte columns would not apply there. The collective order
# and its figure are not tied to the CPU.

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
from fsdp_guide.table import Table
from IPython.display import display

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
rows = []
for world in (2, 4):
    measured_bytes = launch(one_collective_each, world_size=world, backend="gloo", output="none")[0]
    for name, value in measured_bytes.items():
        rows.append([world, name, f"{value:.2f}", RING[name] * (world - 1)])
display(Table(["ranks", "collective", "sent by all ranks / S", "ring optimum"], rows))

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
rows = []
for strategy, (counts, wire, _, (params, grads)) in steps.items():
    described = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
    figures = wire, wire / steps["DDP"][1], TEXTBOOK[strategy] / TEXTBOOK["DDP"], params, grads
    rows.append([strategy, described, *(f"{x:.2f}" for x in figures)])
header = ["strategy", "collectives per step", "sent / P", "vs DDP", "textbook vs DDP"]
header += ["params held / P", "grads held / P"]
display(Table(header, rows))
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
#   instead of per bucket: FSDP2's units are its buckets; its units are `FSDPModule`s.
#   Its name says it may change without notice: a training script that needs plain data parallelism is safer with DDP, and one
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
# (`AG2`), before unit 3 computes its gradients, per torch's source (the line leaves out
# the matmuls): `FSDPParamGroup.pre_backward` (`_fsdp_param_group.py`), the `B3` marker,
# unshards its own unit, then the unit that ran just before it in forward. That is backward prefetching,
# one unit ahead, so that on a GPU the next all-gather runs while this unit computes
# (expected, not measured here). Then unit 3's gradients are reduce-scattered (`RS3`), and
# so on down to unit 0.
#
# Prefetching two units ahead issues `AG2` and `AG1` as soon as unit 3's backward begins,
# and every later unit then finds its parameters already gathered: more all-gathers in
# flight (on a GPU, expected to give more overlap and to hold more memory at once; not
# measured here). FSDP2 has no switch to turn prefetching off: an empty list means the
# default, one unit ahead (`FSDPState._pre_backward` in `_fsdp_state.py` passes
# `default_prefetch`); FSDP1's `backward_prefetch=None` does (`_get_handle_to_prefetch`,
# `torch/distributed/fsdp/_runtime_utils.py`). With `reshard_after_forward=False` the
# backward all-gathers are gone: the parameters stayed gathered from forward (more memory,
# fewer collectives).
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
# (communication-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/communication.py`.
# Four Linear units train one step with `reshard_after_forward=True` (`FULL_SHARD`) and
# `False` (`SHARD_GRAD_OP`). torch's `CommDebugMode` counts the step's collectives, and its
# profiler (`record_shapes=True`) records each collective's tensors, so rank 0 prints the
# full tensors gathered and reduce-scattered as multiples of the parameters' bytes *P*: what
# each unit's collectives carry, before any algorithm splits them up for the wire. The
# tests run this file under torchrun on 2 CPU ranks and check 8 all-gathers of 2 *P* and 4
# reduce-scatters of *P* for `FULL_SHARD`, 4 of *P* and 4 of *P* for `SHARD_GRAD_OP`, both
# tools counting alike (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/communication.py
# :language: python
# ```

# %% [markdown]
# (communication-tips)=
# ## The tips behind this
#
# - {ref}`tip-communication-volume`: FSDP trades memory for communication; measure both.
# - {ref}`tip-memory-estimate`: what the extra all-gathers buy.
# - {ref}`tip-2d-mesh-is-hsdp`: replication across nodes with sharding inside them, from
#   `fully_shard` rather than the private `replicate`.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("communication")
