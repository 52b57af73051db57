"""``summon_full_params``: one context manager over FSDP1, FSDP2/DTensor and plain modules.

FSDP1 has ``FullyShardedDataParallel.summon_full_params``; FSDP2 has no
equivalent, and a module sharded with ``fully_shard`` (or any DTensor
sharding) needs its full parameters for the same reasons: custom weight
initialisation, inspection, surgery. This module gives both the same API.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["summon_full_params"]


@contextlib.contextmanager
def summon_full_params(
    module: nn.Module,
    *,
    writeback: bool = True,
    recurse: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
) -> Iterator[None]:
    """Inside this context, ``module``'s parameters are full, plain tensors; on exit, they are shards again.

    One context manager for three kinds of module:

    - a module holding FSDP1 ``FullyShardedDataParallel`` instances: this is
      ``FullyShardedDataParallel.summon_full_params`` with the same arguments;
    - a module whose parameters are ``DTensor`` (FSDP2 ``fully_shard``, or any
      DTensor sharding): each parameter is replaced by a full plain
      ``nn.Parameter`` under its original name (tied parameters stay tied). On
      exit each rank copies its slice of the full tensor back into its local
      shard, in place, and the original DTensor parameters are put back: the same
      objects, so an optimizer built earlier and FSDP2's own bookkeeping still
      hold them. As in FSDP1, this happens on exit even if the block raised;
    - a plain module: nothing to do.

    Every rank must enter the context (gathering the parameters is a collective).
    Each rank writes back *its own* slice of *its own* full tensor, as FSDP1 does:
    if the block draws random numbers, seed every rank identically first, or the
    shards will come from different tensors.

    Args:
        writeback: copy changes made inside the context back into the shards.
        recurse: also the parameters of nested FSDP units (FSDP1 instances, or
            ``fully_shard``-ed submodules); ``False``: only ``module``'s own unit.
        rank0_only: only rank 0's module shows the full parameters inside the
            context; on the others the shards stay registered. With FSDP1 the
            other ranks free the gathered parameters on entry
            (``torch/distributed/fsdp/_unshard_param_utils.py``,
            ``_unshard_fsdp_state_params``); with DTensor parameters every rank
            still gathers the full tensors and holds them for the whole context,
            so it saves no memory there. Needs ``writeback=False``.
        offload_to_cpu: the full parameters live on the CPU inside the context.
        with_grads: the full gradients too (``param.grad``), written back with
            ``writeback``.

    Raises:
        ValueError: a module mixing FSDP1 instances and DTensor parameters, or
            ``rank0_only=True`` with ``writeback=True``.

    Example (a sharded linear layer, re-initialised from its full weight):

    >>> import torch, torch.nn as nn
    >>> from torch.distributed.fsdp import fully_shard
    >>> from fsdp_guide import launch, summon_full_params
    >>> def init_inside():
    ...     layer = fully_shard(nn.Linear(4, 4))
    ...     with summon_full_params(layer):
    ...         full_shape = tuple(layer.weight.shape)
    ...         nn.init.eye_(layer.weight)
    ...     return full_shape, layer.weight.to_local().tolist()
    >>> launch(init_inside, world_size=2, output="none")
    [((4, 4), [[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]), ((4, 4), [[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]])]
    """
    if rank0_only and writeback:
        raise ValueError(
            "rank0_only=True needs writeback=False: the other ranks do not see the full parameters, "
            "so there is nothing consistent to write back (FSDP1 refuses this combination too)"
        )
    has_fsdp1 = any(isinstance(m, FSDP) for m in module.modules())
    has_dtensor = any(isinstance(p, DTensor) for p in module.parameters())
    if has_fsdp1 and has_dtensor:
        raise ValueError(
            "this module mixes FSDP1 FullyShardedDataParallel instances with DTensor (FSDP2) parameters; "
            "summon_full_params supports one or the other: shard the whole model with one API"
        )
    if has_fsdp1:
        with FSDP.summon_full_params(
            module,
            writeback=writeback,
            recurse=recurse,
            rank0_only=rank0_only,
            offload_to_cpu=offload_to_cpu,
            with_grads=with_grads,
        ):
            yield
        return
    if not has_dtensor:
        yield
        return
    with _summon_dtensor_params(module, writeback, recurse, rank0_only, offload_to_cpu, with_grads):
        yield


@contextlib.contextmanager
def _summon_dtensor_params(module, writeback, recurse, rank0_only, offload_to_cpu, with_grads):
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()  # e.g. after a forward with reshard_after_forward=False: register the shards
    slots = _dtensor_slots(module, recurse)
    sharded = list({id(p): p for _, _, p in slots}.values())  # a tied parameter is gathered once
    full = {id(p): _gather(p, offload_to_cpu, with_grads) for p in sharded}  # every rank, same order
    show = not rank0_only or dist.get_rank() == 0
    try:
        if show:
            for owner, name, p in slots:
                owner._parameters[name] = full[id(p)]
        yield
    finally:
        for owner, name, p in slots:
            owner._parameters[name] = p
        if writeback:
            for p in sharded:
                _write_back(p, full[id(p)], with_grads)


def _dtensor_slots(module: nn.Module, recurse: bool) -> list[tuple[nn.Module, str, DTensor]]:
    """Every (owning module, attribute name, DTensor parameter) to swap, ties included."""
    slots = []
    for owner in _modules_in_scope(module, recurse):
        for name, p in owner._parameters.items():
            if isinstance(p, DTensor):
                slots.append((owner, name, p))
    return slots


def _modules_in_scope(module: nn.Module, recurse: bool) -> Iterator[nn.Module]:
    if recurse:
        yield from module.modules()
        return
    if not isinstance(module, FSDPModule):
        yield module
        return
    # An FSDP2 unit owns its subtree up to, not including, the nested units.
    stack = [module]
    while stack:
        m = stack.pop()
        yield m
        stack.extend(c for c in m.children() if not isinstance(c, FSDPModule))


@torch.no_grad()
def _gather(p: DTensor, offload_to_cpu: bool, with_grads: bool) -> nn.Parameter:
    full = p.full_tensor()
    if offload_to_cpu:
        full = full.cpu()
    param = nn.Parameter(full, requires_grad=p.requires_grad)
    if with_grads and p.grad is not None:
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        param.grad = grad.to(full.device)
    return param


@torch.no_grad()
def _write_back(p: DTensor, full: torch.Tensor, with_grads: bool) -> None:
    p.to_local().copy_(_my_slice(full, p))  # in place: FSDP2 all-gathers from this storage
    if with_grads and p.grad is not None and full.grad is not None:
        local_grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        local_grad.copy_(_my_slice(full.grad, p))


def _my_slice(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    # src_data_rank=None: no communication, each rank keeps its own slice of its own tensor.
    return distribute_tensor(full.to(like.device), like.device_mesh, like.placements, src_data_rank=None).to_local()
