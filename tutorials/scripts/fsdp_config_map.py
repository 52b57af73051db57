"""An fsdp_config's sharding, by hand, as a torchrun script: the fully_shard calls Accelerate makes.

    torchrun --nproc-per-node=2 fsdp_config_map.py

The fsdp_config is the Trainer's (transformers); accelerate turns it into the calls below, which
need only torch. Every rank saves the same small Llama (transformers, one seed) to a folder of its own,
loads it, and shards it with the five fully_shard calls accelerate 1.15's fsdp2_prepare_model
makes of that config: one unit per decoder layer, the embedding, the final norm with the output
layer (kept gathered after forward), then the root. Each rank trains it on its half of the
batch; rank 0 then trains the unsharded model on the whole batch and prints the largest
relative difference between the two runs' losses. Nothing is downloaded. Each rank computes on
its accelerator (GPU) where there is one, else on the CPU (over gloo).
"""

import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

# The Trainer's fsdp_config these calls stand for:
#     {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
STEPS, BATCH = 3, 4


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


def shard_as_accelerate_does(model, mp_policy=None):
    """The fully_shard calls of accelerate's fsdp2_prepare_model for that config. With bf16=True,
    mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
    output_dtype=torch.bfloat16)."""
    mp_policy = mp_policy or MixedPrecisionPolicy()
    for layer in model.model.layers:  # transformer_layer_cls_to_wrap
        fully_shard(layer, reshard_after_forward=True, mp_policy=mp_policy)
    fully_shard(model.model.embed_tokens, reshard_after_forward=True, mp_policy=mp_policy)
    # used first in backward: kept gathered after forward
    fully_shard([model.model.norm, model.lm_head], reshard_after_forward=False, mp_policy=mp_policy)
    return fully_shard(model, mp_policy=mp_policy)  # the root: torch's default for it


def train(model, device, rows=slice(None)):
    """AdamW on the rows ``rows`` of the batch; the loss of each step."""
    tokens = torch.randint(0, 256, (BATCH, 16), generator=torch.Generator().manual_seed(2))
    batch = tokens[rows].to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=batch, labels=batch).loss
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

    model = AutoModelForCausalLM.from_pretrained(folder).to(device)
    shard_as_accelerate_does(model)
    units = sorted(type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule))
    per_rank = BATCH // world_size
    losses = train(model, device, rows=slice(rank * per_rank, (rank + 1) * per_rank))
    dist.all_reduce(losses)  # the mean over the ranks is the loss of the whole batch
    losses /= world_size
    if rank == 0:
        alone = train(AutoModelForCausalLM.from_pretrained(folder).to(device), device)
        relative = ((losses - alone).abs() / alone.abs()).max().item()
        print(f"FSDP units: {units}")
        print(
            f"sharded as Accelerate does on {world_size} ranks vs 1 process, {STEPS} steps, loss "
            f"{alone[0]:.4f} -> {alone[-1]:.4f}: max relative loss difference = {relative:.2e}"
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    # Saved before the process group starts: under one, transformers' save_pretrained writes on
    # rank 0 only, and each rank here has a folder of its own.
    with tempfile.TemporaryDirectory() as folder:
        save_pretrained(folder)
        main(folder)
