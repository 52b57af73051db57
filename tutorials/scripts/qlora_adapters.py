"""QLoRA adapters from FSDP2 shards as a torchrun script: saved whole, loaded in one process, merged.

    torchrun --nproc-per-node=2 qlora_adapters.py

Every rank saves the same small Llama (transformers, one seed) to a folder of its own, loads it
back in 4 bits (bitsandbytes NF4, every other tensor in fp32), adds peft's LoRA adapters, shards
it (one unit per decoder layer, then the root) and trains the adapters on its slice of the
batch. Every rank then gathers the full state dict (a collective) and rank 0 saves the adapters
from it with peft's save_pretrained. Rank 0 loads them into one process on the 4-bit base and
prints the largest logit difference from the trained, sharded model; then merges them into the
4-bit base and into the base dequantised to fp32, and prints each merged first query
projection's error (from its base plus its update) as a part of the update. Nothing is
downloaded. Each rank computes on its accelerator (GPU) where there is one, else on the CPU
(over gloo).
"""

import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from bitsandbytes.functional import dequantize_4bit
from bitsandbytes.nn import Linear4bit
from peft import LoraConfig, PeftModel, get_peft_model
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

CONFIG = LlamaConfig(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
FOUR_BIT = BitsAndBytesConfig(
    load_in_4bit=True,
    bnb_4bit_quant_type="nf4",
    bnb_4bit_compute_dtype=torch.float32,
    bnb_4bit_quant_storage=torch.uint8,
)


def save_pretrained(folder):
    """The "pretrained" model, from one seed, saved in bf16 as checkpoints on the Hub are."""
    torch.manual_seed(0)
    LlamaForCausalLM(CONFIG).to(torch.bfloat16).save_pretrained(folder)


def four_bit_model(folder, device):
    model = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=FOUR_BIT, dtype=torch.float32, device_map=device
    )
    for layer in model.modules():
        # no CPU repacking of the 4-bit weights at the first evaluation (see qlora_cpu_repack.py)
        if isinstance(layer, Linear4bit):
            layer.support_avx512bf16_for_cpu = False
    return model


def dense(layer):
    """The weight a layer computes with, in fp32 (dequantised if it is 4-bit)."""
    if isinstance(layer, Linear4bit):
        return dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()
    return layer.weight.detach().float()


def check_in_one_process(folder, adapters, tokens, trained, device):
    """Rank 0: the saved adapters against the trained model, and what each merge loses."""
    model = PeftModel.from_pretrained(four_bit_model(folder, device), adapters).eval()
    with torch.no_grad():
        unmerged = model(input_ids=tokens).logits
    difference = (unmerged - trained).abs().max().item()
    print(
        f"adapters saved from {dist.get_world_size()} ranks, loaded in one process: "
        f"largest logit difference from the trained model = {difference:.2e}"
    )
    q_proj = model.get_base_model().model.layers[0].self_attn.q_proj
    update, base = q_proj.get_delta_weight("default").float(), dense(q_proj.base_layer)
    for into in ("the 4-bit base", "the base dequantised to fp32"):
        base_model = four_bit_model(folder, device)
        if "dequantised" in into:
            base_model = base_model.dequantize()  # plain Linear layers, in fp32
        merged = PeftModel.from_pretrained(base_model, adapters).merge_and_unload()
        layer = merged.model.layers[0].self_attn.q_proj
        lost = ((dense(layer) - base - update).norm() / update.norm()).item()
        print(f"merged into {into}: q_proj's error as a part of its update = {lost:.2e}")


def main(folder):
    # The rank's device: an accelerator of its own where each rank on this machine has one, else
    # the CPU (is_available: a CUDA build of torch on a machine without a GPU has none).
    local_rank, local_ranks = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    accelerator = (
        torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    )
    if accelerator and torch.accelerator.device_count() >= local_ranks:
        device = torch.device(accelerator.type, local_rank)
        torch.accelerator.set_device_index(local_rank)
    else:
        device = torch.device("cpu")
    backend = dist.get_default_backend_for_device(device)  # NCCL on GPUs, gloo on the CPU
    dist.init_process_group(backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # the adapters' A: the same on every rank
    model = get_peft_model(
        four_bit_model(folder, device),
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    )
    for layer in model.get_base_model().model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    tokens = torch.randint(
        0, CONFIG.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1)
    ).to(device)
    batch = tokens[rank::world_size]  # this rank's slice
    for _ in range(4):
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    # Every rank's slice of every adapter, gathered: a collective, so every rank calls it. The
    # model's own state dict holds DTensors, which peft's save_pretrained cannot write.
    full = get_model_state_dict(
        model,  # the adapters only: the frozen base stays out of the gather
        options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True),
    )
    model.eval()
    with torch.no_grad():
        trained = model(input_ids=tokens).logits  # the sharded model, on the whole batch
    if rank == 0:
        adapters = Path(folder) / "adapters"
        model.save_pretrained(adapters, state_dict=full)
        check_in_one_process(folder, adapters, tokens, trained, device)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    # Saved before the process group starts: under one, transformers' save_pretrained writes on
    # rank 0 only, and each rank here has a folder of its own.
    with tempfile.TemporaryDirectory() as folder:
        save_pretrained(folder)
        main(folder)
