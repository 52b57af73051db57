"""From DeepSpeed ZeRO to FSDP2: one model trained both ways, the same losses.

    pip install deepspeed
    torchrun --nproc-per-node=2 deepspeed_zero.py

Trains one small model for 8 steps with FSDP2 and with DeepSpeed ZeRO-1, -2 and -3, the same
weights, rows and torch AdamW on each, and prints whether every stage's float32 losses and
final weights equal FSDP2's (on 2 CPU ranks they do, bit for bit). Then bf16: FSDP2 with
MixedPrecisionPolicy, started from the bf16-rounded weights and averaging gradients in bf16,
against ZeRO-2 with "bf16" (its float32 master weights start from the bf16-rounded ones, and
it averages in bf16): equal too. Needs torch and DeepSpeed; each rank computes on its
accelerator (GPU) where there is one, else on the CPU (over gloo). No DeepSpeed extension is
compiled: its shared-memory op (inference only) is marked unavailable, and the optimizer is
torch's.
"""

import gc
import os
import warnings

import deepspeed
import deepspeed.ops
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.utils import safe_get_full_fp32_param
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

warnings.filterwarnings("ignore", message=".*is deprecated. Please use")  # DeepSpeed's calls
STEPS, ROWS = 8, 8


def rank_device():
    if torch.accelerator.is_available():
        return torch.device(
            torch.accelerator.current_accelerator().type, int(os.environ["LOCAL_RANK"])
        )
    return torch.device("cpu")


def build(device, rounded_to_bf16=False):
    torch.manual_seed(0)  # the same weights on every rank and in every run
    model = nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4)
    ).to(device)
    if rounded_to_bf16:  # where DeepSpeed's bf16 master weights start
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.bfloat16())
    return model


def batches(device):
    g = torch.Generator().manual_seed(
        100 + dist.get_rank()
    )  # this rank's rows, the same in every run
    return [
        (
            torch.randn(ROWS, 32, generator=g).to(device),
            torch.randn(ROWS, 4, generator=g).to(device),
        )
        for _ in range(STEPS)
    ]


def flat(tensors):
    return torch.cat([t.detach().float().flatten() for t in tensors])


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def train_fsdp2(device, mp_policy=None, rounded=False):
    model = build(device, rounded)
    for unit in [*model[::2], model]:  # each linear layer, then the root
        fully_shard(unit, mp_policy=mp_policy or MixedPrecisionPolicy())
    optimizer, losses = adamw(model), []
    for x, y in batches(device):
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, flat(p.full_tensor() for p in model.parameters())


def train_zero(device, stage, bf16=False):
    model = build(device)
    config = {
        "train_micro_batch_size_per_gpu": ROWS,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,  # DeepSpeed's default clips at 1.0; FSDP2 clips only when asked
        "bf16": {"enabled": bf16},
    }  # with a torch optimizer passed in, DeepSpeed builds none of its own (no fused_adam)
    engine, *_ = deepspeed.initialize(model=model, optimizer=adamw(model), config=config)
    losses = []
    for x, y in batches(device):
        loss = F.mse_loss(engine(x.bfloat16() if bf16 else x).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, flat(safe_get_full_fp32_param(p) for p in engine.module.parameters())


def main():
    device = rank_device()
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    # Before DeepSpeed's communication starts, which would otherwise compile its shared-memory
    # op with ninja and g++ on a CPU machine; the op serves inference's all-reduce only. This is
    # DeepSpeed 0.19's internals (read by build_shm_op in deepspeed/comm/torch.py).
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=dist.get_default_backend_for_device(device))
    losses, weights = train_fsdp2(device)
    moved = bool((weights != flat(build(device).parameters())).any())
    trained = moved and all(map(torch.isfinite, map(torch.tensor, losses)))
    equal = {}
    for stage in (1, 2, 3):
        zero_losses, zero_weights = train_zero(device, stage)
        equal[stage] = zero_losses == losses and torch.equal(zero_weights, weights)
    bf16 = torch.bfloat16
    matched = train_fsdp2(
        device, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16), rounded=True
    )
    zero_bf16 = train_zero(device, 2, bf16=True)
    bf16_equal = matched[0] == zero_bf16[0] and torch.equal(matched[1], zero_bf16[1])
    bf16_trained = bool((zero_bf16[1] != flat(build(device, True).parameters())).any())
    if dist.get_rank() == 0:
        print(
            f"float32, {STEPS} steps on {dist.get_world_size()} ranks; the weights moved, the losses finite: {trained}"
        )
        for stage, same in equal.items():
            print(f"ZeRO-{stage}: losses and weights equal to FSDP2's: {same}")
        print(
            f"bf16, ZeRO-2 against FSDP2 with DeepSpeed's roundings: equal: {bf16_equal}; moved: {bf16_trained}"
        )
    # Free the models (reference cycles) while Python is whole: else gloo's threads may drop
    # their last tensors during the interpreter's shutdown, which aborts the process ("terminate
    # called without an active exception", pytorch/pytorch#179291): half the runs, here, without.
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
