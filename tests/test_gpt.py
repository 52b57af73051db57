"""The GPT under tensor parallelism: attention and MLP shard by heads and columns and compute what one process does."""

from __future__ import annotations

import pytest
import torch

from fsdp_guide import launch
from fsdp_guide.gpt import GPT, GPTConfig

CONFIG = GPTConfig(block_size=16, n_layer=2, n_head=4, n_embd=32)


def _model():
    torch.manual_seed(0)
    model = GPT(CONFIG)
    model.init_weights()
    return model


def _batch():
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(CONFIG.vocab_size, (4, CONFIG.block_size + 1), generator=g)
    return rows[:, :-1], rows[:, 1:]


def _one_process():
    model = _model()
    tokens, targets = _batch()
    _, loss = model(tokens, targets)
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


def _parallel(dp: int):
    """Tensor parallel over 2 ranks (q, k, v and fc by columns, the projections by rows), sharded over dp."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dp, 2), mesh_dim_names=("dp", "tp"))
    model = _model()
    plan = {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(),
    }
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], plan)
        if dp > 1:
            fully_shard(block, mesh=mesh["dp"])
    if dp > 1:
        fully_shard(model, mesh=mesh["dp"])
    tokens, targets = _batch()
    rows = tokens.shape[0] // dp  # the ranks of a TP group share a batch; dp groups split it
    mine = slice(mesh["dp"].get_local_rank() * rows, (mesh["dp"].get_local_rank() + 1) * rows)
    _, loss = model(tokens[mine], targets[mine])
    loss.backward()
    grads = {
        name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
        for name, p in model.named_parameters()
    }
    total = loss.detach().clone()
    dist.all_reduce(total)
    return (total / dist.get_world_size()).item(), grads if dist.get_rank() == 0 else None


@pytest.mark.parametrize("dp, world_size", [(1, 2), (2, 4)])
def test_tensor_parallel_gpt_computes_what_one_process_computes(dp, world_size):
    loss, grads = _one_process()
    results = launch(_parallel, dp, world_size=world_size, output="none")
    parallel_loss, parallel_grads = results[0]
    assert parallel_loss == pytest.approx(loss, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(parallel_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
