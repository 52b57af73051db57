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
# (tutorial-trainer-fsdp)=
# # Trainer and Accelerate: check what an FSDP2 config built
#
# **What you will learn**: that the `transformers` Trainer given an FSDP2 `fsdp_config` on
# CPU ranks trains with DDP and says nothing, and the lines of Accelerate that decide it;
# that keys it does not know are dropped without a word, and `FSDP_*` environment variables
# fill in what the config leaves out; and how a script checks what it got before a long run.
# What each key that does arrive becomes is {ref}`tutorial-fsdp-config-map`.
#
# **What you need**: a CPU; 2 processes on gloo; `transformers` and `accelerate` (the
# package's `test` or `docs` extras); about 10 seconds on 2 CPU cores
# ({ref}`measured <measured-times>`). Nothing is downloaded: the model is a small Llama built
# from a config. On GPUs the Trainer should shard (Accelerate attaches its plugin for GPU
# ranks: the lines are printed below), but no GPU run of this page is recorded. The tips are
# listed {ref}`at the end <trainer-fsdp-tips>`. Its idea as a plain torchrun script to copy:
# {ref}`trainer-fsdp-script` ({download}`download <scripts/trainer_fsdp.py>`).

# %%
import os
import sys
import tempfile
import warnings
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing is downloaded
warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm's notebook import

from fsdp_guide.fp8 import quiet_torchao

quiet_torchao()  # transformers' import reaches torchao, which logs about CUDA kernels a CPU cannot load
import accelerate
import torch
import transformers

transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bars in the outputs
print(
    f"torch {torch.__version__}, transformers {transformers.__version__}, "
    f"accelerate {accelerate.__version__}, Python {sys.version.split()[0]}"
)


# %% [markdown]
# (trainer-fsdp-fallback)=
# ## The Trainer on CPU ranks: DDP, without a word
#
# A small Llama, saved as a pretrained model is, and the Trainer as its documentation
# configures FSDP2: `fsdp=True`, an `fsdp_config` naming FSDP2 and the layer to shard, and
# `use_cpu=True` because these ranks have no GPU. Each rank reports what the Trainer built:

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
FSDP_CONFIG = {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}


def train_with_the_trainer(workdir):
    import logging

    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    transformers.utils.logging.disable_progress_bar()  # its logs, at their default level, show below
    # but bitsandbytes' (which peft imports): on a CPU with AVX512-BF16 it logs that the optional
    # `kernels` package, which would fetch a kernel from the Hub, is not installed
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    tokens = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(1))
    args = TrainingArguments(
        output_dir=str(workdir / "trainer"),
        fsdp=True,
        fsdp_config=dict(FSDP_CONFIG),  # a copy: TrainingArguments adds its defaults to the dict
        use_cpu=True,
        per_device_train_batch_size=2,
        max_steps=2,
        save_steps=2,
        report_to=[],
        disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(workdir / "llama")
    trainer = Trainer(
        model=model, args=args, train_dataset=[{"input_ids": t, "labels": t} for t in tokens]
    )
    trainer.train()
    checkpoint = workdir / "trainer" / "checkpoint-2"
    return {
        "accelerate's type": str(trainer.accelerator.distributed_type),
        "trainer.is_fsdp_enabled": trainer.is_fsdp_enabled,
        "the model trained": type(trainer.model_wrapped).__name__,
        "a decoder layer": type(model.model.layers[0]).__name__,
        "any FSDP module": any(isinstance(m, FSDPModule) for m in trainer.model_wrapped.modules()),
        "model files": sorted(p.name for p in checkpoint.glob("model*"))
        if dist.get_rank() == 0
        else None,
    }


built = launch(train_with_the_trainer, workdir, world_size=2, output="rank0")  # all rank 0 printed
for what, value in built[0].items():
    print(f"{what:24} {value}")

# %% [markdown]
# No `FSDPModule` anywhere: the model trained is a `DistributedDataParallel`, every rank held
# the whole model, and the checkpoint is one `model.safetensors`. Of what rank 0 printed,
# only DDP's own note on `find_unused_parameters` hints at it; nothing mentions
# FSDP. The decision is Accelerate's, when it sets up its state: it attaches the FSDP plugin
# only for these distributed types, and CPU ranks are `MULTI_CPU`:

# %%
import inspect

from accelerate.state import AcceleratorState

lines, first = inspect.getsourcelines(AcceleratorState.__init__)
attach = next(
    i for i, line in enumerate(lines) if "self.distributed_type = DistributedType.FSDP" in line
)
start = max(i for i in range(attach) if "elif self.distributed_type in [" in lines[i])
listed = next(i for i in range(start, attach) if lines[i].strip() == "]:")  # the end of the types
condition = next(i for i in range(listed, attach) if "ACCELERATE_USE_FSDP" in lines[i])
file = Path(inspect.getsourcefile(AcceleratorState)).relative_to(
    Path(accelerate.__file__).parents[1]
)
print(f"{file}, lines {first + start} to {first + attach}:")
for i in [*range(start, listed + 1), None, *range(condition, attach + 1)]:  # None: cp_size's checks
    print("        ..." if i is None else f"{first + i:5} {lines[i].rstrip()}")

# %% [markdown]
# On GPU ranks Accelerate's type starts as `MULTI_GPU`, these lines attach the plugin and set
# it to `FSDP`, and the Trainer shards (expectation, from these lines: not run here). A script
# can check which it got as soon as the Trainer exists, before training:
# `trainer.is_fsdp_enabled` (set in `Trainer.__init__`) and, after a step,
# any `FSDPModule` in `trainer.model_wrapped`.

# %% [markdown]
# (trainer-fsdp-dropped)=
# ## Keys that go nowhere
#
# `transformers` reads the keys it knows and drops the rest without a word
# (`_process_fsdp_args` in `transformers/training_args.py`), and Accelerate's plugin fills
# what it is not given from `FSDP_*` environment variables, which an `accelerate config`
# file sets. Each line below is one config, or one variable, and what the plugin then holds:


# %%
from fsdp_guide.table import Table
from IPython.display import display


def what_the_plugin_gets(workdir, fsdp_config, environ):
    import logging

    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import TrainingArguments

    os.environ.update(environ)
    said = []  # any warning or log record on the way, to show there is none
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    for name in ("transformers", "accelerate"):  # transformers' does not reach the root logger
        logging.getLogger(name).addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = TrainingArguments(
            str(workdir / "args"),
            fsdp=True,
            fsdp_config={**FSDP_CONFIG, **fsdp_config},
            use_cpu=True,
        )
        plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    said += [str(w.message) for w in caught]
    fields = (
        "cpu_offload",
        "reshard_after_forward",
        "activation_checkpointing",
        "mixed_precision_policy",
    )
    return {f: str(getattr(plugin, f)) for f in fields}, said


TRIED = [  # (what a user wrote, fsdp_config, environment)
    ("fsdp_config: {}", {}, {}),
    ("fsdp_offload_params: True (accelerate's YAML name)", {"fsdp_offload_params": True}, {}),
    ("reshard_after_foward: False (misspelt)", {"reshard_after_foward": False}, {}),
    ("mixed_precision: bf16", {"mixed_precision": "bf16"}, {}),
    (
        "FSDP_ACTIVATION_CHECKPOINTING=true in the environment",
        {},
        {"FSDP_ACTIVATION_CHECKPOINTING": "true"},
    ),
]
rows = []
for what, fsdp_config, environ in TRIED:
    got, said = launch(
        what_the_plugin_gets, workdir, fsdp_config, environ, world_size=1, output="none"
    )[0]
    rows.append([what, *got.values(), "; ".join(said) or "(nothing)"])
display(Table(["config", *got.keys(), "warned or logged"], rows))

# %% [markdown]
# The misspelt key, Accelerate's own YAML name for offloading and a mixed-precision key
# change nothing, silently; the environment variable turns on activation checkpointing that
# the `fsdp_config` never mentions. Print `trainer.accelerator.state.fsdp_plugin` once at the
# start of a run and read it against what you meant.
# %% [markdown]
# (trainer-fsdp-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch and `transformers`:
# {download}`scripts/trainer_fsdp.py`. Every rank builds the Trainer with this page's
# `fsdp_config`, and rank 0 prints, before training, Accelerate's distributed type and
# whether FSDP is on, with a warning when the config was not applied; after two steps, the
# model trained and its FSDP units. The tests run this file under torchrun on 2 CPU ranks
# and check that it says so (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/trainer_fsdp.py
# :language: python
# ```

# %% [markdown]
# (trainer-fsdp-tips)=
# ## The tips behind this
#
# - {ref}`tip-trainer-check-fsdp`
# - {ref}`tip-fsdp-config-map`: what each key becomes, in {ref}`tutorial-fsdp-config-map`.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("trainer_fsdp")
