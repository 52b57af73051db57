"""Saving Hugging Face weights from every rank as a torchrun script: DCP's HuggingFaceStorageWriter.

    torchrun --nproc-per-node=2 hf_dcp_export.py

Every rank builds the same small Llama (transformers) from the same seed, shards it with FSDP2 and
trains it a few steps on its slice of the batch. Then nothing is gathered to write it: every rank
writes its own shards as safetensors with torch.distributed.checkpoint's HuggingFaceStorageWriter,
and rank 0 consolidates them into the standard file, writes the config beside it, loads the
directory with from_pretrained and prints the largest differences of its weights and logits from
the trained sharded model's. Nothing is downloaded. Each rank computes on its accelerator (GPU)
where there is one, else on the CPU.
"""

import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.utils.logging import disable_progress_bar

disable_progress_bar()  # no "Loading" bars

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
        fully_shard(layer)  # one unit per decoder layer
    fully_shard(model)  # the root: the tied embedding and output layer, the final norm
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=LR
    )  # after sharding: it updates the shards
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

    # A directory every rank sees (here one machine's /tmp): rank 0 names it, the others learn it.
    out = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(out, src=0)
    out = out[0]
    # Each rank's shards, as DTensors: nothing is gathered. safetensors refuses two names for one
    # tensor, so the tied pair goes under its first name; from_pretrained ties it again (the config).
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    tied -= dict(model.named_parameters()).keys()
    state = {name: t for name, t in get_model_state_dict(model).items() if name not in tied}
    # Every rank writes its own file under out/sharded; rank 0 then merges them into out.
    writer = HuggingFaceStorageWriter(out, save_distributed=True, enable_consolidation=True)
    dcp.save(state, storage_writer=writer)

    # For the check only: the trained weights in full, every name, and the sharded model's logits.
    trained = {name: t.full_tensor() for name, t in model.state_dict().items()}
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    if rank == 0:
        per_rank_files = len(os.listdir(os.path.join(out, "sharded")))
        shutil.rmtree(os.path.join(out, "sharded"))  # consolidated: no longer needed
        CONFIG.save_pretrained(out)  # config.json, which from_pretrained reads first
        files = sorted(os.listdir(out))
        reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).to(device)
        read = reloaded.state_dict()  # every name, the tied pair's two included
        weights = torch.stack([(read[name] - t).abs().max() for name, t in trained.items()])
        weights = weights.max().item()  # a torch reduction: a NaN is not skipped
        with torch.no_grad():
            again = reloaded(input_ids=tokens).logits
        print(f"{per_rank_files} per-rank files consolidated into {files}")
        print(
            f"FSDP2 on {world_size} ranks, {STEPS} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
            f"written by every rank + from_pretrained: max |weight difference| = {weights:.2e}, "
            f"max |logit difference| = {(again - logits).abs().max().item():.2e}"
        )
        shutil.rmtree(out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
