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
# (tutorial-tp-checkpoints)=
# # A 2D checkpoint on another mesh
#
# **What you will learn**
#
# - that a checkpoint saved by a 2 x 2 FSDP x TP run with DCP loads into a 2-rank FSDP run,
#   parameters and optimizer state bit for bit;
# - that a one-file export gathers over both mesh dimensions.
#
# **What you need**: a CPU; 4 and 2 processes on gloo; about 5 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The
# worker code is written to run unchanged with one GPU per rank (NCCL): the mesh is built
# on {func}`fsdp_guide.device`'s type.
# The tips it demonstrates are listed {ref}`at the end <tp-checkpoints-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`tp-checkpoints-script` ({download}`download <scripts/tp_checkpoints.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# The setup of {ref}`the tensor-parallel plan <tp-plan>`, repeated (unfold the cell to read it):
# the package's small GPT ({class}`fsdp_guide.gpt.GPT`), a global batch of 8 sequences, the 2 x 2
# mesh named `dp` and `tp`, TP with sequence parallelism over `tp`, then `fully_shard` over `dp`;
# `my_rows` gives each `dp` rank its half of the batch, the same half on both ranks of a TP group.

# %% tags=["hide-input"]
import fsdp_guide
import torch.distributed as dist
from fsdp_guide import launch
from fsdp_guide.gpt import GPT, GPTConfig
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

CONFIG = GPTConfig(block_size=16, n_layer=2, n_head=4, n_embd=32)
BATCH = 8  # sequences in the global batch


def build_model():
    torch.manual_seed(0)
    model = GPT(CONFIG)
    model.init_weights()
    return model


def global_batch(step=0):
    g = torch.Generator().manual_seed(100 + step)
    rows = torch.randint(CONFIG.vocab_size, (BATCH, CONFIG.block_size + 1), generator=g)
    return rows[:, :-1], rows[:, 1:]


def make_mesh(dp=2, tp=2):
    return init_device_mesh(fsdp_guide.device().type, (dp, tp), mesh_dim_names=("dp", "tp"))


def apply_tp(model, tp_mesh):
    """Column-wise q, k, v and fc, row-wise projections; norms and residual stream along the sequence."""
    plan = {
        sub: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        for sub in ("attn", "mlp")  # a sub-layer gathers the whole sequence on its way in
    }
    plan |= {"ln_1": SequenceParallel(), "ln_2": SequenceParallel()}
    plan |= {f"attn.{name}": ColwiseParallel() for name in ("q", "k", "v")}
    plan |= {"mlp.fc": ColwiseParallel()}
    plan |= {name: RowwiseParallel(output_layouts=Shard(1)) for name in ("attn.proj", "mlp.proj")}
    for block in model.blocks:
        parallelize_module(block, tp_mesh, plan)
    # into the blocks: keep this rank's part of the sequence; out of them: gather it
    edges = {
        "blocks.0": PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        ),
        "ln_f": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
    }
    parallelize_module(model, tp_mesh, edges)


def apply_fsdp(model, dp_mesh):
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def parallelize(model, mesh):
    """TP over mesh["tp"] first, then FSDP over mesh["dp"]: the order FSDP x TP needs."""
    if mesh["tp"].size() > 1:
        apply_tp(model, mesh["tp"])
    if mesh["dp"].size() > 1:
        apply_fsdp(model, mesh["dp"])
    return model


def my_rows(mesh, step=0):
    """This rank's part of the global batch: split over dp, the same for every rank of a TP group."""
    tokens, targets = global_batch(step)
    rows = BATCH // mesh["dp"].size()
    mine = slice(mesh["dp"].get_local_rank() * rows, (mesh["dp"].get_local_rank() + 1) * rows)
    device = fsdp_guide.device()
    return tokens[mine].to(device), targets[mine].to(device)


def full_parameters(model):
    return {
        name: p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
        for name, p in model.named_parameters()
    }


# %% [markdown]
# (tp-checkpoint)=
# ## A 2D checkpoint, loaded by a 1D FSDP run and exported to one file
#
# The 2 x 2 run saves its model and AdamW state with {func}`fsdp_guide.checkpoint.save`
# (DCP: each rank writes its shards, each recorded with its offsets and sizes in the
# global tensor). A 2-rank FSDP run without TP loads it: DCP reads whichever slices each
# new shard needs. It then exports one
# `torch.save` file with {func}`fsdp_guide.checkpoint.export_consolidated`.

# %%
import tempfile
from pathlib import Path

from fsdp_guide import checkpoint

# deleted, with what the page wrote, when the kernel exits
scratch = tempfile.TemporaryDirectory(prefix="tensor-parallel-")
run_dir = Path(scratch.name)


def train_2d_and_save(directory):
    mesh = make_mesh()
    model = parallelize(build_model(), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        model(*my_rows(mesh, step))[1].backward()
        optimizer.step()
        optimizer.zero_grad()
    checkpoint.save(directory, 2, model, optimizer)
    # gathered over dp and tp
    checkpoint.export_consolidated(model, Path(directory) / "model-2d.pt")
    optimizer_state = {
        name: optimizer.state[p]["exp_avg"].full_tensor().cpu()
        for name, p in model.named_parameters()
    }
    params = {name: p.cpu() for name, p in full_parameters(model).items()}
    return params, optimizer_state, fsdp_guide.describe_sharding(model)


def load_on_1d_and_export(directory):
    mesh = init_device_mesh(
        fsdp_guide.device().type, (dist.get_world_size(),), mesh_dim_names=("dp",)
    )
    model = build_model()
    apply_fsdp(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = checkpoint.load(checkpoint.latest(directory), model, optimizer)
    optimizer_state = {
        name: optimizer.state[p]["exp_avg"].full_tensor().cpu()
        for name, p in model.named_parameters()
    }
    checkpoint.export_consolidated(model, Path(directory) / "model.pt")
    params = {name: p.cpu() for name, p in full_parameters(model).items()}
    return step, params, optimizer_state, fsdp_guide.describe_sharding(model)


saved = launch(train_2d_and_save, run_dir, world_size=4, output="none")
loaded = launch(load_on_1d_and_export, run_dir, world_size=2, output="none")
(saved_params, saved_moments, _), (step, loaded_params, loaded_moments, _) = saved[0], loaded[0]
plain = GPT(CONFIG)
print(
    "exported file into a plain GPT:",
    plain.load_state_dict(torch.load(run_dir / "model.pt", weights_only=True)),
)
print(
    f"step {step}; 1D parameters equal the 2D ones exactly:",
    all(torch.equal(loaded_params[n], p) for n, p in saved_params.items()),
)
print(
    "AdamW's first moments equal exactly:",
    all(torch.equal(loaded_moments[n], m) for n, m in saved_moments.items()),
)
print(
    "exported file equals the 2D parameters exactly:",
    all(torch.equal(plain.state_dict()[n], p) for n, p in saved_params.items()),
)
exported_2d = torch.load(run_dir / "model-2d.pt", weights_only=True)
print(
    "the 2D run's own export equals them exactly:",
    all(torch.equal(exported_2d[n], p) for n, p in saved_params.items()),
)

# %% [markdown]
# What the checkpoint holds of one weight, read from DCP's metadata: a chunk per rank of
# the 2 x 2 run (its offset and size in the global tensor, and the file it is in), the
# same blocks that rank held; the 2-rank run then holds other blocks, each read from two
# of those chunks:

# %%
import matplotlib.pyplot as plt
from fsdp_guide.describe import draw_sharding
from torch.distributed.checkpoint import FileSystemReader

WEIGHT = "blocks.0.attn.q.weight"
metadata = FileSystemReader(checkpoint.latest(run_dir)).read_metadata()
chunks = metadata.state_dict_metadata[f"model.{WEIGHT}"].chunks
files = {
    i.offset: d.relative_path
    for i, d in metadata.storage_data.items()
    if i.fqn == f"model.{WEIGHT}"
}
held = [next(row.holds for row in table if row.name == WEIGHT) for _, _, table in saved]
for chunk in chunks:
    block = ", ".join(f"{start}:{start + size}" for start, size in zip(chunk.offsets, chunk.sizes))
    writer = int(files[chunk.offsets].split("_")[2])  # DCP names a rank's file __<rank>_<n>.distcp
    print(
        f"chunk [{block}] in {files[chunk.offsets]}; rank {writer} of the 2 x 2 run held {held[writer]}"
    )

# %% tags=["hide-input"] mystnb={"image": {"alt": "The 32 by 32 weight blocks.0.attn.q.weight coloured by the rank that holds each part: saved by the 2 by 2 run in four bands of 8 rows, ranks 0, 2, 1, 3 from the top; loaded by the 2-rank FSDP run in two halves, rank 0 rows 0 to 15 and rank 1 rows 16 to 31."}}
fig, axes = plt.subplots(1, 2, figsize=(8, 3.6))
draw_sharding(
    [r[2] for r in saved], WEIGHT, lambda r: f"rank {r} (dp {r // 2}, tp {r % 2})", ax=axes[0]
)
draw_sharding([r[3] for r in loaded], WEIGHT, ax=axes[1])
axes[0].set_title(f"{WEIGHT}: saved by the 2 x 2 run")
axes[1].set_title("loaded by the 2-rank FSDP run")
fig.tight_layout()

# %% [markdown]
# Nothing in the checkpoint ties it to the mesh that wrote it: DCP stores each tensor's
# global shape and which slice every file holds, and the loading run asks for the slices
# its own placements need (here a `_StridedShard` over `dp` and a `Shard` over `tp`
# becomes a plain `Shard` over 2 ranks); a 1D checkpoint is expected to load on a 2D run
# the same way (not run here). The export's `get_model_state_dict(...,
# full_state_dict=True)` gathers over every mesh dimension: the 2D run's own export, from
# `_StridedShard` and `Shard` over two dimensions, equals the 1D run's. Bit for bit,
# because no arithmetic is involved, only copies. What does not carry over to a different number
# of ranks is each rank's RNG state: {func}`fsdp_guide.checkpoint.load` restores it only
# on the same world size, so a resumed run that draws random numbers (dropout, data
# order) continues from new streams.


# %% [markdown]
# (tp-checkpoints-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/tp_checkpoints.py`.
# Four ranks form a 2 x 2 mesh; a small model split by TP over `tp` and sharded over `dp` takes two
# AdamW steps and is saved with DCP (`get_state_dict`, `dcp.save`). A second model, sharded by
# FSDP alone over all 4 ranks, loads it (`dcp.load`, `set_state_dict`) and is exported to one
# `torch.save` file of whole tensors (`get_model_state_dict(..., full_state_dict=True)`). Rank 0
# prints whether the parameters and AdamW's first moments came across bit for bit and whether
# the file loads into a plain model and equals them. The tests run this file under torchrun on 4
# CPU ranks and check all four (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/tp_checkpoints.py
# :language: python
# ```

# %% [markdown]
# (tp-checkpoints-tips)=
# ## The tips behind this
#
# - {ref}`tip-tp-checkpoint`

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("tp_checkpoints")
