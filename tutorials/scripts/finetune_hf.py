"""Fine-tuning a Hugging Face model as a torchrun script: shard, train, gather, save_pretrained.

    torchrun --nproc-per-node=2 finetune_hf.py

Every rank builds the same small Llama (transformers) from the same seed, shards it with FSDP2
(one unit per decoder layer, then the root) and trains it a few steps on its slice of the batch.
Then the full weights are gathered to rank 0, which loads them into an ordinary transformers model,
writes it with save_pretrained to a temporary directory, reads it back with from_pretrained, and
prints the largest differences of the weights and logits from the sharded model's. Nothing is
downloaded. Each rank computes on its accelerator (GPU) where there is one, else on the CPU.
"""

import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.utils.logging import disable_progress_bar

disable_progress_bar()  # no "Writing" and "Loading" bars

BATCH, STEPS, LR = 4, 5, 1e-3
CONFIG = LlamaConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,  # the embedding and the output layer: one parameter, under two names
)


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

    torch.manual_seed(0)  # the same "pretrained" weights on every rank
    model = LlamaForCausalLM(CONFIG)
    for layer in model.model.layers:
        fully_shard(layer)  # one unit per decoder layer: gathered for its forward and backward
    fully_shard(model)  # the root: the tied embedding and output layer, the final norm
    # after sharding: it updates the shards
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, 16), generator=g).to(device)
    per_rank = BATCH // world_size
    mine = tokens[rank * per_rank : (rank + 1) * per_rank]
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    losses = torch.stack(losses)
    dist.all_reduce(losses)  # the mean over the ranks is the loss of the whole batch
    losses /= world_size
    with torch.no_grad():
        logits = model(input_ids=tokens).logits  # the sharded model's: every rank runs it

    # Every rank takes part in the gather; rank 0 alone receives the full tensors, on its CPU, one
    # parameter at a time, so no rank holds the whole model on its accelerator.
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    if rank == 0:
        with tempfile.TemporaryDirectory() as out:
            plain = LlamaForCausalLM(CONFIG)  # an ordinary model, to hold the gathered weights
            plain.load_state_dict(state)
            plain.save_pretrained(out)  # config.json and model.safetensors, as on the Hub
            reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        read = reloaded.state_dict()  # every name the gather gave, the tied pair's two included
        weights = torch.stack([(read[name] - t).abs().max() for name, t in state.items()])
        weights = weights.max().item()  # a torch reduction: a NaN is not skipped
        with torch.no_grad():
            again = reloaded.to(device)(input_ids=tokens).logits
        print(
            f"FSDP2 on {world_size} ranks, {STEPS} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
            f"save_pretrained + from_pretrained: max |weight difference| = {weights:.2e}, "
            f"max |logit difference| = {(again - logits).abs().max().item():.2e}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
