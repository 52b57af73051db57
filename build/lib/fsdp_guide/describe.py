"""``describe_sharding``: what each parameter looks like on this rank, for FSDP1, FSDP2 and plain modules."""

from __future__ import annotations

import html
from dataclasses import astuple, dataclass, fields

import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor

__all__ = ["describe_sharding", "ParamShard", "ShardingTable"]


@dataclass(frozen=True)
class ParamShard:
    """One parameter as this rank holds it."""

    name: str
    full_shape: tuple
    local_shape: tuple
    placement: str
    local_bytes: int
    dtype: str


class ShardingTable(list):
    """A list of :class:`ParamShard` rows: a table in a notebook, text in a terminal."""

    @property
    def local_bytes(self) -> int:
        return sum(row.local_bytes for row in self)

    def _cells(self) -> tuple[list[str], list[list[str]]]:
        header = [f.name.replace("_", " ") for f in fields(ParamShard)]
        return header, [[str(v) for v in astuple(row)] for row in self]

    def __str__(self) -> str:
        header, rows = self._cells()
        widths = [max(len(c) for c in column) for column in zip(header, *rows)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [header, *rows]]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines + [f"total local bytes: {self.local_bytes}"])

    def _repr_html_(self) -> str:
        header, rows = self._cells()
        head = "".join(f"<th>{html.escape(c)}</th>" for c in header)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def describe_sharding(module: nn.Module) -> ShardingTable:
    """One row per parameter: name, full shape, local shape, placement, local bytes, dtype, on this rank.

    - FSDP2 (``fully_shard``) or any DTensor parameter: the DTensor's global shape,
      its local shard, and its placements over the device mesh.
    - FSDP1 (``FullyShardedDataParallel``): each original parameter inside the
      flattened ``FlatParameter``: which elements of the flattened parameter this
      rank holds, and where they lie in this rank's flat shard (read from FSDP1's
      private ``_fqns``, ``_shapes`` and ``_shard_param_infos``).
    - Plain parameters: full and local are the same.

    Example:

    >>> import torch.nn as nn
    >>> from torch.distributed.fsdp import fully_shard
    >>> from fsdp_guide import describe_sharding, launch
    >>> def describe():
    ...     return str(describe_sharding(fully_shard(nn.Linear(4, 3))))
    >>> print(launch(describe, world_size=2, output="none")[1])
    name    full shape  local shape  placement                 local bytes  dtype
    ------  ----------  -----------  ------------------------  -----------  -------
    weight  (3, 4)      (1, 4)       Shard(dim=0) over mesh 2  16           float32
    bias    (3,)        (1,)         Shard(dim=0) over mesh 2  4            float32
    total local bytes: 20
    """
    rows = ShardingTable()
    flat_params = set()
    for unit in FSDP.fsdp_modules(module):
        handle = unit._handle
        if handle is None:
            continue
        flat_params.add(handle.flat_param)
        prefix = _clean(_name_of(module, unit))
        rows.extend(_flat_param_rows(prefix, handle.flat_param))
    for name, p in module.named_parameters():
        if p in flat_params or getattr(p, "_is_flat_param", False) or _is_fsdp1_view(name):
            continue
        rows.append(_dtensor_row(name, p) if isinstance(p, DTensor) else _plain_row(name, p))
    return rows


def _dtype(p) -> str:
    return str(p.dtype).removeprefix("torch.")


def _plain_row(name: str, p) -> ParamShard:
    shape = tuple(p.shape)
    return ParamShard(name, shape, shape, "not sharded", p.numel() * p.element_size(), _dtype(p))


def _dtensor_row(name: str, p: DTensor) -> ParamShard:
    local = p.to_local()
    placements = ", ".join(repr(pl) for pl in p.placements)
    mesh = "x".join(str(s) for s in p.device_mesh.shape)
    return ParamShard(name, tuple(p.shape), tuple(local.shape), f"{placements} over mesh {mesh}",
                      local.numel() * local.element_size(), _dtype(p))


def _flat_param_rows(prefix: str, flat) -> list[ParamShard]:
    rows = []
    for fqn, shape, info in zip(flat._fqns, flat._shapes, flat._shard_param_infos):
        numel = info.numel_in_shard if info.in_shard else 0
        # intra_param_*_idx index the flattened original parameter (end inclusive);
        # offset_in_shard/numel_in_shard locate those elements in this rank's flat shard
        # (torch/distributed/fsdp/_flat_param.py, _ShardParamInfo).
        where = (f"elements [{info.intra_param_start_idx}:{info.intra_param_end_idx + 1}] of the parameter, "
                 f"at [{info.offset_in_shard}:{info.offset_in_shard + info.numel_in_shard}] of this rank's flat shard"
                 if info.in_shard else "none on this rank")
        name = _clean(f"{prefix}.{fqn}" if prefix else fqn)
        rows.append(ParamShard(name, tuple(shape), (numel,), where, numel * flat.element_size(), _dtype(flat)))
    return rows


def _name_of(root: nn.Module, target: nn.Module) -> str:
    return next(name for name, m in root.named_modules() if m is target)


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").replace("._fsdp_wrapped_module", "").replace(
        "_fsdp_wrapped_module", "")


def _is_fsdp1_view(name: str) -> bool:
    # With use_orig_params=True, FSDP1 also registers the original parameters as views
    # into the FlatParameter; the FlatParameter rows already describe them.
    return "_fsdp_wrapped_module" in name
