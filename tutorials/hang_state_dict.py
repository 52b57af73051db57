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
# (tutorial-hang-state-dict)=
# # A state dict gathered on rank 0 only, seen with py-spy
#
# **What you will learn**
#
# - why "only rank 0 gathers the full state dict" hangs, while "only rank 0 writes the file"
#   is right: reproduced and stopped within seconds;
# - what `py-spy dump --native` prints of a hung rank from outside (its Python frames and the
#   C++ ones below them), what it needs, and its options;
# - the fix, the gather on every rank and the write on rank 0, checked.
#
# The tools that compare collectives are on {ref}`the first hang's page
# <tutorial-debugging-hangs>`.
#
# **What you need**: a CPU; 2 processes on gloo; `py-spy` (the package's `test` or `docs`
# extra); about 5 seconds on 2 CPU cores ({ref}`measured <measured-times>`), much of it spent
# waiting in the hang for the dumps. The hang runs on gloo on purpose, even where GPUs are
# present (`backend="gloo"`): a gloo collective holds the calling Python line until it
# completes, where an NCCL rank would run on and hang later ({ref}`on GPUs
# <debugging-hangs-gpu>`). The models are built on {func}`fsdp_guide.device`. The tips are
# listed {ref}`at the end <hang-state-dict-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`hang-state-dict-script` ({download}`download <scripts/hang_state_dict.py>`).

# %%
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from fsdp_guide import LaunchError, launch

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


def how_it_ended(error):
    """The rank that stopped and its signal; any other end (a timeout, an exception), as launch said it."""
    if error.exit_code is not None and error.exit_code < 0:
        return f"rank {error.rank} stopped by {signal.Signals(-error.exit_code).name}"
    return str(error).splitlines()[0]


# %% [markdown]
# (debugging-hangs-state-dict)=
# ## The hang
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
# both ranks wait; once both dumps are written, rank 0 stops its own process (SIGTERM, as
# you would stop a hung job), and `launch` stops the other: ending there rather than at a
# `timeout` waits for the dumps however slow the machine is:


# %%
def py_spy_dump_after(seconds, where):
    import subprocess
    import threading

    import torch.distributed as dist

    paths = [Path(where, f"py-spy{rank}.txt") for rank in range(dist.get_world_size())]

    def dump():
        import torch._C._distributed_c10d as c10d

        # and the flight recorder's entries (on by default), for the picture of who waits for whom
        flight = Path(where, f"flight-recorder{dist.get_rank()}.pkl")
        flight.write_bytes(c10d._dump_fr_trace())
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
# Each rank also wrote its flight recorder's entries at the same moment. Its last collective,
# where it waits, and the same drawn (each rank a row, the collective it waits in red):

# %%
import pickle

traces = [
    pickle.loads((workdir / f"flight-recorder{rank}.pkl").read_bytes())["entries"]
    for rank in (0, 1)
]
for rank, entries in enumerate(traces):
    last = entries[-1]
    print(
        f"rank {rank}: {len(entries)} collective(s); waits in #{last['collective_seq_id']}, "
        f"{last['profiling_name']}"
    )

# %% tags=["hide-input"] mystnb={"image": {"alt": "Each rank's collectives in hang 3 from the flight recorder, one row per rank: rank 0 waits in an all-gather of the state-dict gather, rank 1 in a barrier, both collective number 1, in red."}}
from fsdp_guide.collectives import draw_flight_recorder

figure = draw_flight_recorder(traces, "Hang 3: the ranks' collectives, from the flight recorder")

# %% [markdown]
# The two ranks' first collective is the same one by its number, and a different operation
# on each: rank 0's is the gather's first all-gather, rank 1's the barrier. Neither can end:
# gloo pairs the two as one collective, by their order.
#
# Rank 0 is inside the state-dict gather: `get_model_state_dict` redistributes each sharded
# parameter to a full one (an all-gather) and waits for it (`wait_tensor`); rank 1 is in
# `barrier`. The native frames add what is below Python: each main thread is asleep in
# `pthread_cond_wait`, under `c10d::Work::wait` (rank 0 through `c10d::wait_tensor`), waiting
# for a collective that runs on the process group's own threads (`runLoop` and `threads_`
# in `ProcessGroupGloo.hpp`), not computing and not spinning. They name the wait, not which
# collective: that is in the Python frames (or {ref}`the flight recorder
# <debugging-hangs-flight-recorder>`). py-spy needs
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
# Every rank gathered, rank 0 wrote the file, and no rank hung.
#
# (hang-state-dict-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/hang_state_dict.py`.
# It saves the fixed way (every rank gathers the full state dict, rank 0 writes it) and
# checks the file against the unsharded model as one process holds it; then it gathers on
# rank 0 only, with a 10-second collective timeout, so that, instead of hanging, each rank
# raises at the timeout and prints the line of the script it waited on. The tests run this
# file under torchrun on 2 CPU ranks and check that the saved file matches exactly, and that
# the wrong save ends with rank 0 waiting in `get_model_state_dict` and rank 1 in
# `dist.barrier()` (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/hang_state_dict.py
# :language: python
# ```

# %% [markdown]
# (hang-state-dict-tips)=
# ## The tips behind this
#
# - {ref}`tip-hangs-same-collectives`
# - {ref}`tip-hangs-tools`

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("hang_state_dict")
