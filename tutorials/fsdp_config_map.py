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
# (tutorial-fsdp-config-map)=
# # From `fsdp_config` to `fully_shard`: the map
#
# **What you will learn**: how each key of the Trainer's `fsdp_config` travels, from
# `transformers` into Accelerate's FSDP plugin and from there into `fully_shard` arguments,
# a `MixedPrecisionPolicy`, a checkpoint wrapper, a load from rank 0 or a kind of
# checkpoint: a map made by running both libraries, with a test that fails when either
# changes it; and the same model built by hand with `fully_shard`, training to the same
# losses.
#
# **What you need**: a CPU; 2 processes on gloo; `transformers` and `accelerate` (the
# package's `test` or `docs` extras);
# about 15 seconds on 2 CPU cores ({ref}`measured <measured-times>`).
# Nothing is downloaded: the model is a small Llama built
# from a config. On CPU ranks the Trainer itself does not shard ({ref}`tutorial-trainer-fsdp`);
# what it would build on GPUs is run here through Accelerate's own functions, and no GPU run
# of this page is recorded. The tips are listed {ref}`at the end <fsdp-config-map-tips>`. Its
# idea as a plain torchrun script to copy: {ref}`fsdp-config-map-script`
# ({download}`download <scripts/fsdp_config_map.py>`).

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

# %% [markdown]
# (fsdp-config-map-generated)=
# ## What Accelerate builds from the config
#
# Each rank makes the plugin from the config as the Trainer does
# (`TrainingArguments(...).fsdp_plugin_args` into `FullyShardedDataParallelPlugin`), then
# gives an `Accelerator`'s state the values that Accelerate sets on GPU ranks and not on CPU
# ranks ({ref}`trainer-fsdp-fallback`), the plugin and the type `FSDP` (in its state and in
# `PartialState`'s, as `AcceleratorState.__init__` does), and calls
# `accelerator.prepare`: from there on, everything is Accelerate's own code, running on these
# CPU ranks. (What this skips of a GPU rank's set-up: the `ACCELERATE_USE_FSDP` variable that
# `Accelerator` sets, and what the `Accelerator` decides when it is built, such as fp16's
# gradient scaler; none of it changes `prepare` for the cases below, which use no mixed
# precision or bf16, and the by-hand model further down trains to the same losses.) Each `fully_shard` it calls is recorded on the way through (and
# passed on unchanged), and so is a load of rank 0's weights; then `save_fsdp_model`, the
# function behind `accelerator.save_state`'s model files, saves the model:


# %%
def what_accelerate_builds(workdir, name, fsdp_config, training_args):
    """The plugin arguments transformers makes of the config, and what Accelerate then does."""
    import torch.distributed as dist
    import torch.distributed.fsdp as fsdp
    from accelerate import Accelerator
    from accelerate.state import PartialState
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
    accelerator.state.fsdp_plugin = plugin  # the values a GPU rank's state gets
    accelerator.state.distributed_type = PartialState().distributed_type = DistributedType.FSDP
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
# Read by row, for accelerate 1.15: `reshard_after_forward` reaches every unit the wrap
# policy makes and the embedding, not the tail (always kept gathered; with tied embeddings
# the embedding joins it) nor the root (torch's default for a root, `False`);
# `transformer_layer_cls_to_wrap` chooses the units (left out, the model's
# `_no_split_modules`); `cpu_ram_efficient_loading` broadcasts rank 0's weights into the
# sharded model, which saves host memory only if the other ranks did not load them first:
# `from_pretrained` skips the load on them only when `ACCELERATE_USE_FSDP` is already set
# (by `accelerate launch`, or an `Accelerator` built before it; `is_fsdp_enabled` in
# `transformers/distributed/fsdp.py`: read, not run). `state_dict_type` changes only what
# a save writes, DCP's sharded files instead of rank 0's one file (the Trainer's checkpoint
# adds the optimizer and, with `FULL_STATE_DICT` only, a `model.safetensors` from
# `save_model`: with `SHARDED_STATE_DICT`, `save_model` writes no weights; `trainer.py`, read,
# not run). Mixed precision is not an `fsdp_config` key but the Trainer's `bf16=True`, one
# policy on every unit; with it, Accelerate also upcasts trainable parameters that are not
# fp32 to fp32 (`fsdp2_prepare_model`), so a bf16 checkpoint loaded in its own dtype trains
# with fp32 parameters, and without `bf16=True` it trains in bf16 throughout. `activation_checkpointing` wraps each
# layer in a checkpoint wrapper and shards the layer and then its wrapper: the wrappers are
# FSDP units that hold no parameter of their own, so they gather nothing. `cpu_offload`
# fails here at the first `fully_shard`: its `CPUOffloadPolicy` pins host memory, which
# needs an accelerator (on GPUs it should offload; expectation, not run). The `version` key
# (or `fsdp_version`) chooses FSDP2 (2, the default) or the deprecated FSDP1.

# %% [markdown]
# (fsdp-config-map-by-hand)=
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
    from accelerate.state import PartialState
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
        accelerator.state.distributed_type = PartialState().distributed_type = DistributedType.FSDP
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
# The same units and the same losses: the sharding the Trainer's `accelerator.prepare`
# applies with this config is these five `fully_shard` calls (the Trainer's loop adds its
# own clipping, scheduler and weight-decay groups). Anything else the map shows can be added
# by hand the same way: the checkpoint wrapper as Accelerate makes it,
# `checkpoint_wrapper(layer, preserve_rng_state=False)` before sharding, the policy as
# `mp_policy`, DCP's `get_state_dict` for a sharded save.
#
# (fsdp-config-map-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch and `transformers`:
# {download}`scripts/fsdp_config_map.py`. Every rank shards the Llama with the five
# `fully_shard` calls Accelerate makes of the page's `fsdp_config`, and trains it on its
# half of the batch; rank 0 then trains the unsharded model on
# the whole batch and prints the largest relative difference between the two runs' losses.
# The tests run this file under torchrun on 2 CPU ranks and check that line
# (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/fsdp_config_map.py
# :language: python
# ```

# %% [markdown]
# (fsdp-config-map-tips)=
# ## The tips behind this
#
# - {ref}`tip-fsdp-config-map`
# - {ref}`tip-trainer-check-fsdp`: on CPU ranks, none of this happens.

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("fsdp_config_map")
