"""FP8 training with FSDP2 through torchao, on CUDA and (slowly) on CPU with gloo.

``float8_fully_shard`` is torchao's recipe: swap each ``nn.Linear`` for a
``Float8Linear`` *before* sharding, with float8 all-gather enabled, then
``fully_shard`` each of them and the root. Two things are added for the machines
this guide runs on, both said where they happen: gloo cannot all-gather float8
tensors, and torchao's import logs warnings about CUDA kernels a CPU build lacks.

The FP8 pages share one small model, sharded in four precisions, and its batches:
``three_linears``, ``shard_in_precision`` and ``regression_batch``.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["quiet_torchao", "float8_fully_shard", "three_linears", "shard_in_precision", "regression_batch"]

_PRECISIONS = ("fp32", "bf16", "fp8", "fp8+bf16")


def quiet_torchao() -> None:
    """Silence torchao's import-time warnings about CUDA kernels (``_C_mxfp8``, ``_C_cutlass_90a``).

    They are ``logging`` records, not ``warnings``: raise those two loggers to ERROR
    before ``import torchao``, in every process (ranks are fresh processes). FSDP2's
    warning that a ``Float8Linear`` returns a view is silenced too: nothing here edits
    module outputs in place.
    """
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def _float8_as_bytes_all_gather():
    # FSDPModule.set_custom_all_gather is public; the AllGather interface it takes is
    # not exported, hence the private import.
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

    class Float8AsBytesAllGather(AllGather):
        """gloo rejects float8 ('Invalid scalar type'): gather the same bytes as uint8."""

        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            if output_tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the new name, if present
            return gather(output_tensor, input_tensor, group=group, async_op=async_op)

    return Float8AsBytesAllGather()


def float8_fully_shard(model: nn.Module, **fully_shard_kwargs) -> nn.Module:
    """Convert ``model``'s Linears to torchao ``Float8Linear`` (float8 all-gather on), then shard.

    Returns the sharded model (a new object only when ``model`` itself is a Linear).
    Each ``Float8Linear`` becomes an FSDP2 unit, then the root. ``fully_shard_kwargs``
    (``mp_policy``, ``mesh``, ...) go to every ``fully_shard`` call. After each
    ``optimizer.step()``, call torchao's ``precompute_float8_dynamic_scale_for_fsdp(model)``:
    it computes every weight's scale with one all-reduce instead of one per weight
    per all-gather. Linears whose sizes are not multiples of 16 stay in high precision
    (torchao's rule for its fp8 matmul).

    Example:

    >>> import torch.nn as nn
    >>> from fsdp_guide import launch
    >>> from fsdp_guide.fp8 import float8_fully_shard
    >>> def gathered_dtype():
    ...     model = float8_fully_shard(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16)))
    ...     return type(model[0]).__name__, model[0].weight.to_local().__class__.__name__
    >>> launch(gathered_dtype, world_size=2, output="none")[0]
    ('FSDPFloat8Linear', 'WeightWithDynamicFloat8CastTensor')
    """
    quiet_torchao()
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    def fp8_capable(module: nn.Module, fqn: str) -> bool:
        return isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0

    # Before fully_shard: afterwards the weights are DTensors and the swap fails
    # ("aten.mm.default got mixed torch.Tensor and DTensor").
    # returns a new root if the root is a Linear
    model = convert_to_float8_training(
        model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True), module_filter_fn=fp8_capable
    )

    units = [m for m in model.modules() if isinstance(m, Float8Linear) and m is not model]
    for unit in units + [model]:  # the root last
        fully_shard(unit, **fully_shard_kwargs)
        if dist.get_backend() == "gloo":
            unit.set_custom_all_gather(_float8_as_bytes_all_gather())
    return model


def three_linears(width: int = 128) -> nn.Sequential:
    """The FP8 pages' model: three ``width`` x ``width`` Linears without bias, ReLU between.

    Seeded, so every rank (and every call) builds the same weights; ``width`` a multiple of 16
    keeps every Linear float8-capable.
    """
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(width, width, bias=False),
        nn.ReLU(),
        nn.Linear(width, width, bias=False),
        nn.ReLU(),
        nn.Linear(width, width, bias=False),
    )


def shard_in_precision(precision: str, stored: torch.dtype = torch.float32, width: int = 128) -> nn.Module:
    """``three_linears(width)`` with its parameters in ``stored``, sharded in one of four precisions.

    ``precision`` is ``"fp32"``, ``"bf16"``, ``"fp8"`` or ``"fp8+bf16"``; ``stored`` is the
    dtype FSDP2 keeps (and shards) the parameters in. ``"bf16"`` in ``precision`` adds a
    ``MixedPrecisionPolicy`` computing in bfloat16 and reducing gradients in float32;
    ``"fp8"`` converts the Linears with :func:`float8_fully_shard`. Each Linear is a unit,
    then the root. Call it on every rank, inside a process group.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if precision not in _PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {', '.join(_PRECISIONS)}")
    model = three_linears(width).to(stored)
    mp_policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if "bf16" in precision
        else MixedPrecisionPolicy()
    )
    if precision.startswith("fp8"):
        return float8_fully_shard(model, mp_policy=mp_policy)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mp_policy=mp_policy)
    return fully_shard(model, mp_policy=mp_policy)


def regression_batch(
    step: int, rank: int, device: torch.device | str, rows: int = 32, width: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's batch for a step: ``rows`` random inputs and their targets ``tanh(x @ W)``, ``W`` fixed.

    Drawn on the CPU (the same numbers on any device), then moved to ``device``.
    """
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(rows, width, generator=g)
    target = torch.randn(width, width, generator=torch.Generator().manual_seed(7)) / width**0.5
    return x.to(device), torch.tanh(x @ target).to(device)
