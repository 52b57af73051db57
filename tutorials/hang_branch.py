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
# (tutorial-hang-branch)=
# # A unit called on some ranks only: the hang that surfaces later
#
# **What you will learn**
#
# - why a forward whose branch depends on the data (a mixture-of-experts router, an early
#   exit, a skipped layer) hangs an FSDP model, reproduced and stopped within seconds;
# - that the stacks, `TORCH_DISTRIBUTED_DEBUG=DETAIL` and the flight recorder's analyser
#   all point one collective *past* where the ranks parted, and that the recorder's Python
#   stacks find the branch;
# - the fix, every unit called on every rank, checked against one process.
#
# It reuses the tools of {ref}`the first hang <tutorial-debugging-hangs>`, which shows them
# one by one.
#
# **What you need**: a CPU; 2 processes on gloo; about 15 seconds on 2 CPU cores ({ref}`measured <measured-times>`), much of it spent waiting in
# the hang. The hang runs on gloo on purpose, even where GPUs are present (`backend="gloo"`):
# a gloo collective holds the calling Python line until it completes, where an NCCL rank would
# run on and hang later ({ref}`on GPUs <debugging-hangs-gpu>`). The models are built on
# {func}`fsdp_guide.device`. The tips are listed {ref}`at the end <hang-branch-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`hang-branch-script` ({download}`download <scripts/hang_branch.py>`).

# %%
import inspect
import os
import pickle
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from fsdp_guide import LaunchError, launch
from myst_nb import glue

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")
scratch = tempfile.TemporaryDirectory()  # deleted, with what the page wrote, when the kernel exits
workdir = Path(scratch.name)


def mlp(layers=3):
    """A small seeded model: the same weights on every rank."""
    import fsdp_guide
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(layers)]).to(
        fsdp_guide.device()
    )


def shard_per_layer(model):
    """One FSDP2 unit per layer: every forward all-gathers each unit."""
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        fully_shard(layer)
    return fully_shard(model)


def sharded_mlp(layers=3):
    return shard_per_layer(mlp(layers))


def worker_line(fn, line):
    """The source of line `line` of a notebook function (its frames show as <dynamic-code>, line 1 the def)."""
    return inspect.getsource(fn).splitlines()[line - 1].strip()


def user_frames(stack, fn):
    """The frames of a faulthandler stack that are the worker's own, with their source line."""
    lines = [
        int(line.split("line ")[1].split()[0])
        for line in stack.splitlines()
        if "<dynamic-code>" in line
    ]
    return [f"line {line}: {worker_line(fn, line)}" for line in lines]


# %% [markdown]
# The flight recorder's dump and torch's analyser, as {ref}`the first hang's page
# <debugging-hangs-flight-recorder>` writes and runs them (gloo's dumps get their group table
# named before the analyser reads them: {ref}`why <debugging-hangs-analyser>`); collapsed:


# %% tags=["hide-input"]
def dump_flight_recorder_after(seconds, dumps):
    """A thread that writes this rank's flight recorder to DUMPS/fr_trace_rank_<rank> after SECONDS."""
    import threading

    import torch._C._distributed_c10d as c10d
    import torch.distributed as dist

    path = Path(dumps, f"fr_trace_rank_{dist.get_rank()}")
    Path(dumps).mkdir(exist_ok=True)
    threading.Timer(seconds, lambda: path.write_bytes(c10d._dump_fr_trace())).start()


def flight_recorder(dumps, rank):
    return pickle.loads((Path(dumps) / f"fr_trace_rank_{rank}").read_bytes())


def fr_trace(dumps):
    """torch's analyser, as `torchfrtrace DUMPS` runs it; it logs its verdicts on stderr."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(dumps)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.stdout + done.stderr


def name_the_group(dumps, named):
    """Copies of gloo's dumps whose group table carries the name and description their entries use."""
    Path(named).mkdir(exist_ok=True)
    # the file names are kept: the analyser reads them as listed
    for dump in sorted(Path(dumps).iterdir()):
        trace = pickle.loads(dump.read_bytes())
        name, desc = trace["entries"][0]["process_group"]
        (ranks,) = [group["ranks"] for group in trace["pg_config"].values()]
        trace["pg_config"] = {name: {"name": name, "desc": desc, "ranks": ranks}}
        (Path(named) / dump.name).write_bytes(pickle.dumps(trace))


def verdict(report):
    """The analyser's first mismatch, by rank: its own lines name a 'culprit' relative to the dump it read first."""
    number = re.search(r"Collective sequence number: (\d+) has errors", report)
    error = re.search(
        r"Culprit rank (\d+); Error type: (\w+), Expected collective type: '(\w+)' does not match "
        r"found collective type: '(\w+)'",
        report,
    )
    if not (number and error):
        return "no mismatch reported: " + report.strip()[-300:]
    culprit, kind, expected, found = error.groups()
    ops = {int(culprit): found, 1 - int(culprit): expected}
    return f"collective {number[1]} has errors, {kind}: rank 0 ran {ops[0]}, rank 1 ran {ops[1]}"


def mismatched(report):
    """The number of the first collective torch's analyser reports an error for (None if it reports none)."""
    found = re.search(r"Collective sequence number: (\d+) has errors", report)
    return found and int(found[1])


# %% [markdown]
# (debugging-hangs-branch)=
# ## The hang
#
# A model whose forward takes a branch that depends on the data (a mixture-of-experts
# router, an early exit, a skipped layer) calls some FSDP units on some ranks only. The
# rank that calls the unit all-gathers it; the other has moved on. Where do they hang? The
# ranks also dump their flight recorders, for the analysis after this:


# %%
def train_with_a_branch(where, dumps=None):
    import fsdp_guide
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    device = fsdp_guide.device()
    body, expert = sharded_mlp(2), torch.nn.Linear(16, 16).to(device)
    fully_shard(expert)
    if dumps is not None:
        dump_flight_recorder_after(2, dumps)
    torch.manual_seed(dist.get_rank())
    x = torch.randn(4, 16, device=device) + (1 if dist.get_rank() == 0 else -1)
    y = body(x)
    branch = bool(y.mean() > 0)  # data-dependent: true on rank 0's data only
    Path(where, f"expert{dist.get_rank()}.txt").write_text(str(branch))
    if branch:
        y = expert(y)
    y.sum().backward()
    return "done"


try:
    launch(
        train_with_a_branch,
        str(workdir),
        str(workdir / "hang2"),
        world_size=2,
        backend="gloo",
        timeout=8,
        output="none",
    )
except LaunchError as error:
    for rank, stack in sorted(error.stacks.items()):
        print(
            f"rank {rank} called the expert: {(workdir / f'expert{rank}.txt').read_text()}; stuck in "
            f"{stack.splitlines()[0].split(' in ')[-1]!r}, from {user_frames(stack, train_with_a_branch)}"
        )

# %% [markdown]
# (debugging-hangs-branch-tools)=
# Both ranks wait in backward, not in the branch, and in different collectives. The stacks
# show where ranks *wait*, which can be later than where they parted. Do the tools that
# compare collectives do better? `TORCH_DISTRIBUTED_DEBUG=DETAIL` first; each rank keeps the
# error its check raises and returns it:


# %%
def detail_report(where):
    """The hang under DETAIL: the mismatch error this rank raised, or None."""
    try:
        train_with_a_branch(where)
    except RuntimeError as error:  # DETAIL's check, before the collective runs
        return str(error)


os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
try:
    reports = launch(
        detail_report, str(workdir), world_size=2, backend="gloo", timeout=30, output="none"
    )
finally:
    del os.environ["TORCH_DISTRIBUTED_DEBUG"]
for rank, report in enumerate(reports):
    own = re.search(
        rf"Rank {rank} is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+), "
        rf"OpType=(\w+), TensorShape=\[(\d+)\]",
        report or "",
    )
    print(
        f"rank {rank} raised before its collective number {own[1]}: {own[2]} of [{own[3]}]"
        if own
        else f"rank {rank} raised nothing: {report}"
    )

rank0 = re.search(
    r"Rank 0 is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+),", reports[0] or ""
)
glue("hang2_detail_mismatch", rank0 and int(rank0[1]), display=False)  # numbered from 0
glue("hang2_detail_passed", rank0 and int(rank0[1]) - 1, display=False)

# %% [markdown]
# (The numbers the text quotes are this run's, glued from the outputs by myst-nb's `glue`;
# JupyterLab does not render glue's roles: read them in the outputs.)
#
# DETAIL stops both ranks at once, with no timeout, but at collective {glue:text}`hang2_detail_mismatch` (from 0): rank 0's
# reduce-scatter of backward against rank 1's all-gather. Its collective {glue:text}`hang2_detail_passed` passed the check.
# The flight recorder's analyser, on the dumps of the hang above (their group table named
# first), says the same:

# %%
name_the_group(workdir / "hang2", workdir / "hang2-named")
report = fr_trace(workdir / "hang2-named")
print("torchfrtrace, by rank:", verdict(report))

glue("hang2_mismatch", mismatched(report), display=False)  # numbered from 1
glue("hang2_matched", mismatched(report) and mismatched(report) - 1, display=False)

# %% [markdown]
# Collective {glue:text}`hang2_mismatch` (from 1), where rank 0's gradient reduction meets rank 1's all-gather. (On
# gloo, FSDP's `reduce_scatter_single`, where the launcher found rank 0, is recorded as
# `gloo:all_reduce` of the whole gradient, 272 numbers.) Both tools compare operation,
# sizes and dtypes, and collective {glue:text}`hang2_matched` matched: two all-gathers of 136 numbers, each rank's
# shard of a 16×16 layer plus its bias. The flight recorder keeps more than these: the
# Python stack that issued each collective. Printed for the collectives both ranks recorded, with
# the FSDP hook that issued it and the worker's line:

# %%
from fsdp_guide.table import Table
from IPython.display import display

FSDP_HOOKS = ("pre_forward", "pre_backward", "_prefetch_unshard", "post_backward")


def hook_of(entry):
    """The FSDP hook that issued a recorded collective (its frames are innermost first)."""
    return next(frame["name"] for frame in entry["frames"] if frame["name"] in FSDP_HOOKS)


def issued_by(entry, fn):
    """A recorded collective: its operation and size, the FSDP hook and the line of `fn` that issued it."""
    frames = entry["frames"]  # innermost first
    line = next(
        frame["line"]
        for frame in frames
        if (frame["filename"], frame["name"]) == ("<dynamic-code>", fn.__name__)
    )
    return f"{entry['profiling_name'][5:]} {entry['input_sizes'][0]}, {hook_of(entry)}, {worker_line(fn, line)}"


traces = [flight_recorder(workdir / "hang2", rank)["entries"] for rank in (0, 1)]
rows = [
    [number, *(issued_by(entry, train_with_a_branch) for entry in entries)]
    for number, entries in enumerate(zip(*traces), start=1)
]
display(Table(["#", "rank 0", "rank 1"], rows))

# the first collective the two ranks issued from different FSDP hooks
parted = next(
    (number for number, (a, b) in enumerate(zip(*traces), start=1) if hook_of(a) != hook_of(b)),
    None,
)
glue("hang2_parted", parted, display=False)

# %% tags=["hide-input"] mystnb={"image": {"alt": "Each rank's collectives in hang 2 from the flight recorder, one row per rank: all-gathers paired by their order, the one where the ranks parted (rank 0's issued in forward, rank 1's in backward) outlined, and each rank's last collective, where it waits, in red: a different operation on each rank."}}
from fsdp_guide.collectives import draw_flight_recorder

figure = draw_flight_recorder(
    traces,
    "Hang 2: the ranks' collectives, from the flight recorder",
    parted=traces[0][parted - 1]["collective_seq_id"],
)

# %% [markdown]
# Collective {glue:text}`hang2_parted` is where the ranks parted: rank 0's all-gather was issued by the forward
# (`pre_forward`) on the line `y = expert(y)`, rank 1's by backward (`pre_backward`) on
# `y.sum().backward()`. The pair matched because ranks pair collectives by their order,
# not by what they mean: an all-gather concatenates each rank's shard, so rank 1's layer
# was assembled with rank 0's shard of the expert, and both ranks went on with wrong
# weights until their operations differed at collective {glue:text}`hang2_mismatch`. So: the stacks, DETAIL and the
# analyser point at collective {glue:text}`hang2_mismatch`, in backward, one past the cause; the recorder's stacks of
# the collective before the first mismatch find the branch. The analyser's verdict prints
# the stack of the mismatched collective only, from the first dump it read (`EntryState.log`
# in `torch/distributed/flight_recorder/components/types.py`), not of the one before; reading
# the forward for units called under data-dependent conditions finds the same.
#
# (debugging-hangs-branch-fix)=
# **The fix**: call every unit on every rank, and let the data decide what its output
# counts for. Here, compute the expert on every rank and select with `torch.where`; for
# mixture-of-experts, route tokens but run every expert (possibly on zero tokens) on every
# rank. The check: the expert's gradient, gathered, must equal the mean of the gradients
# one process computes on each rank's batch (FSDP averages over ranks), and differ from
# the rank's own:


# %%
def loss_with_every_unit(body, expert, rank):
    """Rank `rank`'s batch through the model; the expert runs whatever the branch says."""
    import fsdp_guide
    import torch

    torch.manual_seed(rank)
    x = torch.randn(4, 16, device=fsdp_guide.device()) + (1 if rank == 0 else -1)
    y = body(x)
    return torch.where(y.mean() > 0, expert(y), y).sum()  # the expert runs on every rank


def train_every_unit_everywhere():
    import copy

    import fsdp_guide
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    rank, ranks = dist.get_rank(), dist.get_world_size()
    body, expert = mlp(2), torch.nn.Linear(16, 16).to(fsdp_guide.device())
    one_process = copy.deepcopy((body, expert))  # unsharded copies, for the reference
    shard_per_layer(body)
    fully_shard(expert)
    loss_with_every_unit(body, expert, rank).backward()
    reduced = expert.weight.grad.full_tensor()  # this rank's reduced shard, gathered
    # one process, each rank's batch
    per_rank = [
        torch.autograd.grad(loss_with_every_unit(*one_process, r), one_process[1].weight)[0]
        for r in range(ranks)
    ]
    mean = torch.stack(per_rank).mean(0)
    own = per_rank[rank]
    return (
        (reduced - mean).abs().max().item(),
        (reduced - own).abs().max().item(),
        own.abs().max().item(),
    )


for rank, (to_mean, to_own, own) in enumerate(
    launch(train_every_unit_everywhere, world_size=2, timeout=30, output="none")
):
    print(
        f"rank {rank} finished; its expert gradient differs from the mean of the ranks' by {to_mean:.1e}, "
        f"from its own batch's by {to_own:.1e} (its own batch's: {own:.1e} at most)"
    )

# %% [markdown]
# Both ranks finish, and the expert's gradient is the mean over both ranks' batches (a
# difference of rounding at most), not the rank's own: it was reduced. On rank 1, whose
# `torch.where` selects the body's output, the expert's own gradient is zero, and the
# reduction still hands it half of rank 0's.
#
# When every rank calls the unit but leaves some of its parameters without a gradient
# (experts inside one unit, some of which get no tokens on a rank), the all-gathers match
# and the reduce-scatters do not: {ref}`the uneven experts page
# <fsdp2-fsdpmodule-set-reduce-scatter-unused-params>` shows gloo aborting, the silent
# case, and `set_reduce_scatter_unused_params(True)` fixing both.

# %% [markdown]
# (hang-branch-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/hang_branch.py`.
# It first runs the fix, the expert called on every rank and selected with `torch.where`,
# and compares the expert's reduced gradient with the mean of the ranks' gradients computed
# in one process; then the branch itself, under the debug level `DETAIL` with a 10-second
# collective timeout, so that, instead of hanging, every rank raises the collective-mismatch
# error; each rank prints the collective it was about to run. The tests run this file under torchrun on 2
# CPU ranks and check that the fixed gradient matches, that the branch ends in seconds, and
# that the error names rank 0's reduce-scatter against rank 1's all-gather, at the same
# position (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/hang_branch.py
# :language: python
# ```

# %% [markdown]
# (hang-branch-tips)=
# ## The tips behind this
#
# - {ref}`tip-hangs-same-collectives`
# - {ref}`tip-hangs-tools`

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("hang_branch")
