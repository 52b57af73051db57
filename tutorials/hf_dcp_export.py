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
# (tutorial-hf-dcp-export)=
# # Saving Hugging Face weights from every rank
#
# **What you will learn**
#
# - how every rank of a sharded model writes its own shards as Hugging Face safetensors
#   with `torch.distributed.checkpoint`'s `HuggingFaceStorageWriter`, rank 0 consolidating
#   them into the standard files ({func}`fsdp_guide.hf.save_pretrained` with
#   `write="sharded"`), so that `from_pretrained` loads exactly the trained weights in one
#   process, with no rank ever holding the whole model;
# - what that costs each rank in memory against gathering to rank 0, measured on 2 and 4
#   ranks;
# - DCP's background save (`dcp.async_save`) with a `DefaultStager` on a CPU.
#
# **What you need**: a CPU; 2 and 4 processes on gloo; Linux (the memory readings come from
# `/proc`); `transformers` and `safetensors` (the package's `hf` extra); about 20 seconds on 2 CPU cores ({ref}`measured <measured-times>`). Nothing is downloaded: the "pretrained" model is a small Llama built from a
# config with a fixed seed, as in {ref}`tutorial-finetune-hf`, which loads it into FSDP2 and
# writes it back by gathering to rank 0. The same worker code is written to run unchanged
# with one GPU per rank (NCCL): the shards live on {func}`fsdp_guide.device`. The tips are
# listed {ref}`at the end <hf-dcp-export-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`hf-dcp-export-script` ({download}`download <scripts/hf_dcp_export.py>`).

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
# (finetune-hf-export-sharded)=
# ## A fine-tuned model, written by every rank
#
# The "pretrained" model of {ref}`tutorial-finetune-hf`: a Llama-architecture model with 8
# decoder layers, its input embedding and output layer tied, on disk as `config.json` and
# `model.safetensors` (a second, tiny one serves to warm up the measurements below).

# %%
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM


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
model_mb = sum(p.numel() * 4 for p in pretrained.parameters()) / 2**20
print(
    f"{sum(p.numel() for p in pretrained.parameters()) / 1e6:.1f}M parameters: {model_mb:.0f} MiB in fp32"
)

# %% [markdown]
# Two ranks load it into FSDP2 ({func}`fsdp_guide.hf.from_pretrained`), train it a few steps
# with AdamW, each on its half of a batch, and write it with
# `save_pretrained(model, path, write="sharded")`: nothing is gathered; every rank writes
# its own shards with `torch.distributed.checkpoint`'s `HuggingFaceStorageWriter`
# (`save_distributed=True`), and rank 0 then consolidates them into the standard files
# (`enable_consolidation=True`), with the configs that `transformers`' `save_pretrained`
# writes when given no weights. They also save a training checkpoint, as a run does (used
# {ref}`below <hf-dcp-export-offline>`). To check the files, and only for that, the ranks then
# gather the trained weights to rank 0 and run the batch through the sharded model.

# %%
from fsdp_guide import launch

STEPS = 5
tokens = torch.randint(0, 8192, (4, 32), generator=torch.Generator().manual_seed(0))


def train_and_export(path, tokens, out):
    import fsdp_guide
    import torch
    import torch.distributed as dist
    from fsdp_guide import checkpoint
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
    save_pretrained(model, out, write="sharded")  # every rank writes its shards
    checkpoint.save(out.parent / "checkpoints", STEPS, model, optimizer)  # what a run saves
    # for the check only: every name of the state dict, the tied pair's two included, gathered
    trained = {name: t.full_tensor().cpu() for name, t in model.state_dict().items()}
    with torch.no_grad():
        logits = model(tokens.to(device)).logits
    return (losses, trained, logits.cpu()) if rank == 0 else None


tuned = workdir / "llama-tuned"
(losses, trained, sharded_logits), _ = launch(
    train_and_export, path, tokens, tuned, world_size=2, output="none"
)
print("loss per step:", " ".join(f"{loss:.4f}" for loss in losses))
print(sorted(f.name for f in tuned.iterdir()))

# %% [markdown]
# The directory holds the standard files, DCP's per-rank files deleted once consolidated.
# One process loads it as any Hugging Face model, and each of its tensors is compared with
# the weights the ranks trained, name by name (`torch.equal`, which a NaN fails), as are the
# logits:

# %%
reloaded = AutoModelForCausalLM.from_pretrained(tuned)
read = reloaded.state_dict()
print(
    f"{len(read)} tensors loaded, each equal to the trained one:",
    read.keys() == trained.keys()
    and all(torch.equal(read[name], t) for name, t in trained.items()),
    # a torch reduction, which a NaN does not skip
    f"(largest difference {torch.stack([(read[n] - t).abs().max() for n, t in trained.items()]).max():.1e})",
)
with torch.no_grad():
    logits = reloaded(tokens).logits
print(
    "tied after loading:",
    reloaded.lm_head.weight is reloaded.model.embed_tokens.weight,
    "| logits equal the sharded model's:",
    torch.equal(logits, sharded_logits),
)

# %% [markdown]
# safetensors refuses two names for one tensor in a file, so the tied pair was written
# once, under its first name (`model.embed_tokens.weight`); `from_pretrained` fills
# `lm_head.weight` by tying it to the embedding, because the config says
# `tie_word_embeddings=True`. Every tensor equals the trained one, bit for bit: the shards
# were written as they were, and consolidation only put the slices side by side.
#
# (hf-dcp-export-memory)=
# ## What it costs, against gathering to rank 0
#
# Gathering to rank 0 (`write="rank0"`, the default, and the way of
# {ref}`finetune-hf-export`) puts the whole model in one process's memory, which a model
# bigger than a host cannot afford. Both ways export the fine-tuned model here, on 2 and on
# 4 ranks, each rank's peak rise of memory measured while it writes (Linux's peak RSS,
# `VmHWM`, reset just before, and the private part; {func}`fsdp_guide.memory.host_peak_rise`),
# after a warm-up export of the tiny model:


# %%
from fsdp_guide.memory import host_peak_rise  # VmHWM, and RssAnon sampled every millisecond
from fsdp_guide.table import Table
from IPython.display import display


def export_and_measure(write, source, out, warmup):
    import time

    import torch
    from fsdp_guide.hf import from_pretrained, save_pretrained

    model = from_pretrained(source, dtype=torch.float32)
    save_pretrained(
        from_pretrained(warmup, dtype=torch.float32),
        out.with_name(out.name + "-warmup"),
        write=write,
    )

    def timed_export():
        start = time.perf_counter()
        save_pretrained(model, out, write=write)
        return time.perf_counter() - start

    return host_peak_rise(timed_export)


exports = {
    (write, world): launch(
        export_and_measure,
        write,
        tuned,
        workdir / f"export-{write}-{world}",
        warmup,
        world_size=world,
        output="none",
    )
    for world in (2, 4)
    for write in ("rank0", "sharded")
}
print(
    f"peak rise while exporting, in model sizes ({model_mb:.0f} MiB); all resident / the private part"
)
rows = []
for (write, world), ((seconds, rss0, private0), *others) in exports.items():
    rss, private = (max(rank[i] for rank in others) / model_mb for i in (1, 2))
    rank0 = f"{rss0 / model_mb:.1f} / {private0 / model_mb:.1f}"
    rows.append([f"write={write!r}", world, rank0, f"{rss:.1f} / {private:.1f}", f"{seconds:.2f}"])
display(Table(["export", "ranks", "rank 0", "other ranks, most", "seconds"], rows))


# %% [markdown]
# Gathering costs rank 0 more than the model, on 2 ranks and on 4: the full state dict
# on its CPU, and more while it is written. Written by every rank, each rank's peak is
# a multiple of its shard (the table: rank 0's and the others' against the shard of 1/2 or
# 1/4 model), so with 2 ranks it is no better than gathering, and with 4 it is lower.
#
# What goes into that peak, from the source, not separated here: each rank's file is
# serialized in memory before it is written (`safetensors.torch.save` in
# `_write_files_from_queue`, `torch/distributed/checkpoint/filesystem.py`), a shard whose
# storage is larger than its bytes is copied first (`_SerialCpuLoader`, same file; FSDP2
# pads the last rank's rows of an uneven dimension, and the intermediate size,
# `hidden_size * 8 // 3` in `save_llama` above, is odd), and rank 0 then consolidates,
# reading the shard files back one full tensor at a time (`_process_output_file` in
# `torch/distributed/checkpoint/_consolidate_hf_safetensors.py`).
#
# The private part is sampled and misses short peaks; nothing here is read through a
# memory map, so the resident peak is the one to read. The seconds are not a measure of
# throughput: the model is small, and on 2 cores 4 ranks share them.
#
# What it needs: a file system every rank sees (each writes its own file, rank 0 reads
# them all), and a full model: a peft model's adapters are written by `write="rank0"`
# only. For a model of many gigabytes, `HuggingFaceStorageWriter`'s `fqn_to_index_mapping`
# splits the output into several files, and DCP's
# `consolidate_safetensors_files_on_every_rank` shares their consolidation among the
# ranks; `save_pretrained` writes one file.
#
# (hf-dcp-export-background)=
# ## In the background: DCP's stager on a CPU
#
# `dcp.async_save` writes in the background: the state is first staged, copied aside so
# that training can change it, then written. Given a `DefaultStager`, it returns at once
# with two futures, `staging_completion` (from then on training may change the model) and
# `upload_completion` (the files are written). The `DefaultStager` is built for GPUs: with
# its default `StagingOptions`, a CPU-only rank cannot stage at all.


# %%
def save_in_background(source, out, options):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from fsdp_guide.hf import from_pretrained
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model = from_pretrained(source, dtype=torch.float32)
    # safetensors refuses two names for one tensor in a file: write the tied pair under its first name
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - dict(
        model.named_parameters()
    ).keys()
    state = {name: t for name, t in get_model_state_dict(model).items() if name not in tied}
    writer = HuggingFaceStorageWriter(str(out), save_distributed=True, enable_consolidation=True)
    try:
        stager = DefaultStager(StagingOptions(**options))
    except AssertionError as error:  # shown below
        return f"{type(error).__name__}: {error}"
    # the background's collectives apart from training's (NCCL on GPUs)
    group = dist.new_group(backend="gloo")
    saving = dcp.async_save(state, storage_writer=writer, async_stager=stager, process_group=group)
    saving.staging_completion.result()  # from here on, training may change the model
    saving.upload_completion.result()  # the files are written and consolidated
    stager.close()
    return "written"


from safetensors.torch import load_file

for options in ({}, {"use_pinned_memory": False, "use_non_blocking_copy": False}):
    result = launch(
        save_in_background, tuned, workdir / "export-async", options, world_size=2, output="none"
    )[0]
    print(f"StagingOptions(**{options}): {result}")
written = load_file(workdir / "export-async" / "model-00001-of-00001.safetensors")
exported = load_file(tuned / "model-00001-of-00001.safetensors")
print(
    "the same tensors as save_pretrained(write='sharded') wrote:",
    written.keys() == exported.keys()
    and all(torch.equal(written[k], exported[k]) for k in written),
)

# %% [markdown]
# `use_non_blocking_copy` needs an accelerator: its copy is synchronised on the
# accelerator's stream (`DefaultStager.__init__` in
# `torch/distributed/checkpoint/staging.py` asserts `torch.accelerator.is_available()`).
# Pinned memory needs CUDA, and is ignored with the warning above. On a CPU, turn both
# off, and the files are the same. Both are meant for GPUs: pinned host memory lets the
# device-to-host copy run without blocking. The other two options, shared memory and a
# background staging thread, were left on in the second run and worked on this CPU,
# although `StagingOptions`' docstring says the staging thread requires CUDA.
#
# Given no stager, `dcp.async_save` stages with the writer itself when the writer is an
# `AsyncStager` (`async_save` in `torch/distributed/checkpoint/state_dict_saver.py`), as
# DCP's `FileSystemWriter`, and so `HuggingFaceStorageWriter`, are: they copy the state to
# the CPU before returning (`BlockingAsyncStager` in `staging.py`), which works on any
# machine. That is what {func}`fsdp_guide.checkpoint.async_save` relies on; the
# {ref}`checkpoints page <llm-async-checkpoint>` measures what saving in the background saves.

# %% [markdown]
# (hf-dcp-export-offline)=
# ## Later, offline: from a training checkpoint
#
# A run saves training checkpoints (the model and the optimizer, sharded by DCP,
# {ref}`tutorial-llm-checkpoints`), not a Hugging Face directory; the ranks above saved one
# too (`fsdp_guide.checkpoint.save`). Turning a checkpoint into a model to share comes
# later, often on a machine without the run's GPUs:
# `python -m fsdp_guide.recipes.to_hf CHECKPOINT OUT --config MODEL_DIR` does it in one
# process with no process group ({func}`fsdp_guide.recipes.to_hf.to_hf`). It reads one
# tensor at a time with DCP, whatever number of ranks wrote them, skips the optimizer, writes
# each name of the model the config describes once (the tied pair under its first name), in
# bf16 unless told otherwise, and copies the config:

# %%
import subprocess
import sys

from fsdp_guide.checkpoint import latest
from fsdp_guide.recipes.to_hf import to_hf
from myst_nb import glue

saved = latest(workdir / "checkpoints")
command = [sys.executable, "-m", "fsdp_guide.recipes.to_hf", str(saved), str(workdir / "bf16")]
done = subprocess.run([*command, "--config", str(path)], capture_output=True, text=True)
print(done.stdout.replace(str(workdir), "WORKDIR") if done.returncode == 0 else done.stderr)
bf16 = AutoModelForCausalLM.from_pretrained(workdir / "bf16").state_dict()
print(
    f"loaded in {bf16['lm_head.weight'].dtype}; each tensor the trained one rounded to bf16:",
    bf16.keys() == trained.keys()
    and all(torch.equal(bf16[name], t.to(torch.bfloat16)) for name, t in trained.items()),
)
fp32, resident, private = host_peak_rise(  # in fp32, split past 20 MB, with the peak measured
    lambda: to_hf(saved, workdir / "fp32", config=path, dtype="fp32", max_shard_size="20MB")
)
read = AutoModelForCausalLM.from_pretrained(fp32).state_dict()
print(
    f"fp32, {len(list(fp32.glob('*.safetensors')))} files: each tensor equal to the trained one:",
    all(torch.equal(read[name], t) for name, t in trained.items()),
    f"| peak rise of this process's memory {resident:.0f} MiB, for a {model_mb:.0f} MiB model",
)
glue("export_offline_peak", f"{resident:.0f}", display=False)
glue("export_offline_model", f"{model_mb:.0f}", display=False)

# %% [markdown]
# The conversion held one output file and one tensor at a time: its peak rise of memory was
# {glue:text}`export_offline_peak` MiB for a {glue:text}`export_offline_model` MiB model in
# fp32. A checkpoint of the LLM recipe's GPT needs no `--config`: its size is read from the
# settings the recipe saves, and it is written as a `GPT2LMHeadModel`, whose layout the
# command's documentation gives ({func}`fsdp_guide.recipes.to_hf.to_hf`). An existing `OUT` is refused, never written over,
# and a checkpoint with a file missing or cut short is refused before anything is written.
#
# Last, the models this page wrote are deleted:

# %%
import shutil

shutil.rmtree(workdir)

# %% [markdown]
# (hf-dcp-export-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch and `transformers`:
# {download}`scripts/hf_dcp_export.py`. Every rank builds the same small Llama, shards it and
# trains it a few steps on its slice of the batch; then every rank writes its own shards with
# `dcp.save` and `HuggingFaceStorageWriter` (the tied pair under its first name) into a
# directory all ranks see, rank 0 consolidates them and writes the config, loads the
# directory with `from_pretrained`, and prints the files it holds and the largest
# differences of its weights and logits from the trained sharded model's. The tests run this
# file under torchrun on 2 CPU ranks and check that the loss fell, that the directory holds
# the consolidated file and no per-rank file, and that both differences are 0: every rank
# wrote, and the trained weights came back exactly (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/hf_dcp_export.py
# :language: python
# ```

# %% [markdown]
# (hf-dcp-export-tips)=
# ## The tips behind this
#
# - {ref}`tip-export-every-rank-writes`
# - {ref}`tip-export-safetensors`: what `from_pretrained` needs of the directory, written
#   here without a gather.
# - {ref}`tip-export-offline`: a training checkpoint turned into the model afterwards.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("hf_dcp_export")
