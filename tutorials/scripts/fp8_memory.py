"""Two master copies as a torchrun script: FP8 under FSDP2 needs one float32 copy of the weights, not two.

    torchrun --nproc-per-node=2 fp8_memory.py

FSDP2's shard of each parameter, float32 here, is the master copy: an optimizer keeping float32
masters of its own (as FP8 libraries' do) holds the weights twice. Rank 0 prints the model states
per parameter of torchao's float8 Linears (bfloat16 policy) trained three ways, and the largest
loss difference between the first two. Needs torch and torchao; each rank computes on its GPU where
it has one (float8 matmuls: compute capability 8.9 or newer), else on the CPU over gloo.
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torchao.float8 import (
    Float8LinearConfig,
    convert_to_float8_training,
    precompute_float8_dynamic_scale_for_fsdp,
)

WIDTH, ROWS, STEPS, LR = 128, 32, 3, 1e-2


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW on float32 masters of the parameters, written back after each step (torch has none)."""

    def __init__(self, params, **kwargs):
        self.model_params = list(params)
        super().__init__([p.detach().float().clone() for p in self.model_params], **kwargs)

    @torch.no_grad()
    def step(self):
        masters = self.param_groups[0]["params"]
        for param, master in zip(self.model_params, masters):
            master.grad = param.grad.float()
        super().step()
        for param, master in zip(self.model_params, masters):
            param.copy_(master)  # rounded to the parameter's dtype
            master.grad = None

    def zero_grad(self, set_to_none=True):
        for param in self.model_params:
            param.grad = None


class BytesAllGather:
    """gloo all-gathers no float8 tensor: gather the same bytes as uint8 (set_custom_all_gather)."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        # all_gather_single where torch has it (all_gather_into_tensor, its old name, is deprecated)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        as_bytes = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
        return gather(*as_bytes, group=group, async_op=async_op)


def sharded_float8_model(stored, device, backend):
    torch.manual_seed(0)  # the same weights on every rank
    linears = [nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(3)]  # sizes: multiples of 16
    model = nn.Sequential(linears[0], nn.ReLU(), linears[1], nn.ReLU(), linears[2])
    model = model.to(device, stored)  # FSDP2 keeps (and shards) the parameters in this dtype
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)  # gathered in float8
    model = convert_to_float8_training(model, config=config)  # before sharding: DTensors won't swap
    # compute in bfloat16 (the activations too), reduce gradients in float32
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit in [*model[::2], model]:  # each Linear a unit, then the root
        fully_shard(unit, mp_policy=bf16)
        if backend == "gloo":
            unit.set_custom_all_gather(BytesAllGather())
    return model


def nbytes(tensors):
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]  # this rank's part
    return sum(t.numel() * t.element_size() for t in local)


def train_and_measure(model, optimizer_class, device):
    optimizer = optimizer_class(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS + 1):
        g = torch.Generator().manual_seed(1000 * step + dist.get_rank())  # each rank its own batch
        x = torch.randn(ROWS, WIDTH, generator=g)
        target = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(7)) / WIDTH**0.5
        loss = F.mse_loss(model(x.to(device)).float(), torch.tanh(x @ target).to(device))
        loss.backward()  # the gradients exist now: after the last step, measure here
        losses.append(loss.detach())
        if step < STEPS:
            optimizer.step()
            precompute_float8_dynamic_scale_for_fsdp(model)  # every weight's scale, one all-reduce
            optimizer.zero_grad()
    params = list(model.parameters())
    held = {id(p) for p in params}  # masters: what the optimizer steps that the model does not hold
    masters = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in held]
    state = [t for s in optimizer.state.values() for t in s.values() if t.dim()]  # not `step`
    states = nbytes(params) + nbytes(p.grad for p in params) + nbytes(state + masters)
    per_rank = sum(p.numel() for p in params) / dist.get_world_size()  # a DTensor's numel is global
    return torch.stack(losses), states / per_rank


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

    setups = [  # (name, dtype FSDP stores the parameters in, optimizer)
        ("AdamW on FSDP's float32 shards", torch.float32, torch.optim.AdamW),
        ("master-weight AdamW beside FSDP's float32 shards", torch.float32, MasterWeightAdamW),
        ("master-weight AdamW on bfloat16 shards", torch.bfloat16, MasterWeightAdamW),
    ]
    losses = []
    for name, stored, optimizer_class in setups:
        model = sharded_float8_model(stored, device, backend)
        loss, per_param = train_and_measure(model, optimizer_class, device)
        losses.append(loss)
        if dist.get_rank() == 0:
            print(f"float8 + bf16, {name}: {per_param:.1f} bytes of model states per parameter")
    if dist.get_rank() == 0:
        # the second float32 copy holds the same numbers as FSDP's: it changes memory, not training
        one, two = losses[:2]
        print(
            f"rank 0, {STEPS} steps, master-weight AdamW vs AdamW on float32 shards: "
            f"max |loss difference| = {(one - two).abs().max().item():.2e} (loss {one[-1].item():.4f})"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
