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
# (tutorial-migration)=
# # From FSDP1 to FSDP2: every argument, the same losses, and the checkpoint
#
# **What you will learn**
#
# - what each `FullyShardedDataParallel` argument becomes with `fully_shard`;
# - that the same model trained both ways gives the same losses, step for step;
# - how to carry an FSDP1 checkpoint (model and optimizer) over to FSDP2 and continue
#   training where FSDP1 stopped.
#
# **What you need**: a CPU; 2 processes on gloo, about 5 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The same code is
# written to run unchanged with one GPU per rank (NCCL): each rank computes on
# {func}`fsdp_guide.device`, its GPU `cuda:LOCAL_RANK` where it has one, else the CPU.
# The tips it demonstrates are listed {ref}`at the end <migration-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`migration-script` ({download}`download <scripts/migration.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# ## The arguments, one by one
#
# | `FullyShardedDataParallel(...)` (FSDP1) | `fully_shard(...)` (FSDP2) |
# | --- | --- |
# | `sharding_strategy=FULL_SHARD` | the default, `reshard_after_forward=None`: `True` for every unit but the root, which stays gathered from forward to backward (`FSDPState._lazy_init`); on a 1-D mesh |
# | `sharding_strategy=SHARD_GRAD_OP` | `reshard_after_forward=False` |
# | `sharding_strategy=NO_SHARD` (deprecated: FSDP1 raises a `FutureWarning` recommending `DistributedDataParallel`, `_init_core_state` in `torch/distributed/fsdp/_init_utils.py`) | plain DDP, as torch recommends; or a 2-D mesh `(world, 1)`, `("replicate", "shard")`: every rank holds everything, gradients all-reduced |
# | `sharding_strategy=HYBRID_SHARD` | `mesh=init_device_mesh(..., (replicas, shard_size))`, a 2-D {term}`device mesh` ({ref}`cluster`) |
# | `auto_wrap_policy=...` | call `fully_shard` on each unit yourself, bottom-up, then on the root ({func}`fsdp_guide.auto_wrap` applies an FSDP1 policy) |
# | `mixed_precision=MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)` | `mp_policy=MixedPrecisionPolicy(param_dtype, reduce_dtype, output_dtype, cast_forward_inputs)`; no buffer dtype: cast buffers yourself |
# | `cpu_offload=CPUOffload(offload_params=True)` | `offload_policy=CPUOffloadPolicy(pin_memory=...)` |
# | `backward_prefetch=BACKWARD_PRE` | always prefetches one unit ahead in backward; more with `unit.set_modules_to_backward_prefetch([...])` |
# | `forward_prefetch=True` | `unit.set_modules_to_forward_prefetch([...])` |
# | `limit_all_gathers=True` | nothing to set: FSDP2 has no such flag. FSDP1's rate limiter blocks the CPU thread on an event (`_unshard` in `torch/distributed/fsdp/_runtime_utils.py`); FSDP2 orders its all-gather streams with events instead (`FSDPParamGroup.wait_for_unshard` in `torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py`), keeping in forward the previous unit's all-gather buffer only until the next copy-out |
# | `sync_module_states=True` | build identically on every rank (same seed), or broadcast before sharding ({ref}`tutorial-deterministic-init`) |
# | `param_init_fn=...` | build on the {term}`meta device`, `fully_shard`, `to_empty`, then initialise (inside {func}`fsdp_guide.summon_full_params` on CPU) |
# | `use_orig_params=True` | always: parameters keep their names and shapes, each a {term}`DTensor` shard |
# | `ignored_modules=[...]` / `ignored_states` | `ignored_params={...}`, or leave the module out of every `fully_shard` call |
# | `device_id=...` | the mesh's device type (on CUDA, the current device); `fully_shard` moves the module's parameters there |
# | `FSDP.state_dict_type(model, SHARDED_STATE_DICT)` (deprecated: a `FutureWarning` recommends `get_state_dict`/`set_state_dict`) | `model.state_dict()` is already sharded (DTensors) |
# | `FSDP.state_dict_type(model, FULL_STATE_DICT)` / `FSDP.optim_state_dict` | `get_model_state_dict` / `get_optimizer_state_dict` from `torch.distributed.checkpoint.state_dict` (they work for both) |
# | `FSDP.summon_full_params(model)` | closest: `unit.unshard()` ... `unit.reshard()` (`FSDPModule` in `torch/distributed/fsdp/_fully_shard/_fully_shard.py`), one unit at a time (not recursive), gathered in `param_dtype`, no writeback; {func}`fsdp_guide.summon_full_params` adds recursion and writeback, and works for both |
# | `with model.no_sync():` | `model.set_requires_gradient_sync(False)` |
# | `model.clip_grad_norm_(max_norm)` | `torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)` (on DTensors) |
#
# ## The same model, both ways
#
# A small residual MLP, one unit per block. FSDP1 gets an `auto_wrap_policy`; FSDP2 gets
# one `fully_shard` call per block, then one on the root:

# %%
import fsdp_guide
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from fsdp_guide import launch
from fsdp_guide.compare import largest_difference
from fsdp_guide.table import Table
from IPython.display import display

WIDTH, STEPS = 32, 6


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + F.gelu(self.fc(self.norm(x)))


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(*(Block() for _ in range(3)), nn.Linear(WIDTH, 1))


def batch(step, device):
    """This rank's rows of global batch ``step``, on ``device``."""
    g = torch.Generator().manual_seed(step)  # drawn on the CPU: the same numbers on any device
    x = torch.randn(16, WIDTH, generator=g)
    y = x.sum(1, keepdim=True).sin()
    rank, world = dist.get_rank(), dist.get_world_size()
    return x.chunk(world)[rank].to(device), y.chunk(world)[rank].to(device)


def shard(model, api, device):
    if api == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            use_orig_params=True,
            device_id=device,
        )
    from torch.distributed.fsdp import fully_shard

    for block in model[:3]:
        fully_shard(block)
    return fully_shard(model)


def train(model, optimizer, steps, device):
    losses = []
    for step in steps:
        x, y = batch(step, device)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    return losses


def both_apis():
    device = fsdp_guide.device()
    out = {}
    for api in ("fsdp1", "fsdp2"):
        model = shard(make_model(), api, device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        out[api] = train(model, optimizer, range(STEPS), device)
    return out


losses = launch(both_apis, output="none")[0]
pairs = enumerate(zip(losses["fsdp1"], losses["fsdp2"]))
rows = [[step, f"{a:.6f}", f"{b:.6f}"] for step, (a, b) in pairs]
display(Table(["step", "loss, FSDP1", "loss, FSDP2"], rows))
difference = largest_difference(zip(losses["fsdp1"], losses["fsdp2"]))
print(f"max |FSDP1 - FSDP2| over {STEPS} steps: {difference:.1e}")

# %% [markdown]
# The same losses, here bit for bit (the batches are random, so the loss jumps from step
# to step; what matters is that the columns agree). Both APIs average the same gradients
# and AdamW is pointwise, so it does not matter that FSDP1 steps flat slices and FSDP2
# blocks of rows ({ref}`tip-pointwise-optimizers` says when it does).
#
# (migration-fsdp1-errors)=
# ## FSDP1's messages, and what each means
#
# FSDP1 flattens each unit's parameters into one `FlatParameter`, and most of its
# commonest errors are about what cannot go into one flat tensor. Each mistake below is
# made on purpose on 2 ranks, with its message and the FSDP1 fix beside it:

# %%
import traceback
import warnings


class WithPacked(nn.Module):
    """The model and a frozen 4-bit weight packed two to a byte (uint8), as bitsandbytes stores one."""

    def __init__(self):
        super().__init__()
        self.packed = nn.Parameter(
            torch.zeros(WIDTH * WIDTH // 2, dtype=torch.uint8), requires_grad=False
        )
        self.model = make_model()

    def forward(self, x):
        return self.model(x)


def outcome(attempt) -> str:
    """What ``attempt()`` raises, as Python prints it, or "ok"."""
    try:
        attempt()
    except Exception as error:
        return "".join(traceback.format_exception_only(error)).strip()
    return "ok"


def fsdp1_mistakes():
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    device = fsdp_guide.device()
    one_unit = dict(device_id=device)  # no wrap policy: the whole model is one FlatParameter
    per_block = dict(device_id=device, auto_wrap_policy=ModuleWrapPolicy({Block}))

    def bf16_block(**options):
        model = make_model()
        model[1].to(torch.bfloat16)
        return FSDP(model, **options)

    def frozen_block(**options):
        model = make_model()
        model[1].requires_grad_(False)
        return FSDP(model, **options)

    def packed(ignore=False, **options):
        model = WithPacked()
        return FSDP(model, **options, ignored_states=[model.packed] if ignore else None)

    def fsdp2_one_unit():  # the frozen block and the uint8 parameter in one fully_shard unit
        from torch.distributed.fsdp import fully_shard

        model = WithPacked()
        model.model[1].requires_grad_(False)
        fully_shard(model)
        model(torch.ones(2, WIDTH, device=device)).sum().backward()

    def clip(on_root):
        model = FSDP(make_model(), **per_block)
        model(torch.ones(2, WIDTH, device=device)).sum().backward()
        (model if on_root else model.module[0]).clip_grad_norm_(1.0)

    rows = [
        (
            "a bfloat16 block in the unit",
            outcome(lambda: bf16_block(**one_unit)),
            "the block a unit of its own",
            outcome(lambda: bf16_block(**per_block)),
        ),
        (
            "a frozen block in the unit",
            outcome(lambda: frozen_block(**one_unit, use_orig_params=False)),
            "use_orig_params=True",
            outcome(lambda: frozen_block(**one_unit, use_orig_params=True)),
        ),
        (
            "a uint8 parameter first",
            outcome(lambda: packed(**one_unit)),
            "ignored_states=[it]",
            outcome(lambda: packed(**one_unit, ignore=True)),
        ),
        (
            "clip_grad_norm_ on an inner unit",
            outcome(lambda: clip(on_root=False)),
            "on the root",
            outcome(lambda: clip(on_root=True)),
        ),
    ]
    rows.append(
        (
            "FSDP2: a frozen block and a uint8 parameter in one unit, a step",
            outcome(fsdp2_one_unit),
            "",
            "",
        )
    )
    if device.type == "cpu":  # cpu-only: without device_id, FSDP1 uses the accelerator
        rows.append(
            (
                "no device_id on a CPU-only machine",
                outcome(lambda: FSDP(make_model())),
                "device_id=torch.device('cpu')",
                outcome(lambda: FSDP(make_model(), device_id=device)),
            )
        )
    # a group of one rank, as a one-GPU run has
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        FSDP(make_model(), process_group=dist.new_group([dist.get_rank()]), device_id=device)
    rows.append(
        (
            "a process group of 1 rank",
            *(
                f"{w.category.__name__}: {w.message}"
                for w in caught
                if "NO_SHARD" in str(w.message)
            ),
            "",
            "",
        )
    )
    return rows


for mistake, message, fix, after in launch(fsdp1_mistakes, output="none")[0]:
    print(f"{mistake}:\n    {message}")
    if fix:
        print(f"  with {fix}: {after}")

# %% [markdown]
# A `FlatParameter` has one dtype and one `requires_grad` (`_validate_tensors_to_flatten`
# in `torch/distributed/fsdp/_flat_param.py`), and only floating-point tensors go in, so
# LoRA's frozen base beside trainable adapters, fp32 adapters in a bf16 model, or a
# quantised base in one unit are refused. `use_orig_params=True` lets frozen and trainable
# parameters share a unit. A clip computes the norm over every unit, so only the root can.
# With one rank FSDP1 has nothing to shard and says it switches to `NO_SHARD`: test
# sharding on 2 ranks or more.
#
# FSDP2 keeps each parameter a `DTensor` of its own, so frozen and trainable parameters
# share a unit, and a frozen uint8 parameter is sharded as it is (the FSDP2 line); what remains is that a
# unit's *trainable* parameters share one dtype ({ref}`lora-dtypes` executes it), and
# `torch.nn.utils.clip_grad_norm_` over the model's parameters replaces the root's
# `clip_grad_norm_`.
#
# (migration-checkpoint)=
# ## Carrying an FSDP1 checkpoint over
#
# An FSDP1 job saved its state the FSDP1 way: a sharded model state dict under
# `FSDP.state_dict_type(..., SHARDED_STATE_DICT)` and `FSDP.optim_state_dict`, written with
# `torch.distributed.checkpoint` (DCP). The cell below saves the same way, so torch's
# `FutureWarning` appears in its output: `FSDP.state_dict_type` is being deprecated in
# favour of `get_state_dict`/`set_state_dict` (`FullyShardedDataParallel.state_dict_type`
# in `torch/distributed/fsdp/fully_sharded_data_parallel.py`), which the FSDP2 side uses.
# The other warnings come from torch's own FSDP1 sharded-state-dict code: two
# `UserWarning`s from `torch/distributed/fsdp/_shard_utils.py` calling the internal
# `_get_pg_default_device`, and `FutureWarning`s that `ShardedTensor` is deprecated
# (`torch/distributed/fsdp/_state_dict_utils.py`): nothing in the user's code to change,
# one more reason to move to the new API.
# Both dictionaries are keyed by the parameters' original names (`0.fc.weight`), not by
# the FSDP1 module's own parameter names (`_fsdp_wrapped_module...`; both printed below,
# from rank 0), so an FSDP2 model can read them: build it, ask `get_state_dict` for the
# state it expects, let DCP fill it from the FSDP1 files (resharding flat slices into
# rows), and hand it to `set_state_dict`.

# %%
import tempfile

# deleted, with what the page wrote, when the kernel exits
scratch = tempfile.TemporaryDirectory(prefix="fsdp1-checkpoint-")
CHECKPOINT = scratch.name


def fsdp1_saves_then_continues(path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    device = fsdp_guide.device()
    model = shard(make_model(), "fsdp1", device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optimizer, range(STEPS), device)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=path)
    saved_keys = [*state["model"], *state["optim"]["state"]]
    names = {
        "own": next(name for name, _ in model.named_parameters() if name.endswith("fc.weight")),
        "model": "0.fc.weight" in state["model"],
        "optim": "0.fc.weight" in state["optim"]["state"],
        "wrapped": sum("_fsdp_wrapped_module" in key for key in saved_keys),
    }
    # what FSDP1 would have done next
    return train(model, optimizer, range(STEPS, 2 * STEPS), device), names


def fsdp2_loads_and_continues(path, with_optimizer=True):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    device = fsdp_guide.device()
    model = shard(make_model(), "fsdp2", device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model_state, optim_state = get_state_dict(model, optimizer)  # FSDP2's layout, to be filled
    state = (
        {"model": model_state, "optim": optim_state} if with_optimizer else {"model": model_state}
    )
    dcp.load(state, checkpoint_id=path)
    if with_optimizer:
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
    else:
        set_model_state_dict(model, state["model"])
    return train(model, optimizer, range(STEPS, 2 * STEPS), device)


fsdp1_next, names = launch(fsdp1_saves_then_continues, CHECKPOINT, output="none")[0]
print(f"the FSDP1 module's name of the first block's fc.weight: {names['own']}")
print(
    f"saved under '0.fc.weight': model state {names['model']}, optimizer state {names['optim']}; "
    f"saved keys with '_fsdp_wrapped_module': {names['wrapped']}"
)
for with_optimizer in (True, False):
    fsdp2_next = launch(fsdp2_loads_and_continues, CHECKPOINT, with_optimizer, output="none")[0]
    difference = largest_difference(zip(fsdp1_next, fsdp2_next))
    loaded = "model and optimizer" if with_optimizer else "model only"
    print(
        f"steps {STEPS}-{2 * STEPS - 1}, FSDP2 from FSDP1's checkpoint, {loaded:19}: "
        f"max |loss - FSDP1's own continuation| = {difference:.1e}"
    )

# %% [markdown]
# FSDP2 picks up FSDP1's weights *and* AdamW's moments and step counts: its next steps are
# the ones FSDP1 would have taken. Loading the model alone is not enough: AdamW's moments
# restart from zero, its first steps are full-size again, and the losses part ways. From here on, save with
# `get_state_dict`/`set_state_dict` (they work for both APIs, and
# {func}`fsdp_guide.checkpoint.save` wraps them with an atomic publish and exact resume).

# %% [markdown]
# (migration-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/migration.py`.
# `torchrun --nproc-per-node=2 migration.py` trains the same model twice on the same batches: with
# `FullyShardedDataParallel` (an `auto_wrap_policy`, `MixedPrecision`, `device_id`), then with
# `fully_shard` on each block and the root (`MixedPrecisionPolicy`), both in bfloat16 with float32
# gradient reduction, and rank 0 prints the largest difference between their losses. The tests run
# it on 2 CPU ranks and check that the difference is at most 1e-6 (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/migration.py
# :language: python
# ```

# %% [markdown]
# (migration-tips)=
# ## The tips behind this
#
# - {ref}`tip-migrate-fsdp1-fsdp2`: map the arguments, compare losses, carry the checkpoint.
# - {ref}`tip-pointwise-optimizers`: why the optimizer step is the same on flat and row shards.
# - {ref}`tip-exact-resume`: checkpoints with the state-dict helpers.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("migration")
