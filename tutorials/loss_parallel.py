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
# (tutorial-loss-parallel)=
# # The embedding and the output layer under TP: loss parallel
#
# **What you will learn**
#
# - the token embedding and the output layer split by vocabulary (or by dimension), and
#   what each plan runs and returns;
# - loss parallel: the cross-entropy computed on vocabulary-split logits, never gathered,
#   with one process's loss and gradients.
#
# **What you need**: a CPU; 4 processes on gloo; about 10 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The
# worker code is written to run unchanged with one GPU per rank (NCCL): the mesh is built
# on {func}`fsdp_guide.device`'s type.
# The tips it demonstrates are listed {ref}`at the end <loss-parallel-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`loss-parallel-script` ({download}`download <scripts/loss_parallel.py>`).

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
from fsdp_guide.compare import largest_difference
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


# %% [markdown]
# (tp-edge-layers)=
# ## The embedding and the output layer
#
# The {ref}`plan <tp-plan>` leaves the token embedding (256 x 32) and the output layer tied to it
# whole on every rank of a TP group. Both can be split by TP too, as torchtitan's plans do
# (`apply_tp` in `torchtitan/models/llama3/infra/parallelize.py`). An `nn.Embedding`
# takes `RowwiseParallel(input_layouts=Replicate())`: its rows are the vocabulary, each
# rank looks up the tokens in its half and contributes zeros for the others, summed
# across the group (`_MaskPartial` in `torch/distributed/tensor/placement_types.py`). Or
# it takes `ColwiseParallel()`: each rank holds half of every token's vector. The output
# layer takes `ColwiseParallel`: its rows are the vocabulary too, so each rank computes the
# logits of its half. Each plan on a fresh module, on a rank's 4 x 16 tokens (or
# 4 x 16 x 32 hidden states for the output layer), against the unsharded module's output
# split as the plan says it should be:

# %%
import torch.nn as nn
from fsdp_guide.collectives import count_collectives
from fsdp_guide.table import Table
from IPython.display import display
from myst_nb import glue
from torch.distributed.tensor import DTensor, distribute_tensor


def embedding():
    return nn.Embedding(CONFIG.vocab_size, CONFIG.n_embd)


def output_layer():
    return nn.Linear(CONFIG.n_embd, CONFIG.vocab_size, bias=False)


EDGE_PLANS = {  # name: (module, plan, the layout its output should have over tp)
    "embedding, vocabulary-split": (
        embedding,
        RowwiseParallel(input_layouts=Replicate()),
        Replicate(),
    ),
    "embedding, vocabulary-split, output along the sequence": (
        embedding,
        RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        Shard(1),
    ),
    "embedding, dimension-split": (embedding, ColwiseParallel(), Shard(-1)),
    "output layer, logits gathered": (
        output_layer,
        ColwiseParallel(output_layouts=Replicate()),
        Replicate(),
    ),
    "output layer, logits left split": (
        output_layer,
        ColwiseParallel(use_local_output=False),
        Shard(-1),
    ),
}


def on_a_rank(t):
    """A tensor's shape on this rank, and its placement over tp if it is a DTensor."""
    if isinstance(t, DTensor):
        return f"{tuple(t.to_local().shape)} {t.placements[0]!r}"
    return f"{tuple(t.shape)} Tensor"


def edge_layer_layouts():
    mesh = make_mesh()
    tokens, _ = my_rows(mesh)
    hidden = torch.randn(
        *tokens.shape, CONFIG.n_embd, generator=torch.Generator().manual_seed(0)
    ).to(tokens.device)
    result = {}
    for name, (make, plan, layout) in EDGE_PLANS.items():
        torch.manual_seed(0)
        module = make().to(fsdp_guide.device())
        x = tokens if isinstance(module, nn.Embedding) else hidden
        whole = module(x).detach()
        parallelize_module(module, mesh["tp"], plan)
        with count_collectives(mesh) as seen:
            out = module(x)
        local = out.to_local() if isinstance(out, DTensor) else out
        # this rank's piece
        expected = distribute_tensor(whole, mesh["tp"], [layout], src_data_rank=None).to_local()
        result[name] = (
            on_a_rank(module.weight),
            on_a_rank(out),
            seen.rows(),
            (local - expected).abs().max().item(),
            fsdp_guide.describe_sharding(module),  # for the figure below
        )
    return result


edge_ranks = launch(edge_layer_layouts, world_size=4, output="none")
edges = edge_ranks[0]
header = [
    "plan",
    "weight on a rank",
    "output on a rank",
    "tp collectives (kind, n, bytes)",
    "vs unsharded",
]
table = []
for name, (weight, out, seen, gap, _) in edges.items():
    collectives = ", ".join(f"{kind} {n} {nbytes}" for _, kind, n, nbytes in seen) or "none"
    table.append([name, weight, out, collectives, f"{gap:.0e}"])
display(Table(header, table))  # an HTML table on the site, aligned text elsewhere
# (dim, kind, n, bytes)
glue("tp_emb_reduce_bytes", edges["embedding, vocabulary-split"][2][0][3], display=False)
glue("tp_logits_gather_bytes", edges["output layer, logits gathered"][2][0][3], display=False)

# %% tags=["hide-input"] mystnb={"image": {"alt": "The 256 by 32 weights of the embedding, split two ways, and of the output layer, coloured by the rank of a TP group that holds each part: vocabulary-split, tp rank 0 holds rows 0 to 127 and tp rank 1 rows 128 to 255; dimension-split, each holds 16 of the 32 columns of every row; the output layer is split by rows, as the vocabulary-split embedding."}}
import matplotlib.pyplot as plt
from fsdp_guide.describe import draw_sharding

shown = [  # one TP group, ranks 0 and 1 (ranks 2 and 3 hold the same, for the other dp rank)
    "embedding, vocabulary-split",
    "embedding, dimension-split",
    "output layer, logits left split",
]
fig, axes = plt.subplots(1, 3, figsize=(9, 4))
for ax, plan in zip(axes, shown):
    draw_sharding(
        [edge_ranks[rank][plan][4] for rank in (0, 1)], "weight", lambda r: f"tp {r}", ax=ax
    )
    ax.set(title=plan.split(",")[0] + ",\n" + plan.split(", ")[1], ylabel="dim 0: the vocabulary")
    ax.set_xlabel("dim 1: the hidden features")
fig.tight_layout()

# %% [markdown]
# - The vocabulary-split embedding holds half the rows and all-reduces its output (a
#   rank's 4 x 16 x 32 floats, {glue:text}`tp_emb_reduce_bytes` bytes); with `output_layouts=Shard(1)` it
#   reduce-scatters it instead and hands on half the sequence, which is what a
#   sequence-parallel stack wants next. This GPT adds the position embedding, whole
#   sequence, to the token embedding's output, so the plan keeps `Replicate()` there
#   and lets `blocks.0`'s `PrepareModuleInput` take the rank's half.
# - The dimension-split embedding runs no collective: each rank returns half of every
#   vector (`Shard(-1)`, returned as a plain tensor by default), which the next layer must
#   expect.
# - The output layer's `ColwiseParallel` holds half the vocabulary's rows. Gathered
#   (`output_layouts=Replicate()`), every rank gets all 256 logits of every token, one
#   all-gather of {glue:text}`tp_logits_gather_bytes` bytes for these 64 tokens; left split as a `DTensor`
#   (`use_local_output=False`), each rank holds the logits of its half of the vocabulary,
#   and nothing moves. Every row matches the unsharded module.
#
# (tp-loss-parallel)=
# ## Loss parallel: the cross-entropy on vocabulary-split logits
#
# The logits hold a value per vocabulary entry for every token (here 256, against 32
# hidden features), and gathering them to compute the loss undoes the output layer's
# split. Inside `torch.distributed.tensor.parallel.loss_parallel()`, `F.cross_entropy` accepts logits
# split along the vocabulary (`Shard(-1)`) and computes the loss from per-token maxima,
# sums of exponentials and target logits reduced across the TP group (`loss_parallel` in
# `torch/distributed/tensor/parallel/loss.py`); the `backward()` must run inside it too.
# The GPT keeps its tied weight: both plans split it by rows, each makes its own
# `DTensor` of it, and the two are tied again. One forward and backward on TP alone over
# all 4 ranks (each rank a quarter of the vocabulary), three ways, and the loss parallel
# one again under FSDP x TP; the global batch of 8 as before:

# %%
import contextlib

from torch.distributed.tensor.parallel import loss_parallel


def apply_vocab_parallel(model, tp_mesh, shard_logits=True):
    """The token embedding and the output layer split by vocabulary; logits left split (loss_parallel) or gathered."""
    # as torchtitan's apply_tp
    output_plan = ColwiseParallel(
        output_layouts=Shard(-1) if shard_logits else Replicate(), use_local_output=not shard_logits
    )
    parallelize_module(
        model,
        tp_mesh,
        {"tok_emb": RowwiseParallel(input_layouts=Replicate()), "lm_head": output_plan},
    )
    untied = model.lm_head.weight is not model.tok_emb.weight
    # each plan made its own DTensor of the tied weight: tie them again
    model.lm_head.weight = model.tok_emb.weight
    return untied


def mean_over_dp(loss, mesh):
    loss = loss.detach().clone()
    dist.all_reduce(loss, group=mesh.get_group("dp"))
    return (loss / mesh["dp"].size()).item()


def full_gradients(model):
    return {
        name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        for name, p in model.named_parameters()
    }


def loss_with_output_plan(shape, shard_logits):
    """One forward and backward. shard_logits None: the blocks' plan; False: logits gathered; True: loss parallel."""
    mesh = make_mesh(*shape)
    model = build_model()
    apply_tp(model, mesh["tp"])
    untied = shard_logits is not None and apply_vocab_parallel(model, mesh["tp"], shard_logits)
    if mesh["dp"].size() > 1:
        apply_fsdp(model, mesh["dp"])
    with (
        count_collectives(mesh) as seen,
        loss_parallel() if shard_logits else contextlib.nullcontext(),
    ):
        logits, loss = model(*my_rows(mesh))
        loss.backward()  # inside loss_parallel too
    local = logits.to_local() if isinstance(logits, DTensor) else logits
    loss = mean_over_dp(loss.full_tensor() if isinstance(loss, DTensor) else loss, mesh)
    grads = {name: g.cpu() for name, g in full_gradients(model).items()}
    return (
        untied,
        model.lm_head.weight is model.tok_emb.weight,
        local.nbytes,
        logits.numel() * logits.element_size(),
        [row for row in seen.rows() if row[0] == "tp"],
        loss,
        grads if dist.get_rank() == 0 else None,
    )


OUTPUT_PLANS = {
    "TP alone, the blocks' plan": ((1, 4), None),
    "TP alone, logits gathered": ((1, 4), False),
    "TP alone, loss parallel": ((1, 4), True),
    "FSDP x TP, loss parallel": ((2, 2), True),
}


def every_output_plan():
    return {name: loss_with_output_plan(*setup) for name, setup in OUTPUT_PLANS.items()}


one = build_model()  # one process on the global batch: the loss and gradients to match
_, loss = one(*global_batch())
loss.backward()
one_loss = loss.item()
print(f"one process on the global batch: loss {one_loss:.7f}")
results = launch(every_output_plan, world_size=4, output="none")[0]
header = ["plan", "logits on a rank / full (bytes)", "tp all-gathers (n, bytes)"]
header += ["tp all-reduces (n, bytes)", "loss", "grads vs one process", "the tied weight"]
table = []
for name, (untied, tied, held, full, rows, loss, grads) in results.items():
    cells = {kind: f"{n} {nbytes}" for _, kind, n, nbytes in rows}
    difference = largest_difference((grads[n], p.grad) for n, p in one.named_parameters())
    table.append(
        [name, f"{held} / {full}", cells.get("all-gather", "-"), cells.get("all-reduce", "-")]
        + [
            f"{loss:.7f}",
            f"{difference:.1e}",
            f"untied by the plans, tied again: {tied}" if untied else "-",
        ]
    )
display(Table(header, table))


def tp_collectives(plan, kind):
    """(n, bytes) of one plan's tp collectives of a kind, as in the table above."""
    return next((n, nbytes) for _, k, n, nbytes in results[plan][4] if k == kind)


PAGE, GATHERED, PARALLEL, _ = OUTPUT_PLANS
gathered_n, gathered_bytes = tp_collectives(GATHERED, "all-reduce")
parallel_n, parallel_bytes = tp_collectives(PARALLEL, "all-reduce")
extra_gather = tp_collectives(GATHERED, "all-gather")[1] - tp_collectives(PAGE, "all-gather")[1]
glue("tp_logits_bytes", results[PAGE][2], display=False)  # the logits on a rank, the blocks' plan
glue("tp_extra_gather_bytes", extra_gather, display=False)
glue("tp_hidden_reduce_bytes", gathered_bytes // gathered_n, display=False)  # each all-reduce's
# each of loss parallel's own all-reduces
lp_reduce = (parallel_bytes - gathered_bytes) // (parallel_n - gathered_n)
glue("tp_lp_reduce_bytes", lp_reduce, display=False)

# %% [markdown]
# - With the blocks' plan every rank computes all the logits of all 8 sequences
#   ({glue:text}`tp_logits_bytes` bytes) from the whole output layer. Split and gathered, a rank computes a
#   quarter and all-gathers the rest: one more all-gather, of the full {glue:text}`tp_extra_gather_bytes` bytes.
#   The split adds two all-reduces of the hidden states (2 x {glue:text}`tp_hidden_reduce_bytes` bytes): the
#   embedding's output in the forward, and the output layer's input gradient in the
#   backward (`ColwiseParallel._prepare_input_fn` in `style.py` wraps the input with
#   `DTensor.from_local` as `Replicate()`, and `_FromTorchTensor.backward` in
#   `torch/distributed/tensor/_api.py` redistributes its partial gradient to that).
# - With loss parallel a rank holds a quarter of the logits and they are never
#   gathered: its all-gathers are exactly the blocks' plan's, and beside those two
#   all-reduces it runs three more of {glue:text}`tp_lp_reduce_bytes` bytes, one float per token: the
#   maximum and the sum of exponentials of the log-softmax (`_log_softmax` in
#   `torch/distributed/tensor/parallel/loss.py`) and the target's log-probability
#   (`_nll_loss_forward`, same file).
# - The loss and every gradient equal one process's up to float32 rounding, the tied
#   weight's included (the plans untie it; the table's `True` is the weight tied again),
#   with FSDP over `dp` on top as well. Under loss parallel the loss is a `DTensor`,
#   `Replicate()` over `tp` (`_nll_loss_forward_handler`, same file): `full_tensor()`
#   reads it.

# %% [markdown]
# (loss-parallel-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/loss_parallel.py`.
# A small language model's embedding and output layer are split by vocabulary over 2 ranks, and
# five AdamW steps compute the cross-entropy and its backward inside `loss_parallel()`. Rank 0
# prints the logits it holds (half the vocabulary, a `DTensor` sharded on its last dimension)
# and the largest differences between the run's losses and weights and one process's. The tests
# run this file under torchrun on 2 CPU ranks and check the logits' shape and placement and both
# differences, at most 1e-5 (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/loss_parallel.py
# :language: python
# ```

# %% [markdown]
# (loss-parallel-tips)=
# ## The tips behind this
#
# - {ref}`tip-loss-parallel`

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("loss_parallel")
