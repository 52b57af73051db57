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
# (tutorial-ema-and-teacher)=
# # A second copy of the weights: an EMA and a frozen teacher
#
# **What you will learn**
#
# - how to keep an exponential moving average (EMA) of a sharded model on the shards, with
#   no communication, equal to one process's, and how to export it;
# - what a frozen teacher (or reference) model costs beside the trained one, sharded, and
#   whether its root unit should stay gathered.
#
# It builds on {ref}`tutorial-beyond-the-step`, where evaluation leaves the root unit
# gathered.
#
# **What you need**: a CPU; 2 processes on gloo; about 5 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The
# worker code is written to run unchanged with one GPU per rank (NCCL): the shards live on
# {func}`fsdp_guide.device`. The tips it demonstrates are listed
# {ref}`at the end <ema-and-teacher-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`ema-and-teacher-script` ({download}`download <scripts/ema_and_teacher.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# The model is the package's small GPT ({class}`fsdp_guide.gpt.GPT`), 2 blocks, each
# block an FSDP unit and the root holding the embeddings (the output head is tied to them),
# as in {ref}`tutorial-beyond-the-step`. `gathers` runs a function and counts FSDP's
# all-gathers in it, with {func}`fsdp_guide.precision.record_dtypes`; memory is measured
# with {func}`fsdp_guide.memory.measure`, in units of *P*, the whole model's parameter
# bytes.

# %%
import fsdp_guide
import torch.distributed as dist
import torch.nn.functional as F
from fsdp_guide import launch
from fsdp_guide.compare import largest_difference
from fsdp_guide.gpt import GPT, GPTConfig
from fsdp_guide.memory import measure
from fsdp_guide.precision import record_dtypes
from fsdp_guide.table import Table
from IPython.display import display
from myst_nb import glue
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

CONFIG = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)


def build_model(seed=0):
    torch.manual_seed(seed)
    model = GPT(CONFIG)
    model.init_weights()
    return model


def shard_model(model, **kwargs):
    mesh = init_device_mesh(fsdp_guide.device().type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    return fully_shard(model, mesh=mesh, **kwargs)


def whole_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


def gathers(fn):
    """fn's result, and how many all-gathers FSDP ran in it."""
    with record_dtypes() as seen:
        result = fn()
    return result, seen.count[("forward", "all-gather")] + seen.count[("backward", "all-gather")]


# %% [markdown]
# (beyond-ema)=
# ## An EMA of a sharded model
#
# An exponential moving average ({term}`EMA`) is elementwise: `ema = decay * ema + (1 - decay) * param`.
# Kept as a copy of each parameter's **shard** (the `DTensor`s FSDP2 registers), it needs
# no communication and costs *P*/*N* per rank. torch's `AveragedModel` deep-copies the model,
# which FSDP refuses for a sharded one:

# %%
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

DECAY, STEPS = 0.9, 8


def averaged_model_of_sharded():
    model = shard_model(build_model())
    AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY))


try:
    launch(averaged_model_of_sharded, output="none")
except fsdp_guide.LaunchError as error:  # "rank N raised ...": whichever rank failed first
    print("a rank raised", str(error).splitlines()[0].split(" raised ", 1)[1])

# %% [markdown]
# Here the EMA is a second model, built and sharded as the
# trained one, frozen, and started from a copy of the model's shards (also right for a model
# loaded from a checkpoint). Its parameters are `DTensor` shards laid out like the model's,
# updated after every optimizer step with `AveragedModel`'s update (`get_ema_multi_avg_fn`,
# a `torch._foreach_lerp_` over the two lists of shards: `torch/optim/swa_utils.py`).
# torch's `CommDebugMode` counts the collectives the updates run, including any a `DTensor`
# operation would run inside.
# Being a model, the EMA is exported like one: `get_model_state_dict` gathers it whole for
# one file (tied weights under both names); its shards go into a DCP checkpoint as the
# model's do ({ref}`tutorial-llm`). One process runs the same function on the whole model,
# for the same steps on the same global batches:

# %%
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor.debug import CommDebugMode


@torch.no_grad()
def copy_of(model, ema_model):
    """ema_model, frozen, holding a copy of model's parameters (shard by shard when sharded)."""
    ema_model.requires_grad_(False)
    for ema, param in zip(ema_model.parameters(), model.parameters()):
        ema.copy_(param.detach())
    return ema_model


def train_batch(step):
    g = torch.Generator().manual_seed(100 + step)
    rows = torch.randint(CONFIG.vocab_size, (4, CONFIG.block_size + 1), generator=g)
    return rows[:, :-1], rows[:, 1:]


def train_with_ema(model, ema_model, device, rows=slice(None)):
    """Train STEPS steps, updating ema_model after each; the number of collectives the updates ran."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    update = get_ema_multi_avg_fn(DECAY)
    ema_collectives = 0
    for step in range(STEPS):
        tokens, targets = train_batch(step)
        _, loss = model(tokens[rows].to(device), targets[rows].to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        with CommDebugMode() as comm:
            update(list(ema_model.parameters()), list(model.parameters()), step)
        ema_collectives += comm.get_total_counts()
    return ema_collectives


def ema_sharded():
    device = fsdp_guide.device()
    model = shard_model(build_model())
    ema_model = copy_of(model, shard_model(build_model()))  # the same layout, the model's values
    # this rank's half of each global batch
    rows = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
    ema_collectives = train_with_ema(model, ema_model, device, rows)
    per_rank = measure(ema_model).total / whole_bytes(ema_model)
    # whole tensors, on rank 0's CPU
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full, trained = (
        get_model_state_dict(ema_model, options=options),
        get_model_state_dict(model, options=options),
    )
    return (full, trained) if dist.get_rank() == 0 else None, ema_collectives, per_rank


one = build_model()
one_ema = copy_of(one, build_model())
train_with_ema(one, one_ema, torch.device("cpu"))  # cpu-only: the reference runs here
(exported, trained), ema_collectives, per_rank = launch(ema_sharded, output="none")[0]


def apart(full, reference):
    return largest_difference((full[name], t) for name, t in reference.state_dict().items())


print(
    f"collectives in {STEPS} EMA updates: {ema_collectives}; EMA model per rank: {per_rank:.2f} P"
)
print(f"trained model vs one process's: largest difference {apart(trained, one):.1e}")
print(f"exported EMA vs one process's:  largest difference {apart(exported, one_ema):.1e}")

import tempfile
from pathlib import Path

scratch = tempfile.TemporaryDirectory()  # deleted, with what the page wrote, when the kernel exits
path = Path(scratch.name) / "ema.pt"
torch.save(exported, path)  # rank 0's export, loaded into a plain model:
plain = build_model()
print("loads into a plain GPT:", plain.load_state_dict(torch.load(path)))

# one EMA update at decay 0.999, from 1 towards 2, in each dtype
one, two = (torch.tensor(1.0), torch.tensor(2.0))
print(
    f"one update at decay 0.999 from 1 towards 2: {torch.lerp(one, two, 1 - 0.999).item():.4f} in fp32, "
    f"{torch.lerp(one.bfloat16(), two.bfloat16(), 1 - 0.999).item():.4f} in bf16"
)

# %% [markdown]
# The EMA updates ran no collective. The EMA model
# holds half of the model per rank, parameters only, and after 8 steps equals the EMA one
# process computes as closely as the trained models agree with each other (the two
# differences printed above): an elementwise rule on shards is the same rule on the whole. The export is a plain state dict, with the tied
# head under both names, which a plain `GPT` loads with no missing or unexpected key.
#
# Two cautions. While a unit is gathered, `parameters()` gives its whole plain tensors, not
# the shards ({ref}`the evaluation table's last two columns <beyond-eval>`): `reshard()` the EMA model after
# evaluating it (and the model before updating the EMA), or the update mixes tensors and
# `DTensor`s, or updates a gathered copy that resharding then drops. And the EMA's dtype is
# its parameters': under a `MixedPrecisionPolicy` the sharded parameters keep their
# original dtype, fp32 for a model stored in fp32 (`param_dtype` applies to the unsharded
# ones: the `MixedPrecisionPolicy` docstring in
# `torch/distributed/fsdp/_fully_shard/_fsdp_api.py`), so the EMA does; a model stored in
# bf16 needs its EMA kept in fp32. With a decay of 0.999 an update moves the EMA by a
# thousandth of its distance to the parameter, which bf16's 8 significant bits round away
# unless the distance is comparable to the value itself (the last line above).
#
# (beyond-teacher)=
# ## A frozen teacher beside the student
#
# Distillation, or a reference model in preference training, runs a second model forward
# only. Sharded like the student, with its parameters frozen ({term}`frozen parameter`), it holds *P*/*N* per rank and
# no gradients or optimizer state. Its root unit is what to watch: with the default it
# stays gathered after every forward, and a teacher never runs a backward to reshard it.


# %%
def distillation_step(teacher_reshard_root):
    device = fsdp_guide.device()
    student = shard_model(build_model(seed=0))
    teacher = build_model(seed=1).requires_grad_(False).eval()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in teacher.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(teacher, mesh=mesh, reshard_after_forward=teacher_reshard_root)
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-2)
    tokens, _ = train_batch(0)
    tokens = tokens[2 * dist.get_rank() : 2 * dist.get_rank() + 2].to(device)

    def student_step(teacher_logits):
        logits, _ = student(tokens)
        loss = F.kl_div(
            F.log_softmax(logits.float(), -1),
            F.log_softmax(teacher_logits.float(), -1),
            log_target=True,
            reduction="batchmean",
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    counts = []
    for _ in range(2):  # the second step shows the steady state
        with torch.no_grad():
            (teacher_logits, _), teacher_gathers = gathers(lambda: teacher(tokens))
        _, student_gathers = gathers(lambda: student_step(teacher_logits))  # noqa: B023 (called here)
        counts.append((teacher_gathers, student_gathers))
    P = whole_bytes(student)
    return {
        "teacher": ([t for t, _ in counts], measure(teacher).total / P),
        "student": ([s for _, s in counts], measure(student, optimizer).total / P),
    }


def both_teachers():
    return {setting: distillation_step(setting) for setting in (None, True)}


teachers = launch(both_teachers, output="none")[0]
rows = []
for setting, parts in teachers.items():
    for who, (counts, states) in parts.items():
        name = "default" if setting is None else "reshard_after_forward=True"
        rows.append([name, who, " ".join(str(c) for c in counts), f"{states:.2f}"])
display(
    Table(["teacher root", "model", "all-gathers in steps 1, 2", "model states held / P"], rows)
)
glue("bts_student_held", teachers[None]["student"][1], display=False)
glue("bts_teacher_default_held", teachers[None]["teacher"][1], display=False)
glue("bts_teacher_resharded_held", teachers[True]["teacher"][1], display=False)

# %% [markdown]
# The student, trained with AdamW, holds {glue:text}`bts_student_held:.1f` *P* per rank after its step: half its
# parameters and half of each of AdamW's two moments (`zero_grad()` has freed the
# gradients). The teacher holds parameters only. Its root is the choice:
#
# - with the default, the root stays gathered after the teacher's forward and through the
#   student's whole step ({glue:text}`bts_teacher_default_held:.2f` *P*: its shards and the root's embeddings, whole), and the
#   next step's teacher forward gathers only the 2 blocks;
# - with `reshard_after_forward=True` passed to the teacher's root, the teacher holds its
#   shards only ({glue:text}`bts_teacher_resharded_held:.2f` *P*), and pays one more all-gather, the root's, per step.
#
# Left unsharded (a plain module on every rank, not given to `fully_shard`), the teacher
# would hold 1 *P* on every rank and run no collective; replicated *with* FSDP (a shard
# group of one rank) it would hold that 1 *P* as its shards and more while it runs, FSDP
# copying each unit into an unsharded buffer at every forward (measured, for a model kept
# gathered from forward to backward, in the {ref}`frozen weights tutorial <lora-traffic>`). `no_grad` keeps the
# teacher out of autograd: no activations saved for it, no backward, so no backward
# all-gathers, gradients or reduce-scatters (the student's step above ran its own 5
# all-gathers and none of the teacher's). `requires_grad_(False)` keeps its parameters out of
# the optimizer and gradient-free; it is not a substitute for `no_grad` when the teacher's
# inputs require gradients (the student's hidden states, soft prompts): its outputs then
# require gradients too, autograd saves the teacher's activations, and FSDP registers the
# hooks that gather its units again in backward (`FSDPState._register_pre_backward_hook` in
# `torch/distributed/fsdp/_fully_shard/_fsdp_state.py`).


# %% [markdown]
# (ema-and-teacher-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/ema_and_teacher.py`.
# It trains a small model sharded on 2 ranks, each on its half of every global batch, and
# keeps an EMA of it as a second sharded, frozen copy updated on the shards after every
# optimizer step; rank 0 gathers the EMA whole and compares it with the EMA one process
# computes for the same steps on the whole batches. The tests run this file under torchrun
# on 2 CPU ranks and check that the difference is at most 1e-6, and that the collectives the
# EMA updates ran are none (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/ema_and_teacher.py
# :language: python
# ```

# %% [markdown]
# (ema-and-teacher-tips)=
# ## The tips behind this
#
# - {ref}`tip-ema-on-shards`
# - {ref}`tip-frozen-teacher`

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("ema_and_teacher")
