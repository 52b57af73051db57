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
# (tutorial-weight-sync)=
# # Weights from training to an inference copy
#
# **What you will learn**
#
# - how to move an FSDP2 model's weights into a separate inference model, the step a
#   reinforcement-learning trainer repeats after every update so that its inference engine
#   generates with the new weights: three ways, from a gathered state dict, one parameter
#   at a time, and in buckets;
# - what each costs the trainer's ranks in memory and the sync in time, measured, and how
#   many messages each sends;
# - that the inference copy then computes the trainer's logits: exactly when it keeps the
#   trainer's dtype, to bf16's precision when it computes in bf16.
#
# **What you need**: a CPU; 3 processes on gloo: 2 train, 1 serves; about 15 seconds on 2 CPU cores ({ref}`measured <measured-times>`).
# The same code is written to run unchanged with one GPU per rank (NCCL): every tensor
# lives on {func}`fsdp_guide.device`. The tips are listed {ref}`at the end <weight-sync-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`weight-sync-script` ({download}`download <scripts/weight_sync.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# ## A trainer of two ranks, an engine of one
#
# Ranks 0 and 1 train a GPT of 8 blocks, 512 wide, sharded by FSDP2 over a mesh of their
# own; rank 2 stands for the inference engine (an inference server such as vLLM): a plain,
# unsharded copy of the same model, in bf16, that never trains. After one optimizer step
# the trainer sends its new weights to the engine over a process group of ranks 0 and 2,
# parameter by parameter in `named_parameters()` order, which both sides know. Every rank
# creates both groups (`new_group` is collective over all ranks), and only the ranks in a
# group use it:

# %%
import time

import fsdp_guide
import torch.distributed as dist
from fsdp_guide import launch
from fsdp_guide.gpt import GPT, GPTConfig
from fsdp_guide.memory import tensor_peak_rise
from fsdp_guide.table import Table
from IPython.display import display
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

CONFIG = GPTConfig(vocab_size=256, block_size=64, n_layer=8, n_head=8, n_embd=512)
BUCKET_BYTES = 16 * 2**20
TOKENS = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))


def make_model():
    torch.manual_seed(0)
    model = GPT(CONFIG)
    model.init_weights()
    return model


def trained_trainer(group, device):
    """The model sharded over ``group``'s ranks, after one AdamW step on each rank's own batch."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, device.type)
    model = make_model().to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(dist.get_rank()))
    _, loss = model(batch[:, :-1].to(device), targets=batch[:, 1:].to(device))
    loss.backward()
    optimizer.step()
    return model


def buckets(shapes, itemsize, limit):
    """Consecutive parameters grouped into buckets of at most ``limit`` bytes (one larger parameter alone)."""
    groups, size = [[]], 0
    for i, shape in enumerate(shapes):
        nbytes = shape.numel() * itemsize
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += nbytes
    return groups


# %% [markdown]
# The three ways to send, as the trainer's two ranks run them (both call every collective
# among themselves; rank 0 alone sends to the engine), and the engine's side of each:


# %%
def send(how, model, link, dtype):
    """The trainer's side of one sync; returns how many messages rank 0 sent to the engine."""
    params = [p for _, p in model.named_parameters()]  # a tied weight once
    sends = 0

    def to_engine(tensor):
        nonlocal sends
        if dist.get_rank() == 0:
            dist.broadcast(tensor.to(dtype), src=0, group=link)
            sends += 1

    if how == "gathered state dict":  # every parameter gathered into rank 0's CPU memory first
        full = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if dist.get_rank() == 0:
            for name, _ in model.named_parameters():
                to_engine(full[name].to(fsdp_guide.device()))
    elif how == "per parameter":  # one all-gather, then one message, at a time
        for p in params:
            full = p.full_tensor()  # both trainer ranks: the all-gather
            to_engine(full)
            del full  # freed before the next parameter is gathered
    elif how == "bucketed":  # gathered one at a time into a buffer reused for every bucket
        groups = buckets([p.shape for p in params], dtype.itemsize, BUCKET_BYTES)
        buffer = (
            torch.empty(
                max(sum(params[i].numel() for i in bucket) for bucket in groups),
                dtype=dtype,
                device=fsdp_guide.device(),
            )
            if dist.get_rank() == 0
            else None
        )
        for bucket in groups:
            filled = 0
            for i in bucket:
                full = params[i].full_tensor()  # both trainer ranks: the all-gather
                if dist.get_rank() == 0:
                    # converted as it is copied
                    buffer[filled : filled + full.numel()].copy_(full.flatten())
                filled += full.numel()
                del full  # freed before the next parameter is gathered
            if dist.get_rank() == 0:
                to_engine(buffer[:filled])
    return sends


@torch.no_grad()
def receive(how, engine, link):
    """The engine's side: the same messages, in the same order, into its own parameters."""
    params = [p for _, p in engine.named_parameters()]
    if how == "bucketed":
        groups = buckets([p.shape for p in params], params[0].element_size(), BUCKET_BYTES)
        buffer = torch.empty(
            max(sum(params[i].numel() for i in bucket) for bucket in groups),
            dtype=params[0].dtype,
            device=params[0].device,
        )
        for bucket in groups:
            sizes = [params[i].numel() for i in bucket]
            dist.broadcast(buffer[: sum(sizes)], src=0, group=link)
            for i, part in zip(bucket, buffer[: sum(sizes)].split(sizes)):
                params[i].copy_(part.view_as(params[i]))
    else:
        for p in params:
            dist.broadcast(p, src=0, group=link)  # straight into the parameter's storage


def sync(how, dtype):
    device = fsdp_guide.device()
    # every rank makes both, in this order
    trainers, link = (dist.new_group([0, 1]), dist.new_group([0, 2]))
    if dist.get_rank() == 2:  # the engine
        engine = make_model().to(device, dtype).eval()  # the weights it had before: the old policy
        # the trainer's warm-up sync, the timed one, and the one its memory is counted in
        for _ in range(3):
            receive(how, engine, link)
        with torch.no_grad():
            return {"logits": engine(TOKENS.to(device))[0].float().cpu()}
    model = trained_trainer(trainers, device)
    send(how, model, link, dtype)  # once before: imports, connections and first calls do not count

    def timed():
        start = time.perf_counter()
        sends = send(how, model, link, dtype)
        # a GPU's collectives run on its streams; a no-op on CPU
        torch.get_device_module(device).synchronize()
        return sends, time.perf_counter() - start

    sends, seconds = timed()  # timed alone: counting tensors below slows every operation
    _, peak = tensor_peak_rise(lambda: send(how, model, link, dtype))
    with torch.no_grad():
        logits = model(TOKENS.to(device))[0].cpu()
    return {"sends": sends, "seconds": seconds, "peak": peak, "logits": logits}


# %% [markdown]
# Each way runs three times: once to warm up (imports, connections, first calls), once
# timed, and once with torch's `MemTracker` following every tensor each trainer rank
# creates and frees, on the CPU and on a GPU alike ({func}`fsdp_guide.memory.tensor_peak_rise`).
# Each in bf16, the engine's usual dtype, and one in fp32:

# %%
sizes = [p.numel() * 4 / 2**20 for p in make_model().parameters()]  # fp32 MiB, a tied weight once
model_mib = sum(sizes)
runs = {
    (how, dtype): launch(sync, how, dtype, world_size=3, output="none")
    for how, dtype in [
        ("gathered state dict", torch.bfloat16),
        ("per parameter", torch.bfloat16),
        ("bucketed", torch.bfloat16),
        ("per parameter", torch.float32),
    ]
}

print(
    f"the model: {model_mib:.0f} MiB in fp32, {len(sizes)} parameters, its largest {max(sizes):.0f} MiB; "
    "peak rise of the tensors each trainer rank holds while syncing, in MiB"
)
rows = []
for (how, dtype), (r0, r1, engine) in runs.items():
    gap = (engine["logits"] - r0["logits"]).abs().max().item()
    name = f"{how}, {str(dtype).removeprefix('torch.')}"
    peaks = [f"{r['peak']:.1f}" for r in (r0, r1)]
    rows.append([name, *peaks, r0["sends"], f"{r0['seconds']:.2f}", f"{gap:.1e}"])
header = ["sync", "rank 0", "rank 1", "messages", "seconds"]
display(Table([*header, "logits, max |engine - trainer|"], rows))
engine_bf16 = [
    engine["logits"] for (how, dtype), (_, _, engine) in runs.items() if dtype == torch.bfloat16
]
print(
    "the engine's bf16 logits are the same all three ways:",
    all(torch.equal(weights, engine_bf16[0]) for weights in engine_bf16),
)

# %% [markdown]
# - **Gathered state dict** (`get_model_state_dict` with `full_state_dict=True,
#   cpu_offload=True`, the export route of {ref}`tutorial-finetune-hf`): rank 0 holds the
#   whole model in fp32 before the first message, more than the model's size above.
#   With `cpu_offload=True`, `get_model_state_dict` gathers for rank 0 alone
#   (`ranks_only=(0,)` in `_maybe_full_or_cpu_state_dict`, `torch/distributed/checkpoint/state_dict.py`),
#   and `_iterate_state_dict` (`torch/distributed/_state_dict_utils.py`) moves each
#   gathered parameter to the CPU before it gathers the next: the whole model is in host
#   memory, one parameter at a time on the device. (On this CPU run the two are the same
#   memory.) The other ranks gather every parameter too, and drop each one: in torch's code
#   an empty state dict is all they keep, and a peak of one gathered parameter is what that
#   code suggests. Rank 1's peak on this path is in the table; where it exceeds one
#   parameter, what else it held is not established here.
#   Gathered on the GPU instead, it would sit beside the weights of an engine sharing that
#   GPU (a colocated RL trainer): the model twice on one device.
# - **Per parameter**: each `full_tensor()` all-gathers one parameter among the trainer's
#   ranks, and rank 0 sends it, converted, before the next is gathered: one message per
#   parameter (a tied weight once). Rank 0's peak is at least the largest parameter
#   gathered, in fp32, and its bf16 copy; more on a run where the previous parameter's
#   tensors are still held when the next are made (below).
# - **Bucketed**: the same gathers, each copied and converted into one buffer of at most
#   16 MiB, reused for every bucket: a handful of messages instead of one per parameter,
#   for the buffer's memory on rank 0.
#
# The trainer's rank 1 gathers every parameter too (`full_tensor` is an all-gather, so
# every rank of the mesh receives the whole parameter) and throws it away. Sending per
# parameter or in buckets, its peak is one gathered parameter, or two when the next
# all-gather starts before the previous result is freed. Which of the two a run shows
# depends on timing, its likely cause not separated here: gloo runs each collective on a
# worker thread, which may still hold its tensors for a moment after the caller's `del`.
# Either way each rank
# holds a few parameters at most, never the model. An
# engine with several ranks of its own would receive each rank's shard instead: the same
# loop, with a slice taken before each message.
#
# These counts are tensors only: what gloo (or NCCL, on GPUs) keeps in buffers of its own
# is not in them. The seconds are one sync each, on this machine's loopback, and vary from
# run to run; how much bucketing saves where each message has a fixed cost (a network, an
# inference server's weight-loading call) is not measured here.
#
# The last column checks the engine: its logits on the same tokens, against the trainer's
# own forward. In fp32 they are equal, bit for bit: the engine computes with exactly the
# trainer's weights. In bf16 the engine's weights and arithmetic are bf16, and its logits
# are the same whichever way the weights came.

# %% [markdown]
# (weight-sync-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script: {download}`scripts/weight_sync.py` (torch alone).
# `torchrun --nproc-per-node=3 weight_sync.py` trains a small model for one step on ranks 0 and 1,
# sharded over their own mesh, then sends it to rank 2 one gathered parameter at a time, in fp32;
# rank 0 prints the largest differences between the engine's weights and output and the trainer's,
# and how far the step moved the weights. The tests run this file under torchrun on 3 CPU ranks and
# check that the engine holds exactly the trainer's new weights (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/weight_sync.py
# :language: python
# ```

# %% [markdown]
# (weight-sync-tips)=
# ## The tips behind this
#
# - {ref}`tip-weight-sync`: gather and send one parameter at a time, never the whole
#   state dict beside a colocated engine; buckets cost rank 0 their buffer, for fewer
#   messages.
# - {ref}`tip-export-every-rank-writes`: writing weights out to disk instead, from every rank.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("weight_sync")
