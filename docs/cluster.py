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
# (cluster)=
# # Running on a cluster: torchrun, SLURM and HSDP
#
# The tutorials start their ranks with {func}`fsdp_guide.launch`; on a cluster `torchrun` starts
# them, and the same worker code runs unchanged: `launch` sees the `RANK` and `WORLD_SIZE` that
# `torchrun` set and runs the function in the process `torchrun` started.
#
# **What you will learn**
#
# - the `torchrun` commands for one machine and for several, and the environment variables that matter;
# - a SLURM script, with restarts when a rank dies;
# - hybrid sharding (HSDP) on a 2 x 2 mesh, executed: shard within a node, replicate across nodes;
# - the messages a launch fails with (a script started without `torchrun`, a port in use, a rank that
#   never arrives, a backend missing for a device, a mesh of the wrong size), each reproduced, and
#   `torchrun`'s `ChildFailedError` read for the rank that caused it.
#
# **What you need**: a CPU; 4 processes on gloo for the HSDP cell; about 20 seconds on 2 CPU cores ({ref}`measured <measured-times>`).
# Back to {doc}`fsdp` (how FSDP works) or {doc}`fsdp_tips`.
# Its idea as a plain torchrun script to copy: {ref}`cluster-script` ({download}`download <../tutorials/scripts/cluster.py>`).
#
# ## One machine, then several
#
# ```bash
# # one machine, 8 ranks (one per GPU; on CPU, gloo)
# torchrun --nproc-per-node=8 -m fsdp_guide.recipes.train_llm --steps 1000
#
# # two machines: run the same command on each; HOST is one of them, reachable from both
# torchrun --nnodes=2 --nproc-per-node=8 \
#     --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 --rdzv-id=my-run \
#     -m fsdp_guide.recipes.train_llm --checkpoint-dir /shared/ckpt --checkpoint-every 500
# ```
#
# With `--rdzv-backend=c10d` the first `torchrun` to start on HOST serves a small key-value store on
# port 29500; the others connect to it and agree on the ranks, and every rank then reads `RANK`,
# `LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` from its environment (these and the
# other variables that matter: {ref}`fsdp-torchrun-environment`). Checkpoints must go to a file
# system every node sees. The test suite runs the two-machine form as two one-rank `torchrun`
# processes on one machine and checks that they produce exactly the losses of one machine with 2
# ranks. That store, and the process group's own, accept connections on *every* interface of HOST,
# not only the endpoint's ({ref}`fsdp-torchrun-stores`): run on a private network, or behind a
# firewall that lets only the cluster's nodes reach those ports.
#
# ## SLURM
#
# One `torchrun` per node, started by `srun`; `torchrun` starts the ranks of its node:

# %% [markdown]
r"""
```bash
#!/bin/bash
#SBATCH --job-name=fsdp-llm
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1          # one torchrun per node
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=04:00:00
#SBATCH --requeue                     # preempted jobs come back and resume

head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
ckpt=/shared/ckpt/$SLURM_JOB_NAME
export NCCL_SOCKET_IFNAME=ib0 OMP_NUM_THREADS=8
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1  # a fresh store for each restart (below)

srun torchrun --nnodes="$SLURM_NNODES" --nproc-per-node=8 --max-restarts=3 \
    --rdzv-backend=c10d --rdzv-endpoint="$head:29500" --rdzv-id="$SLURM_JOB_ID" \
    -m fsdp_guide.recipes.train_llm --checkpoint-dir "$ckpt" --checkpoint-every 500 --resume auto
```
"""

# %% [markdown]
# `--resume auto` resumes from the newest complete checkpoint in `--checkpoint-dir`, or starts at
# step 1 when there is none, and prints which: the first attempt and every requeued one run the same
# command (`--resume latest` fails without a checkpoint, for a run that must not start afresh by
# mistake). The recipe publishes a checkpoint only once complete ({ref}`tip-exact-resume`): a job
# killed during a save resumes from the one before.
#
# (cluster-max-restarts)=
# `--max-restarts=3` lets `torchrun` handle a rank that dies without giving up the allocation: it
# stops the other ranks, starts them all again (up to 3 times), and `--resume auto` takes them to the
# newest complete checkpoint. The guide's tests do this on one machine (`tests/test_llm.py`): under
# `torchrun --max-restarts=1` they kill rank 1 with `SIGKILL`, once mid-training and once while it
# saves, and the restarted run ends with the losses, weights, optimizer state and random states of an
# uninterrupted run, bit for bit. Export `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` for such a job (the
# recipe warns when a restarting `torchrun` shares its store): by default `torchrun` keeps one
# rendezvous store for all its attempts and shares it with the ranks, so a restarted rank can read the
# address a rank of the previous attempt published and fail to connect (pytorch/pytorch#135712,
# closed, on NCCL; those tests run with this setting; the source: {ref}`fsdp-torchrun-stores`).
# {ref}`tutorial-rank-dies` runs such a restart on one machine and measures what it costs;
# {ref}`tutorial-torchft-recovery` sets it beside torchft, which keeps the other replicas training.
#
# ## HSDP: shard within a node, replicate across nodes
#
# `FULL_SHARD` over many nodes all-gathers every layer across the slow links between them. Hybrid
# sharding ({term}`HSDP`) shards within a group of ranks (a node, whose GPUs are typically linked by
# NVLink) and keeps a full replica of the shards on each group: all-gathers stay inside the node, and
# only the gradient reduction crosses nodes. FSDP1 calls it `ShardingStrategy.HYBRID_SHARD`; FSDP2
# takes a 2-D {term}`device mesh`, `(replicate, shard)`. Here 4 CPU processes on gloo stand for 2
# nodes of 2, each putting its batch on {func}`fsdp_guide.device` (`cuda:LOCAL_RANK` where it has a
# GPU, else the CPU), so the same code is written to run unchanged with one GPU per rank (NCCL):

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %%
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fsdp_guide
from fsdp_guide import launch


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))


def batch(rank):
    """Rank ``rank``'s inputs and targets, drawn on the CPU: the same numbers on any device."""
    g = torch.Generator().manual_seed(rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)


def hsdp_step():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode

    device = fsdp_guide.device()
    mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("replicate", "shard"))
    model = make_model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = (t.to(device) for t in batch(dist.get_rank()))
    with CommDebugMode() as comm:
        F.mse_loss(model(x), y).backward()
    optimizer.step()
    weight = model[0].weight
    return dict(
        shard_group=dist.get_process_group_ranks(mesh.get_group("shard")),
        replicate_group=dist.get_process_group_ranks(mesh.get_group("replicate")),
        placements=str(weight.placements),
        local_shape=tuple(weight.to_local().shape),
        collectives={str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()},
        weights=[p.full_tensor().cpu() for p in model.parameters()],  # for the comparison below
    )


from IPython.display import display

from fsdp_guide.table import Table

ranks = launch(hsdp_step, world_size=4, output="none")
header = ["rank", "shard group", "replicate group", "model[0].weight", "local shape"]
rows = [
    [rank, r["shard_group"], r["replicate_group"], r["placements"], r["local_shape"]] for rank, r in enumerate(ranks)
]
display(Table(header, rows))  # an HTML table on the site; aligned text where there is no HTML
print("collectives in forward + backward, per rank:", ranks[0]["collectives"])

from myst_nb import glue  # the counts the text quotes, from this run (JupyterLab shows glue's roles unrendered)

for name, op in (
    ("hsdp_all_gathers", "_allgather_base_"),
    ("hsdp_reduce_scatters", "_reduce_scatter_base_"),
    ("hsdp_all_reduces", "allreduce_"),
):
    glue(name, ranks[0]["collectives"].get(op, 0), display=False)

# %% tags=["hide-input"] mystnb={"image": {"alt": "The 2 by 2 mesh as the ranks reported it: ranks 0 and 1 in one shard group and ranks 2 and 3 in the other, each rank holding half of the first layer's weight; ranks 0 and 2, and ranks 1 and 3, in the replicate groups that hold the same half."}}
import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch


def draw_mesh(ranks):
    """Each rank at (its shard group, its place in it), as the ranks' own groups say."""
    shard_groups = sorted({tuple(r["shard_group"]) for r in ranks})
    where = {rank: (row, group.index(rank)) for row, group in enumerate(shard_groups) for rank in group}
    for r in ranks:  # a replicate group is a column: the same place in each shard group
        assert len({where[rank][1] for rank in r["replicate_group"]}) == 1, "not a 2-D mesh"
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for rank, (row, col) in where.items():
        rows = ranks[rank]["local_shape"][0]
        box = (col * 2.2, -row * 2)
        ax.add_patch(FancyBboxPatch(box, 1.8, 1, "round,pad=0.05", fc="#eef"))
        label = f"rank {rank}\nrows {col * rows}-{(col + 1) * rows - 1}"
        ax.text(box[0] + 0.9, box[1] + 0.5, label, ha="center", va="center")
    for row, group in enumerate(shard_groups):
        frame = FancyBboxPatch((-0.15, -row * 2 - 0.15), 4.1, 1.3, "round,pad=0.05", fill=False, ec="tab:blue", lw=2)
        ax.add_patch(frame)
        label = f"shard group {list(group)}:\nall-gather, reduce-scatter"
        ax.text(4.2, -row * 2 + 0.5, label, color="tab:blue", va="center")
    for col in range(len(shard_groups[0])):
        members = sorted(rank for rank, (_, c) in where.items() if c == col)
        x = col * 2.2 + 0.9
        for row in range(len(shard_groups) - 1):  # in the gap between the shard groups' frames
            ax.plot([x, x], [-row * 2 - 0.25, -row * 2 - 0.95], color="tab:orange", lw=2.5, ls="--")
            label = f"replicate {members}:\nall-reduce"
            ax.text(x + 0.1, -row * 2 - 0.6, label, color="tab:orange", va="center", fontsize=9)
    ax.set(xlim=(-0.3, 7.2), ylim=(-2.3, 1.3), title="model[0].weight, 64 rows, on the (replicate, shard) mesh")
    ax.axis("off")
    return fig


figure = draw_mesh(ranks)  # shown by the inline backend, once
# %% [markdown]
# Each weight is `Shard(0)` within a shard group (ranks 0 and 1 hold its halves, as do 2 and 3) and
# `Replicate()` across the replicate groups (ranks 0 and 2 hold the same half). The counts do not say
# which group each collective used; the mesh does, in torch's source (`FSDPParamGroup` in
# `torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py`): all-gathers and reduce-scatters use
# `_all_gather_process_group` and `_reduce_scatter_process_group`, the mesh's `shard` dimension, and
# all-reduces `_all_reduce_process_group`, its `replicate` dimension. So the
# {glue:text}`hsdp_all_gathers` all-gathers (2 units, in forward and again in backward) run inside the
# shard group of 2; each unit's gradients are reduce-scattered inside it
# ({glue:text}`hsdp_reduce_scatters`), then all-reduced across the replicate group
# ({glue:text}`hsdp_all_reduces`), so every rank ends with its shard of the gradient averaged over all
# 4 ranks (counts glued from the line above, this run's; JupyterLab shows glue's roles unrendered).
# The `UserWarning`s printed with the table come from `CommDebugMode`, which counts the collectives,
# not from the model ({ref}`fsdp-commdebugmode-warnings`).
#
# That this is data-parallel training, up to float rounding:

# %%
from fsdp_guide.compare import largest_difference

model = make_model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
sum(F.mse_loss(model(x), y) for x, y in map(batch, range(4))).div(4).backward()  # the 4 ranks' batches at once
optimizer.step()
difference = largest_difference(zip(ranks[0]["weights"], model.parameters()))  # a NaN shows as NaN
print(f"HSDP on a 2 x 2 mesh vs one process on all 4 batches: max |weight difference| = {difference:.1e}")

# %% [markdown]
# With `fsdp_guide.shard`, `{"sharding_strategy": "HYBRID_SHARD", "data_parallel_shard_degree": 2}`
# builds the same mesh ({ref}`tip-fsdp-config`); on a cluster, the shard degree is a node's GPU count.
#
# (cluster-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`../tutorials/scripts/cluster.py`.
# Under `torchrun --nproc-per-node=4 cluster.py` each rank builds the (replicate, shard) mesh, shards
# the model over it and trains on its slice of every batch; rank 0 prints its groups and its shard,
# then the largest differences in losses and final weights from the same training in one process,
# which the tests (`tests/test_scripts.py`, 4 CPU ranks under torchrun) check are at most 1e-5.
#
# ```{literalinclude} ../tutorials/scripts/cluster.py
# :language: python
# ```
#
# (cluster-launch-errors)=
# ## When the launch itself fails: the messages, reproduced
#
# Many messages in user reports of FSDP runs come before FSDP does anything: the processes cannot
# find each other, or the process group has no backend for a tensor. Each cell below makes one such
# mistake and prints what Python prints (`traceback.format_exception_only`); the {ref}`errors-index`
# links here. A torchrun script started with `python`, and a collective before `init_process_group`:

# %%
import inspect
import os
import subprocess
import traceback

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
without_torchrun = {name: value for name, value in os.environ.items() if name not in TORCHRUN_VARIABLES}


def last_words(code: str) -> str:
    """What a fresh Python started without torchrun's variables says last, running ``code``."""
    run = subprocess.run([sys.executable, "-c", code], env=without_torchrun, capture_output=True, text=True)
    return run.stderr.strip().splitlines()[-1]


def failure(attempt) -> str:
    """The message ``attempt()`` raises, as Python prints it."""
    try:
        attempt()
    except Exception as error:
        return "".join(traceback.format_exception_only(error)).strip()
    raise AssertionError("expected an error")


print("python train.py ->", last_words("import torch.distributed as dist; dist.init_process_group()"))
print("a collective first ->", last_words("import torch, torch.distributed as dist; dist.all_reduce(torch.ones(1))"))

# %% [markdown]
# `init_process_group()` reads the rank, the world size and rank 0's store address from variables
# that `torchrun` sets and `python` does not. Start the script with `torchrun --nproc-per-node=N train.py`
# (in a notebook, {func}`fsdp_guide.launch`) and call `init_process_group` before any collective
# (`fully_shard` and `init_device_mesh` call it for you when the variables are there).
#
# Under `torchrun` the last thing printed when a rank fails is its summary, `ChildFailedError`, not
# the error. Here rank 1 of two is killed with `SIGKILL`, as an out-of-memory killer or a scheduler would:

# %%
import tempfile

from fsdp_guide.isolation import loopback_only  # torchrun's stores listen on every interface: keep them in here

KILLED = """
import os, signal
from datetime import timedelta
import torch.distributed as dist

# gloo on any machine: the barrier's tensor is on the CPU, and the point is torchrun's report
dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a rank left waiting gives up in a minute
if dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()
dist.destroy_process_group()
"""
with tempfile.TemporaryDirectory() as folder:
    with open(os.path.join(folder, "train_killed_on_rank_1.py"), "w") as script:
        script.write(KILLED)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "train_killed_on_rank_1.py"]
    run = subprocess.run(
        loopback_only(torchrun), env=without_torchrun, capture_output=True, text=True, cwd=folder, timeout=120
    )
lines = run.stderr.splitlines()
print(*(line for line in lines if line.startswith("[rank") and "Error: " in line), sep="\n")  # the ranks' last words
summary = next(i for i, line in enumerate(lines) if line.startswith("torch.distributed.elastic"))
print(*lines[summary:], sep="\n")
print("torchrun's exit status:", run.returncode)

# %% [markdown]
# The box names the root cause, rank 1, killed (exit code -9, `Signal 9 (SIGKILL)`) with no
# traceback: a killed process writes none. Any Python error above the box is rank 0's, a consequence:
# its peer left mid-barrier, and gloo says so in the words of whichever it saw first
# (`Connection closed by peer` or `reset by peer`), unless torchrun's `SIGTERM` stopped rank 0 before
# it noticed. Read the box for the rank that failed first, then its own lines (prefixed `[rank1]:`),
# where a rank that raised prints its traceback. On a cluster, expect a `SIGKILL` from outside the
# process (the kernel's out-of-memory killer, seen in `dmesg`, or the scheduler's limits), not torch.
#
# Two jobs on one `MASTER_PORT`, and a job whose other ranks never arrive (a node that did not start,
# a wrong address or `--nnodes`, a firewall):

# %%
# The stores run in a child process, with the page's failure() helper, from its source.
STORES = f"""
import traceback
from datetime import timedelta

from torch.distributed import TCPStore

{inspect.getsource(failure)}
first_job = TCPStore("127.0.0.1", 29500, is_master=True, wait_for_workers=False)
print("a second job on port 29500 ->", failure(lambda: TCPStore("127.0.0.1", 29500, is_master=True)))
print("rank 1 never comes ->", failure(lambda: TCPStore(
    "127.0.0.1", 29501, world_size=2, is_master=True, timeout=timedelta(seconds=1))))
print("no store at MASTER_ADDR:MASTER_PORT ->", failure(lambda: TCPStore(
    "127.0.0.1", 29502, is_master=False, timeout=timedelta(seconds=1))))
"""
run = subprocess.run(loopback_only([sys.executable, "-c", STORES]), capture_output=True, text=True, timeout=60)
print(run.stdout or run.stderr)

# %% [markdown]
# `init_process_group` meets the other ranks through a `TCPStore` at `MASTER_ADDR:MASTER_PORT`: a
# server on rank 0 and clients on the others, or under `torchrun` clients of the store its agent
# serves (`_create_c10d_store` in `torch/distributed/rendezvous.py`). A port another job holds is
# refused at once: `torchrun --standalone` picks a free one on one machine; on a cluster, give each
# job its own. The other two wait for the timeout (1 s here; `init_process_group(timeout=...)`, by
# default 30 minutes, 10 for NCCL: `_get_default_timeout` in `torch/distributed/distributed_c10d.py`):
# the server for ranks that never connect, a client for a store no one serves there. Check that every
# node started with the same `--nnodes` and endpoint and can reach `MASTER_ADDR` (named in the error).
#
# The backend: a script written for GPUs on a torch built without NCCL (the CPU wheel this site runs
# with), and a process group without a backend for CPU tensors:

# %%
import warnings

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

CPU = "cpu"  # cpu-only: the error below is about tensors on the CPU


def backend_errors():
    said = []
    if not dist.is_nccl_available():  # the CPU wheel; a CUDA build has NCCL
        with warnings.catch_warnings():  # and a warning that NCCL has no default timeout here
            warnings.simplefilter("ignore")
            said.append(failure(lambda: dist.new_group(backend="nccl")))
    # A group with a backend for CUDA tensors only, as init_process_group("nccl") makes,
    # and a DTensor whose shards are on the CPU (CPU offload, or a state dict moved there).
    cuda_only = dist.new_group(backend="cuda:gloo")
    cpu_shards = DTensor.from_local(torch.ones(2), DeviceMesh.from_group(cuda_only, CPU), [Shard(0)])
    said.append(failure(cpu_shards.full_tensor))
    # The launch's own group has a backend for every device its tensors are on.
    default = DTensor.from_local(torch.ones(2), DeviceMesh.from_group(dist.group.WORLD, CPU), [Shard(0)])
    said.append(f"on the group of {dist.get_backend_config()!r}: full_tensor() = {default.full_tensor().tolist()}")
    return said


print(*launch(backend_errors, output="none")[0], sep="\n")

# %% [markdown]
# `init_process_group` gives a group a backend per device type, from its `backend` string
# (`BackendConfig` in `torch/distributed/distributed_c10d.py`): `"nccl"` serves CUDA tensors only, as
# does `init_process_group()` with no backend on a GPU machine (it picks the accelerator's backend
# alone), so any collective on a CPU tensor fails as above. With FSDP2 that is a CPU DTensor's: a
# `full_tensor()` of shards moved to the CPU, or `clip_grad_norm_` over gradients `CPUOffloadPolicy`
# keeps on the CPU, whose norm is all-reduced there (expected on GPUs from the same code path; not
# run here). Give every device its backend, and NCCL only where there is CUDA:
#
# ```python
# dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
# ```
#
# A mesh that does not multiply to the world size (`(2, 4)` on 4 ranks: a node count typed wrong):


# %%
def wrong_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return failure(lambda: init_device_mesh(fsdp_guide.device().type, (2, 4), mesh_dim_names=("replicate", "shard")))


print(launch(wrong_mesh, world_size=4, output="none")[0])

# %% [markdown]
# The mesh's shape is (nodes, ranks per node) for HSDP, and its product must be the world size
# `torchrun` started: `WORLD_SIZE`, `--nnodes` times `--nproc-per-node`.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("cluster")
