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
# (tutorial-fsdp-config)=
# # Configuring FSDP with a dictionary
#
# **What you will learn**
#
# - how {func}`fsdp_guide.shard` applies a trainer-style `fsdp_config` dictionary with
#   FSDP2 (`fully_shard`) or FSDP1 (`FullyShardedDataParallel`), and how a model steers
#   it with `fsdp_wrap_fn` and `activation_checkpointing_fn`;
# - what each `sharding_strategy` stores on a rank and sends per step, measured on 4
#   ranks;
# - which dtypes the `mixed_precision` presets `FULL`, `DEFAULT` and `PURE` really compute
#   and reduce in;
# - what a mistake in the dictionary tells you.
#
# **What you need**: a CPU; 2 and 4 processes on gloo, about 5 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The same code
# is written to run unchanged with one GPU per rank (NCCL): `shard` puts each rank's
# model on {func}`fsdp_guide.device`, its GPU `cuda:LOCAL_RANK` where it has one, else
# the CPU, and the workers put their batches there too. The full key-by-key mapping is in the reference,
# {ref}`fsdp-config-reference`; the tips are listed {ref}`at the end <fsdp-config-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`fsdp-config-script` ({download}`download <scripts/fsdp_config.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# ## A dictionary, a model, and the plan
#
# This is the dictionary trainer libraries such as MosaicML Composer take. The model
# marks its FSDP units with `fsdp_wrap_fn` (here: each block) and the modules to
# checkpoint with `activation_checkpointing_fn`; `shard` looks for both on the model
# and on `model.model`. With `verbose`, rank 0 prints the plan: each setting as the
# chosen API received it, and the units with the parameters each one all-gathers.

# %%
import fsdp_guide
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from fsdp_guide import launch, shard
from fsdp_guide.table import Table
from IPython.display import display

fsdp_config = {
    "sharding_strategy": "FULL_SHARD",
    "min_params": 1e8,
    "cpu_offload": False,
    "mixed_precision": "DEFAULT",
    "backward_prefetch": "BACKWARD_POST",
    "activation_checkpointing": False,
    "activation_cpu_offload": False,
    "verbose": True,
}


class Model(nn.Module):
    def __init__(self, width=32, depth=3):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)
        )
        self.head = nn.Linear(width, 4)
        self.register_buffer("temperature", torch.tensor(2.0))  # a buffer, to see its dtype

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x) / self.temperature

    def fsdp_wrap_fn(self, module):
        return module in self.blocks

    def activation_checkpointing_fn(self, module):
        return module in self.blocks


def apply_config(api, config):
    device = fsdp_guide.device()
    model = shard(Model(), config, api=api)
    model(torch.randn(4, 32).to(device)).sum().backward()  # it trains


for api, config in (
    ("fsdp2", fsdp_config),
    ("fsdp1", {**fsdp_config, "activation_checkpointing": True}),
):
    launch(apply_config, api, config, output="rank0")

# %% [markdown]
# `min_params` is 1e8, so no module is a unit by size: the blocks are units because
# `fsdp_wrap_fn` says so, and the head stays in the root unit. With
# `activation_checkpointing` on, each unit is checkpointed *inside* its FSDP wrapper
# (the order the {ref}`checkpointing tutorial <tutorial-checkpoint-placement>` shows is cheaper).
# `DEFAULT` computes in bfloat16 and reduces gradients in float32; `precision: "auto"`
# (the default) picks bfloat16 on any CPU (torch computes bfloat16 on every CPU: natively
# with the AVX512-BF16 or AMX instructions, otherwise emulated) and on CUDA GPUs of
# compute capability 8.0 or newer, float16 otherwise
# ({func}`fsdp_guide.precision.low_precision_dtype`).
#
# ## What each sharding strategy stores and sends
#
# One step of each strategy on 4 ranks, in full precision so that the result can be
# compared with one process exactly: the share of the parameters a rank keeps between
# steps, the collectives of one forward and backward, and the difference of the loss
# after one SGD step from that of one process doing the same.

# %%
from torch.distributed.tensor.debug import CommDebugMode

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")


def stored_share(model):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    full = sum(p.numel() for p in Model().parameters())
    units = FSDP.fsdp_modules(model)
    if units:  # FSDP1: each unit's flat parameter holds this rank's shard
        return sum(u._flat_param.numel() for u in units if u._flat_param is not None) / full
    return sum(p.to_local().numel() for p in model.parameters()) / full


def one_step(model, x, y):
    with CommDebugMode() as comm:
        F.mse_loss(model(x), y).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    loss = F.mse_loss(model(x), y)  # after the step
    counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    # c10d's names and the functional ones
    kinds = {
        "all-gather": ("allgather", "all_gather"),
        "reduce-scatter": ("reduce_scatter",),
        "all-reduce": ("allreduce", "all_reduce"),
    }
    sent = {
        kind: sum(n for op, n in counts.items() if any(name in op for name in names))
        for kind, names in kinds.items()
    }
    unclassified = [op for op in counts if not any(name in op for name in sum(kinds.values(), ()))]
    assert not unclassified, f"a collective this table does not name: {unclassified}"
    return loss, sent


def strategy_table(api):
    device = fsdp_guide.device()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)
    x, y = x.to(device), y.to(device)
    one_process = Model().to(device)
    F.mse_loss(one_process(x), y).backward()
    torch.optim.SGD(one_process.parameters(), lr=0.1).step()
    reference = F.mse_loss(one_process(x), y).item()
    my_rows = slice(dist.get_rank() * 2, dist.get_rank() * 2 + 2)
    rows = []
    for strategy in STRATEGIES:
        # HYBRID_SHARD: 2 groups of 2 ranks
        config = {
            "sharding_strategy": strategy,
            "mixed_precision": "FULL",
            "data_parallel_shard_degree": 2,
        }
        model = shard(Model(), config, api=api)
        share = stored_share(model)  # between steps
        loss, sent = one_step(model, x[my_rows], y[my_rows])
        loss = loss.detach().clone()
        dist.all_reduce(loss)  # the mean over ranks is the loss of the whole batch
        rows.append((strategy, share, sent, abs(loss.item() / 4 - reference)))
    return rows


collectives, rows = {}, []
for api in ("fsdp2", "fsdp1"):
    for strategy, share, sent, error in launch(strategy_table, api, world_size=4, output="none")[0]:
        collectives[api, strategy] = sent
        counts = [sent["all-gather"], sent["reduce-scatter"], sent["all-reduce"]]
        rows.append([api, strategy, f"{share:.3f}", *counts, f"{error:.1e}"])
header = [
    "API",
    "strategy",
    "stored",
    "all-gathers",
    "reduce-scatters",
    "all-reduces",
    "loss vs 1 process",
]
display(Table(header, rows))

from myst_nb import glue  # the count the text below quotes, from this table

glue("full_shard_all_gathers", collectives["fsdp2", "FULL_SHARD"]["all-gather"], display=False)

# %% [markdown]
# - `FULL_SHARD` (ZeRO-3) keeps a quarter and all-gathers each unit twice, once for
#   forward and again for backward, because it frees the gathered parameters after
#   forward; except the root unit, whose backward comes first: both APIs keep it
#   gathered ({glue:text}`full_shard_all_gathers` all-gathers for 4 units: this run's count, glued from the table by
#   myst-nb's `glue`, which JupyterLab does not render; read it in the table).
# - `SHARD_GRAD_OP` (ZeRO-2) keeps them gathered from forward to backward: one
#   all-gather per unit instead of two, for more memory during the step.
# - `NO_SHARD` is DDP: a full copy, gradients all-reduced. (`shard` gives FSDP2 a
#   `(replicate, shard)` mesh with shards of one rank. torch 2.13's `fully_shard` also has a
#   replicate-only mode, `dp_mesh_dims=DataParallelMeshDims(replicate=...)`, for parameters
#   that are DTensors on that mesh already: `_get_mesh_info_from_named_dims` in
#   `torch/distributed/fsdp/_fully_shard/_fsdp_init.py`; not used here.) For FSDP1's
#   `NO_SHARD`, torch prints the `FutureWarning` shown above the table: it deprecates
#   that strategy and recommends `DistributedDataParallel` instead (raised in
#   `_init_core_state`, `torch/distributed/fsdp/_init_utils.py`).
# - `HYBRID_SHARD` shards inside groups of `data_parallel_shard_degree` ranks (by default
#   the ranks of one node) and replicates across the groups: half of the parameters on
#   each of the 4 ranks here, with a reduce-scatter inside the group and an all-reduce
#   across groups.
#
# The loss after a step is the same for all of them: they trade memory for
# communication, and do not change the mathematics.
#
# The `UserWarning`s printed with the table (the collectives are counted with it; the hook's with both APIs) come from `CommDebugMode`, not from the model. On
# entry it registers a full backward pre-hook on every module (`_CommModeModuleTracker.__enter__`
# in `torch/distributed/tensor/debug/_comm_mode.py`), and torch runs such hooks by passing each
# module's output through an identity autograd function (`BackwardHook` in
# `torch/utils/hooks.py`, `BackwardHookFunction`): FSDP2 then sees a view as the unit's output
# and warns, and the hook warns that it fires where no input of the module requires grad.
#
# ## Mixed precision presets: the dtypes that actually ran
#
# {func}`fsdp_guide.precision.record_dtypes` records the dtype of every matmul and
# collective as it runs, after FSDP's casts. For each preset, on 2 ranks:

# %%
from fsdp_guide.precision import record_dtypes

PRESETS = (("FULL", "bf16"), ("DEFAULT", "bf16"), ("PURE", "bf16"), ("DEFAULT", "fp16"))


def preset_dtypes(api):
    device = fsdp_guide.device()
    rows = []
    for preset, precision in PRESETS:
        config = {"mixed_precision": preset, "precision": precision}
        model = shard(Model(), config, api=api)
        seen = {}

        # in the root's forward, after FSDP's casts
        def buffer_dtype(module, args, seen=seen, model=model):
            seen["buffer"] = model.temperature.dtype

        model.head.register_forward_pre_hook(buffer_dtype)
        with record_dtypes() as dtypes:
            model(torch.randn(4, 32).to(device)).float().sum().backward()
        rows.append(
            (
                preset,
                precision,
                dtypes.get("forward", "matmul"),
                dtypes.get("backward", "matmul"),
                dtypes.get("backward", "reduce-scatter"),
                str(seen["buffer"]).removeprefix("torch."),
            )
        )
    return rows


rows = []
for api in ("fsdp2", "fsdp1"):
    rows += [[api, *row] for row in launch(preset_dtypes, api, output="none")[0]]
header = ["API", "preset", "low", "forward matmul", "grad matmul", "reduce-scatter", "buffer"]
display(Table(header, rows))

# %% [markdown]
# `FULL` is all float32. `DEFAULT` computes forward and backward in the low-precision
# dtype and reduces gradients in float32; `PURE` reduces them in low precision too,
# halving the bytes of the reduction (what that does to accuracy is not measured here).
# The difference between the APIs is the buffer: FSDP1 casts buffers to `buffer_dtype`;
# FSDP2's `MixedPrecisionPolicy` has no buffer dtype, so they keep their own. `precision`
# picks the low dtype for the whole dictionary: `"auto"` is bfloat16 on any CPU and on
# CUDA from compute capability 8.0, otherwise float16.
#
# ## Mistakes say what would be right
#
# Every check that needs no process group is in {func}`fsdp_guide.config.validate`,
# which `shard` calls first; a mistake is a `ValueError` that names the key, lists the
# valid choices and suggests the closest one:

# %%
from fsdp_guide.config import validate

for mistake in (
    {"sharding_stratgy": "FULL_SHARD"},
    {"sharding_strategy": "FULL_SHRAD"},
    {"mixed_precision": "DEFALUT"},
    {"min_params": "1e8"},
):
    try:
        validate(mistake)
    except ValueError as err:
        print(f"{str(mistake)}\n  -> {type(err).__name__}: {err}")

# %% [markdown]
# Settings that pass the checks but cannot work together fail on the ranks, before any
# sharding, with the same kind of message:


# %%
def mistakes():
    messages = []
    hybrid_in_threes = {"sharding_strategy": "HYBRID_SHARD", "data_parallel_shard_degree": 3}
    for config, api in (
        (hybrid_in_threes, "fsdp2"),
        ({"backward_prefetch": "NONE"}, "fsdp2"),
        ({"cpu_offload": True}, "fsdp1"),
    ):
        try:
            shard(Model(), config, api=api)
        except ValueError as err:
            messages.append(f"{api}: {type(err).__name__}: {err}")
    return messages


for message in launch(mistakes, output="none")[0]:
    print(message, end="\n\n")

# %% [markdown]
# (fsdp-config-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/fsdp_config.py`.
# Its `fully_shard_kwargs` turns the dictionary's `sharding_strategy`, `mixed_precision` and
# `cpu_offload` into `fully_shard`'s `mesh`, `reshard_after_forward`, `MixedPrecisionPolicy` and
# `CPUOffloadPolicy` by hand, as {ref}`fsdp-config-reference` maps them; rank 0 prints the dtype the
# forward computed in, whether the gathered weights were freed after forward, and the largest
# relative difference of the losses from float32 training in one process. The tests run it on 2 CPU
# ranks and check bfloat16, freed, and a difference below 2e-2 (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/fsdp_config.py
# :language: python
# ```

# %% [markdown]
# (fsdp-config-tips)=
# ## The tips behind this
#
# - {ref}`tip-fsdp-config`
# - {ref}`tip-mixed-precision-presets`
# - {ref}`tip-checkpoint-inside-unit`
#
# Every key, its FSDP1 argument and its FSDP2 equivalent: {ref}`fsdp-config-reference`.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("fsdp_config")
