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
# # Trainer and Accelerate: what an FSDP2 config builds
#
# **What you will learn**: that the `transformers` Trainer given an FSDP2 `fsdp_config` on
# CPU ranks trains with DDP and says nothing, and the lines of Accelerate that decide it; how
# each `fsdp_config` key travels, from `transformers` into Accelerate's FSDP plugin and from
# there into `fully_shard` arguments, a `MixedPrecisionPolicy`, a checkpoint wrapper, a load
# from rank 0 or a kind of checkpoint: a map made by running both libraries, with a test that
# fails when either changes it; and the same model built by hand with `fully_shard`,
# training to the same losses.
#
# **What you need**: a CPU; 2 processes on gloo; `transformers` and `accelerate` (the
# package's `test` or `docs` extras); about 20 seconds on 2 CPU cores
# ({ref}`measured <measured-times>`). Nothing is downloaded: the model is a small Llama built
# from a config. On GPUs the Trainer should build what the map shows (Accelerate attaches its
# plugin for GPU ranks: the lines are printed below), but no GPU run of this page is
# recorded. The tips are listed {ref}`at the end <trainer-fsdp-tips>`. Its idea as a plain
# torchrun script to copy: {ref}`trainer-fsdp-script`
# ({download}`download <scripts/trainer_fsdp.py>`).

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
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    transformers.utils.logging.set_verbosity_error()  # in this rank: its logs say nothing of FSDP either
    tokens = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(1))
    args = TrainingArguments(
        output_dir=str(workdir / "trainer"),
        fsdp=True,
        fsdp_config=FSDP_CONFIG,
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


built = launch(train_with_the_trainer, workdir, world_size=2, output="none")
for what, value in built[0].items():
    print(f"{what:24} {value}")

# %% [markdown]
# No `FSDPModule` anywhere: the model trained is a `DistributedDataParallel`, every rank held
# the whole model, and the checkpoint is one `model.safetensors`, with nothing logged or
# warned. The decision is Accelerate's, when it sets up its state: it attaches the FSDP plugin
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
for i in [*range(start, listed + 1), None, *range(condition, attach + 1)]:
    print(
        "        ..." if i is None else f"{first + i:5} {lines[i].rstrip()}"
    )  # None: checks of cp_size

# %% [markdown]
# On GPU ranks Accelerate's type is `MULTI_GPU`, the plugin is attached and the Trainer
# shards (expectation, from these lines: not run here). A script can check which it got:
# `trainer.is_fsdp_enabled`, or any `FSDPModule` in `trainer.model_wrapped`, as above.
#
# (trainer-fsdp-map)=
# ## From `fsdp_config` to `fully_shard`: the map, generated
#
# To see what the same config builds where Accelerate does attach its plugin, each rank below
# makes the plugin from the config as the Trainer does (`TrainingArguments(...).fsdp_plugin_args`
# into `FullyShardedDataParallelPlugin`), then gives an `Accelerator`'s state the two values
# that the lines above set on GPU ranks, the plugin and the type `FSDP`, and calls
# `accelerator.prepare`: from there on, everything is Accelerate's own code, running on these
# CPU ranks. Each `fully_shard` it calls is recorded on the way through (and passed on
# unchanged), and so is a load of rank 0's weights; then `save_fsdp_model`, the function
# behind `accelerator.save_state`'s model files, saves the model:


# %%
def what_accelerate_builds(workdir, name, fsdp_config, training_args):
    """The plugin arguments transformers makes of the config, and what Accelerate then does."""
    import torch.distributed as dist
    import torch.distributed.fsdp as fsdp
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, fsdp_utils
    from transformers import AutoModelForCausalLM, TrainingArguments

    transformers.utils.logging.set_verbosity_error()
    config = {**FSDP_CONFIG, **fsdp_config}
    args = TrainingArguments(
        str(workdir / "args"),
        fsdp=True,
        fsdp_config=config,
        use_cpu=True,
        report_to=[],
        **training_args,
    )
    plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    accelerator = Accelerator(cpu=True, mixed_precision="bf16" if args.bf16 else "no")
    if args.bf16:  # what Accelerate's state does with the plugin it attaches
        plugin.set_mixed_precision("bf16")
    accelerator.state.fsdp_plugin = plugin  # the two values a GPU rank's state gets
    accelerator.state.distributed_type = DistributedType.FSDP
    done, policies = [], set()

    def fully_shard(module, **options):  # recorded, then passed on
        names = "+".join(
            type(m).__name__ for m in (module if isinstance(module, list) else [module])
        )
        shown = [f"{k}={v}" for k, v in options.items() if k == "reshard_after_forward"]
        if type(options["offload_policy"]) is not fsdp.OffloadPolicy:  # that one: no offloading
            shown.append(type(options["offload_policy"]).__name__)
        policies.add(options["mp_policy"])  # said once, below
        done.append(f"fully_shard({', '.join([names, *shown])})")
        return shard(module, **options)

    def load_from_rank_0(*args, **kwargs):
        done.append("rank 0's weights broadcast (fsdp2_load_full_state_dict)")
        return load(*args, **kwargs)

    shard, load = fsdp.fully_shard, fsdp_utils.fsdp2_load_full_state_dict
    fsdp.fully_shard, fsdp_utils.fsdp2_load_full_state_dict = fully_shard, load_from_rank_0
    try:
        model = AutoModelForCausalLM.from_pretrained(workdir / "llama")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
    except RuntimeError as error:
        return args.fsdp_plugin_args, done + [f"RuntimeError: {error}"]
    finally:
        fsdp.fully_shard, fsdp_utils.fsdp2_load_full_state_dict = shard, load
    for mp in policies - {fsdp.MixedPrecisionPolicy()}:  # that one: no casts
        done.append(f"every unit: {mp}".replace("torch.", ""))
    wrappers = [m for m in model.modules() if type(m).__name__ == "FSDPCheckpointWrapper"]
    if wrappers:  # an FSDP unit of its own: does it hold parameters?
        held = sum(m._get_fsdp_state()._fsdp_param_group is not None for m in wrappers)
        done.append(f"{len(wrappers)} checkpoint wrappers, {held} holding parameters of their own")
    saved = workdir / "saved" / name
    fsdp_utils.save_fsdp_model(plugin, accelerator, model, str(saved))
    dist.barrier()
    # DCP's .metadata has no suffix: its name
    kinds = {p.suffix or p.name for p in saved.rglob("*") if p.is_file()}
    done.append("saved: " + ", ".join(sorted(kinds)))
    return args.fsdp_plugin_args, done


plain, baseline = launch(
    what_accelerate_builds, workdir, "plain", {}, {}, world_size=2, output="none"
)[0]
print(f"fsdp_config {FSDP_CONFIG}\nbecomes the plugin's {plain}\nand Accelerate does:")
for step in baseline:
    print("  " + step)

# %% [markdown]
# Besides one unit per decoder layer, Accelerate makes the embedding a unit, the final norm
# and the output layer another that stays gathered after forward
# (`reshard_after_forward=False`: it is used again first in backward), and the root; a
# `FULL_STATE_DICT` checkpoint (the default) is one `.bin` file written by rank 0. Now each
# key changed alone, and what changes in what Accelerate does (the plugin arguments that
# differ from the config above, and each step not in the list above):

# %%
from collections import Counter

from fsdp_guide.table import Table
from IPython.display import display

CASES = [  # (the key, as the Trainer's fsdp_config or TrainingArguments takes it; the setting)
    ("reshard_after_forward", {"reshard_after_forward": False}, {}),
    ("transformer_layer_cls_to_wrap", {"transformer_layer_cls_to_wrap": ["LlamaMLP"]}, {}),
    ("activation_checkpointing", {"activation_checkpointing": True}, {}),
    ("cpu_ram_efficient_loading", {"cpu_ram_efficient_loading": True}, {}),
    ("state_dict_type", {"state_dict_type": "SHARDED_STATE_DICT"}, {}),
    ("cpu_offload", {"cpu_offload": True}, {}),
    ("bf16 (TrainingArguments)", {}, {"bf16": True}),
]
rows = []
for key, fsdp_config, training_args in CASES:
    arguments, done = launch(
        what_accelerate_builds,
        workdir,
        key.split()[0],
        fsdp_config,
        training_args,
        world_size=2,
        output="none",
    )[0]
    changed = {k: v for k, v in arguments.items() if plain.get(k) != v}
    new = Counter(step for step in done if step not in baseline)
    rows.append(
        [
            f"{key}: {next(iter({**fsdp_config, **training_args}.values()))}",
            ", ".join(f"{k}={v}" for k, v in changed.items()) or "(none)",
            "; ".join(f"{step} ×{n}" if n > 1 else step for step, n in new.items()),
        ]
    )
display(
    Table(["setting", "plugin arguments changed", "what Accelerate does that it did not"], rows)
)

# %% [markdown]
# Read by row: `reshard_after_forward` reaches the decoder layers and the embedding, not the
# tail (always kept gathered) nor the root (torch's own default); `transformer_layer_cls_to_wrap`
# chooses the units; `cpu_ram_efficient_loading` loads the weights on rank 0 and broadcasts
# them; `state_dict_type` changes only what a save writes, DCP's sharded files instead of
# rank 0's one file; mixed precision is not an `fsdp_config` key at all but the Trainer's
# `bf16=True`, which becomes one policy on every unit. `activation_checkpointing` wraps each
# layer in a checkpoint wrapper and shards the layer and then its wrapper: the wrappers are
# FSDP units that hold no parameter of their own, so they gather nothing. `cpu_offload`
# fails here at the first `fully_shard`: its `CPUOffloadPolicy` pins host memory, which
# needs an accelerator (on GPUs it should offload; expectation, not run). The `version` key
# (or `fsdp_version`) chooses FSDP2 (2, the default) or the deprecated FSDP1.
#
# (trainer-fsdp-by-hand)=
# ## The same model by hand
#
# The config above as `fully_shard` calls, the ones the first list recorded, in the order
# Accelerate makes them; with `bf16=True`, the same calls with
# `MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
# output_dtype=torch.bfloat16)`. Each rank trains the model Accelerate prepared and the one
# built here for 3 steps on its half of the same batches, from the same weights:


# %%
def shard_as_accelerate_does(model, mp_policy=None):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = mp_policy or MixedPrecisionPolicy()
    for layer in model.model.layers:  # transformer_layer_cls_to_wrap
        fully_shard(layer, reshard_after_forward=True, mp_policy=mp_policy)
    fully_shard(model.model.embed_tokens, reshard_after_forward=True, mp_policy=mp_policy)
    # used first in backward: kept gathered after forward
    fully_shard([model.model.norm, model.lm_head], reshard_after_forward=False, mp_policy=mp_policy)
    return fully_shard(model, mp_policy=mp_policy)  # the root: torch's default for it


def three_steps(workdir, by_hand):
    import fsdp_guide
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import FSDPModule
    from transformers import AutoModelForCausalLM, TrainingArguments

    transformers.utils.logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(workdir / "llama").to(fsdp_guide.device())
    if by_hand:
        shard_as_accelerate_does(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:  # as above: the plugin the Trainer makes, in a state as GPU ranks get it
        args = TrainingArguments(
            str(workdir / "args"), fsdp=True, fsdp_config=FSDP_CONFIG, use_cpu=True, report_to=[]
        )
        accelerator = Accelerator(cpu=True)
        accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
        accelerator.state.distributed_type = DistributedType.FSDP
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
    tokens = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(2))
    batch = tokens[dist.get_rank() :: dist.get_world_size()].to(fsdp_guide.device())
    losses = []
    for _ in range(3):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    units = sorted(type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule))
    return losses, units


runs = {}
for by_hand in (False, True):
    who = "by hand" if by_hand else "Accelerate"
    runs[who] = launch(three_steps, workdir, by_hand, world_size=2, output="none")[0]
    losses, units = runs[who]
    print(f"{who:10}: rank 0's losses {' '.join(f'{x:.6f}' for x in losses)}; FSDP units {units}")
print("the same losses, bit for bit:", runs["Accelerate"][0] == runs["by hand"][0])

# %% [markdown]
# The same units and the same losses: what the Trainer would run on GPUs with this config
# is these five `fully_shard` calls, and anything the map shows can be added by hand the
# same way (the checkpoint wrapper with `checkpoint_wrapper` before sharding, the policy as
# `mp_policy`, DCP's `get_state_dict` for a sharded save).
#
# (trainer-fsdp-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch, `transformers` and `accelerate`:
# {download}`scripts/trainer_fsdp.py`. Every rank trains the small Llama with the Trainer and
# this page's `fsdp_config`, then rank 0 prints what the Trainer built: Accelerate's
# distributed type, whether FSDP is on, the model trained, and a warning when the config was
# not applied. The tests run this file under torchrun on 2 CPU ranks and check that it says
# so (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/trainer_fsdp.py
# :language: python
# ```

# %% [markdown]
# (trainer-fsdp-tips)=
# ## The tips behind this
#
# - {ref}`tip-trainer-check-fsdp`
# - {ref}`tip-fsdp-config-map`

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("trainer_fsdp")
