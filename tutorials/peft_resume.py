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
# (tutorial-peft-resume)=
# # Resuming LoRA through Accelerate
#
# **What you will learn**: how the Trainer saves and resumes a LoRA model under FSDP2,
# through Accelerate's `save_fsdp_model` and `load_fsdp_model` with `adapter_only=True`. With
# a full state dict, Accelerate 1.14 kept only rank 0's slice of each adapter: every other
# rank resumed without its part of what training had learned (accelerate#4206). A sharded
# state dict, and a full one from Accelerate 1.15, restore every rank's slice and resume
# with the losses of a run never stopped. And a check for your own runs.
#
# **What you need**: a CPU; 2 processes on gloo; `transformers`, `peft` and `accelerate`
# (the package's `test` or `docs` extras); about 15 seconds on 2 CPU cores ({ref}`measured <measured-times>`).
# Nothing is downloaded: the model is a small Llama built from a config. On CPU ranks the Trainer does not shard ({ref}`tutorial-trainer-fsdp`), so
# the ranks here call Accelerate's functions as the Trainer does, in the state Accelerate
# gives GPU ranks (as in {ref}`tutorial-fsdp-config-map`); no GPU run of this page is
# recorded. The tips are listed {ref}`at the end <peft-resume-tips>`. Its idea as a plain
# torchrun script to copy: {ref}`peft-resume-script` ({download}`download <scripts/peft_resume.py>`).

# %%
import contextlib
import inspect
import os
import sys
import tempfile
import textwrap
import warnings
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing is downloaded
warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm's notebook import
# peft 0.21 asks transformers 5 a deprecated question; the ranks' warnings come back here
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")

from fsdp_guide.fp8 import quiet_torchao

quiet_torchao()  # transformers' import reaches torchao, which logs about CUDA kernels a CPU cannot load
import accelerate
import peft
import torch
import transformers

transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bars in the outputs
print(
    f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, "
    f"accelerate {accelerate.__version__}, Python {sys.version.split()[0]}"
)

# %% [markdown]
# The Trainer saves an FSDP model for resuming with Accelerate's functions, asking for the
# adapter only whenever `save_fsdp_model` takes `adapter_only`, and loads it back the same
# way. From the installed `transformers`:

# %%
from transformers import Trainer
from transformers.distributed.fsdp import get_fsdp_ckpt_kwargs

source = inspect.getsource(Trainer)
for call in ("save_fsdp_model(", "load_fsdp_model("):
    start = source.index(call)
    print(source[start : source.index(")", start) + 1].replace("\n", " ").replace("  ", ""))
print("get_fsdp_ckpt_kwargs() =", get_fsdp_ckpt_kwargs())

# %%
from fsdp_guide import launch
from transformers import LlamaConfig, LlamaForCausalLM

scratch = tempfile.TemporaryDirectory()  # deleted, with what the page wrote, when the kernel exits
workdir = Path(scratch.name)
torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
LlamaForCausalLM(config).save_pretrained(workdir / "llama")

# %% [markdown]
# What a save writes depends on the plugin's `state_dict_type`; the Trainer's default differs
# from Accelerate's:

# %%
from accelerate.utils import FullyShardedDataParallelPlugin
from transformers import TrainingArguments

args = TrainingArguments(
    str(workdir / "args"), fsdp=True, fsdp_config={"version": 2}, use_cpu=True, report_to=[]
)
trainer_default = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args).state_dict_type.name
print(f"the Trainer, fsdp_config={{'version': 2}}: state_dict_type {trainer_default}")
accelerate_default = FullyShardedDataParallelPlugin(fsdp_version=2).state_dict_type.name
print(f"Accelerate's plugin, fsdp_version=2: state_dict_type {accelerate_default}")

# %% [markdown]
# A full state dict is what a Trainer with an FSDP2 config saves unless the config names
# another: the case below is a Trainer's resume from its own checkpoint. (Accelerate's own
# default holds where `FSDP_STATE_DICT_TYPE` is unset; `accelerate launch` sets it from its
# config file.)

# %% [markdown]
# (peft-resume-lost)=
# ## Save, stop, resume
#
# Each rank builds the LoRA model and its optimizer, prepared by Accelerate with the FSDP
# plugin the Trainer makes of `fsdp_config`; it trains 2 steps, saves model and optimizer
# as the Trainer does, then builds them again (a restart), **sets every adapter to zero**,
# so that a slice left unrestored shows, loads, and trains 2 more steps. A run that never
# stopped trains the same 4 steps. In what decides what is saved and loaded, Accelerate 1.14
# differed from 1.15 in the two branches #4206 added to `_get_model_state_dict` and
# `_set_model_state_dict` (1.15 also ends each load with a barrier): with `adapter_only`,
# 1.14 asked `peft` for the adapter's state dict, which `as_accelerate_1_14()` restores for
# its block.


# %%
def prepared(workdir, state_dict_type):
    """Accelerate's FSDP2 model and optimizer of the Trainer's fsdp_config: a LoRA Llama."""
    import fsdp_guide
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, TrainingArguments

    transformers.utils.logging.set_verbosity_error()
    fsdp_config = {
        "version": 2,
        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
        "state_dict_type": state_dict_type,
    }
    on_cpu = fsdp_guide.device().type == "cpu"  # cpu-only: Accelerate's use_cpu flag
    args = TrainingArguments(
        str(workdir / "args"), fsdp=True, fsdp_config=fsdp_config, use_cpu=on_cpu, report_to=[]
    )
    accelerator = Accelerator(cpu=on_cpu)  # the plugin and type a GPU rank's state gets:
    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    accelerator.state.distributed_type = PartialState().distributed_type = DistributedType.FSDP
    torch.manual_seed(0)  # the same adapters' initial values on every rank and run
    model = AutoModelForCausalLM.from_pretrained(workdir / "llama").to(fsdp_guide.device())
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    trained = [p for p in model.parameters() if p.requires_grad]
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(trained, lr=1e-2))
    return accelerator, model, optimizer


def train(accelerator, model, optimizer, steps):
    """Each rank's half of a batch per step (the batch from the step's number); the losses."""
    import fsdp_guide
    import torch.distributed as dist

    losses = []
    for step in steps:
        tokens = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(step))
        batch = tokens[dist.get_rank() :: dist.get_world_size()].to(fsdp_guide.device())
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def adapters(model):
    """This rank's slice of each adapter tensor."""
    return {
        name: p.to_local().detach().clone()
        for name, p in model.named_parameters()
        if p.requires_grad
    }


@contextlib.contextmanager
def as_accelerate_1_14():
    """Accelerate 1.15's checkpoint functions as 1.14 ran them: peft's state dict for the adapter."""
    import accelerate.utils.fsdp_utils as fsdp_utils
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    kept = fsdp_utils._get_model_state_dict, fsdp_utils._set_model_state_dict
    fsdp_utils._get_model_state_dict = lambda model, **_: get_peft_model_state_dict(model)
    fsdp_utils._set_model_state_dict = lambda model, state, **_: set_peft_model_state_dict(
        model, state
    )
    try:
        yield
    finally:
        fsdp_utils._get_model_state_dict, fsdp_utils._set_model_state_dict = kept


def save_and_resume(workdir, state_dict_type, accelerate_code):
    """Train 2 steps, save, restart with zeroed adapters, load, train 2 more: what came back."""
    from accelerate.utils import (
        load_fsdp_model,
        load_fsdp_optimizer,
        save_fsdp_model,
        save_fsdp_optimizer,
    )

    folder = str(workdir / f"{state_dict_type}-{accelerate_code}")  # a str, as the Trainer passes
    as_then = as_accelerate_1_14 if accelerate_code == "1.14" else contextlib.nullcontext
    accelerator, model, optimizer = prepared(workdir, state_dict_type)
    losses = train(accelerator, model, optimizer, steps=[0, 1])
    saved = adapters(model)
    with as_then():  # as the Trainer's _save_checkpoint calls them
        save_fsdp_model(
            accelerator.state.fsdp_plugin, accelerator, model, folder, adapter_only=True
        )
        save_fsdp_optimizer(accelerator.state.fsdp_plugin, accelerator, optimizer, model, folder)

    accelerator, model, optimizer = prepared(workdir, state_dict_type)  # a restart
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.zero_()
    with as_then():  # as the Trainer's resume_from_checkpoint calls them
        load_fsdp_model(
            accelerator.state.fsdp_plugin, accelerator, model, folder, adapter_only=True
        )
        load_fsdp_optimizer(
            accelerator.state.fsdp_plugin, accelerator, optimizer, model, folder, adapter_only=True
        )
    loaded = adapters(model)
    restored = sum(int((loaded[k] == saved[k]).sum()) for k in saved)
    zero = sum(int((loaded[k] == 0).sum()) for k in saved)
    size = sum(v.numel() for v in saved.values())
    lora_b = model.get_submodule("base_model.model.model.layers.0.self_attn.q_proj.lora_B.default")
    lora_b = lora_b.weight.full_tensor().detach().cpu()  # layer 0's q_proj lora_B, whole, as loaded
    return {
        "restored": f"{restored} of {size}",  # values equal to the saved ones, exactly
        "zero": f"{zero} of {size}",
        "losses": losses + train(accelerator, model, optimizer, steps=[2, 3]),
        "files": sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*") if p.is_file()),
        "lora_B": lora_b,
    }


def every_way(workdir):
    """A run that never stopped, then each state dict type saved and resumed by each code."""
    accelerator, model, optimizer = prepared(workdir, "SHARDED_STATE_DICT")
    never_stopped = train(accelerator, model, optimizer, steps=[0, 1])
    lora_b = model.get_submodule("base_model.model.model.layers.0.self_attn.q_proj.lora_B.default")
    trained_lora_b = (
        lora_b.weight.full_tensor().detach().cpu()
    )  # after the 2 steps every resume saved
    never_stopped += train(accelerator, model, optimizer, steps=[2, 3])
    ways = {}
    for state_dict_type in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        for code in ("1.14", "1.15"):
            ways[state_dict_type, code] = save_and_resume(workdir, state_dict_type, code)
    return never_stopped, trained_lora_b, ways


results = launch(every_way, workdir, world_size=2, output="none")

# %%
from fsdp_guide.table import Table
from myst_nb import glue

columns = ["state dict", "saved and loaded by", "rank", "adapter values restored", "left zero"]
rows = []
for (state_dict_type, code), way in results[0][2].items():
    print(f"{state_dict_type}, accelerate {code}: {', '.join(way['files'])}")
    for rank, (never_stopped, _, ways) in enumerate(results):
        way = ways[state_dict_type, code]
        apart = max(abs(a - b) for a, b in zip(way["losses"], never_stopped))
        done = [way["restored"], way["zero"], f"{apart:.1e}"]
        rows.append([state_dict_type, f"accelerate {code}", f"rank {rank}", *done])
lost = results[1][2]["FULL_STATE_DICT", "1.14"]
glue("lost_restored", lost["restored"], display=False)
glue("lost_zero", lost["zero"], display=False)
Table([*columns, "max |loss - never stopped|"], rows)

# %% [markdown]
# What the two full-state-dict files hold, read here in one process:

# %%
import logging

from torch.distributed.tensor import DTensor

# 1.14's file pickles DTensors with their mesh; unpickled without a process group, torch warns
logging.getLogger("torch.distributed.device_mesh").setLevel(logging.ERROR)
for code in ("1.14", "1.15"):
    state = torch.load(
        workdir / f"FULL_STATE_DICT-{code}" / "pytorch_model_fsdp.bin", weights_only=True
    )
    name = next(key for key in state if "layers.0.self_attn.q_proj.lora_B" in key)
    tensor = state[name]
    values = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    print(
        f"accelerate {code}'s file, {len(state)} tensors; {name}: {type(tensor).__name__} of shape "
        f"{tuple(tensor.shape)} holding {tuple(values.shape)} values"
    )

# %% [markdown]
# With a full state dict, Accelerate 1.14 restored rank 0's slice and nothing of rank 1's:
# {glue:text}`lost_restored` values of rank 1's adapter came back, {glue:text}`lost_zero`
# stayed at zero (without the zeroing, at their initial values: `lora_B` zero, `lora_A`
# random, as the report's 2-GPU table shows), and both ranks' later losses differ from the
# run that never stopped, without an error or a warning. A sharded state dict (DCP, a file per rank) restored every slice with
# either version, and so does a full one with 1.15; their resumed losses equal the
# uninterrupted run's, bit for bit. The picture: layer 0's `q_proj` adapter `lora_B` (64 rows,
# 32 on each rank) as training left it and as each full-state-dict resume found it.

# %% mystnb={"image": {"alt": "Three heat maps of layer 0's q_proj lora_B, 64 rows by 8 columns, with a dashed line between rank 0's rows 0 to 31 and rank 1's rows 32 to 63: as trained before saving; after a full-state-dict resume with Accelerate 1.14, rank 0's half as trained and rank 1's half all zero (dark); after one with Accelerate 1.15, the same as trained."}}
import matplotlib.pyplot as plt

_, trained_lora_b, ways = results[0]
pictures = {
    "trained (before saving)": trained_lora_b,
    "full, accelerate 1.14": ways["FULL_STATE_DICT", "1.14"]["lora_B"],
    "full, accelerate 1.15": ways["FULL_STATE_DICT", "1.15"]["lora_B"],
}
figure, axes = plt.subplots(1, 3, figsize=(7, 3.2), sharey=True)
top = float(trained_lora_b.abs().max())  # one colour scale: the trained values'
for ax, (title, weight) in zip(axes, pictures.items()):
    ax.imshow(weight.abs().numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=top)
    ax.axhline(31.5, color="white", linewidth=1, linestyle="--")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("rank of the adapter (8)")
axes[0].set_ylabel("row: 0-31 rank 0, 32-63 rank 1")
figure.suptitle("layer 0's q_proj lora_B after loading, |value| (dark: zero)", fontsize=10)
figure.tight_layout()
plt.show()

# %% [markdown]
# ## Why, in Accelerate's code
#
# With `adapter_only`, 1.14 took `peft`'s `get_peft_model_state_dict`: on a model sharded with
# `fully_shard` its values are DTensors, and in the `FULL_STATE_DICT` branch only rank 0
# writes the file, so the file holds rank 0's local slices. At load only rank 0 reads it;
# the others get `{}` and expect a broadcast from rank 0, which `peft`'s
# `set_peft_model_state_dict` never makes, so every other rank keeps what it had. Since
# #4206 a full state dict goes through DCP's `get_model_state_dict` with
# `ignore_frozen_params=True`, which gathers each adapter whole, and `set_model_state_dict`,
# which broadcasts each whole tensor from rank 0 for every rank to keep its slice. The
# installed Accelerate:

# %%
import accelerate.utils.fsdp_utils as fsdp_utils

print(inspect.getsource(fsdp_utils._get_model_state_dict))
loading = inspect.getsource(fsdp_utils.load_fsdp_model)
start = loading.rindex("\n", 0, loading.index("# we want an empty state dict")) + 1
end = loading.index("state_dict = {}", start) + len("state_dict = {}")
print(textwrap.dedent(loading[start:end]))

# %% [markdown]
# (peft-resume-check)=
# ## A check for your own run
#
# With its default initialisation (`init_lora_weights=True`), `peft` starts each `lora_B` at
# zero, so a rank whose `lora_B` slices are all zero after a resume lost its adapter (with
# PiSSA, OLoRA, LoftQ and the like `lora_B` starts otherwise, and this check cannot tell).
# Each rank's sum of squares, gathered, says which rank (run it right after loading, before
# the next step):


# %%
def zero_lora_b_ranks(model):
    """The ranks holding lora_B values, all of them zero (or NaN): those resumed without their adapter."""
    import torch.distributed as dist

    lora_b = [p.detach().to_local() for n, p in model.named_parameters() if "lora_B" in n]
    held = (sum(p.numel() for p in lora_b), sum(float(p.float().square().sum()) for p in lora_b))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, held)
    return [rank for rank, (count, squares) in enumerate(every) if count > 0 and not squares > 0]


def resumed_then_checked(workdir, saved_by, loaded_by):
    from accelerate.utils import load_fsdp_model

    as_then = as_accelerate_1_14 if loaded_by == "1.14" else contextlib.nullcontext
    accelerator, model, _ = prepared(workdir, "FULL_STATE_DICT")  # a fresh model: lora_B zero
    folder = str(workdir / f"FULL_STATE_DICT-{saved_by}")
    with as_then():
        load_fsdp_model(
            accelerator.state.fsdp_plugin, accelerator, model, folder, adapter_only=True
        )
    return zero_lora_b_ranks(model)


from fsdp_guide import LaunchError

for saved_by, loaded_by in (("1.14", "1.14"), ("1.15", "1.15"), ("1.14", "1.15")):
    what = f"full state dict saved by accelerate {saved_by}, loaded by {loaded_by}:"
    try:
        lost_on = launch(
            resumed_then_checked, workdir, saved_by, loaded_by, world_size=2, output="none"
        )
        print(what, f"lora_B all zero on ranks {lost_on[0]}")
    except LaunchError as error:  # "rank N raised ...": the rank that failed first, and its error
        print(what, str(error).splitlines()[0].split(" raised ")[1])

# %% [markdown]
# On a resume from the folder Accelerate 1.14 wrote, rank 1's `lora_B` is all zero; from
# 1.15's, no rank's. And 1.15 cannot read a folder 1.14 wrote: the file holds DTensors
# (rank 0's slices, pickled with their mesh), and `set_model_state_dict` fails as it
# broadcasts the first of them from rank 0; the rank 0 slices it holds are all there is of
# that run's adapter. Upgrade to Accelerate 1.15 or later before saving, or save with `fsdp_config={"state_dict_type": "SHARDED_STATE_DICT",
# ...}`, and keep a check like this one after a resume: a lost slice gives no error.
#
# (peft-resume-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch, `transformers`, `peft` and
# `accelerate`: {download}`scripts/peft_resume.py`. Every rank prepares the LoRA Llama with
# Accelerate's FSDP2 plugin (on CPU ranks in the state GPU ranks get, as here), trains 2
# steps, saves model and optimizer as the Trainer does with a full state dict, builds them
# again with zeroed adapters, loads, checks that no rank's `lora_B` is all zero and trains 2
# more steps; rank 0 prints whether every rank's slice came back and whether the resumed
# losses equal those of a run that never stopped. The tests run this file under torchrun on
# 2 CPU ranks and check those lines (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/peft_resume.py
# :language: python
# ```

# %% [markdown]
# (peft-resume-tips)=
# ## The tips behind this
#
# - {ref}`tip-peft-resume`
# - {ref}`tip-trainer-check-fsdp`: on CPU ranks, the Trainer does not shard at all.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("peft_resume")
