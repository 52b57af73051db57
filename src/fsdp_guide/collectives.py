"""``count_collectives``: the collectives a piece of code runs, per mesh dimension, with their bytes.

On a 2D mesh the same kind of collective runs on different process groups: FSDP's
all-gathers over ``dp``, tensor parallelism's all-reduces over ``tp``. torch's
``CommDebugMode`` counts collectives per operator and per module, but not per process
group and not their size; this mode keeps both. Like ``CommDebugMode`` it lets a
``DTensor`` operation run first, so the collectives DTensor issues inside it (TP's,
``full_tensor()``, ``redistribute``) are seen as well as FSDP's.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group  # a functional collective's group
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["count_collectives", "collective_kind", "CollectiveCount", "draw_flight_recorder"]

# Operator name (without overload) -> (kind, index of the argument whose tensors are the
# collective's full size): an all-gather's gathered output, a reduce-scatter's input,
# an all-reduce's buffer. c10d's ops are what FSDP calls; _c10d_functional's are DTensor's.
_OPS = {
    "c10d::_allgather_base_": ("all-gather", 0),
    "c10d::allgather_": ("all-gather", 0),
    "c10d::allgather_into_tensor_coalesced_": ("all-gather", 0),
    "c10d::_reduce_scatter_base_": ("reduce-scatter", 1),
    "c10d::reduce_scatter_": ("reduce-scatter", 1),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce-scatter", 1),
    "c10d::allreduce_": ("all-reduce", 0),
    "c10d::allreduce_coalesced_": ("all-reduce", 0),
    "c10d::broadcast_": ("broadcast", 0),
    "c10d::alltoall_base_": ("all-to-all", 1),
    "_c10d_functional::all_gather_into_tensor": ("all-gather", None),  # None: the output
    "_c10d_functional::all_gather_into_tensor_coalesced": ("all-gather", None),
    "_c10d_functional::reduce_scatter_tensor": ("reduce-scatter", 0),
    "_c10d_functional::reduce_scatter_tensor_coalesced": ("reduce-scatter", 0),
    "_c10d_functional::all_reduce": ("all-reduce", 0),
    "_c10d_functional::all_reduce_": ("all-reduce", 0),
    "_c10d_functional::all_reduce_coalesced": ("all-reduce", 0),
    "_c10d_functional::broadcast": ("broadcast", 0),
    "_c10d_functional::all_to_all_single": ("all-to-all", 0),
}


def collective_kind(operator: str) -> str | None:
    """The kind of collective an operator runs, by its name as the profiler records it; None for any other.

    Eager c10d operators (what FSDP calls) and the functional ones (what DTensor and
    compiled graphs call) alike.

    Example:

    >>> from fsdp_guide.collectives import collective_kind
    >>> collective_kind("c10d::_allgather_base_"), collective_kind("_c10d_functional::reduce_scatter_tensor")
    ('all-gather', 'reduce-scatter')
    >>> collective_kind("aten::mm") is None
    True
    """
    kind = _OPS.get(operator)
    return kind[0] if kind else None


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _group_ranks(func, args, kwargs) -> frozenset[int] | None:
    """The global ranks of the process group a c10d or functional collective runs on."""
    for i, arg in enumerate(func._schema.arguments):
        value = kwargs.get(arg.name, args[i] if i < len(args) else None)
        if arg.name == "group_name":  # functional collectives (DTensor's) name their group
            return frozenset(dist.get_process_group_ranks(_resolve_process_group(value)))
        if arg.name == "process_group":  # c10d's ops get it as a ScriptObject
            return frozenset(dist.get_process_group_ranks(dist.ProcessGroup.unbox(value)))
    return None


class CollectiveCount(TorchDispatchMode):
    """Collectives per ``(dimension, kind)``: ``count`` and ``nbytes`` (full-size bytes).

    ``dimension`` is the name of the mesh dimension whose ranks ran it (``"dp"``, ``"tp"``;
    for an unnamed mesh its index as a string), or ``"other"``.
    """

    def __init__(self, *meshes: DeviceMesh | None):
        super().__init__()
        self.count: dict[tuple[str, str], int] = defaultdict(int)
        self.nbytes: dict[tuple[str, str], int] = defaultdict(int)
        self._dims = {}
        for mesh in meshes:
            if mesh is None:
                continue
            names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
            # By ranks, not by group: DTensor may run a mesh dimension's collectives on the
            # group of an earlier, equal mesh (same shape and names), which is the same ranks.
            self._dims.update(
                {frozenset(dist.get_process_group_ranks(mesh.get_group(i))): name for i, name in enumerate(names)}
            )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run; the collectives it issues come back here
        out = func(*args, **kwargs)
        found = _OPS.get(func._schema.name)
        if found is not None:
            kind, which = found
            key = (self._dims.get(_group_ranks(func, args, kwargs), "other"), kind)
            self.count[key] += 1
            self.nbytes[key] += _nbytes(out if which is None else args[which])
        return out

    def rows(self) -> list[tuple[str, str, int, int]]:
        """``(dimension, kind, count, bytes)``, sorted."""
        return [(dim, kind, self.count[(dim, kind)], self.nbytes[(dim, kind)]) for dim, kind in sorted(self.count)]


def count_collectives(*meshes: DeviceMesh | None) -> CollectiveCount:
    """A context manager that counts the collectives run inside it, per mesh dimension, with their bytes.

    ``meshes``: the meshes whose dimensions name the groups (several when parts of a
    model are sharded on different meshes, as experts are); a group of none is ``"other"``,
    and a group that is a dimension of several (the same ranks) takes the last one's name.

    Seen: FSDP's (c10d's all-gather, reduce-scatter, all-reduce) and the ones ``DTensor``
    runs for tensor parallelism or ``full_tensor()``. The bytes are each collective's
    full-size tensor: the gathered output of an all-gather, the input of a
    reduce-scatter, the buffer of an all-reduce (what a rank handles, not what crosses
    the wire, which depends on the algorithm).

    Example:

    >>> import torch, torch.distributed as dist
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> from fsdp_guide import launch
    >>> from fsdp_guide.collectives import count_collectives
    >>> def on_each_dim():
    ...     mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ...     with count_collectives(mesh) as seen:
    ...         dist.all_reduce(torch.ones(4), group=mesh.get_group("tp"))
    ...         dist.all_reduce(torch.ones(2), group=mesh.get_group("dp"))
    ...         dist.all_reduce(torch.ones(2), group=mesh.get_group("dp"))
    ...     return seen.rows()
    >>> launch(on_each_dim, world_size=4, output="none")[0]
    [('dp', 'all-reduce', 2, 16), ('tp', 'all-reduce', 1, 16)]
    """
    return CollectiveCount(*meshes)


def draw_flight_recorder(entries_by_rank: list[list[dict]], title: str, parted: int | None = None):
    """Who waits for whom: each rank's collectives from its flight recorder, a row per rank.

    ``entries_by_rank``: each rank's ``entries`` from a flight recorder dump
    (``torch._C._distributed_c10d._dump_fr_trace()``, unpickled), in the order they were issued.
    A box per collective at its sequence number, named by its operation; each rank's last, where
    it waits for a peer that never issues the same, in red; ``parted``, the sequence number of the
    first collective the ranks issued for different reasons (found by the caller), outlined.
    Returns the matplotlib figure.

    >>> entries = [[{"collective_seq_id": 1, "profiling_name": "gloo:all_gather_into_tensor_coalesced"},
    ...             {"collective_seq_id": 2, "profiling_name": "gloo:all_reduce"}],
    ...            [{"collective_seq_id": 1, "profiling_name": "gloo:all_gather_into_tensor_coalesced"},
    ...             {"collective_seq_id": 2, "profiling_name": "gloo:all_gather_into_tensor_coalesced"}]]
    >>> figure = draw_flight_recorder(entries, "two ranks part at collective 2")
    >>> [text.get_text() for text in figure.axes[0].texts][-2:]
    ['all\\ngather', 'all\\ngather']
    """
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(10, 1.1 + 0.5 * len(entries_by_rank)))
    for rank, entries in enumerate(entries_by_rank):
        for entry in entries:
            seq, last = entry["collective_seq_id"], entry is entries[-1]
            op = entry["profiling_name"].split(":")[-1].replace("_into_tensor", "").replace("_coalesced", "")
            box = plt.Rectangle((seq - 0.45, rank - 0.35), 0.9, 0.7, facecolor="tab:red" if last else "0.85")
            if seq == parted:
                box.set(edgecolor="tab:blue", linewidth=2.5)
            ax.add_patch(box)
            color = "white" if last else "black"
            ax.text(seq, rank, op.replace("_", "\n", 1), ha="center", va="center", fontsize=6, color=color)
    numbers = [entry["collective_seq_id"] for entries in entries_by_rank for entry in entries]
    ax.set(xlim=(min(numbers) - 0.6, max(numbers) + 0.6), ylim=(len(entries_by_rank) - 0.5, -0.5), title=title)
    ax.set_yticks(range(len(entries_by_rank)), [f"rank {rank}" for rank in range(len(entries_by_rank))])
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # sequence numbers, not fractions
    outlined = "; outlined: where the ranks parted" if parted is not None else ""
    ax.set_xlabel(f"collective sequence number (red: where each rank waits{outlined})")
    fig.tight_layout()
    return fig
