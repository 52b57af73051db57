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
# # Debugging hangs: three real ones, every tool, and the fixes
#
# **What you will learn**
#
# - three hangs FSDP users meet most: uneven numbers of evaluation batches per rank, a unit
#   called on some ranks only (data-dependent control flow), and a state-dict call made on
#   rank 0 only; each reproduced and stopped within seconds;
# - what each diagnostic tool prints for them, executed: the per-rank Python stacks
#   {func}`fsdp_guide.launch` shows when it gives up, `TORCH_DISTRIBUTED_DEBUG=DETAIL`'s
#   collective-mismatch report, `dist.monitored_barrier` naming the rank that did not
#   arrive, torch's flight recorder, its analyser (`torchfrtrace`) and the Python stack it
#   records for each collective, and `py-spy dump --native`; and, for the hang whose ranks
#   wait far from where they parted, which of these tools find the cause and which do not;
# - a fault that only torchrun shows, wrong sums with no error rather than a hang:
#   collectives issued in the order of a `set`, which the notebook's forked ranks agree on
#   and torchrun's new interpreters do not;
# - what changes on GPUs (NCCL's watchdog and its settings), from torch's source;
# - the fix for each, checked, and a symptom → tool → fix table.
#
# **What you need**: a CPU; 2 processes on gloo; `py-spy` for its section (the package's
# `test` or `docs` extra); about 50 seconds on 2 CPU cores ({ref}`measured <measured-times>`), much of it spent waiting in
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
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from fsdp_guide import LaunchError, launch
from torch.distributed.constants import default_pg_timeout

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
# ## Hang 1: uneven evaluation batches
#
# The evaluation set is split across ranks, and one rank gets one batch more. Every
# forward of an FSDP model all-gathers its units' parameters, so the rank with the extra
# batch waits in an all-gather that the other rank, already summing the results in an
# `all_reduce`, never joins. Nothing errors. Left alone, both would wait until the
# {term}`collective timeout` (`default_pg_timeout` for gloo, printed below; 5 minutes
# under `launch`, its `collective_timeout`); here {func}`fsdp_guide.launch` stops them
# first, after its `timeout` seconds (the argument below), and its error shows where each
# rank was. (The collective timeout's own error is not shown on this page: waiting for it
# would take minutes.)


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
# two ranks are in *different* {term}`collectives <collective>`: that is the signature of a hang from control
# flow that differs between ranks.
#
# (debugging-hangs-detail)=
# `TORCH_DISTRIBUTED_DEBUG=DETAIL` turns the wait into an error. Set in the environment the
# ranks start with, it wraps every process group (`_create_process_group_wrapper` in
# `torch/distributed/distributed_c10d.py`) in a `ProcessGroupWrapper` whose helper gloo group
# runs, before each collective, "monitored barrier, sequence number checking, collective
# fingerprint collecting" (`glooBackend_` and `runCollectiveChecks` in
# `torch/include/torch/csrc/distributed/c10d/ProcessGroupWrapper.hpp`): a debugging
# setting, not a production one.

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
# `_ALLGATHER_BASE` (FSDP's). `dist.monitored_barrier` (a {term}`monitored barrier`) is the targeted version: put it
# before the collective where ranks should meet, and rank 0 names who did not arrive in
# time. It runs on gloo only ("only supported with the GLOO backend", its docstring in
# `distributed_c10d.py`; with NCCL training, on a gloo group created for it with
# `dist.new_group(backend="gloo")`), and each rank waits for a send/recv with rank 0 ("Rank
# 0 will block until all send /recv from other ranks are processed", the same docstring): a
# debugging aid too.

# %%
try:
    launch(evaluate, 3, str(workdir), world_size=2, backend="gloo", timeout=30, output="none")
except LaunchError:
    print((workdir / "monitored0.txt").read_text().splitlines()[0])

# %% [markdown]
# (debugging-hangs-flight-recorder)=
# Torch's {term}`flight recorder` keeps, in each rank, a ring buffer of the last collectives:
# their sequence numbers, sizes, states and the Python stack that issued each. It is on by
# default in torch 2.13 with 2000 entries: the `FlightRecorder` constructor in
# `torch/include/torch/csrc/distributed/c10d/FlightRecorder.hpp` reads
# `TORCH_FR_BUFFER_SIZE` (default 2000) and sets `enabled_ = max_entries_ > 0`, so 0 turns it
# off. `ProcessGroupGloo` has no dump on timeout: its header,
# `torch/include/torch/csrc/distributed/c10d/ProcessGroupGloo.hpp`, declares no watchdog,
# no monitor thread and no dump (the settings {ref}`below <debugging-hangs-gpu>` are
# NCCL's); the dump is a private binding, `torch._C._distributed_c10d._dump_fr_trace`,
# which returns the recorder's `dump`, a pickle (`pickle_str` in `FlightRecorderDetail.hpp`),
# the format torch's analyser loads. A thread started in each rank writes it 2 seconds after the model is built,
# while the ranks hang, to `fr_trace_rank_<rank>` (a prefix then the rank, as
# `DebugInfoWriter` in `FlightRecorder.hpp` names NCCL's dumps). A hang never ends by itself:
# once every rank's dump is written, rank 0 stops its own process (SIGTERM, as you would stop
# a hung job), and `launch` stops the others; ending there rather than at a `timeout` waits
# for the dumps however slow the machine is:


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
    launch(
        evaluate,
        3,
        None,
        str(workdir / "hang1"),
        world_size=2,
        backend="gloo",
        timeout=120,
        output="none",
    )
except LaunchError as error:
    print("the hang ended:", how_it_ended(error))
for rank in (0, 1):
    print(f"rank {rank}'s last collectives (sequence number, operation, input sizes):")
    for entry in flight_recorder(workdir / "hang1", rank)["entries"][-3:]:
        print("   ", entry["collective_seq_id"], entry["profiling_name"], entry["input_sizes"])

# %% [markdown]
# Read the sequence numbers: the ranks agree up to the last collective they share (the
# second batch's all-gathers), then rank 0's next is the `all_reduce` and rank 1's an
# all-gather of its third batch. (The recorder numbers collectives from 1, the DETAIL report
# above from 0: the same collective.)
#
# (debugging-hangs-analyser)=
# Torch ships an analyser for these dumps, `torch/distributed/flight_recorder/fr_trace.py`
# (the `torchfrtrace` command, in torch's `entry_points.txt`): given the folder of one
# dump per rank, it pairs the ranks' collectives in order and reports the first that do
# not match. On gloo's dumps of torch 2.13 it fails:


# %%
def fr_trace(dumps):
    """torch's analyser, as `torchfrtrace DUMPS` runs it; it logs its verdicts on stderr."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(dumps)],
        capture_output=True,
        text=True,
        timeout=60,
    )
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
# The analyser looks each entry's group up in the dump's group table
# (`build_groups_memberships` and `build_collectives` in
# `torch/distributed/flight_recorder/components/builder.py`), and gloo's table names its one
# group `''`, while its entries name it `'0'`. The order is in the shipped
# `torch/distributed/distributed_c10d.py`: `_new_process_group_helper` first constructs
# `ProcessGroupGloo(backend_prefix_store, group_rank, group_size, timeout=timeout)`, then sets
# `backend_class.options.group_name = group_name`, and only at its end calls
# `pg._set_group_name(group_name)` and `pg._set_group_desc(group_desc)`; the table printed
# above is the result. The recording itself is in gloo's C++ constructor, which records the
# group at construction (`record_pg_ranks` in `ProcessGroupGloo.cpp`, not shipped in the
# wheel, read in torch's repository). For NCCL the same function sets
# `backend_options.group_name = group_name` *before* it constructs `ProcessGroupNCCL`, so
# NCCL's dumps are not expected to need the renaming below (read in the source, not run
# here). Copy the dumps with the table keyed by the name the entries carry,
# and the analyser runs:


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
print(
    "\n".join(
        line
        for line in report.splitlines()
        if line.startswith(("Collective sequence", "error msg"))
    )
)
print("by rank:", verdict(report))

# the numbers the text quotes, from this run (JupyterLab shows glue's roles unrendered)
from myst_nb import glue


def mismatched(report):
    """The number of the first collective torch's analyser reports an error for (None if it reports none)."""
    found = re.search(r"Collective sequence number: (\d+) has errors", report)
    return found and int(found[1])


glue("hang1_mismatch", mismatched(report), display=False)

# %% [markdown]
# (The numbers the text quotes from here on are this run's, glued from the outputs by myst-nb's
# `glue`; JupyterLab does not render glue's roles: read them in the outputs.)
#
# The analyser finds the collective where the ranks parted, number {glue:text}`hang1_mismatch`, and the mismatch
# type. Its "culprit" is not a judgement: it compares every rank's entry with that of the
# first dump it read and blames the rank that differs ("Here we assume the current rank is
# not the source of the error", `check_current_entry_match` in
# `torch/distributed/flight_recorder/components/utils.py`), so with two ranks it names
# whichever it read second. It reads the files in the order `os.walk` lists them
# (`read_dir` in `torch/distributed/flight_recorder/components/loader.py`), which is the
# file system's order, not the ranks' (printed above): its culprit is an artefact of that
# order. The line by rank is read from its message.
#
# **The fix**: every rank runs the same number of forwards. Either pad the split so each
# rank gets the same number of batches (`DistributedSampler` pads by repeating samples, "add
# extra samples to make it evenly divisible" in `DistributedSampler.__iter__`,
# `torch/utils/data/distributed.py`, which changes the metric slightly), or keep going until
# *every* rank is out of data: an `all_reduce` with `MIN` of "I still have a batch" before
# each step, with a rank that has none running a forward on a dummy batch whose result it
# ignores, or simply stopping all ranks together:


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
#
# (debugging-hangs-branch)=
# ## Hang 2: a unit called on some ranks only
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
    """Hang 2 under DETAIL: the mismatch error this rank raised, or None."""
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
# DETAIL stops both ranks at once, with no timeout, but at collective {glue:text}`hang2_detail_mismatch` (from 0): rank 0's
# reduce-scatter of backward against rank 1's all-gather. Its collective {glue:text}`hang2_detail_passed` passed the check.
# The flight recorder's analyser, on the dumps of the hang above (their group table named
# as before), says the same:

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
print(f"{'':3}{'rank 0':56}rank 1")
for number, entries in enumerate(zip(*traces), start=1):
    print(
        f"{number:<3}" + "".join(f"{issued_by(entry, train_with_a_branch):56}" for entry in entries)
    )

# the first collective the two ranks issued from different FSDP hooks
glue(
    "hang2_parted",
    next(
        (number for number, (a, b) in enumerate(zip(*traces), start=1) if hook_of(a) != hook_of(b)),
        None,
    ),
    display=False,
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
# and the reduce-scatters do not: {ref}`the FSDP2 controls page
# <fsdp2-fsdpmodule-set-reduce-scatter-unused-params>` shows gloo aborting, the silent
# case, and `set_reduce_scatter_unused_params(True)` fixing both.
#
# (debugging-hangs-state-dict)=
# ## Hang 3: a state dict on rank 0 only
#
# "Only rank 0 writes the file" is right; "only rank 0 *gathers* the state dict" is not:
# gathering a sharded model's full state dict is a collective (an all-gather per
# parameter: `_gather_state_dict` in `torch/distributed/_state_dict_utils.py` redistributes
# each DTensor to a full one), which every rank must call. Here rank 0 calls `get_model_state_dict` and
# rank 1 goes on to a barrier. `py-spy dump` prints a running process's stacks from
# outside: on Linux it reads the process's memory with `process_vm_readv`, which needs the
# permission to trace it, and it pauses the process (attaching with `ptrace`) while it
# reads, unless told `--nonblocking` ("Don't pause the python process", its help, printed
# below; `process_vm_readv` is named in the installed `py-spy` binary, as the last line
# below checks). With `--native` it prints the C and C++ frames too, and then it pauses
# the process: the two options cannot be combined (asked for both, the installed py-spy
# refuses, below). Its help on the two options, its version, and that refusal:


# %%
def find_py_spy():
    """py-spy on PATH, or next to this Python (a virtual environment that is not activated)."""
    return shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))


def no_colours(text):
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


help_text = no_colours(
    subprocess.run([find_py_spy(), "dump", "--help"], capture_output=True, text=True).stdout
)
print(
    *[
        " ".join(line.split())
        for line in help_text.splitlines()
        if "--native" in line or "--nonblocking" in line
    ],
    sep="\n",
)
print(subprocess.run([find_py_spy(), "--version"], capture_output=True, text=True).stdout.strip())
# refused before it attaches to anything
both = subprocess.run(
    [find_py_spy(), "dump", "--native", "--nonblocking", "--pid", str(os.getpid())],
    capture_output=True,
    text=True,
)
print(
    f"asked for both (exit status {both.returncode}):",
    no_colours(both.stdout + both.stderr).strip(),
)
print(
    "process_vm_readv named in the binary:", b"process_vm_readv" in Path(find_py_spy()).read_bytes()
)

# %% [markdown]
# (debugging-hangs-py-spy)=
# A thread in each rank runs `py-spy dump --native` on its own process after 2 seconds, when
# both ranks wait; once both dumps are written, rank 0 stops, as with the flight recorder:


# %%
def py_spy_dump_after(seconds, where):
    import subprocess
    import threading

    import torch.distributed as dist

    paths = [Path(where, f"py-spy{rank}.txt") for rank in range(dist.get_world_size())]

    def dump():
        try:
            done = subprocess.run(
                [find_py_spy(), "dump", "--native", "--pid", str(os.getpid())],
                capture_output=True,
                text=True,
                timeout=20,
            )
            text = done.stdout or done.stderr
        except (OSError, subprocess.TimeoutExpired) as error:  # not installed, or not allowed here
            text = f"py-spy could not run: {error}"
        write_then_rename(paths[dist.get_rank()], text.encode())
        stop_once_written(paths)

    threading.Timer(seconds, dump).start()


def save_on_rank_0_only(where):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = sharded_mlp()
    py_spy_dump_after(2, where)
    if dist.get_rank() == 0:
        full = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        torch.save(full, Path(where, "model.pt"))
    dist.barrier()


def main_thread(dump):
    """py-spy's frames of the main thread, innermost first."""
    return [
        line.strip()
        for line in dump.split('"MainThread"')[-1].split("\nThread ")[0].strip().splitlines()
    ]


NATIVE = ("pthread_cond_wait", "std::condition_variable::wait", "c10d::")  # the frames of the wait
PYTHON = {
    "wait_tensor",
    "DTensor.redistribute",
    "get_model_state_dict",
    "barrier",
    "save_on_rank_0_only",
}

try:
    launch(
        save_on_rank_0_only, str(workdir), world_size=2, backend="gloo", timeout=120, output="none"
    )
except LaunchError as error:
    print("the hang ended:", how_it_ended(error))
for rank in (0, 1):
    dump = no_colours((workdir / f"py-spy{rank}.txt").read_text())
    if '"MainThread"' not in dump:  # py-spy's error: not installed, or not allowed to trace
        print(f"rank {rank}: {dump.strip()[:300]}")
        continue
    frames = main_thread(dump)
    native = [frame for frame in frames if frame.startswith(NATIVE)]
    python = [
        frame for frame in frames if frame.split(" (")[0] in PYTHON and re.search(r":\d+\)$", frame)
    ]
    print(
        f"rank {rank}, main thread, innermost first; native frames:",
        *native,
        "... Python frames:",
        *python,
        sep="\n    ",
    )

# %% [markdown]
# Rank 0 is inside the state-dict gather: `get_model_state_dict` redistributes each sharded
# parameter to a full one (an all-gather) and waits for it (`wait_tensor`); rank 1 is in
# `barrier`. The native frames add what is below Python: each main thread is asleep in
# `pthread_cond_wait`, under `c10d::Work::wait` (rank 0 through `c10d::wait_tensor`), waiting
# for a collective that runs on the process group's own threads (`runLoop` and `threads_`
# in `ProcessGroupGloo.hpp`), not computing and not spinning. They name the wait, not which
# collective: that is in the Python frames (or the flight recorder). py-spy needs
# permission to trace the process: it had it here; elsewhere `ptrace_scope` or a container
# without `SYS_PTRACE` can forbid it
# ([py-spy's README](https://github.com/benfred/py-spy#how-do-i-run-py-spy-in-docker)), and
# the cell above would print py-spy's error instead.
#
# **The fix**: every rank calls the gather; only rank 0 writes.


# %%
def save_everywhere_write_on_rank_0(where):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = sharded_mlp()
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if dist.get_rank() == 0:  # the gather is every rank's; the file is rank 0's
        torch.save(full, Path(where, "model.pt"))
    dist.barrier()
    return len(full)


# the hang above may have left none; make sure this one writes it
(workdir / "model.pt").unlink(missing_ok=True)
print(
    "tensors in the saved state dict:",
    launch(save_everywhere_write_on_rank_0, str(workdir), world_size=2, timeout=30, output="none")[
        0
    ],
    "| file written:",
    (workdir / "model.pt").exists(),
)
# %% [markdown]
# (debugging-hangs-set-order)=
# ## Wrong sums the notebook hides: collectives in the order of a set
#
# Python orders a `set` of strings (and a `dict` built from one) by their hashes, and
# each interpreter hashes strings with its own random seed (unless
# [`PYTHONHASHSEED`](https://docs.python.org/3/using/cmdline.html#envvar-PYTHONHASHSEED) is
# set). torchrun starts each rank as a new interpreter (its agent's `_start_workers` calls
# `start_processes`, which runs a script entry point through `subprocess.Popen`, in
# `torch/distributed/elastic/`), so two ranks iterating the same set of parameter names
# visit them in different orders, and collectives issued in that order are paired by
# position, name against name: mixed-up sums when their sizes agree, as below.
# {func}`fsdp_guide.launch` forks its ranks from one server (warm launches), and a fork
# keeps its parent's hash seed: the same code runs right here and goes wrong under
# torchrun. Below, each rank
# all-reduces one value per name, iterating a set, first with cold ranks (new
# interpreters, as torchrun starts them), then warm:

# %%
import contextlib

from fsdp_guide.launcher import launches


def reduce_per_name(in_order):
    """All-reduce one value per parameter name, in the order of a set of names, or sorted."""
    import fsdp_guide
    import torch
    import torch.distributed as dist

    names = {f"blocks.{i}.weight" for i in range(16)}
    # every rank adds the same per name
    value = {name: float(i) for i, name in enumerate(sorted(names))}
    order = sorted(names) if in_order else list(names)
    summed = {}
    for name in order:
        total = torch.tensor([value[name]], device=fsdp_guide.device())
        dist.all_reduce(total)
        summed[name] = total.item()
    return order, all(summed[name] == dist.get_world_size() * value[name] for name in names)


@contextlib.contextmanager
def as_torchrun_starts_them():
    """Cold ranks, each a new interpreter with a hash seed of its own (PYTHONHASHSEED=random, its default)."""
    saved = {name: os.environ.get(name) for name in ("FSDP_GUIDE_WARM", "PYTHONHASHSEED")}
    os.environ.update(FSDP_GUIDE_WARM="0", PYTHONHASHSEED="random")
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def show(how, results):
    (order0, right0), (order1, right1) = results
    warm = all(rank["warm"] for rank in launches()[-1]["ranks"])
    print(
        f"{how:34} warm={warm!s:5}  same order on both ranks: {order0 == order1!s:5}  "
        f"every sum right: {right0 and right1}"
    )


with as_torchrun_starts_them():
    show(
        "set order, cold (as torchrun)", launch(reduce_per_name, False, world_size=2, output="none")
    )
show("set order, warm (forked)", launch(reduce_per_name, False, world_size=2, output="none"))
with as_torchrun_starts_them():
    show("sorted, cold (as torchrun)", launch(reduce_per_name, True, world_size=2, output="none"))

# %% [markdown]
# Cold ranks visit the 16 names in different orders and sum the wrong values together,
# with no error; the warm ranks of the notebook agree by accident of the fork. Iterating
# `sorted(names)` (or a list, or a module's `named_parameters()`, which follow definition
# order: `_named_members` in `torch/nn/modules/module.py` walks the module's `_modules` and
# `_parameters`, dicts kept in insertion order) gives every rank the same order however it
# was started. To see the torchrun behaviour in a notebook, run with `FSDP_GUIDE_WARM=0`,
# which starts every launch cold.

# %% [markdown]
# (debugging-hangs-gpu)=
# ## On GPUs: NCCL's watchdog (from torch's source, not executed here)
#
# Nothing on this page ran on a GPU. What follows is what torch 2.13's source says its NCCL
# process group does; the symbols are in the header the installed package ships,
# `torch/include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp` (its `.cpp` is not
# shipped), and in torch's Python files. This build has no NCCL:

# %%
from torch.distributed.constants import default_pg_nccl_timeout

print("torch.distributed.constants.default_pg_nccl_timeout on this build:", default_pg_nccl_timeout)

# %% [markdown]
# - **Where an NCCL rank waits.** An NCCL collective is queued on a CUDA stream: "At this
#   point, NCCL kernel has already by queued successfully", and the `wait()` that follows
#   only makes the current stream wait: "this function is async operation as well" (the
#   usage example above `class ProcessGroupNCCL` in the header). So the Python line that
#   issued it is meant to go on, and a rank whose
#   partner never joins is meant to block later, wherever the CPU next waits for the GPU (an
#   `.item()`, a copy to the CPU, a synchronize). Its Python stack (the launcher's, py-spy's)
#   would then show that line, not the collective: the flight recorder's sequence numbers
#   and stacks are the tool there.
# - **The timeout: 10 minutes.** `init_process_group`'s docstring in `distributed_c10d.py`:
#   "Default value is 10 minutes for NCCL and 30 minutes for other backends"; the header
#   has `kProcessGroupNCCLDefaultTimeout = 10 * 60 * 1000` ms, and gloo's 30 minutes are
#   `kBackendDefaultTimeout` in `Backend.hpp` (printed as `default_pg_timeout` in
#   {ref}`hang 1's cell <debugging-hangs-uneven>`). Python reads NCCL's as
#   `torch.distributed.constants.default_pg_nccl_timeout`, from the binding
#   `_DEFAULT_PG_NCCL_TIMEOUT` (`None` above: no NCCL here); that the binding is
#   `kProcessGroupNCCLDefaultTimeout` is set in `torch/csrc/distributed/c10d/init.cpp`, not
#   shipped in the wheel, read in torch's repository. `init_process_group(timeout=...)` sets
#   it: "the duration after which collectives will be aborted asynchronously and the process
#   will crash" (its docstring). Shorten it while debugging.
# - **The watchdog.** `ProcessGroupNCCL::Watchdog` is "a side thread to check whether the
#   NCCL collective is timed out or errors on the cached NCCL communicators"; its `runLoop`
#   "takes care of cleaning up completed work, and aborting upon failure or timeout". It
#   exists because torch "can't rely on the user calling certain methods like wait(),
#   isCompleted()" (the comment on `Watchdog::run`).
# - **`TORCH_NCCL_ASYNC_ERROR_HANDLING`** chooses what the watchdog does on a timeout or an
#   error, the `ErrorHandlingMode`: `0` no handling, `1` tear the process down, `2` clean up
#   (abort the communicators) without tearing down, `3` tear down without cleaning up;
#   the header's comment wants "to eventually remove this variable and make users to use the
#   default value (3 - SkipCleanUp)". torchrun sets `1` for
#   its workers unless the variable is set (`_start_workers` in
#   `torch/distributed/elastic/agent/server/local_elastic_agent.py`).
# - **`TORCH_NCCL_BLOCKING_WAIT`** "Control[s] whether or not wait() is blocking": it sets
#   `blockingWait_`, "Whether or not wait() and synchronize() are blocking operations that
#   wait for the operation to complete", and `WorkNCCL::wait` with a timeout "will block the
#   CPU thread until the NCCL work is completed or timed out. If timeout, exception will be
#   thrown" (both comments in the header; "the process will block and wait for this
#   timeout", `init_process_group`'s docstring). So, set, the Python thread that calls
#   `work.wait()` is meant to block there and the error should be raised on that line, as
#   gloo's is: read in the source, not observed.
# - **`TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`** (with `TORCH_NCCL_ENABLE_MONITORING`): a
#   `HeartbeatMonitor` thread "aborts the process when the ProcessGroupNCCL Watchdog thread
#   gets stuck and no heartbeat is detected after `TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`", for a
#   watchdog itself stuck in a CUDA or NCCL call.
# - **`TORCH_NCCL_DESYNC_DEBUG`** ("must be set together with
#   `TORCH_NCCL_ASYNC_ERROR_HANDLING`"): a `DesyncDebugger` logs each collective's start and
#   end to the store, and the watchdog runs it "at time of timeout" for a "desync root cause
#   analysis", meant to tell from those records which ranks had not started or finished the
#   collective that timed out (its report is written in `ProcessGroupNCCL.cpp`, not shipped
#   in the wheel, read in torch's repository).
# - **`TORCH_NCCL_DUMP_ON_TIMEOUT`**: the flight recorder dumped "on watchdog timeout"
#   ("must be set together with `TORCH_NCCL_ENABLE_MONITORING=1` and
#   `TORCH_NCCL_TRACE_BUFFER_SIZE > 0`", the header's comment; `TORCH_NCCL_TRACE_BUFFER_SIZE`
#   is the old name of `TORCH_FR_BUFFER_SIZE`: the `FlightRecorder` constructor reads
#   `{"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}`, default 2000, so it is on).
#   It is on by default, as torch's source reads: the header's `HeartbeatMonitor` holds
#   `dumpOnTimeoutOrEx_` ("Whether or not to dump debug info on exception including both
#   watchdog timeout and nccl errors"), and its constructor, in `ProcessGroupNCCL.cpp` (not
#   shipped in the wheel, read in torch's repository's main branch), sets it with
#   `getCvarBool(TORCH_NCCL_DUMP_ON_TIMEOUT, true)`, and the monitor's own switch with
#   `getCvarBool(TORCH_NCCL_ENABLE_MONITORING, true)`. Not verified: that the 2.13 wheel was built from that line (a default
#   is not a string in the binary), nor on a GPU. Set it to 0 to turn the dump off. It
#   writes one file per rank named by a prefix and the rank (`DebugInfoWriter` in
#   `FlightRecorder.hpp`). The prefix is `TORCH_FR_DUMP_TEMP_FILE` (or its old name
#   `TORCH_NCCL_DEBUG_INFO_TEMP_FILE`) if set; by default, in `DebugInfoWriter::getWriter`
#   (`FlightRecorder.cpp`, not shipped, read in torch's repository),
#   `$XDG_CACHE_HOME/torch/comm_lib_trace_rank_`, else `$HOME/.cache/torch/comm_lib_trace_rank_`
#   (`/tmp/.cache/...` without `HOME`): so `~/.cache/torch/comm_lib_trace_rank_0` for rank 0.
#   The installed `libtorch_cpu.so` carries the strings that code uses
#   (`TORCH_FR_DUMP_TEMP_FILE`, `XDG_CACHE_HOME`, `HOME`, `/tmp`, `/.cache`, `/torch`,
#   `comm_lib_trace_r`…), which is consistent with it, not a proof. Those files are what
#   `torchfrtrace` reads, as {ref}`above <debugging-hangs-analyser>`.
# - **`NCCL_DEBUG=INFO`** is NCCL's own variable, not torch's
#   ([NCCL's documentation](https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-debug)):
#   at `INFO` NCCL prints its own debug information (its version, its communicators' setup,
#   its warnings). It knows NCCL's operations, not FSDP's units or torch's sequence numbers.

# %% [markdown]
# ## Symptom → tool → fix
#
# | Symptom | First tool | What it shows | Fix |
# |---|---|---|---|
# | hangs at the end of an epoch or of evaluation | the launcher's stacks (or py-spy) | one rank in FSDP's all-gather, the other in your `all_reduce` | equal batch counts: pad, or `all_reduce(MIN)` of "I have data" |
# | hangs in backward after a data-dependent forward | the flight recorder's stacks of the collective *before* the first mismatch | one rank's all-gather issued by a forward (`pre_forward`, the branch's line), the other's by backward | run every unit on every rank; select with `torch.where` |
# | any hang, to see the collectives | flight recorder, then `torchfrtrace` (on gloo's dumps after naming their group) | the first sequence number at which the ranks' operations, sizes or dtypes differ, which can be one past the cause | (the fix of the hang it points to) |
# | hangs at saving | py-spy (or the launcher's stacks) | rank 0 in a state-dict gather, the others elsewhere | gather on every rank, write on rank 0 |
# | is the rank computing or waiting? | `py-spy dump --native` | the main thread in `pthread_cond_wait` under `c10d::Work::wait` | (where it waits: the Python frames) |
# | a hang, turned into an error | `TORCH_DISTRIBUTED_DEBUG=DETAIL` | each rank's own collective where operation, size or dtype first differ | (debug runs only: it checks every collective) |
# | "who is late?" | `dist.monitored_barrier` | the ranks that did not arrive | (on a gloo group) |
# | an NCCL job killed after 10 minutes, or stuck | the flight recorder's dumps (written on timeout by default per torch's source, to `torch/comm_lib_trace_rank_<rank>` under `$XDG_CACHE_HOME` or `~/.cache` unless `TORCH_FR_DUMP_TEMP_FILE` says where), `TORCH_NCCL_DESYNC_DEBUG`, a shorter `timeout` (cited, not run here) | the flight recorder's dumps; the ranks that did not join | (the fix of the hang the dumps point to) |
# | hangs or wrong sums under torchrun, not in the notebook | `FSDP_GUIDE_WARM=0` (cold ranks, as torchrun's) | a loop over a `set` or `dict` of strings issuing collectives | iterate `sorted(...)` |

# %% [markdown]
# (debugging-hangs-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/debugging_hangs.py`.
# It runs hang 1 (one rank with an evaluation batch more) with the debug level `DETAIL` and a
# 10-second collective timeout, so that, instead of hanging, every rank raises the
# collective-mismatch error and exits; rank 0 prints each rank's collective, by number and
# operation. The tests run this file under torchrun on 2 CPU ranks and check that it ends and
# names rank 0's `ALLREDUCE` and rank 1's `_ALLGATHER_BASE` (`tests/test_scripts.py`).
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
