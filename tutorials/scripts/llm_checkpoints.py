"""Checkpoints that resume exactly, as a torchrun script: DCP save, stop, load, and the same losses.

    torchrun --nproc-per-node=2 llm_checkpoints.py

A small GPT over bytes, sharded with FSDP2, trains 40 steps without stopping. A second run trains
20, and saves with torch.distributed.checkpoint (DCP) each rank's shards of the model and of AdamW's
state, and the step, which is the data position too (batch i depends on i alone). A third model,
initialised otherwise, loads it and trains steps 21 to 40: rank 0 compares their losses with the
first run's with == (bit for bit; a NaN never equals itself). Needs torch alone; each rank computes
on its accelerator (GPU) where there is one, else on the CPU (over gloo).
"""

import math
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

GLOBAL_BATCH, BLOCK, STEPS, STOP, LR = 16, 64, 40, 20, 3e-3


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


def batch(corpus, step, rank, world_size):
    """This rank's rows of the global batch of ``step``: windows of the corpus, targets shifted by one."""
    g = torch.Generator().manual_seed(1000 + step)  # the same global batch on every rank
    starts = torch.randint(len(corpus) - BLOCK - 1, (GLOBAL_BATCH,), generator=g)[rank::world_size]
    rows = torch.stack([corpus[s : s + BLOCK + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def build(seed, device):
    """The model, sharded, and its optimizer; ``seed``: the initial weights, the same on every rank."""
    torch.manual_seed(seed)
    model = GPT().to(device)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:  # nanoGPT's N(0, 0.02); LayerNorms keep 1 and 0
                p.normal_(0, 0.02)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def train(model, optimizer, corpus, steps, rank, world_size, device):
    """Train ``steps`` (step numbers: the batches they read); the losses, averaged over ranks."""
    losses = []
    for step in steps:
        inputs, targets = (t.to(device) for t in batch(corpus, step, rank, world_size))
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss := loss.detach())
        losses.append(loss.item() / world_size)
    return losses


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
    with open(__file__, "rb") as f:  # the text: this file's bytes
        corpus = torch.tensor(list(f.read()))
    run = dict(corpus=corpus, rank=rank, world_size=world_size, device=device)

    model, optimizer = build(0, device)
    straight = train(model, optimizer, steps=range(1, STEPS + 1), **run)  # without stopping

    model, optimizer = build(0, device)
    train(model, optimizer, steps=range(1, STOP + 1), **run)
    model_state, optim_state = get_state_dict(model, optimizer)  # sharded: DTensors
    path = f"checkpoint/step-{STOP}"  # each rank writes its own shards into this directory
    dcp.save({"model": model_state, "optim": optim_state, "step": STOP}, checkpoint_id=path)
    del model, optimizer  # the job stops here

    model, optimizer = build(1, device)  # other weights: the load must replace all of them
    model_state, optim_state = get_state_dict(model, optimizer)  # what to fill in, with its shards
    state = {"model": model_state, "optim": optim_state, "step": 0}
    dcp.load(state, checkpoint_id=path)  # in place; each rank reads the pieces its shards need
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    start = state["step"] + 1  # the data position: the next batch is the next step's
    resumed = train(model, optimizer, steps=range(start, STEPS + 1), **run)

    if rank == 0:
        print(
            f"without stopping: step 1 loss {straight[0]:.4f}, step {STEPS} loss {straight[-1]:.4f}"
        )
        print(f"resumed from {path} at step {start}: step {STEPS} loss {resumed[-1]:.4f}")
        finite = all(math.isfinite(loss) for loss in straight + resumed)
        print(
            f"steps {start}-{STEPS}, resumed == without stopping: {resumed == straight[STOP:]} "
            f"({len(resumed)} losses, all finite: {finite})"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
