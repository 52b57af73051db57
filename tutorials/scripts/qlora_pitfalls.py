"""Three ways QLoRA breaks under FSDP2, the first two with their fix, as a torchrun script.

    torchrun --nproc-per-node=2 qlora_pitfalls.py

Every rank saves the same small Llama (transformers, one seed) to a folder of its own, then:

1. builds a bitsandbytes Linear4bit by hand and shards it before it is quantised (its first
   forward fails with an AssertionError without a message), then quantises first (it runs);
2. loads the model in 4 bits with the codes stored as bfloat16, adds peft's LoRA adapters, and
   runs a forward under MixedPrecisionPolicy(param_dtype=torch.float32), which casts the codes
   (it fails), then under param_dtype=torch.bfloat16 (it runs);
3. counts the bf16 code words that are NaN bit patterns, gathers the sharded model (unshard on
   every unit, as a forward does) and compares the bits (on CUDA, copies are reported to rewrite
   them: bitsandbytes#1945, pytorch#159333).

Rank 0 prints a line for each. Nothing is downloaded. Each rank computes on its accelerator
(GPU) where there is one, else on the CPU (over gloo).
"""

import os
import tempfile

import torch
import torch.distributed as dist
from bitsandbytes.nn import Linear4bit
from peft import LoraConfig, get_peft_model
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

CONFIG = LlamaConfig(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
BF16_CODES = BitsAndBytesConfig(
    load_in_4bit=True,
    bnb_4bit_quant_type="nf4",
    bnb_4bit_compute_dtype=torch.float32,
    bnb_4bit_quant_storage=torch.bfloat16,  # the storage that policies cast and copies may rewrite
)


def save_pretrained(folder):
    """The "pretrained" model, from one seed, saved in bf16 as checkpoints on the Hub are."""
    torch.manual_seed(0)
    LlamaForCausalLM(CONFIG).to(torch.bfloat16).save_pretrained(folder)


def one_layer(device, quantise_first):
    """1. A Linear4bit built by hand: Params4bit.to quantises it, and only if it is not yet a DTensor."""
    torch.manual_seed(0)
    layer = Linear4bit(128, 128, bias=False, compute_dtype=torch.float32, quant_type="nf4")
    if quantise_first:
        layer.to(device)
    fully_shard(layer)
    layer.to(device)
    try:
        out = layer(torch.ones(1, 128, device=device))
        return f"runs, output {tuple(out.shape)}"
    except AssertionError as error:
        return f"AssertionError{': ' + str(error) if str(error) else ' (no message)'}"


def sharded_model(folder, device, **options):
    model = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=BF16_CODES, device_map=device
    )
    torch.manual_seed(0)  # the adapters' A: the same on every rank
    model = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    )
    for layer in model.get_base_model().model.layers:
        fully_shard(layer, **options)
    return fully_shard(model, **options)


def forward_under(folder, device, param_dtype):
    """2. One forward of the model with bf16-stored codes under a policy casting to param_dtype."""
    model = sharded_model(folder, device, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype))
    tokens = torch.randint(
        0, CONFIG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1)
    )
    try:
        loss = model(input_ids=tokens.to(device), labels=tokens.to(device)).loss
        return f"runs, loss {loss.item():.4f}"
    except RuntimeError as error:
        return f"RuntimeError: {error}"


def nan_patterns(folder, device):
    """3. The codes that read as NaN, and whether FSDP2's gather keeps their bits."""
    model = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=BF16_CODES, device_map=device
    )
    bits = [
        m.weight.detach().view(torch.int16).clone()
        for m in model.modules()
        if isinstance(m, Linear4bit)
    ]
    nans = sum(int(b.view(torch.bfloat16).isnan().sum()) for b in bits)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.unshard()  # every unit's parameters gathered, as a forward gathers them
    gathered = [
        m.weight.detach().view(torch.int16) for m in model.modules() if isinstance(m, Linear4bit)
    ]
    same = all(torch.equal(a, b) for a, b in zip(gathered, bits))
    return f"{nans} of {sum(b.numel() for b in bits)} code words are NaN patterns; gathered, the same bits: {same}"


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

    lines = [
        f"Linear4bit sharded, then moved: {one_layer(device, quantise_first=False)}",
        f"Linear4bit quantised, then sharded: {one_layer(device, quantise_first=True)}",
        f"bf16 codes, param_dtype=float32: {forward_under(folder, device, torch.float32)}",
        f"bf16 codes, param_dtype=bfloat16: {forward_under(folder, device, torch.bfloat16)}",
        f"on the {device.type}: {nan_patterns(folder, device)}",
    ]
    if dist.get_rank() == 0:
        print("\n".join(lines))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    # Saved before the process group starts: under one, transformers' save_pretrained writes on
    # rank 0 only, and each rank here has a folder of its own.
    with tempfile.TemporaryDirectory() as folder:
        save_pretrained(folder)
        main(folder)
