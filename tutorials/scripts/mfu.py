"""MFU as a torchrun script: a measured step's achieved FLOP/s over a peak, with FLOPs counted right.

    torchrun --nproc-per-node=2 mfu.py                      # the peak estimated from a timed matmul
    torchrun --nproc-per-node=8 mfu.py --peak-tflops 67     # an H100 SXM's fp32 peak (it trains in fp32)

MFU = tokens/s x FLOPs per token / (ranks x one's peak FLOP/s). FLOPs per token: 6 per matmul
parameter of the whole model (not a rank's shard), plus attention's; rank 0 checks them against
torch's FlopCounterMode. The peak: the datasheet's dense one (without sparsity) for the dtype the
run computes in, given, or else what a matmul reaches on each rank. Needs torch alone; each rank
computes on its accelerator (GPU) where there is one, else on the CPU (over gloo).
"""

import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

GLOBAL_BATCH, BLOCK, LAYERS, DIM, HEADS = 16, 64, 2, 64, 4


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
    def __init__(self, vocab=256, block=BLOCK, layers=LAYERS, dim=DIM, heads=HEADS):
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


def batch(step, rank, world_size):
    """This rank's rows of the global batch of ``step``: random bytes (the speed, not the text, counts here)."""
    g = torch.Generator().manual_seed(1000 + step)  # the same global batch on every rank
    rows = torch.randint(256, (GLOBAL_BATCH, BLOCK + 1), generator=g)[rank::world_size]
    return rows[:, :-1], rows[:, 1:]


def flops_per_token(model):
    """6 per matmul parameter (2 forward, 4 backward) + attention's scores and weighted values."""
    matmul = sum(p.numel() for p in model.parameters()) - model.pos.weight.numel()  # a lookup
    return 6 * matmul + 12 * LAYERS * HEADS * (DIM // HEADS) * BLOCK


def matmul_peak(device, n=512, repeats=20):
    """An estimate of a rank's peak: the best FLOP/s of n x n matmuls, every rank at once."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    best = math.inf
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        (a @ b).sum().item()  # .item(): waits for an accelerator too
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--peak-tflops", type=float, help="one accelerator's dense peak, TFLOP/s")
    args = parser.parse_args()
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

    torch.manual_seed(0)
    model = GPT().to(device)
    per_token = flops_per_token(model)  # the whole model's: under FSDP, a DTensor's numel is whole
    if rank == 0:  # the formula against torch's count of one forward and backward, unsharded
        inputs, targets = (t.to(device) for t in batch(0, 0, 1))
        # the math attention kernel: the counter has no formula for the CPU's fused one
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            F.cross_entropy(GPT().to(device)(inputs).flatten(0, 1), targets.flatten()).backward()
        counted = counter.get_total_flops() / targets.numel()
        print(f"FLOPs per token: 6N + attention {per_token:,}; FlopCounterMode {counted:,.0f}")
        print(f"counted / formula: {counted / per_token:.4f}")
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def step(i):
        inputs, targets = (t.to(device) for t in batch(i, rank, world_size))
        F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()

    for i in range(3):  # warm-up: the first steps allocate and set up
        step(i)
    dist.barrier()
    start, steps = time.perf_counter(), 10
    for i in range(3, 3 + steps):
        step(i)
    torch.tensor(0.0, device=device).item()  # wait for an accelerator's queued work
    dist.barrier()
    seconds = time.perf_counter() - start
    tokens_per_s = GLOBAL_BATCH * BLOCK * steps / seconds  # all ranks' tokens
    if args.peak_tflops:
        peak, source = args.peak_tflops * 1e12, "given"
    else:
        peaks = [None] * world_size
        dist.all_gather_object(peaks, matmul_peak(device))
        peak, source = min(peaks), "estimated: the best 512 x 512 matmul on each rank"
    achieved = tokens_per_s * per_token / world_size  # per rank
    if rank == 0:
        print(
            f"{tokens_per_s:,.0f} tokens/s on {world_size} ranks; {achieved / 1e9:.3f} GFLOP/s per rank"
        )
        print(f"peak {peak / 1e9:.1f} GFLOP/s per rank ({source}); MFU {achieved / peak:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
