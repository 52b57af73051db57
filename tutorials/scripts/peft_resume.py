"""Save and resume a LoRA model under Accelerate's FSDP2 as the Trainer does, checking every rank's slice.

    torchrun --nproc-per-node=2 peft_resume.py

Every rank saves the same small Llama (transformers, one seed) to a folder of its own, adds LoRA
adapters (peft) and prepares model and optimizer with Accelerate's FSDP2 plugin and a full state
dict. A run trains 4 steps without stopping; another trains 2 steps, saves model and optimizer
with save_fsdp_model(..., adapter_only=True) and save_fsdp_optimizer (the Trainer's calls), builds
both again with every adapter set to zero, loads them, checks that no rank's lora_B is all zero
and trains 2 more steps. Rank 0 prints whether every rank's adapter slice came back exactly and
whether the resumed losses equal the uninterrupted run's (bit for bit on CPU ranks; GPU kernels
that are not deterministic may change the last bits). With accelerate 1.14 (and, by
accelerate#4206, earlier FSDP2 releases), a full state dict kept rank 0's slices only. Nothing is
downloaded. One machine: rank 0 makes the checkpoint folder the others save into. Each rank
computes on its accelerator (GPU) where there is one, else on the CPU (over gloo); on CPU ranks
Accelerate does not shard by itself, and the script gives its state the plugin as GPU ranks get it.
"""

import os
import shutil
import tempfile

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import (
    DistributedType,
    FullyShardedDataParallelPlugin,
    load_fsdp_model,
    load_fsdp_optimizer,
    save_fsdp_model,
    save_fsdp_optimizer,
)
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM


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


def fsdp2_accelerator():
    """An Accelerator with the FSDP2 plugin the Trainer makes of its fsdp_config, full state dicts."""
    local_ranks = int(os.environ["LOCAL_WORLD_SIZE"])
    on_accelerators = (
        torch.accelerator.is_available() and torch.accelerator.device_count() >= local_ranks
    )
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        state_dict_type="FULL_STATE_DICT",
    )
    accelerator = Accelerator(cpu=not on_accelerators, fsdp_plugin=plugin)
    if accelerator.distributed_type != DistributedType.FSDP:
        # CPU ranks: Accelerate attaches the plugin on accelerator ranks only and would train as
        # DDP; the state is given what an accelerator rank's gets, so that FSDP2 shards here too.
        accelerator.state.fsdp_plugin = plugin
        accelerator.state.distributed_type = PartialState().distributed_type = DistributedType.FSDP
    return accelerator


def prepared(accelerator, folder):
    """The LoRA model and its optimizer, sharded by Accelerate; the same initial values every time."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder).to(accelerator.device)
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    trained = [p for p in model.parameters() if p.requires_grad]
    return accelerator.prepare(model, torch.optim.AdamW(trained, lr=1e-2))


def train(accelerator, model, optimizer, steps):
    """Each rank's half of the step's batch (from the step's number); this rank's losses."""
    losses = []
    for step in steps:
        tokens = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(step))
        batch = tokens[dist.get_rank() :: dist.get_world_size()].to(accelerator.device)
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def adapter_slices(model):
    """This rank's slice of each adapter tensor."""
    return {
        n: p.detach().to_local().clone() for n, p in model.named_parameters() if p.requires_grad
    }


def ranks_with_zero_lora_b(model):
    """The ranks holding lora_B values, all zero (or NaN) after a load: with peft's default
    initialisation lora_B starts at zero, so these resumed without their part of the adapter
    (the check to keep after a resume)."""
    lora_b = [p.detach().to_local() for n, p in model.named_parameters() if "lora_B" in n]
    held = (sum(p.numel() for p in lora_b), sum(float(p.float().square().sum()) for p in lora_b))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, held)
    return [rank for rank, (count, squares) in enumerate(every) if count > 0 and not squares > 0]


def main(folder):
    accelerator = fsdp2_accelerator()  # starts the process group, from torchrun's variables
    checkpoint = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(checkpoint)  # one folder that every rank saves into
    try:
        resume_and_check(accelerator, folder, checkpoint[0])
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(checkpoint[0])
    accelerator.end_training()  # destroys the process group Accelerate made


def resume_and_check(accelerator, folder, checkpoint):
    plugin = accelerator.state.fsdp_plugin
    model, optimizer = prepared(accelerator, folder)
    never_stopped = train(accelerator, model, optimizer, steps=[0, 1, 2, 3])

    model, optimizer = prepared(accelerator, folder)
    losses = train(accelerator, model, optimizer, steps=[0, 1])
    saved = adapter_slices(model)
    save_fsdp_model(plugin, accelerator, model, checkpoint, adapter_only=True)
    save_fsdp_optimizer(plugin, accelerator, optimizer, model, checkpoint)

    model, optimizer = prepared(accelerator, folder)  # a restart, with every adapter at zero
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.zero_()
    load_fsdp_model(plugin, accelerator, model, checkpoint, adapter_only=True)
    load_fsdp_optimizer(plugin, accelerator, optimizer, model, checkpoint, adapter_only=True)
    lost = ranks_with_zero_lora_b(model)
    loaded = adapter_slices(model)
    exact = all(torch.equal(loaded[name], saved[name]) for name in saved)
    losses += train(accelerator, model, optimizer, steps=[2, 3])

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (exact, losses == never_stopped))
    if dist.get_rank() == 0:
        print(
            f"{plugin.state_dict_type.name}, adapter_only=True: ranks whose lora_B is all zero after loading: {lost}"
        )
        print(f"every rank's adapter slice restored exactly: {all(e for e, _ in every)}")
        print(
            f"resumed losses equal the uninterrupted run's on every rank: {all(s for _, s in every)}"
        )
    dist.barrier()  # every rank has loaded before the checkpoint goes


if __name__ == "__main__":
    # Saved before the process group starts: under one, transformers' save_pretrained writes on
    # rank 0 only, and each rank here has a folder of its own.
    with tempfile.TemporaryDirectory() as folder:
        save_pretrained(folder)
        main(folder)
