"""Loss parallel as a torchrun script: the logits split by vocabulary, the cross-entropy never gathers them.

    torchrun --nproc-per-node=2 loss_parallel.py

A small language model (token embedding, one hidden layer, output layer) under tensor parallelism
over 2 ranks: the embedding and the output layer are split by vocabulary (their rows), so each rank
computes the logits of its half of the vocabulary. Inside loss_parallel(), F.cross_entropy takes
those split logits as they are (a DTensor sharded on its last dimension) and computes the loss from
per-token maxima, sums of exponentials and target logits reduced across the ranks; the backward
runs inside it too. Rank 0 prints the logits it holds, then trains the unsharded model alone on
the same batches and prints the largest differences between the two runs' losses and weights.
Needs torch alone; each rank computes on its accelerator (GPU) where there is one, else on the CPU
(over gloo).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

VOCAB, DIM, STEPS, LR = 64, 16, 5, 1e-2


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, DIM)
        self.hidden = nn.Linear(DIM, DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        return self.lm_head(torch.tanh(self.hidden(self.tok_emb(tokens))))


def batch(step):
    """4 sequences of 16 tokens and their next tokens: the same on every rank."""
    g = torch.Generator().manual_seed(100 + step)
    rows = torch.randint(VOCAB, (4, 17), generator=g)
    return rows[:, :-1], rows[:, 1:]


def train(model, device, parallel_loss):
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        tokens, targets = (t.to(device) for t in batch(step))
        # loss_parallel() around the loss and its backward; one process needs no context
        with loss_parallel() if parallel_loss else torch.enable_grad():
            logits = model(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        # under loss_parallel the loss is a DTensor, Replicate() over the ranks
        losses.append(loss.full_tensor() if hasattr(loss, "full_tensor") else loss.detach())
    return torch.stack(losses), logits


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
    tp_mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("tp",))

    torch.manual_seed(0)  # the same weights on every rank
    model = TinyLM().to(device)
    plan = {
        # rows are the vocabulary: each rank looks up the tokens of its half, the rest sum in
        "tok_emb": RowwiseParallel(input_layouts=Replicate()),
        # the hidden layer split by columns, its output gathered for the output layer
        "hidden": ColwiseParallel(output_layouts=Replicate()),
        # each rank computes the logits of its half of the vocabulary, left split (a DTensor)
        "lm_head": ColwiseParallel(use_local_output=False),
    }
    parallelize_module(model, tp_mesh, plan)
    losses, logits = train(model, device, parallel_loss=True)
    weights = [p.full_tensor() for p in model.parameters()]  # a collective: every rank calls it

    if dist.get_rank() == 0:
        print(
            f"rank 0 holds logits {tuple(logits.to_local().shape)} of {tuple(logits.shape)}: "
            f"{logits.placements} over the vocabulary"
        )
        torch.manual_seed(0)
        alone = TinyLM().to(device)
        alone_losses, _ = train(alone, device, parallel_loss=False)  # one process
        loss_gap = (losses - alone_losses).abs().max().item()
        gaps = [(w - a).abs().max() for w, a in zip(weights, alone.parameters())]
        weight_gap = torch.stack(gaps).max().item()  # torch's max keeps a NaN; Python's may not
        print(
            f"loss parallel on {dist.get_world_size()} ranks vs 1 process, {STEPS} steps: "
            f"max |loss difference| = {loss_gap:.2e}, max |weight difference| = {weight_gap:.2e}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
