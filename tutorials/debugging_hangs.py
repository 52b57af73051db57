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
# (tutorial-debugging-hangs)=
# # Debugging a hang: uneven evaluation batches, and the tools that name it
#
# **What you will learn**
#
# - the hang FSDP users meet most, one rank with an evaluation batch more than the others:
#   reproduced, stopped within seconds, and fixed (checked);
# - what each diagnostic tool prints for it, executed: the per-rank Python stacks
#   {func}`fsdp_guide.launch` shows when it gives up, `TORCH_DISTRIBUTED_DEBUG=DETAIL`'s
#   collective-mismatch report, `dist.monitored_barrier` naming the rank that did not
#   arrive, torch's flight recorder, and its analyser (`torchfrtrace`).
#
# Next: {ref}`a unit called on some ranks only <tutorial-hang-branch>` (where these tools
# point past the cause), {ref}`a state dict gathered on rank 0 only <tutorial-hang-state-dict>`
# (with `py-spy`), {ref}`wrong sums from the order of a set <tutorial-set-order>`; NCCL's
# watchdog, from torch's source: {ref}`debugging-hangs-gpu`; symptom → tool → fix: {ref}`symptom-hang`.
#
# **What you need**: a CPU; 2 processes on gloo; about 20 seconds on 2 CPU cores ({ref}`measured <measured-times>`), much of it spent waiting in
# hangs, for a timeout or for the dumps. The hangs run on gloo on purpose, even where GPUs are present
# (`backend="gloo"`): a gloo collective holds the calling Python line until it completes
# (the stacks below find each rank on that line), where an NCCL rank would run on and hang
# later ({ref}`on GPUs <debugging-hangs-gpu>`). The models are built on
# {func}`fsdp_guide.device`. The tips are listed {ref}`at the end <debugging-hangs-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`debugging-hangs-script` ({download}`download <scripts/debugging_hangs.py>`).

# %%
import inspect
import os
import pickle
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from fsdp_guide import LaunchError, launch
from myst_nb import glue
from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout

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
# (debugging-hangs-uneven)=
# ## The hang
#
# The evaluation set is split across ranks, and one rank gets one batch more. Every forward
# of an FSDP model all-gathers its units' parameters, so the rank with the extra batch waits
# in an all-gather that the other rank, already summing the results in an `all_reduce`,
# never joins. Nothing errors. Left alone, both would wait until the
# {term}`collective timeout` (`default_pg_timeout` for gloo, printed below; 5 minutes under
# `launch`, its `collective_timeout`); here {func}`fsdp_guide.launch` stops them first,
# after its `timeout` seconds (the argument below), and its error shows where each rank was.
# (The collective timeout's own error is not shown: waiting for it would take minutes.)


# %%
def evaluate(batches_on_rank_1, monitored=None, dumps=None):
    import datetime

    import fsdp_guide
    import torch
    import torch.distributed as dist

    device = fsdp_guide.device()
    model = sharded_mlp()
    if dumps is not None:
        # defined below, with the flight recorder
        dump_flight_recorder_after(2, dumps, then_stop=True)
    batches = 2 if dist.get_rank() == 0 else batches_on_rank_1
    total = torch.zeros(1, device=device)
    with torch.no_grad():
        for _ in range(batches):
            total += model(torch.randn(4, 16, device=device)).sum()  # all-gathers every unit
    if monitored is not None:  # a checkpoint of arrival before the collective
        try:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=2))
        except RuntimeError as error:  # rank 0 names the late ranks; kept for the page to print
            Path(monitored, f"monitored{dist.get_rank()}.txt").write_text(
                f"{type(error).__name__}: {error}"
            )
            raise
    dist.all_reduce(total)
    return total.item()


print(
    "gloo's default collective timeout (torch.distributed.constants.default_pg_timeout):",
    default_pg_timeout,
)
# NCCL's, used on GPUs (None on a build without NCCL)
print("torch.distributed.constants.default_pg_nccl_timeout on this build:", default_pg_nccl_timeout)
try:
    # time enough to reach the hang
    launch(evaluate, 3, world_size=2, backend="gloo", timeout=6, output="none")
except LaunchError as error:
    print(f"{type(error).__name__}: {str(error).splitlines()[0][:110]} ...")
    for rank, stack in sorted(error.stacks.items()):
        print(
            f"rank {rank}: innermost {stack.splitlines()[0].split(' in ')[-1]!r}, "
            f"called from {user_frames(stack, evaluate)}"
        )

# %% [markdown]
# Rank 1, on its third batch, waits in FSDP's all-gather (`all_gather_single`, called from
# the forward on the evaluation line); rank 0 waits in the `all_reduce` after the loop. The
# two ranks are in *different* {term}`collectives <collective>`: the signature of a hang
# from control flow that differs between ranks.
#
# (debugging-hangs-detail)=
# ## The tools that name it
#
# `TORCH_DISTRIBUTED_DEBUG=DETAIL`, set in the environment the ranks start with, checks
# every collective against the other ranks' before it runs, and turns the wait into an
# error: a debugging setting, not a production one ({ref}`how, from torch's source
# <fsdp-hang-tools-detail>`).

# %%
os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
try:
    launch(evaluate, 3, world_size=2, backend="gloo", timeout=30, output="none")
except LaunchError as error:
    report = str(error).splitlines()[0]
    # the exception's class and its first sentence
    print(report.split(" raised ", 1)[1].split(". Rank")[0])
    for rank, sequence, op in re.findall(
        r"Rank (\d) is running collective: CollectiveFingerPrint\("
        r"SequenceNumber=(\d+), OpType=(\w+)",
        report,
    ):
        print(f"rank {rank} is running collective number {sequence}: {op}")
    print(report[report.rindex("Collectives differ") :])
finally:
    del os.environ["TORCH_DISTRIBUTED_DEBUG"]

# %% [markdown]
# (debugging-hangs-monitored)=
# The report names both collectives: rank 0 in an `ALLREDUCE`, rank 1 in an
# `_ALLGATHER_BASE` (FSDP's). `dist.monitored_barrier` (a {term}`monitored barrier`) is the
# targeted version: put it before the collective where ranks should meet, and rank 0 names
# who did not arrive in time. It runs on gloo only ("only supported with the GLOO backend",
# its docstring in `distributed_c10d.py`; with NCCL training, on a gloo group from
# `dist.new_group(backend="gloo")`), and each rank waits for a send/recv with rank 0: a
# debugging aid too.

# %%
try:
    launch(evaluate, 3, str(workdir), world_size=2, backend="gloo", timeout=30, output="none")
except LaunchError:
    print((workdir / "monitored0.txt").read_text().splitlines()[0])

# %% [markdown]
# (debugging-hangs-flight-recorder)=
# Torch's {term}`flight recorder` keeps in each rank a ring buffer of the last collectives:
# their sequence numbers, sizes, states and the Python stack that issued each. It is on by
# default, with 2000 entries (`TORCH_FR_BUFFER_SIZE`; 0 turns it off). On gloo nothing dumps
# it on a timeout, so a thread in each rank dumps it (a pickle, the format torch's analyser
# loads) to `fr_trace_rank_<rank>` 2 seconds after the model is built, while the ranks hang.
# A hang never ends by itself: once every rank's dump is written, rank 0 stops its own
# process (SIGTERM, as you would stop a hung job), and `launch` stops the others; unlike a
# `timeout`, this waits for the dumps however slow the machine. (Its settings and dump, from
# torch's source: {ref}`fsdp-hang-tools-flight-recorder`.)


# %%
def write_then_rename(path, data):
    """The whole file or none: another rank may be waiting for it to appear."""
    part = path.with_name(f".{path.name}.part")
    part.write_bytes(data)
    part.rename(path)


def stop_once_written(paths):
    """On rank 0: wait until every path exists, then stop this process."""
    import signal
    import time

    import torch.distributed as dist

    if dist.get_rank() == 0:
        while not all(path.exists() for path in paths):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)


def dump_flight_recorder_after(seconds, dumps, then_stop=False):
    import threading

    import torch._C._distributed_c10d as c10d
    import torch.distributed as dist

    paths = [Path(dumps, f"fr_trace_rank_{rank}") for rank in range(dist.get_world_size())]

    def dump():
        write_then_rename(paths[dist.get_rank()], c10d._dump_fr_trace())  # with stack traces
        if then_stop:
            stop_once_written(paths)

    Path(dumps).mkdir(exist_ok=True)
    threading.Timer(seconds, dump).start()


def flight_recorder(dumps, rank):
    return pickle.loads((Path(dumps) / f"fr_trace_rank_{rank}").read_bytes())


def how_it_ended(error):
    """The rank that stopped and its signal; any other end (a timeout, an exception), as launch said it."""
    if error.exit_code is not None and error.exit_code < 0:
        return f"rank {error.rank} stopped by {signal.Signals(-error.exit_code).name}"
    return str(error).splitlines()[0]


try:
    hang1 = str(workdir / "hang1")  # where each rank dumps its flight recorder
    launch(evaluate, 3, None, hang1, world_size=2, backend="gloo", timeout=120, output="none")
except LaunchError as error:
    print("the hang ended:", how_it_ended(error))
for rank in (0, 1):
    print(f"rank {rank}'s last collectives (sequence number, operation, input sizes):")
    for entry in flight_recorder(workdir / "hang1", rank)["entries"][-3:]:
        print("   ", entry["collective_seq_id"], entry["profiling_name"], entry["input_sizes"])

# %% tags=["hide-input"] mystnb={"image": {"alt": "Each rank's collectives in order from the flight recorder, one row per rank: the same all-gathers side by side up to the second batch, then rank 0's all-reduce facing rank 1's all-gather at the same sequence number, each rank waiting there for the other."}}
from fsdp_guide.collectives import draw_flight_recorder

entries = [flight_recorder(workdir / "hang1", rank)["entries"] for rank in (0, 1)]
figure = draw_flight_recorder(entries, "Hang 1: the ranks' collectives, from the flight recorder")

# %% [markdown]
# Read the sequence numbers: the ranks agree up to the last collective they share (the
# second batch's all-gathers), then rank 0's next is the `all_reduce` and rank 1's an
# all-gather of its third batch. (The recorder numbers collectives from 1, the DETAIL report
# above from 0: the same collective.)
#
# (debugging-hangs-analyser)=
# Torch ships an analyser for these dumps, `torch/distributed/flight_recorder/fr_trace.py`
# (the `torchfrtrace` command, in torch's `entry_points.txt`): given the folder of one dump
# per rank, it pairs the ranks' collectives in order and reports the first that do not
# match. On gloo's dumps of torch 2.13 it fails:


# %%
def fr_trace(dumps):
    """torch's analyser, as `torchfrtrace DUMPS` runs it; it logs its verdicts on stderr."""
    command = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(dumps)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    return done.stdout + done.stderr


failure = fr_trace(workdir / "hang1").strip().splitlines()[-1]
# (group, the rank it read first: file order)
looked_up = re.fullmatch(r"(\w+): \('(\w*)', \d+\)", failure)
print(
    "torchfrtrace on gloo's dumps:",
    f"{looked_up[1]} looking up group {looked_up[2]!r}" if looked_up else failure,
)
trace = flight_recorder(workdir / "hang1", 0)
print("the dump's group table (pg_config):", trace["pg_config"])
print("the group its entries name:        ", trace["entries"][0]["process_group"])

# %% [markdown]
# The analyser looks each entry's group up in the dump's group table, and gloo's table names
# its one group `''`, while its entries name it `'0'`. Copy the dumps with the table keyed by
# the name the entries carry ({ref}`why they differ, from torch's source
# <fsdp-hang-tools-analyser>`), and the analyser runs:


# %%
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


name_the_group(workdir / "hang1", workdir / "hang1-named")
print(
    "the order the analyser reads the dumps (os.listdir, the file system's order):",
    os.listdir(workdir / "hang1-named"),
)
report = fr_trace(workdir / "hang1-named")
verdicts = ("Collective sequence", "error msg")  # its lines that name the mismatch
print("\n".join(line for line in report.splitlines() if line.startswith(verdicts)))
print("by rank:", verdict(report))


def mismatched(report):
    """The number of the first collective torch's analyser reports an error for (None if it reports none)."""
    found = re.search(r"Collective sequence number: (\d+) has errors", report)
    return found and int(found[1])


# the number the text quotes, from this run (JupyterLab shows glue's roles unrendered)
glue("hang1_mismatch", mismatched(report), display=False)

# %% [markdown]
# The analyser finds the collective where the ranks parted, number
# {glue:text}`hang1_mismatch` (glued from this run; in JupyterLab, read it in the output),
# and the mismatch type. Its "culprit" is not a judgement: with two ranks it names whichever
# dump it read second, in the file system's order printed above; the line by rank is read
# from its message ({ref}`why, from torch's source <fsdp-hang-tools-analyser>`).
#
# (debugging-hangs-uneven-fix)=
# ## The fix
#
# Every rank runs the same number of forwards. Either pad the split so each rank gets the
# same number of batches (`DistributedSampler` pads by repeating samples, "add extra samples
# to make it evenly divisible" in `DistributedSampler.__iter__`,
# `torch/utils/data/distributed.py`, which changes the metric slightly), or keep going until
# *every* rank is out of data: an `all_reduce` with `MIN` of "I still have a batch" before
# each step, a rank with none running a forward on a dummy batch whose result it ignores, or
# simply stopping all ranks together:


# %%
def evaluate_together(batches_on_rank_1):
    import fsdp_guide
    import torch
    import torch.distributed as dist

    device = fsdp_guide.device()
    model = sharded_mlp()
    batches = 2 if dist.get_rank() == 0 else batches_on_rank_1
    total, step = torch.zeros(1, device=device), 0
    with torch.no_grad():
        while True:
            more = torch.tensor([1 if step < batches else 0], device=device)
            dist.all_reduce(more, op=dist.ReduceOp.MIN)  # does *every* rank still have a batch?
            if not more.item():
                break
            total += model(torch.randn(4, 16, device=device)).sum()
            step += 1
    dist.all_reduce(total)
    return step, total.item()


print(
    "batches evaluated per rank:",
    [steps for steps, _ in launch(evaluate_together, 3, world_size=2, timeout=30, output="none")],
)

# %% [markdown]
# Both ranks stop after 2 batches: no hang. Rank 1's third batch is skipped here; to count
# it, run its forward on every rank (the other with a dummy input it discards), or pad.
# Every example counted once, on uneven ranks: {ref}`beyond-uneven-eval`.

# %% [markdown]
# (debugging-hangs-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/debugging_hangs.py`.
# It runs this hang (one rank with an evaluation batch more) with the debug level `DETAIL`
# and a 10-second collective timeout, so that, instead of hanging, every rank raises the
# collective-mismatch error and exits; rank 0 prints each rank's collective, by number and
# operation. The tests (2 CPU ranks, `tests/test_scripts.py`) check that it ends and names
# rank 0's `ALLREDUCE` and rank 1's `_ALLGATHER_BASE`.
#
# ```{literalinclude} scripts/debugging_hangs.py
# :language: python
# ```

# %% [markdown]
# (debugging-hangs-tips)=
# ## The tips behind this
#
# - {ref}`tip-hangs-same-collectives`
# - {ref}`tip-hangs-tools`

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("debugging_hangs")
