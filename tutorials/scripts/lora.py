"""LoRA with FSDP2 as a torchrun script: peft's adapters train on a sharded, frozen model.

    torchrun --nproc-per-node=2 lora.py

Every rank builds the same small Llama (transformers) from the same seed, adds peft's LoRA
adapters to it, then shards it: one unit per decoder layer, then the root. Only the adapters
train; each rank trains on its slice of the batch. Rank 0 prints how many parameters train and
whether all of them are shards, then trains the same model alone, on the whole batch, and prints
the largest relative difference between the losses of the two runs. Nothing is downloaded. Each
rank computes on its accelerator (GPU) where there is one, else on the CPU (over gloo).
"""

import os

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

BATCH, STEPS, LR = 4, 5, 1e-2
CONFIG = LlamaConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def lora_model():
    """The "pretrained" model and its adapters, from one seed: the same on every rank."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG)
    # peft freezes the base and adds A (random) and B (zeros) beside the two projections
    return get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    )


def train(model, device, rows=slice(None)):
    """AdamW on the adapters, on the rows ``rows`` of the batch; the loss of each step."""
    tokens = torch.randint(
        0, CONFIG.vocab_size, (BATCH, 16), generator=torch.Generator().manual_seed(1)
    )
    tokens = tokens.to(device)[rows]
    # after sharding, and over the trainable parameters only: no state for the frozen base
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=tokens, labels=tokens).loss  # the mean over the rows' tokens
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


def main():
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

    # LoRA first, then shard: fully_shard manages the parameters a module holds when it is
    # called, so adapters added afterwards would be neither sharded nor reduced.
    model = lora_model()
    for layer in model.get_base_model().model.layers:
        fully_shard(layer)  # the layer's frozen weights and its adapters: one unit
    fully_shard(model)  # the root: the embedding, the final norm and the output layer
    per_rank = BATCH // world_size
    losses = train(model, device, rows=slice(rank * per_rank, (rank + 1) * per_rank))
    dist.all_reduce(losses)  # the mean over the ranks is the loss of the whole batch
    losses /= world_size

    if rank == 0:
        trainable = [p for p in model.parameters() if p.requires_grad]
        print(
            f"LoRA: {sum(p.numel() for p in trainable):,} of {sum(p.numel() for p in model.parameters()):,} "
            f"parameters trainable, every one a shard: {all(isinstance(p, DTensor) for p in trainable)}"
        )
        alone = train(lora_model().to(device), device)  # one process, the whole batch
        relative = ((losses - alone).abs() / alone.abs()).max().item()
        print(
            f"LoRA with FSDP2 on {world_size} ranks vs 1 process, {STEPS} steps, loss "
            f"{alone[0]:.4f} -> {alone[-1]:.4f}: max relative loss difference = {relative:.2e}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
