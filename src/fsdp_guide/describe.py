"""``describe_sharding``: what each parameter looks like on this rank, for FSDP1, FSDP2 and plain modules."""

from __future__ import annotations

import html
import itertools
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass, fields

import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard  # FSDP's placement on a 2D mesh

__all__ = ["describe_sharding", "draw_sharding", "ParamShard", "ShardingTable"]


@dataclass(frozen=True)
class ParamShard:
    """One parameter as this rank holds it.

    ``placement``: how it is split, one placement per mesh dimension (each named with its
    size when the mesh has names); ``holds``: which part of the full parameter is here,
    as a slice of each dimension (``[8:16, :]``: rows 8 to 15, every column), ``all``, or
    for FSDP1 the elements of the flattened parameter.
    """

    name: str
    full_shape: tuple
    local_shape: tuple
    placement: str
    holds: str
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

    __repr__ = __str__  # what Jupyter shows as text/plain: the table, not the list of rows

    def _repr_html_(self) -> str:
        header, rows = self._cells()
        head = "".join(f"<th>{html.escape(c)}</th>" for c in header)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
        total = f'<tfoot><tr><td colspan="{len(header)}">total local bytes: {self.local_bytes}</td></tr></tfoot>'
        return f'<table class="fsdp-guide-table"><thead><tr>{head}</tr></thead><tbody>{body}</tbody>{total}</table>'


def describe_sharding(module: nn.Module) -> ShardingTable:
    """One row per parameter: name, full shape, local shape, placement, local bytes, dtype, on this rank.

    - FSDP2 (``fully_shard``) or any DTensor parameter: the DTensor's global shape,
      its local shard, its placements over the device mesh, and the slice of the full
      tensor the local shard is. On a 2D mesh (FSDP over ``dp`` after tensor parallelism
      over ``tp``) a parameter that both shard along dim 0 gets FSDP's
      ``_StridedShard(dim=0, sf=2)``: FSDP splits the rows this rank's TP group holds,
      not the full tensor's, and ``holds`` shows which rows that leaves here.
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
    name    full shape  local shape  placement                 holds     local bytes  dtype
    ------  ----------  -----------  ------------------------  --------  -----------  -------
    weight  (3, 4)      (1, 4)       Shard(dim=0) over mesh 2  [2:3, :]  16           float32
    bias    (3,)        (1,)         Shard(dim=0) over mesh 2  [2:3]     4            float32
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
    return ParamShard(name, shape, shape, "not sharded", "all", p.numel() * p.element_size(), _dtype(p))


def _dtensor_row(name: str, p: DTensor) -> ParamShard:
    local = p.to_local()
    return ParamShard(
        name,
        tuple(p.shape),
        tuple(local.shape),
        _placements(p),
        _holds(p),
        local.numel() * local.element_size(),
        _dtype(p),
    )


def _placements(p: DTensor) -> str:
    mesh = p.device_mesh
    if mesh.mesh_dim_names is None:
        return f"{', '.join(repr(pl) for pl in p.placements)} over mesh {'x'.join(map(str, mesh.shape))}"
    return ", ".join(
        f"{pl!r} over {name}={size}" for pl, name, size in zip(p.placements, mesh.mesh_dim_names, mesh.shape)
    )


def _holds(p: DTensor) -> str:
    """The slice of the full tensor this rank's shard is, e.g. ``[8:16, :]``."""
    if not any(_shards(pl) for pl in p.placements):
        return "all"
    return "[" + ", ".join(_indices_held(p, dim) for dim in range(p.dim())) + "]"


def _indices_held(p: DTensor, dim: int) -> str:
    # DTensor's own sharding rules (``_StridedShard`` included) applied to one index
    # vector per dimension: no formula of ours to drift from torch's, and no
    # communication (``src_data_rank=None``: every rank splits its own copy).
    placements = [pl if _shards(pl, dim) else Replicate() for pl in p.placements]
    if all(isinstance(pl, Replicate) for pl in placements):
        return ":"
    shape = [1] * p.dim()
    shape[dim] = p.shape[dim]
    index = torch.arange(p.shape[dim]).view(shape)
    held = distribute_tensor(index, p.device_mesh, placements, src_data_rank=None).to_local().flatten().tolist()
    return "+".join(f"{start}:{stop}" for start, stop in _runs(held)) or "none"


def _shards(placement, dim: int | None = None) -> bool:
    # Since torch 2.10 _StridedShard is no longer a subclass of Shard, and its is_shard() is False.
    return isinstance(placement, (Shard, _StridedShard)) and dim in (None, placement.dim)


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Consecutive indices as half-open ranges: [0, 1, 2, 8, 9] -> [(0, 3), (8, 10)]."""
    runs = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _flat_param_rows(prefix: str, flat) -> list[ParamShard]:
    rows = []
    for fqn, shape, info in zip(flat._fqns, flat._shapes, flat._shard_param_infos):
        numel = info.numel_in_shard if info.in_shard else 0
        # intra_param_*_idx index the flattened original parameter (end inclusive);
        # offset_in_shard/numel_in_shard locate those elements in this rank's flat shard
        # (torch/distributed/fsdp/_flat_param.py, _ShardParamInfo).
        where = (
            f"at [{info.offset_in_shard}:{info.offset_in_shard + info.numel_in_shard}] of this rank's flat shard"
            if info.in_shard
            else "none on this rank"
        )
        name = _clean(f"{prefix}.{fqn}" if prefix else fqn)
        holds = (
            f"elements {info.intra_param_start_idx}:{info.intra_param_end_idx + 1} (flattened)"
            if info.in_shard
            else "none"
        )
        rows.append(ParamShard(name, tuple(shape), (numel,), where, holds, numel * flat.element_size(), _dtype(flat)))
    return rows


def _name_of(root: nn.Module, target: nn.Module) -> str:
    return next(name for name, m in root.named_modules() if m is target)


def _clean(name: str) -> str:
    return (
        name.replace("_fsdp_wrapped_module.", "")
        .replace("._fsdp_wrapped_module", "")
        .replace("_fsdp_wrapped_module", "")
    )


def _is_fsdp1_view(name: str) -> bool:
    # With use_orig_params=True, FSDP1 also registers the original parameters as views
    # into the FlatParameter; the FlatParameter rows already describe them.
    return "_fsdp_wrapped_module" in name


def draw_sharding(tables: Sequence[ShardingTable], name: str, label: Callable[[int], str] | None = None, ax=None):
    """Which rank holds each element of the parameter ``name``: the full tensor, a block per shard.

    ``tables``: every rank's :func:`fsdp_guide.describe_sharding` of the same model, in rank order (what
    ``launch`` returns when the worker returns it). A block names the ranks that hold it
    (``label(rank)``, ``"rank 0"`` by default); a replicated block names them all. A 1-D
    parameter is drawn as one row, a 3-D one (stacked experts) as its dim-0 slices side by side.
    JAX's ``visualize_array_sharding`` draws a jax.Array's the same way. Returns the axes
    (drawn on ``ax``, or on a new figure's). The shards are read from the tables' ``holds``:
    FSDP1's flattened shards are not blocks of the tensor and are refused.

    >>> import torch.nn as nn
    >>> from torch.distributed.fsdp import fully_shard
    >>> from fsdp_guide import launch
    >>> from fsdp_guide.describe import describe_sharding, draw_sharding
    >>> tables = launch(lambda: describe_sharding(fully_shard(nn.Linear(4, 4))), world_size=2, output="none")
    >>> ax = draw_sharding(tables, "weight")
    >>> sorted(text.get_text() for text in ax.texts)
    ['rank 0', 'rank 1']
    """
    import matplotlib.pyplot as plt

    label = label or (lambda rank: f"rank {rank}")
    rows = [_row_named(table, name, rank) for rank, table in enumerate(tables)]
    shape = rows[0].full_shape
    if not 1 <= len(shape) <= 3:
        raise ValueError(f"{name} has {len(shape)} dimensions; draw_sharding draws tensors of 1, 2 or 3 dimensions")
    owners: dict[tuple, list[int]] = {}  # a block (its range in each dimension) -> the ranks that hold it
    for rank, row in enumerate(rows):
        for block in _blocks(row):
            owners.setdefault(block, []).append(rank)
    # A 1-D tensor is one row; a 3-D one is its dim-0 slices side by side, a column apart.
    panels = shape[0] if len(shape) == 3 else 1
    height, width = (1, shape[0]) if len(shape) == 1 else shape[-2:]
    ax = ax or plt.subplots(figsize=(min(10, 1.5 + 2.5 * panels), 2.8 if len(shape) > 1 else 1.2))[1]
    colours = plt.get_cmap("Pastel1").colors
    groups = sorted({tuple(ranks) for ranks in owners.values()})
    for block, ranks in owners.items():
        block = [*([(0, 1)] if len(shape) == 1 else []), *block]  # (panel,) rows, columns
        first, last = block[0] if len(shape) == 3 else (0, 1)
        (top, bottom), (left, right) = block[-2:]
        for panel in range(first, last):
            x = panel * (width + 1) + left
            colour = colours[groups.index(tuple(ranks)) % len(colours)]
            ax.add_patch(plt.Rectangle((x, top), right - left, bottom - top, facecolor=colour, edgecolor="0.3"))
            text = ", ".join(label(rank) for rank in ranks)
            ax.text(x + (right - left) / 2, (top + bottom) / 2, text, ha="center", va="center", fontsize=7)
    ax.set(xlim=(0, panels * (width + 1) - 1), ylim=(height, 0), title=name)
    if len(shape) == 3:
        ax.set_xticks([p * (width + 1) + width / 2 for p in range(panels)], [f"[{p}]" for p in range(panels)])
        ax.set_xlabel(f"dim 0 (each a {height} x {width} slice: dim 1 down, dim 2 across)")
    else:
        ax.set_xlabel("dim 0" if len(shape) == 1 else "dim 1")
        ax.set_ylabel("" if len(shape) == 1 else "dim 0")
    if len(shape) == 1:
        ax.set_yticks([])
    return ax


def _row_named(table: ShardingTable, name: str, rank: int) -> ParamShard:
    found = [row for row in table if row.name == name]
    if not found:
        names = ", ".join(row.name for row in table)
        raise ValueError(f"rank {rank}'s table has no parameter named {name!r}; it has: {names}")
    return found[0]


def _blocks(row: ParamShard) -> list[tuple]:
    """The blocks of the full tensor a row's ``holds`` names: one (start, stop) per dimension each."""
    if row.holds.startswith("elements") or row.placement in ("none on this rank",) or "flat shard" in row.placement:
        raise ValueError(
            f"{row.name}: {row.holds!r} is a part of FSDP1's flattened parameter, not blocks of the tensor"
        )
    if row.holds == "all":
        return [tuple((0, size) for size in row.full_shape)]
    runs = []
    for spec, size in zip(row.holds.strip("[]").split(", "), row.full_shape):
        if spec == ":":
            runs.append([(0, size)])
        elif spec == "none":
            return []  # nothing of this tensor on this rank (fewer rows than ranks)
        else:
            runs.append([tuple(int(i) for i in run.split(":")) for run in spec.split("+")])
    return list(itertools.product(*runs))
