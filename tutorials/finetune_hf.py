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
# (tutorial-finetune-hf)=
# # Fine-tuning a Hugging Face model: weights in, train, weights out
#
# **What you will learn**
#
# - three ways to load a pretrained `transformers` model into FSDP2 on every rank, and
#   what each costs in host memory, measured: every rank reading the whole file, rank 0
#   reading and broadcasting into a model built on the `meta` device
#   ({func}`fsdp_guide.hf.from_pretrained`), and each rank reading only its own slices;
# - that fine-tuning the sharded model computes what one process computes;
# - how to write the sharded model back, gathered to rank 0, as an ordinary Hugging Face
#   directory ({func}`fsdp_guide.hf.save_pretrained`) that `from_pretrained` loads in one
#   process, the tied pair written once.
#
# **What you need**: a CPU; 2 processes on gloo; Linux (the memory readings come from
# `/proc`); `transformers` and `safetensors` (the package's `hf` extra); about 15 seconds on 2 CPU cores ({ref}`measured <measured-times>`). Nothing is downloaded: the "pretrained" model is a small Llama built from a
# config with a fixed seed. The same worker code is written to run unchanged with one GPU
# per rank (NCCL): the shards live on {func}`fsdp_guide.device`. The tips are listed
# {ref}`at the end <finetune-hf-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`finetune-hf-script` ({download}`download <scripts/finetune_hf.py>`).

# %%
import os
import sys
import tempfile
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing is downloaded

import warnings

# tqdm's notebook import: no widgets here
warnings.filterwarnings("ignore", message="IProgress not found")

from fsdp_guide.fp8 import quiet_torchao

quiet_torchao()  # saving imports torchao, whose import logs about CUDA kernels a CPU cannot load

import torch
import transformers

transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bars in the outputs
print(
    f"torch {torch.__version__}, transformers {transformers.__version__}, Python {sys.version.split()[0]}"
)

# %% [markdown]
# ## A "pretrained" model on disk
#
# A Llama-architecture model with 8 decoder layers, its input embedding and output layer
# tied, written by `save_pretrained` as a checkpoint from the Hub would be: `config.json`
# and `model.safetensors`. (A second, tiny one serves to warm up the measurements below.)

# %%
from transformers import LlamaConfig, LlamaForCausalLM


def save_llama(path, hidden_size, layers):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=8192,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    # the dtype most checkpoints on the Hub are stored in
    model.to(torch.bfloat16).save_pretrained(path)
    return model


workdir = Path(tempfile.mkdtemp())
path = workdir / "llama"
pretrained = save_llama(path, hidden_size=512, layers=8)
warmup = workdir / "warmup"  # a tiny one, loaded first so imports do not count in the measurement
save_llama(warmup, hidden_size=16, layers=1)

pretrained.float()  # trained in fp32 below
model_mb = sum(p.numel() * 4 for p in pretrained.parameters()) / 2**20
print(
    f"{sum(p.numel() for p in pretrained.parameters()) / 1e6:.1f}M parameters: {model_mb:.0f} MiB in fp32, "
    f"{(path / 'model.safetensors').stat().st_size / 2**20:.0f} MiB on disk in bf16"
)
print(sorted(f.name for f in path.iterdir()))

# %% [markdown]
# (finetune-hf-loading)=
# ## Three ways in, measured
#
# Each rank records the rise of its resident memory while it loads (Linux's peak RSS,
# `VmHWM`, reset just before, and the private part; {func}`fsdp_guide.memory.host_peak_rise`)
# and the bytes of the parameters it keeps. The first way is
# the one most scripts start with: every rank calls `transformers`' `from_pretrained`,
# holding the whole model, and only then shards it. The other two are
# {func}`fsdp_guide.hf.from_pretrained`: the model is built on the `meta` device (no
# memory), sharded, and only the shards are allocated; then either rank 0 reads the file
# and torch broadcasts each tensor (`read="rank0"`, the default), or each rank reads just
# its own slices of the safetensors file (`read="sharded"`).

# %%
from fsdp_guide import launch
from fsdp_guide.compare import largest_difference
from fsdp_guide.memory import host_peak_rise  # VmHWM, and RssAnon sampled every millisecond
from fsdp_guide.table import Table
from IPython.display import display


def every_rank_reads(path):
    import fsdp_guide
    import torch
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    # the whole model, on every rank
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model.to(fsdp_guide.device())


def load_and_measure(how, path, warmup):
    import torch
    from fsdp_guide.hf import from_pretrained

    loaders = {
        "every rank reads": every_rank_reads,  # fp32 parameters from the bf16 file, in each way
        "rank 0 reads, broadcasts": lambda p: from_pretrained(p, read="rank0", dtype=torch.float32),
        "each rank reads its slices": lambda p: from_pretrained(
            p, read="sharded", dtype=torch.float32
        ),
    }
    loaders[how](warmup)  # imports and first calls, on a tiny model
    model, rss, private = host_peak_rise(lambda: loaders[how](path))
    kept = sum(p.to_local().numel() * p.element_size() for p in model.parameters()) / 2**20
    return rss, private, kept


ways = ["every rank reads", "rank 0 reads, broadcasts", "each rank reads its slices"]
measured = {
    how: launch(load_and_measure, how, path, warmup, world_size=2, output="none") for how in ways
}

from myst_nb import glue  # the figures the text below quotes, taken from this run

print(
    f"peak rise while loading, in model sizes ({model_mb:.0f} MiB); all resident memory / the private part"
)
in_sizes, rows = {}, []
for how, ranks in measured.items():
    (rss0, private0, kept), (rss1, private1, _) = in_sizes[how] = tuple(
        tuple(v / model_mb for v in r) for r in ranks
    )
    rows.append(
        [how, f"{rss0:.1f} / {private0:.1f}", f"{rss1:.1f} / {private1:.1f}", f"{kept:.2f}"]
    )
display(Table(["loading", "rank 0", "rank 1", "shard kept"], rows))
every, broadcast, sliced = (in_sizes[how] for how in ways)
glue("every_rank_private", min(every[0][1], every[1][1]), display=False)
glue("rank0_mapped", broadcast[0][0] - broadcast[0][1], display=False)
glue("rank1_extra", broadcast[1][1] - broadcast[0][2], display=False)
glue("sliced_resident", min(sliced[0][0], sliced[1][0]), display=False)

# %% [markdown]
# The figures in this text are this run's, taken from the table by myst-nb's `glue`; in
# JupyterLab, which does not render glue's roles, read them from the table above.
#
# Read the private part first: it is memory the rank allocated, which nothing else can use
# and which the kernel cannot drop under pressure, as it can clean file pages (sampled every
# millisecond, so a lower bound on the peak). When every rank reads, each builds the whole
# fp32 model ({glue:text}`every_rank_private:.1f` model sizes or more, on *each* rank: N copies on a machine of N ranks)
# before sharding frees all but its half. With
# {func}`fsdp_guide.hf.from_pretrained`, rank 0's full copy is the file itself: safetensors
# maps it rather than copying it, so it shows in the resident total only ({glue:text}`rank0_mapped:.1f` model
# sizes more than the private part; the bf16 file is 0.5), as file pages the kernel shares and can drop. Rank 1 receives the
# broadcast one tensor at a time, each allocated whole before it copies out its slice
# (its extra over its shard, {glue:text}`rank1_extra:.1f` model sizes in this run: a tensor, never the model, though
# it varies from run to run, and a busy machine's sampling can miss it; `_broadcast_state_dict` and `_broadcast_tensors` in
# `torch/distributed/_state_dict_utils.py`). Reading its own slices, each rank's private
# memory is its shard; the resident, {glue:text}`sliced_resident:.1f` here, is more than that private
# part: the pages of the file mapped around those slices.

# %% mystnb={"image": {"alt": "Grouped bars of the peak memory rise per rank while loading, in model sizes, private part and all resident memory, for the three ways of loading: every rank reads, rank 0 reads and broadcasts, each rank reads its slices."}}
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(9, 3))
labels = [f"{how}\nrank {r}" for how in ways for r in (0, 1)]
rss = [measured[how][r][0] / model_mb for how in ways for r in (0, 1)]
private = [measured[how][r][1] / model_mb for how in ways for r in (0, 1)]
x = range(len(labels))
ax.bar([i - 0.2 for i in x], private, width=0.4, label="private (allocated)")
ax.bar([i + 0.2 for i in x], rss, width=0.4, label="all resident (with mapped file pages)")
ax.axhline(0.5, color="gray", linestyle=":", label="the shard each rank keeps")
ax.set_xticks(list(x), labels, fontsize=7)
ax.set_ylabel("peak rise, model sizes")
ax.legend(fontsize=7)
fig.tight_layout()

# %% [markdown]
# Which to use: `read="rank0"` (the default) when the files are on rank 0's machine only,
# or on a slow shared file system that N ranks reading at once would crowd; it costs one
# broadcast of the model, and each rank briefly holds the largest single tensor whole.
# `read="sharded"` when every machine sees the files (a shared file system) and the model
# is large: no broadcast, and each rank allocates only its slices. Avoid letting every rank
# build the full model: its peak is N copies per machine, before the first step.
#
# (finetune-hf-check)=
# ## Fine-tune, and check against one process
#
# Two ranks, each on its half of the batch, train the sharded model a few steps with AdamW
# on one batch it can memorise; one process trains the same model on the whole batch. The
# loss is the mean over tokens, and every row has the same number of tokens, so the two
# losses are the same number computed two ways.

# %%
STEPS = 5
tokens = torch.randint(0, 8192, (4, 32), generator=torch.Generator().manual_seed(0))


def fine_tune(path, tokens, out):
    import fsdp_guide
    import torch
    import torch.distributed as dist
    from fsdp_guide.hf import from_pretrained, save_pretrained

    device = fsdp_guide.device()
    model = from_pretrained(path, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = tokens[rank::world].to(device)  # this rank's rows of the batch
    losses = []
    for _ in range(STEPS):
        loss = model(mine, labels=mine).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(mean := loss.detach().clone(), op=dist.ReduceOp.AVG)
        losses.append(mean.item())
    save_pretrained(model, out)  # every rank calls it; rank 0 writes
    with torch.no_grad():
        logits = model(tokens.to(device)).logits
    output_layer = model.lm_head.weight.full_tensor().cpu()  # a collective: every rank calls it
    return losses, logits.cpu(), output_layer if rank == 0 else None


tuned = workdir / "llama-tuned"
(sharded_losses, sharded_logits, trained_output_layer), _ = launch(
    fine_tune, path, tokens, tuned, world_size=2, output="none"
)

single = pretrained  # the same weights, in fp32, in this process
optimizer = torch.optim.AdamW(single.parameters(), lr=1e-3)
single_losses = []
for _ in range(STEPS):
    loss = single(tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    single_losses.append(loss.item())

pairs = enumerate(zip(sharded_losses, single_losses))
rows = [[step, f"{a:.6f}", f"{b:.6f}"] for step, (a, b) in pairs]
display(Table(["step", "loss, 2 ranks", "loss, 1 process"], rows))
relative = [abs(a - b) / b for a, b in zip(sharded_losses, single_losses)]
print(
    f"relative difference at the first step: {relative[0]:.0e}; "
    f"largest relative difference: {largest_difference(zip(sharded_losses, single_losses), relative=True):.0e}"
)

# %% [markdown]
# The same losses, to fp32 rounding (the relative differences printed above: the first
# step's, and the largest over the steps). Where the rounding comes from is not separated
# here: the sharded run averages two half-batch losses where one process takes one mean,
# and its matrix products see half as many rows. Sharding split the work, not the
# arithmetic.
#
# (finetune-hf-export)=
# ## Weights out: a directory `from_pretrained` loads
#
# `save_pretrained` above gathered the full state dict to rank 0's CPU, one parameter at a
# time (`get_model_state_dict` with `full_state_dict=True, cpu_offload=True`), and wrote it
# with `transformers`' own `save_pretrained`, each file renamed into place once all were on
# disk (other files in the directory stay). What it wrote for the tied pair is read back
# from the safetensors file's header with `safetensors.safe_open`; then one process loads
# the directory as any Hugging Face model:

# %%
from safetensors import safe_open
from transformers import AutoModelForCausalLM

print(sorted(f.name for f in tuned.iterdir()))
tied_pair = ["model.embed_tokens.weight", "lm_head.weight"]
with safe_open(tuned / "model.safetensors", framework="pt") as f:
    written = set(f.keys())
    pair = {name: f.get_tensor(name) for name in tied_pair if name in written}
names = set(pretrained.state_dict())  # the model's own names: the tied pair under both
print(
    f"{len(written)} tensors written for the {len(names)} names of the state dict; the tied pair: "
    + ", ".join(f"{name} {'written' if name in written else 'not written'}" for name in tied_pair)
)
assert pair, "neither name of the tied pair was written"
print(
    "each written equals the output layer the ranks trained:",
    all(torch.equal(t, trained_output_layer) for t in pair.values()),
    f"({sum(t.nbytes for t in pair.values()) / 2**20:.0f} MiB of the file's "
    f"{(tuned / 'model.safetensors').stat().st_size / 2**20:.0f} MiB)",
)

reloaded = AutoModelForCausalLM.from_pretrained(tuned)
with torch.no_grad():
    logits = reloaded(tokens).logits
print(
    "logits equal the sharded model's:",
    torch.equal(logits, sharded_logits),
    f"(largest difference {(logits - sharded_logits).abs().max().item():.1e})",
)

# %% [markdown]
# The file holds the tied pair once, under the embedding's name. Gathering gives each name
# of the state dict a full tensor of its own; {func}`fsdp_guide.hf.save_pretrained` points
# the names that share one parameter in the sharded model at one of them, and `transformers`
# writes a tensor shared by two names once, under the name the model declares as the one to
# keep (`remove_tied_weights_from_state_dict` in `transformers/modeling_utils.py` groups the
# state dict by storage). The tensor written equals the output layer the two ranks trained:
# had sharding untied the pair, the embedding and the output layer would have trained apart
# and this would print `False`. On loading, `from_pretrained` fills `lm_head.weight` by
# tying it to the embedding, because the config says `tie_word_embeddings=True`
# (`PreTrainedModel.tie_weights`, same file); the reloaded model's logits equal the sharded
# model's exactly.
#
# Gathering puts the whole model in rank 0's memory, which a model bigger than a host
# cannot afford: {ref}`tutorial-hf-dcp-export` lets every rank write its own shards
# instead, and measures what each way costs.
#
# Last, the models this page wrote are deleted:

# %%
import shutil

shutil.rmtree(workdir)

# %% [markdown]
# (finetune-hf-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch and `transformers`:
# {download}`scripts/finetune_hf.py`. Every rank builds the same small Llama, shards it and
# trains it a few steps on its slice of the batch; the full weights are gathered to rank 0, which
# writes them with `save_pretrained` to a temporary directory, loads them back with
# `from_pretrained`, and prints the largest differences of the weights and of the logits from
# the sharded model's. The tests run this file under torchrun on 2 CPU ranks and check that the
# loss fell and that both differences are 0: the round trip is exact (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/finetune_hf.py
# :language: python
# ```

# %% [markdown]
# (finetune-hf-tips)=
# ## The tips behind this
#
# - {ref}`tip-load-pretrained-once`
# - {ref}`tip-export-safetensors`
# - {ref}`tip-check-against-one-process`: the losses above.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("finetune_hf")
