"""QLoRA on a CPU as a torchrun script: one evaluation repacks bitsandbytes' 4-bit weights.

    torchrun --nproc-per-node=2 qlora_cpu_repack.py

Every rank saves the same small Llama (transformers, one seed) to a folder of its own, loads it
back in 4 bits (NF4 codes stored as uint8), adds peft's LoRA adapters and shards it: one unit per
decoder layer, then the root. It evaluates one batch twice (eval(), no gradient), then takes one
training step's backward and counts the adapters that got a gradient: once as bitsandbytes
leaves it, once with its CPU conversion switched off (support_avx512bf16_for_cpu = False on
every Linear4bit). Rank 0 prints both. On a CPU with AVX512-BF16 the first evaluation converts
each weight to another layout: the sharded model's second evaluation then computes another
loss, and no adapter gets a gradient. On a CPU without it, or on GPUs, both cases agree.
Nothing is downloaded. Each rank computes on its accelerator (GPU) where there is one, else on
the CPU (over gloo).
"""

import os
import tempfile

import bitsandbytes
import torch
import torch.distributed as dist
from bitsandbytes.nn import Linear4bit
from peft import LoraConfig, get_peft_model
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


def sharded_qlora_model(folder, device, repack):
    """The model in 4 bits with its adapters, sharded; ``repack=False``: never converted."""
    model = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=FOUR_BIT, device_map=device
    )
    for layer in model.modules():
        if isinstance(layer, Linear4bit):
            if not repack:  # bitsandbytes' CPU conversion, at an eval() forward needing no gradient
                layer.support_avx512bf16_for_cpu = False
    torch.manual_seed(0)  # the adapters' A: the same on every rank
    model = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    )
    for layer in model.get_base_model().model.layers:
        fully_shard(layer)
    return fully_shard(model)


def evaluate_twice_then_step(model, tokens):
    """The loss of two evaluations of ``tokens``, then the adapters a backward reaches."""
    model.eval()
    with torch.no_grad():
        twice = [model(input_ids=tokens, labels=tokens).loss.item() for _ in range(2)]
    model.train()
    model(input_ids=tokens, labels=tokens).loss.backward()
    adapters = [p for p in model.parameters() if p.requires_grad]
    return twice, sum(p.grad is not None for p in adapters), len(adapters)


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

    tokens = torch.randint(
        0, CONFIG.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1)
    ).to(device)
    if dist.get_rank() == 0:
        print(f"AVX512-BF16 on this CPU: {bool(bitsandbytes.functional.has_avx512bf16())}")
    for repack in (True, False):
        model = sharded_qlora_model(folder, device, repack)
        twice, with_grad, adapters = evaluate_twice_then_step(model, tokens)
        if dist.get_rank() == 0:
            print(
                f"repack={repack}: evaluations {twice[0]:.5f} then {twice[1]:.5f}; "
                f"{with_grad} of {adapters} adapters got a gradient"
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    # Saved before the process group starts: under one, transformers' save_pretrained writes on
    # rank 0 only, and each rank here has a folder of its own.
    with tempfile.TemporaryDirectory() as folder:
        save_pretrained(folder)
        main(folder)
