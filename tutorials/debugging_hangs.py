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
#   arrive, torch's flight recorder, and `py-spy dump`;
# - a fourth that only torchrun shows: collectives issued in the order of a `set`, which
#   the notebook's forked ranks agree on and torchrun's new interpreters do not;
# - the fix for each, checked, and a symptom → tool → fix table.
#
# **What you need**: a CPU; 2 processes on gloo; `py-spy` for its section (the package's
# `test` or `docs` extra); about 60 seconds on 2 CPU cores, most of it spent waiting for
# hangs to time out. The hangs run on gloo on purpose, even where GPUs are present
# (`backend="gloo"`): a gloo collective blocks the Python line that called it, so the
# tools below find the rank on that line. NCCL collectives are queued on a CUDA stream
# and return at once, so an NCCL rank hangs later, at its next synchronisation (an
# `.item()`, a barrier), and its watchdog's timeout and dumps are the tools there
# (`TORCH_NCCL_DUMP_ON_TIMEOUT`, `TORCH_FR_DUMP_TEMP_FILE`). The models are built on
# {func}`fsdp_guide.device`. The tips are listed {ref}`at the end <debugging-hangs-tips>`.

# %%
import os
import re
import sys
import tempfile
from pathlib import Path

import torch

from fsdp_guide import LaunchError, launch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")
workdir = Path(tempfile.mkdtemp())


def sharded_mlp(layers=3):
    """A small model, one FSDP2 unit per layer: every forward all-gathers each unit."""
    import torch
    from torch.distributed.fsdp import fully_shard

    import fsdp_guide

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(layers)]).to(fsdp_guide.device())
    for layer in model:
        fully_shard(layer)
    return fully_shard(model)


def user_frames(stack):
    """The frames of a stack that are the worker's own (notebook functions show as <dynamic-code>)."""
    return [line.split(" in ")[-1] + " (line " + line.split("line ")[1].split()[0] + ")"
            for line in stack.splitlines() if "<dynamic-code>" in line]


# %% [markdown]
# ## Hang 1: uneven evaluation batches
#
# The evaluation set is split across ranks, and one rank gets one batch more. Every
# forward of an FSDP model all-gathers its units' parameters, so the rank with the extra
# batch waits in an all-gather that the other rank, already summing the results in an
# `all_reduce`, never joins. Nothing errors; both wait until the {term}`collective timeout` (30
# minutes by default on gloo; 5 minutes under `launch`, its `collective_timeout`).
# {func}`fsdp_guide.launch` stops them after `timeout` seconds, and its error shows where
# each rank was:

# %%
def evaluate(batches_on_rank_1, monitored=None, where=None):
    import datetime

    import torch
    import torch.distributed as dist

    import fsdp_guide

    device = fsdp_guide.device()
    model = sharded_mlp()
    if where is not None:
        dump_flight_recorder_after(2, where)  # defined below, with the flight recorder
    batches = 2 if dist.get_rank() == 0 else batches_on_rank_1
    total = torch.zeros(1, device=device)
    with torch.no_grad():
        for _ in range(batches):
            total += model(torch.randn(4, 16, device=device)).sum()  # all-gathers every unit
    if monitored is not None:  # a checkpoint of arrival before the collective
        try:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=2))
        except RuntimeError as error:  # rank 0 names the late ranks; kept for the page to print
            Path(monitored, f"monitored{dist.get_rank()}.txt").write_text(str(error))
            raise
    dist.all_reduce(total)
    return total.item()


try:
    launch(evaluate, 3, world_size=2, backend="gloo", timeout=10, output="none")  # the ranks hang within 5 s
except LaunchError as error:
    print(str(error).splitlines()[0][:110], "...")
    for rank, stack in sorted(error.stacks.items()):
        print(f"rank {rank}: innermost {stack.splitlines()[0].split(' in ')[-1]!r}, "
              f"called from {user_frames(stack)}")

# %% [markdown]
# Rank 1, on its third batch, waits in FSDP's all-gather (`all_gather_single`, called from
# the forward on the evaluation line); rank 0 waits in the `all_reduce` after the loop. The
# two ranks are in *different* {term}`collectives <collective>`: that is the signature of a hang from control
# flow that differs between ranks.
#
# `TORCH_DISTRIBUTED_DEBUG=DETAIL` turns the wait into an error. Set in the environment the
# ranks start with, it wraps every process group so that before each collective the ranks
# compare what they are about to run (before every collective, a monitored barrier and an
# all-gather of the collectives' fingerprints on an extra gloo group: a debugging
# setting, not a production one):

# %%
os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
try:
    launch(evaluate, 3, world_size=2, backend="gloo", timeout=30, output="none")
except LaunchError as error:
    report = str(error).splitlines()[0]
    for rank, sequence, op in re.findall(r"Rank (\d) is running collective: CollectiveFingerPrint\("
                                         r"SequenceNumber=(\d+), OpType=(\w+)", report):
        print(f"rank {rank} is running collective number {sequence}: {op}")
    print(report[report.rindex("Collectives differ"):])
finally:
    del os.environ["TORCH_DISTRIBUTED_DEBUG"]

# %% [markdown]
# The report names both collectives: rank 0 in an `ALLREDUCE`, rank 1 in an
# `_ALLGATHER_BASE` (FSDP's). `dist.monitored_barrier` (a {term}`monitored barrier`) is the targeted version: put it
# before the collective where ranks should meet, and rank 0 names who did not arrive in
# time. It runs on a gloo group (with NCCL training, on a gloo group created for it), and
# costs a round trip to rank 0: a debugging aid too.

# %%
try:
    launch(evaluate, 3, str(workdir), world_size=2, backend="gloo", timeout=30, output="none")
except LaunchError:
    print((workdir / "monitored0.txt").read_text().splitlines()[0])

# %% [markdown]
# Torch's {term}`flight recorder` keeps, in each rank, a ring buffer of the last collectives and
# their state (on by default in torch 2.13, 2000 entries: `TORCH_FR_BUFFER_SIZE` resizes
# it, 0 turns it off). For gloo the dump is a private function,
# `torch._C._distributed_c10d._dump_fr_trace_json`. A thread started in each rank dumps it
# 2 seconds after the model is built, while the ranks hang:

# %%
def dump_flight_recorder_after(seconds, where):
    import json
    import threading

    import torch._C._distributed_c10d as c10d
    import torch.distributed as dist

    def dump():
        entries = json.loads(c10d._dump_fr_trace_json(True, False))["entries"]  # collectives, not only active
        summary = [(e["collective_seq_id"], e["profiling_name"], e["input_sizes"]) for e in entries]
        Path(where, f"fr{dist.get_rank()}.json").write_text(json.dumps(summary))

    threading.Timer(seconds, dump).start()


try:
    launch(evaluate, 3, None, str(workdir), world_size=2, backend="gloo", timeout=10, output="none")
except LaunchError as error:
    print(str(error).splitlines()[0][:60], "...")
import json

for rank in (0, 1):
    print(f"rank {rank}'s last collectives (sequence number, operation, input sizes):")
    for entry in json.loads((workdir / f"fr{rank}.json").read_text())[-3:]:
        print("   ", *entry)

# %% [markdown]
# Read the sequence numbers: the ranks agree up to the last collective they share (the
# second batch's all-gathers), then rank 0's next is the `all_reduce` and rank 1's an
# all-gather of its third batch. The first sequence number at which the ranks' operations
# differ is where their control flow parted. (The recorder numbers collectives from 1, the
# DETAIL report above from 0: the same collective.)
#
# **The fix**: every rank runs the same number of forwards. Either pad the split so each
# rank gets the same number of batches (`DistributedSampler` pads by repeating samples,
# which changes the metric slightly), or keep going until *every* rank is out of data: an
# `all_reduce` with `MIN` of "I still have a batch" before each step, with a rank that has
# none running a forward on a dummy batch whose result it ignores, or simply stopping all
# ranks together:

# %%
def evaluate_together(batches_on_rank_1):
    import torch
    import torch.distributed as dist

    import fsdp_guide

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


print("batches evaluated per rank:", [steps for steps, _ in launch(evaluate_together, 3, world_size=2,
                                                                    timeout=30, output="none")])

# %% [markdown]
# Both ranks stop after 2 batches: no hang. Rank 1's third batch is skipped here; to count
# it, run its forward on every rank (the other with a dummy input it discards), or pad.
#
# ## Hang 2: a unit called on some ranks only
#
# A model whose forward takes a branch that depends on the data (a mixture-of-experts
# router, an early exit, a skipped layer) calls some FSDP units on some ranks only. The
# rank that calls the unit all-gathers it; the other has moved on. Where do they hang?

# %%
def train_with_a_branch(where):
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import fsdp_guide

    device = fsdp_guide.device()
    body, expert = sharded_mlp(2), torch.nn.Linear(16, 16).to(device)
    fully_shard(expert)
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
    launch(train_with_a_branch, str(workdir), world_size=2, backend="gloo", timeout=8, output="none")
except LaunchError as error:
    for rank, stack in sorted(error.stacks.items()):
        print(f"rank {rank} called the expert: {(workdir / f'expert{rank}.txt').read_text()}; stuck in "
              f"{stack.splitlines()[0].split(' in ')[-1]!r}, from {user_frames(stack)}")

# %% [markdown]
# Both ranks wait in backward (line 18 is `y.sum().backward()`), not in the branch: rank
# 0's all-gather for the expert met rank 1's first all-gather of backward, a tensor of the
# same size (the expert and a body layer are both 16×16 plus a bias). Collectives are
# paired by their order, on every backend, not by what they mean: both ranks went on with
# mixed-up weights (rank 1's layer got half of the expert's), until one ran a reduce-scatter
# where the other ran an all-gather. The stacks show where ranks wait, which can be later
# than where they parted; here the flight recorder and DETAIL, which compare operations,
# sizes and dtypes, would see the two all-gathers as a match too. What finds this bug is
# reading the forward for FSDP units called under data-dependent conditions.
#
# **The fix**: call every unit on every rank, and let the data decide what its output
# counts for. Here, compute the expert on every rank and select with `torch.where`; for
# mixture-of-experts, route tokens but run every expert (possibly on zero tokens) on every
# rank:

# %%
def train_every_unit_everywhere():
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import fsdp_guide

    device = fsdp_guide.device()
    body, expert = sharded_mlp(2), torch.nn.Linear(16, 16).to(device)
    fully_shard(expert)
    torch.manual_seed(dist.get_rank())
    x = torch.randn(4, 16, device=device) + (1 if dist.get_rank() == 0 else -1)
    y = body(x)
    y = torch.where(y.mean() > 0, expert(y), y)  # the expert runs on every rank
    y.sum().backward()
    return expert.weight.grad is not None


print("every rank finished, the expert's gradient reduced:", launch(train_every_unit_everywhere, world_size=2,
                                                                  timeout=30, output="none"))

# %% [markdown]
# ## Hang 3: a state dict on rank 0 only
#
# "Only rank 0 writes the file" is right; "only rank 0 *gathers* the state dict" is not:
# gathering a sharded model's full state dict is a collective (an all-gather per
# parameter), which every rank must call. Here rank 0 calls `get_model_state_dict` and
# rank 1 goes on to a barrier. `py-spy dump` prints a running process's Python stacks
# from outside, pausing it for a moment (it reads the process's memory with `ptrace`): a
# thread in each rank runs it on its own process after 3 seconds.

# %%
def py_spy_dump_after(seconds, where):
    import subprocess
    import threading

    import torch.distributed as dist

    def dump():
        try:
            done = subprocess.run(["py-spy", "dump", "--pid", str(os.getpid())], capture_output=True, text=True,
                                  timeout=20, env={**os.environ, "NO_COLOR": "1"})
            text = done.stdout or done.stderr
        except (OSError, subprocess.TimeoutExpired) as error:  # not installed, or not allowed here
            text = f"py-spy could not run: {error}"
        Path(where, f"py-spy{dist.get_rank()}.txt").write_text(text)

    threading.Timer(seconds, dump).start()


def save_on_rank_0_only(where):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = sharded_mlp()
    py_spy_dump_after(3, where)
    if dist.get_rank() == 0:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        torch.save(full, Path(where, "model.pt"))
    dist.barrier()


try:
    launch(save_on_rank_0_only, str(workdir), world_size=2, backend="gloo", timeout=8, output="none")
except LaunchError as error:
    print(str(error).splitlines()[0][:60], "...")
for rank in (0, 1):
    dump = re.sub(r"\x1b\[[0-9;]*m", "", (workdir / f"py-spy{rank}.txt").read_text())  # no colours
    main = dump.split('"MainThread"')[-1].split("\nThread ")[0].strip().splitlines()
    print(f"rank {rank}, py-spy's main thread, innermost first:", *[line.strip() for line in main[:2]],
          "...", *[line.strip() for line in main if any(name in line for name in (
              "wait_tensor", "DTensor.redistribute", "get_model_state_dict (", "save_on_rank_0_only"))], sep="\n    ")

# %% [markdown]
# Rank 0 is inside the state-dict gather: `get_model_state_dict` redistributes each sharded
# parameter to a full one (an all-gather) and waits for it (`wait_tensor`); rank 1 is in
# `barrier`. py-spy needs permission to trace the
# process: it had it here; elsewhere `ptrace_scope` or a container without `SYS_PTRACE`
# can forbid it, and the file above would hold py-spy's error instead.
#
# **The fix**: every rank calls the gather; only rank 0 writes.

# %%
def save_everywhere_write_on_rank_0(where):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = sharded_mlp()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:  # the gather is every rank's; the file is rank 0's
        torch.save(full, Path(where, "model.pt"))
    dist.barrier()
    return len(full)


print("tensors in the saved state dict:", launch(save_everywhere_write_on_rank_0, str(workdir), world_size=2,
                                                  timeout=30, output="none")[0],
      "| file written:", (workdir / "model.pt").exists())

# %% [markdown]
# (debugging-hangs-set-order)=
# ## A hang the notebook hides: collectives in the order of a set
#
# Python orders a `set` of strings (and a `dict` built from one) by their hashes, and
# each interpreter hashes strings with its own random seed (unless `PYTHONHASHSEED` is
# set). torchrun starts each rank as a new interpreter, so two ranks iterating the same
# set of parameter names visit them in different orders, and collectives issued in that
# order are paired by position, name against name: mixed-up sums when their sizes agree,
# a hang or an error when they do not. After its first launch {func}`fsdp_guide.launch`
# forks its ranks from one server (warm launches), and a fork keeps its parent's hash
# seed: the same code runs right here and goes wrong under torchrun. Below, each rank
# all-reduces one value per name, iterating a set, first with cold ranks (new
# interpreters, as torchrun starts them), then warm:

# %%
import contextlib

from fsdp_guide.launcher import launches


def reduce_per_name(in_order):
    """All-reduce one value per parameter name, in the order of a set of names, or sorted."""
    import torch
    import torch.distributed as dist

    import fsdp_guide

    names = {f"blocks.{i}.weight" for i in range(16)}
    value = {name: float(i) for i, name in enumerate(sorted(names))}  # every rank adds the same per name
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
    print(f"{how:34} warm={warm!s:5}  same order on both ranks: {order0 == order1!s:5}  "
          f"every sum right: {right0 and right1}")


with as_torchrun_starts_them():
    show("set order, cold (as torchrun)", launch(reduce_per_name, False, world_size=2, output="none"))
show("set order, warm (forked)", launch(reduce_per_name, False, world_size=2, output="none"))
with as_torchrun_starts_them():
    show("sorted, cold (as torchrun)", launch(reduce_per_name, True, world_size=2, output="none"))

# %% [markdown]
# Cold ranks visit the 16 names in different orders and sum the wrong values together,
# with no error; the warm ranks of the notebook agree by accident of the fork. Iterating
# `sorted(names)` (or a list, or a module's `named_parameters()`, which follow definition
# order) gives every rank the same order however it was started. To see the torchrun
# behaviour in a notebook, run with `FSDP_GUIDE_WARM=0`, which starts every launch cold.

# %% [markdown]
# ## Symptom → tool → fix
#
# | Symptom | First tool | What it shows | Fix |
# |---|---|---|---|
# | hangs at the end of an epoch or of evaluation | the launcher's stacks (or py-spy) | one rank in FSDP's all-gather, the other in your `all_reduce` | equal batch counts: pad, or `all_reduce(MIN)` of "I have data" |
# | hangs in backward after a data-dependent forward | the launcher's stacks, then reading the forward | ranks in different collectives of backward | run every unit on every rank; select with `torch.where` |
# | any hang, to see the collectives | flight recorder | the ranks' collective sequences part at one number | (the fix of the hang it points to) |
# | hangs at saving | py-spy (or the launcher's stacks) | rank 0 in a state-dict gather, the others elsewhere | gather on every rank, write on rank 0 |
# | a hang, turned into an error | `TORCH_DISTRIBUTED_DEBUG=DETAIL` | both collectives, named, where they differ in operation, size or dtype | (debug runs only: it checks every collective) |
# | "who is late?" | `dist.monitored_barrier` | the ranks that did not arrive | (on a gloo group) |
# | hangs or wrong sums under torchrun, not in the notebook | `FSDP_GUIDE_WARM=0` (cold ranks, as torchrun's) | a loop over a `set` or `dict` of strings issuing collectives | iterate `sorted(...)` |
#
# (debugging-hangs-tips)=
# ## The tips behind this
#
# - {ref}`tip-hangs-same-collectives`
# - {ref}`tip-hangs-tools`

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("debugging_hangs")
