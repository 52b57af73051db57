"""The LLM recipe as a torchrun script: a small GPT over bytes, sharded with FSDP2, whose loss falls.

    torchrun --nproc-per-node=2 llm.py

The recipe's order: build the model on the meta device (no memory), fully_shard each block then
the root, allocate each rank's shards on its device, and initialise them as one process would
(every rank draws each parameter in full from the same seed and keeps its own slice). Then AdamW
with gradient clipping over the global norm, each rank training on its rows of every global batch
of bytes of this file. Rank 0 prints the loss every 10 steps. Needs torch alone; each rank computes
on its accelerator (GPU) where there is one, else on the CPU (over gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

GLOBAL_BATCH, BLOCK, STEPS, LR = 16, 64, 40, 3e-3


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.fc, self.out = nn.Linear(dim, 4 * dim, bias=False), nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (
            t.view(B, T, self.heads, -1).transpose(1, 2)
            for t in self.qkv(self.ln_1(x)).chunk(3, -1)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab=256, block=BLOCK, layers=2, dim=64, heads=4):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(block, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: one tensor, in the root's unit

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@torch.no_grad()
def init_weights(model, seed):
    """Every rank draws each parameter in full from the same generator and keeps its own slice:
    the weights one process would draw (on the shards, each rank would draw the same numbers)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():  # the same order everywhere; a tied one once
        if p.dim() == 1:  # LayerNorm: weight 1, bias 0
            full = torch.ones(p.shape) if name.endswith("weight") else torch.zeros(p.shape)
        else:
            full = torch.randn(p.shape, generator=g) * 0.02
        mine = distribute_tensor(full.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
        p.to_local().copy_(mine.to_local())  # src_data_rank=None: each rank slices its own copy


def batch(corpus, step, rank, world_size):
    """This rank's rows of the global batch of ``step``: windows of the corpus, targets shifted by one."""
    g = torch.Generator().manual_seed(1000 + step)  # the same global batch on every rank
    starts = torch.randint(len(corpus) - BLOCK - 1, (GLOBAL_BATCH,), generator=g)[rank::world_size]
    rows = torch.stack([corpus[s : s + BLOCK + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


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

    with torch.device("meta"):
        model = GPT()  # no memory yet, whatever the size
    for block in model.blocks:
        fully_shard(block)  # each block a unit: gathered for its forward and backward only
    fully_shard(model)  # the root last: embeddings, final norm, the tied head
    model.to_empty(device=device)  # each rank allocates its shards only
    init_weights(model, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)  # over the shards

    with open(__file__, "rb") as f:  # the text: this file's bytes
        corpus = torch.tensor(list(f.read()))
    for step in range(1, STEPS + 1):
        inputs, targets = (t.to(device) for t in batch(corpus, step, rank, world_size))
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()  # the gradients are reduce-scattered: each rank gets its shard's average
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the norm of the whole gradient
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss := loss.detach())  # the mean over ranks, for the log
        if rank == 0 and (step == 1 or step % 10 == 0):
            print(f"step {step:2}: loss {loss.item() / world_size:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
