"""Activation checkpointing variants on an FSDP2-sharded Llama, as a torchrun script.

    torchrun --nproc-per-node=2 checkpoint_variants.py

A small Llama (built from its config, no download) is sharded with each decoder layer an FSDP
unit, three ways: no checkpointing, each block checkpointed (checkpoint_wrapper), and selective
checkpointing that keeps the matmuls' outputs and recomputes the rest. Rank 0 prints, for each,
the activations one forward leaves for the backward on the rank's device (torch's MemTracker),
the matmul FLOPs of
a step (FlopCounterMode) and whether the gradients equal no checkpointing's on every rank.
Needs torch and transformers; each rank computes on its accelerator (GPU) where there is one,
else on the CPU (over gloo).
"""

import functools
import os

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = LlamaConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=256,
    attn_implementation="eager",  # its matmuls visible to the FLOP counter and the policy
)
ROWS, SEQ = 2, 64
# eager attention's matmuls; with SDPA, add its kernel (aten._scaled_dot_product_flash_attention, ...)
MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default)


def save_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


def build(variant, device):
    torch.manual_seed(0)  # the same weights in every variant
    model = LlamaForCausalLM(CONFIG).to(device)
    # the mesh on the rank's device: fully_shard's default follows the build's accelerator
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for i, layer in enumerate(model.model.layers):
        if variant == "each block":
            layer = checkpoint_wrapper(layer)
        elif variant == "selective":
            context = functools.partial(create_selective_checkpoint_contexts, save_matmuls)
            layer = checkpoint_wrapper(layer, context_fn=context)
        model.model.layers[i] = layer
        fully_shard(
            layer, mesh=mesh
        )  # checkpointing inside the unit: the recomputation runs after its gather
    return fully_shard(model, mesh=mesh)


def loss_of(model, x):
    # use_cache=False: a recomputed attention would append to the KV cache a second time
    return model(input_ids=x, labels=x, use_cache=False).loss


def measure(variant, x, device):
    model = build(variant, device)
    loss_of(model, x).backward()  # warm-up
    model.zero_grad(set_to_none=True)
    tracker = MemTracker()
    with tracker:
        loss = loss_of(model, x)
        snapshot = tracker.get_tracker_snapshot("current")
        held = snapshot.get(device, {}).get(_MemRefType.ACT, 0)  # activations on this rank's device
        loss.backward()
    grads = [p.grad.to_local().clone() for p in model.parameters()]  # this rank's shards
    model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as flops:
        loss_of(model, x).backward()
    return held, flops.get_total_flops(), grads


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

    g = torch.Generator().manual_seed(dist.get_rank())  # each rank its own rows
    x = torch.randint(CONFIG.vocab_size, (ROWS, SEQ), generator=g).to(device)
    runs = {variant: measure(variant, x, device) for variant in ("none", "each block", "selective")}
    _, none_flops, none_grads = runs["none"]
    # equal gradients prove nothing if they are all zero, or NaN (torch.equal is False for a NaN)
    usable = all(bool(g.isfinite().all()) for g in none_grads) and any(
        bool(g.any()) for g in none_grads
    )
    usable = torch.tensor(int(usable), device=device)
    dist.all_reduce(usable, op=dist.ReduceOp.MIN)
    if dist.get_rank() == 0:
        print(f"no checkpointing's gradients finite and not all zero on every rank: {bool(usable)}")
    for variant, (held, flops, grads) in runs.items():
        equal = torch.tensor(
            int(all(torch.equal(a, b) for a, b in zip(grads, none_grads))), device=device
        )
        dist.all_reduce(equal, op=dist.ReduceOp.MIN)  # on every rank
        if dist.get_rank() == 0:
            print(
                f"{variant}: {held / 2**20:.2f} MiB held for the backward, "
                f"{flops / none_flops:.2f}x the matmul FLOPs, gradients equal to none: {bool(equal)}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
