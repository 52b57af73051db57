"""QLoRA with FSDP2 as a torchrun script: peft's adapters train on a sharded 4-bit base (bitsandbytes).

    torchrun --nproc-per-node=2 qlora.py

Every rank saves the same small Llama (transformers, one seed) to a folder of its own and loads
it back in 4 bits (NF4 codes stored as uint8), adds peft's LoRA adapters, and shards it: one unit
per decoder layer, then the root. Only the adapters train, in train() mode; each rank trains on
its slice of the batch. Rank 0 prints how many bytes of 4-bit weights each rank holds, then
trains the same model alone, on the whole batch, and prints the largest relative difference
between the losses of the two runs. Nothing is downloaded. Each rank computes on its
accelerator (GPU) where there is one, else on the CPU (over gloo).
"""

import os
import tempfile

import torch
import torch.distributed as dist
from bitsandbytes.nn import Linear4bit
from peft import LoraConfig, get_peft_model
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

BATCH, STEPS, LR = 4, 5, 1e-2
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
    bnb_4bit_quant_storage=torch.uint8,  # bytes: no mixed-precision policy casts them
)


def save_pretrained(folder):
    """The "pretrained" model, from one seed, saved in bf16 as checkpoints on the Hub are."""
    torch.manual_seed(0)
    LlamaForCausalLM(CONFIG).to(torch.bfloat16).save_pretrained(folder)


def qlora_model(folder, device):
    """The model loaded in 4 bits, with its adapters: the same on every rank."""
    model = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=FOUR_BIT, device_map=device
    )
    torch.manual_seed(0)  # the adapters' A
    return get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    )


def train(model, device, rows=slice(None)):
    """AdamW on the adapters, on the rows ``rows`` of the batch; the loss of each step."""
    tokens = torch.randint(
        0, CONFIG.vocab_size, (BATCH, 16), generator=torch.Generator().manual_seed(1)
    )
    tokens = tokens.to(device)[rows]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    model.train()  # from_pretrained returns the model in eval(): train, as a training loop does
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


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

    model = qlora_model(folder, device)
    # adapters first, then shard: the 4-bit weights (their bytes) and the adapters of a
    # layer are one unit
    for layer in model.get_base_model().model.layers:
        fully_shard(layer)
    fully_shard(model)
    per_rank = BATCH // world_size
    losses = train(model, device, rows=slice(rank * per_rank, (rank + 1) * per_rank))
    dist.all_reduce(losses)  # the mean over the ranks is the loss of the whole batch
    losses /= world_size
    four_bit = [m.weight for m in model.modules() if isinstance(m, Linear4bit)]
    held = torch.tensor(
        [sum(w.to_local().untyped_storage().nbytes() for w in four_bit)], device=device
    )
    every = [torch.zeros_like(held) for _ in range(world_size)]
    dist.all_gather(every, held)

    if rank == 0:
        alone = qlora_model(folder, device)  # one process, the whole batch
        whole = sum(
            m.weight.untyped_storage().nbytes()
            for m in alone.modules()
            if isinstance(m, Linear4bit)
        )
        print(f"4-bit weights per rank: {[int(t) for t in every]} bytes, of {whole} in one process")
        alone = train(alone, device)
        relative = ((losses - alone).abs() / alone.abs()).max().item()
        print(
            f"QLoRA with FSDP2 on {world_size} ranks vs 1 process, {STEPS} steps, loss "
            f"{alone[0]:.4f} -> {alone[-1]:.4f}: max relative loss difference = {relative:.2e}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    # Saved before the process group starts: under one, transformers' save_pretrained writes on
    # rank 0 only, and each rank here has a folder of its own.
    with tempfile.TemporaryDirectory() as folder:
        save_pretrained(folder)
        main(folder)
