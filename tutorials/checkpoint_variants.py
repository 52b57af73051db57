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
# (tutorial-checkpoint-variants)=
# # Activation checkpointing, every variant measured
#
# **What you will learn**: what each way of checkpointing a transformer's activations keeps
# for the backward and what it runs again, measured on one model under FSDP2: none, each
# block (`checkpoint_wrapper`, torch's composable `checkpoint`, Hugging Face's
# `activation_checkpointing_enable`, formerly `gradient_checkpointing_enable`), each child of
# a block, selective (the matmuls saved), and offload to the host, alone or with each
# block; and the one setting an HF model needs before torch's own checkpointing works on it.
#
# **What you need**: a CPU; 2 processes on gloo; about 15 seconds on 2 CPU cores ({ref}`measured <measured-times>`).
# The code is written to run unchanged with one GPU per rank (NCCL): each rank computes on
# {func}`fsdp_guide.device`, its GPU `cuda:LOCAL_RANK` where it has one, else the CPU; no
# GPU run of it is recorded, so what GPUs change is said as expectation. It follows
# {ref}`tutorial-checkpoint-placement`, which shows why checkpointing goes inside the FSDP
# unit. The tips are listed {ref}`at the end <checkpoint-variants-tips>`. Its idea as a plain
# torchrun script to copy: {ref}`checkpoint-variants-script` ({download}`download <scripts/checkpoint_variants.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# The model is a small Llama built from its config (no download): 4 decoder layers, each
# an FSDP unit, and the root holding the embeddings and the head. Each variant is a
# function that changes the model before `fully_shard`; every variant starts from the same
# seeded weights and sees the same tokens. Eager attention, so that the attention's
# matmuls are visible to the FLOP counter and to the selective policy.

# %%
import functools
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm's notebook import

import fsdp_guide
import torch.distributed as dist
from torch.distributed._composable import checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper,
    offload_wrapper,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = LlamaConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=256,
    attn_implementation="eager",
)
ROWS, SEQ = 2, 128  # each rank's batch: activations, not weights, fill the memory


def each_block(model):  # torch's module wrapper: names gain "_checkpoint_wrapped_module."
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(layer)


def each_block_composable(model):  # the same, as a hook on the module: names unchanged
    for layer in model.model.layers:
        checkpoint(layer)


def each_child(model):  # each of a layer's 4 children on its own (accelerate#3897's shape)
    for layer in model.model.layers:
        for name, child in list(layer.named_children()):
            setattr(layer, name, checkpoint_wrapper(child))


def save_matmuls(ctx, op, *args, **kwargs):
    # eager attention's matmuls; with SDPA, add its kernel (aten._scaled_dot_product_flash_attention, ...)
    matmuls = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default)
    return CheckpointPolicy.MUST_SAVE if op in matmuls else CheckpointPolicy.PREFER_RECOMPUTE


def selective(model):  # each block, keeping what the matmuls computed
    context = functools.partial(create_selective_checkpoint_contexts, save_matmuls)
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(layer, context_fn=context)


def hugging_face(model):
    model.activation_checkpointing_enable()  # the new name of gradient_checkpointing_enable


def offload(model):  # each block's saved tensors copied to the host
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = offload_wrapper(layer)


def each_block_offloaded(model):  # what each block's checkpoint keeps, copied to the host
    for i, layer in enumerate(model.model.layers):  # Accelerate's activation_checkpointing_offload
        model.model.layers[i] = offload_wrapper(checkpoint_wrapper(layer))


VARIANTS = {
    "none": lambda model: None,
    "each block (checkpoint_wrapper)": each_block,
    "each block (composable checkpoint)": each_block_composable,
    "each block (HF activation_checkpointing_enable)": hugging_face,
    "each child of a block": each_child,
    "selective: matmuls saved": selective,
    "offload to the host": offload,
    "each block, offloaded": each_block_offloaded,
}


def build(variant):
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG).to(fsdp_guide.device())
    VARIANTS[variant](model)
    mesh = init_device_mesh(fsdp_guide.device().type, (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def tokens():
    g = torch.Generator().manual_seed(dist.get_rank())  # each rank its own rows
    return torch.randint(CONFIG.vocab_size, (ROWS, SEQ), generator=g).to(fsdp_guide.device())


def step(model, x):
    # use_cache=False: training needs no KV cache, and a recomputed layer would write it twice
    model(input_ids=x, labels=x, use_cache=False).loss.backward()


# %% [markdown]
# (checkpoint-variants-measured)=
# ## Each variant, measured
#
# For each variant, on each rank, one step after a warm-up: the tensor memory the forward
# leaves for the backward and the peak of the step (torch's `MemTracker`, which follows
# every tensor's storage, here from the step's start), the matmul FLOPs of forward and
# backward (`FlopCounterMode`), the collectives (`fsdp_guide.collectives.count_collectives`),
# the gradients against no checkpointing's (bit for bit, on each rank's shards), and the
# step's time (the fastest of 5 rounds, each running every variant once).

# %%
import time

from fsdp_guide import launch
from fsdp_guide.collectives import count_collectives
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.utils.checkpoint import set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

MIB = 2**20


def on_device(snapshot, kind):
    """MiB of `kind` (or "Total") on this rank's device: offloaded copies count apart."""
    return snapshot.get(fsdp_guide.device(), {}).get(kind, 0) / MIB


def synchronized_clock():
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()  # a GPU runs behind the Python that queued its work
    return time.perf_counter()


def measure(model, x):
    step(model, x)  # warm-up: the first step allocates what every step reuses
    model.zero_grad(set_to_none=True)
    tracker = MemTracker()
    with tracker:
        loss = model(input_ids=x, labels=x, use_cache=False).loss
        held = on_device(tracker.get_tracker_snapshot("current"), _MemRefType.ACT)
        forward_peak = on_device(tracker.get_tracker_snapshot("peak"), "Total")
        loss.backward()
        peak = on_device(tracker.get_tracker_snapshot("peak"), "Total")
    grads = {
        n.replace("_checkpoint_wrapped_module.", ""): p.grad.to_local().clone()
        for n, p in model.named_parameters()
    }
    model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as flops, count_collectives() as seen:
        step(model, x)
    model.zero_grad(set_to_none=True)
    calls = {kind: n for _, kind, n, _ in seen.rows()}
    return {
        "held": held,
        "forward peak": forward_peak,
        "peak": peak,
        "flops": flops.get_total_flops(),
        "calls": calls,
        "grads": grads,
    }


def every_variant(rounds=5):
    x = tokens()
    models = {variant: build(variant) for variant in VARIANTS}
    found = {variant: measure(model, x) for variant, model in models.items()}
    with set_checkpoint_early_stop(False), FlopCounterMode(display=False) as flops:
        step(models["each block (checkpoint_wrapper)"], x)  # recompute each block to its end
    models["each block (checkpoint_wrapper)"].zero_grad(set_to_none=True)
    seconds = {variant: [] for variant in VARIANTS}
    for _ in range(rounds):  # interleaved: a busy moment of the machine slows every variant alike
        for variant, model in models.items():
            start = synchronized_clock()
            step(model, x)
            seconds[variant].append(synchronized_clock() - start)
            model.zero_grad(set_to_none=True)
    reference = found["none"]["grads"]
    for variant, row in found.items():
        grads = row.pop("grads")
        row["equal"] = grads.keys() == reference.keys() and all(
            torch.equal(grads[n], g) for n, g in reference.items()
        )
        row["seconds"] = min(seconds[variant])
    found["none"]["gradients finite, not all zero"] = all(
        bool(g.isfinite().all()) for g in reference.values()
    ) and any(bool(g.any()) for g in reference.values())
    found["each block (checkpoint_wrapper)"]["flops without early stop"] = flops.get_total_flops()
    return found


ranks = launch(every_variant, output="none")
found = ranks[0]

# %%
from fsdp_guide.table import Table
from IPython.display import display
from myst_nb import glue

none, block, child = (
    found[v] for v in ("none", "each block (checkpoint_wrapper)", "each child of a block")
)
rows = []
for variant, row in found.items():
    equal = all(rank[variant]["equal"] for rank in ranks)
    rows.append(
        [
            variant,
            f"{row['held']:.2f}",
            f"{row['peak']:.1f}",
            f"{row['flops'] / none['flops']:.2f}",
            f"{row['seconds'] / none['seconds']:.2f}",
            row["calls"].get("all-gather", 0),
            row["calls"].get("reduce-scatter", 0),
            "equal" if equal else "DIFFER",
        ]
    )
header = [
    "variant",
    "activations held for backward, MiB",
    "peak, MiB",
    "matmul FLOPs ×",
    "time ×",
    "all-gathers",
    "reduce-scatters",
    "gradients",
]
display(Table(header, rows))
each_block = [v for v in VARIANTS if v.startswith("each block (")]
print(
    f"the three each-block APIs hold the same bytes: {len({found[v]['held'] for v in each_block}) == 1}"
)
print(
    f"no checkpointing's gradients finite and not all zero, on every rank: {all(r['none']['gradients finite, not all zero'] for r in ranks)}"
)
print(
    f"no checkpointing: {none['flops'] / 1e6:.0f} MFLOP a step in matmuls on rank 0, {none['seconds'] * 1e3:.0f} ms"
)
without_early_stop = block["flops without early stop"] / none["flops"]
print(
    f"each block, recomputed to its end (set_checkpoint_early_stop(False)): {without_early_stop:.2f}× the matmul FLOPs"
)
for variant in ("each block (checkpoint_wrapper)", "each child of a block"):
    print(
        f"{variant}: peak in the forward {found[variant]['forward peak']:.1f} MiB, in the step {found[variant]['peak']:.1f} MiB"
    )

# the figures the text quotes, from this run (JupyterLab shows glue's roles unrendered)
for name, variant in {
    "none": "none",
    "block": "each block (checkpoint_wrapper)",
    "child": "each child of a block",
    "selective": "selective: matmuls saved",
    "offload": "offload to the host",
}.items():
    glue(f"ac_held_{name}", found[variant]["held"], display=False)
    glue(f"ac_peak_{name}", found[variant]["peak"], display=False)
glue("ac_block_flops", block["flops"] / none["flops"], display=False)
glue("ac_block_flops_to_the_end", without_early_stop, display=False)
glue("ac_child_over_block", child["held"] / block["held"], display=False)
glue("ac_child_forward_peak", child["forward peak"], display=False)

# %% [markdown]
# The figures in this text are this run's, taken from the outputs by myst-nb's `glue`; in
# JupyterLab, which does not render glue's roles, read them from the table.
#
# - **No checkpointing** keeps every activation of every layer: {glue:text}`ac_held_none:.1f` MiB
#   at the end of the forward, on each rank (the column counts the tensors `MemTracker` tags
#   as activations on the rank's device: not the parameters, nor host copies).
# - **Each block**, by any of the three APIs, keeps what enters each block (its hidden
#   states, and the mask and rotary tables every block is given) and what the root computes
#   outside the blocks (the final norm, the log-softmax of the loss): {glue:text}`ac_held_block:.2f` MiB.
#   The backward runs each block's forward again, {glue:text}`ac_block_flops:.2f` times the matmul FLOPs:
#   not to its end, as torch stops a recomputation once it has rebuilt the last tensor the
#   backward needs (`set_checkpoint_early_stop`, on by default, `torch/utils/checkpoint.py`),
#   so each block's last matmul (the MLP's `down_proj`) does not run again; recomputed to
#   its end, {glue:text}`ac_block_flops_to_the_end:.2f` times. The three hold the same bytes and train the
#   same gradients, bit for bit. `checkpoint_wrapper` adds `_checkpoint_wrapped_module.` to
#   the names `named_parameters()` gives, not to `state_dict()`'s keys (the wrapper strips it,
#   so checkpoints load either way).
# - **Each child of a block** keeps what enters each child (the attention's norm, the
#   attention, the MLP's norm, the MLP): {glue:text}`ac_child_over_block:.1f` times what each block keeps,
#   for a little less recomputation (each child's last matmul is not rerun). This is
#   accelerate#3897's report: FSDP2's checkpointing there wrapped every child module and used
#   "a lot more" memory; Accelerate 1.15 wraps the matched layer itself
#   (`apply_activation_checkpointing`, `accelerate/utils/fsdp_utils.py`). Its peak is lower
#   ({glue:text}`ac_peak_child:.1f` MiB, against {glue:text}`ac_peak_block:.1f` for each block): the forward's peak
#   is {glue:text}`ac_child_forward_peak:.1f` MiB (printed above), so the step's peak comes in the backward,
#   which recomputes one child at a time where each block recomputes a whole block at once.
# - **Selective, matmuls saved** recomputes only the norms, the activation function, the
#   softmax and the element-wise work: the matmul FLOPs do not grow, and it keeps
#   {glue:text}`ac_held_selective:.1f` MiB, the matmuls' outputs, the attention's scores
#   (`ROWS × heads × SEQ × SEQ` per layer) the largest of them. The FLOP counter counts
#   matmuls only; the element-wise recomputation can only show in the time, and at this
#   size its time also carries the policy, a Python function called for every operator
#   the block runs.
# - **Offload to the host** (`offload_wrapper`, torch's `save_on_cpu(pin_memory=True)`) copies
#   each saved tensor into a new host tensor, once for each time it is saved (its pack hook
#   allocates and copies, `torch/autograd/graph.py`, whatever device the tensor is on,
#   though the class's docstring says a CPU graph is not copied). On a CPU rank the host is
#   where the tensors already are, so it only adds copies: {glue:text}`ac_held_offload:.1f` MiB, more than
#   none, since a tensor several operators save (a norm's output, read by the q, k and v
#   projections) is copied several times. **Each block, offloaded** (Accelerate's
#   `activation_checkpointing_offload`: `offload_wrapper(checkpoint_wrapper(layer))`) copies
#   only what the checkpoints keep, each block's input, once: on a CPU rank it holds what each
#   block holds, as the copy replaces the saved input. On a GPU these copies are expected to leave the GPU's
#   memory, at the cost of a host transfer each way, the saved weights coming back as new
#   copies beside the ones FSDP gathers again; no GPU run here shows it.
# - The all-gathers are the same in every variant: each block is gathered once in the
#   forward and once in the backward, and the recomputation runs inside the block's
#   backward, after its gather. Checkpointing placed outside the FSDP unit gathers again:
#   {ref}`pitfalls-checkpoint-inside-unit`.
# - The times are ratios of a step of tens of milliseconds on this CPU, on a machine shared
#   with other work: read them as rough. The table's other columns depend only on the
#   seeded weights, the tokens and the shapes.

# %% mystnb={"image": {"alt": "A scatter of the eight variants, activations held for the backward in MiB against matmul FLOPs relative to no checkpointing: none, selective and offload at 1.0, offload the highest and selective below none; the each-block variants, each child and each block offloaded near 1.25 with the least memory."}}
import matplotlib.pyplot as plt

figure, axis = plt.subplots(figsize=(6.4, 3.6))
for variant, row in found.items():
    x, y = row["flops"] / none["flops"], row["held"]
    axis.scatter([x], [y], s=30)
    axis.annotate(variant, (x, y), xytext=(6, -3), textcoords="offset points", fontsize=7)
axis.set_xlabel("matmul FLOPs of a step, relative to none")
axis.set_ylabel("activations held for backward, MiB")
axis.set_xlim(0.95, 1.5)
axis.set_title("what each variant keeps against what it runs again (rank 0)", fontsize=10)
figure.tight_layout()
plt.show()

# %% [markdown]
# (checkpoint-variants-cache)=
# ## An HF model and torch's checkpointing: turn the cache off
#
# A Hugging Face model in training mode still builds a KV cache if `use_cache` is left at
# its config's default (`True` for Llama). Torch's checkpointing then runs each
# attention's forward twice, and the second run appends its keys and values to the cache
# the first run filled:

# %%
from fsdp_guide import LaunchError


def with_the_cache_on():
    model, x = build("each block (checkpoint_wrapper)"), tokens()
    model(input_ids=x, labels=x).loss.backward()  # use_cache left at the config's True


print(f"SEQ = {SEQ}")
try:
    launch(with_the_cache_on, output="none")
except LaunchError as error:
    print(str(error).splitlines()[0])

# %% [markdown]
# Twice the keys (`2 × SEQ`) meet a mask for `SEQ`. HF's own
# `activation_checkpointing_enable` does not fail: its layers drop the cache when they
# checkpoint (`GradientCheckpointingLayer`, `transformers/modeling_layers.py`: "otherwise
# the cache is updated a second time on the backward replay"), and they checkpoint
# `forward`, so that FSDP2's hooks stay outside it. With `checkpoint_wrapper`, the
# composable `checkpoint` or selective checkpointing on an HF model, pass `use_cache=False` to the forward
# or set `model.config.use_cache = False`, as `step` above does.

# %% [markdown]
# (checkpoint-variants-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch and transformers alone:
# {download}`scripts/checkpoint_variants.py`. It shards the same small Llama with no
# checkpointing, with each block checkpointed and with selective checkpointing, and prints
# each one's memory held for the backward, its matmul FLOPs and whether its gradients
# equal no checkpointing's. The tests run this file under torchrun on 2 CPU ranks and check
# that each block keeps less than selective, which keeps less than none, with equal
# gradients (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/checkpoint_variants.py
# :language: python
# ```

# %% [markdown]
# (checkpoint-variants-tips)=
# ## The tips behind this
#
# - {ref}`tip-checkpoint-each-block`
# - {ref}`tip-checkpoint-hf-cache`

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("checkpoint_variants")
