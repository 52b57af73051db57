"""The transformers Trainer with an FSDP2 config as a torchrun script, checking what it built.

    torchrun --nproc-per-node=2 trainer_fsdp.py

Every rank saves the same small Llama (transformers, one seed) to a folder of its own and builds
the Trainer as its documentation configures FSDP2: fsdp=True and an fsdp_config naming FSDP2
and the decoder layer to shard. Before training, rank 0 prints Accelerate's distributed type
and whether FSDP is on, and a warning when the config was not applied; after two steps, the
type of the model trained and its FSDP units. On CPU ranks (over gloo) Accelerate's type is
MULTI_CPU, its FSDP plugin is dropped, and the Trainer trains with DistributedDataParallel
without saying so. With an accelerator per rank the plugin should be attached and the model
sharded (read in accelerate's AcceleratorState, not run here). Nothing is downloaded.
"""

import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)

FSDP_CONFIG = {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}


def save_pretrained(folder):
    """The "pretrained" model, from one seed, as a Hugging Face model folder."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    LlamaForCausalLM(config).save_pretrained(folder)


def main(folder):
    # The rank's device: an accelerator of its own where each rank on this machine has one, else
    # the CPU; the Trainer then places the model there itself (use_cpu, or LOCAL_RANK's device).
    local_ranks = int(os.environ["LOCAL_WORLD_SIZE"])
    on_accelerators = (
        torch.accelerator.is_available() and torch.accelerator.device_count() >= local_ranks
    )
    tokens = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(1))
    args = TrainingArguments(  # starts the process group, from torchrun's variables
        output_dir=str(Path(folder) / "trainer"),
        fsdp=True,
        fsdp_config=dict(FSDP_CONFIG),  # a copy: TrainingArguments adds its defaults to the dict
        use_cpu=not on_accelerators,
        per_device_train_batch_size=2,
        max_steps=2,
        save_strategy="no",  # nothing of this check is kept
        report_to=[],
        disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(folder)
    trainer = Trainer(
        model=model, args=args, train_dataset=[{"input_ids": t, "labels": t} for t in tokens]
    )
    # Check before a long run: is_fsdp_enabled is set when the Trainer is built.
    state = trainer.accelerator.state
    if dist.get_rank() == 0:
        print(
            f"Trainer with fsdp_config {FSDP_CONFIG}: accelerate's distributed type "
            f"{state.distributed_type.value}, is_fsdp_enabled={trainer.is_fsdp_enabled}"
        )
        if not trainer.is_fsdp_enabled:
            print(
                "WARNING: the fsdp_config was not applied: every rank will train the whole model "
                "(Accelerate attaches its FSDP plugin on accelerator ranks, not on "
                f"{state.distributed_type.value})"
            )
    trainer.train()
    units = [m for m in trainer.model_wrapped.modules() if isinstance(m, FSDPModule)]
    if dist.get_rank() == 0:
        print(f"trained a {type(trainer.model_wrapped).__name__} with {len(units)} FSDP units")
    # No destroy_process_group here: the group is the Trainer's (TrainingArguments made it), and
    # destroyed under the Trainer's DDP model it left a rank blocked as the model was freed, 1 run
    # in 6 (both ranks in main's return after it; the Trainer's own scripts never destroy it).


if __name__ == "__main__":
    # Saved before the process group starts: under one, transformers' save_pretrained writes on
    # rank 0 only, and each rank here has a folder of its own.
    with tempfile.TemporaryDirectory() as folder:
        save_pretrained(folder)
        main(folder)
