"""``ShardedMuon``: torch's Muon for parameters sharded by ``fully_shard``, each matrix orthogonalised whole, once.

Muon's momentum and weight decay are elementwise, so they run on each rank's shard. Its
Newton–Schulz iteration is not: it needs the whole matrix. ``torch.optim.Muon`` given
FSDP2's ``DTensor`` parameters runs the iteration through ``DTensor`` operations, which
gather and reduce inside every matrix product (dozens of collectives a step, every rank
taking part in every product). Orthogonalising each rank's shard alone is a different
update, silently. This optimizer sends the shards of each matrix's update to the one rank
that owns it (one all-to-all for all the matrices of a parameter group), runs torch's own
iteration there on the whole matrix, and sends each rank its rows back (a second
all-to-all): each matrix is orthogonalised once, by one rank, the largest matrices spread
first over the least loaded ranks.

torch has no distributed Muon (2.9 to 2.15); what is written here is that routing. The
iteration, the learning-rate adjustment and the state are torch's ``Muon``'s.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.optim import Muon

# torch's Newton–Schulz iteration and learning-rate rule, private in torch.optim._muon
# (2.9 to 2.15): used as they are rather than copied, so that this optimizer computes what
# torch's Muon computes.
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

__all__ = ["ShardedMuon"]


def _rows(rows: int, world: int) -> list[int]:
    """How many rows of a ``rows``-row matrix each rank holds under ``Shard(0)``: torch.chunk's
    sizes, then empty shards (FSDP2's and DTensor's rule)."""
    sizes = [len(chunk) for chunk in torch.arange(rows).chunk(world)]
    return sizes + [0] * (world - len(sizes))


class ShardedMuon(Muon):
    """``torch.optim.Muon`` for 2-D parameters sharded on dimension 0 (``fully_shard``'s default).

    Takes the arguments of ``torch.optim.Muon`` and keeps its state (``momentum_buffer``,
    a ``DTensor`` like the parameter, so DCP saves it sharded). Each step orthogonalises
    each matrix's update whole on one rank (the largest matrices first, each to the least
    loaded rank) and applies each rank's rows of the result on that rank: two all-to-alls
    per parameter group and mesh. Parameters that are not DTensors are updated as
    ``torch.optim.Muon`` updates them. Put the other parameters (biases, norms, embeddings
    if you wish) in another optimizer, such as AdamW.

    Example (2 ranks; the same weights as one process's ``torch.optim.Muon`` to rounding):

    >>> import torch
    >>> from fsdp_guide import launch
    >>> def two_steps():
    ...     from torch.distributed.fsdp import fully_shard
    ...     from fsdp_guide.muon import ShardedMuon
    ...     torch.manual_seed(0)
    ...     model = torch.nn.Linear(8, 6, bias=False)
    ...     alone = torch.nn.Linear(8, 6, bias=False)
    ...     alone.load_state_dict(model.state_dict())
    ...     fully_shard(model)
    ...     sharded, one = ShardedMuon(model.parameters(), lr=0.1), torch.optim.Muon(alone.parameters(), lr=0.1)
    ...     x = torch.randn(4, 8)
    ...     rank = torch.distributed.get_rank()
    ...     for _ in range(2):
    ...         model(x[2 * rank : 2 * rank + 2]).square().mean().backward()
    ...         alone(x).square().mean().backward()
    ...         sharded.step(), one.step()
    ...         sharded.zero_grad(), one.zero_grad()
    ...     return (model.weight.full_tensor() - alone.weight).abs().max().item() < 3e-3
    >>> launch(two_steps, world_size=2, output="none")
    [True, True]
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], **muon_arguments: Any) -> None:
        super().__init__(params, **muon_arguments)  # torch.optim.Muon's arguments and checks

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, after checking each DTensor's placement (a group added later is checked too)."""
        params = param_group["params"]
        if not isinstance(params, (torch.Tensor, set)):  # a set: torch's own error, unchanged
            params = list(params)  # a generator, such as model.parameters(), is read once, here
            param_group = {**param_group, "params": params}
        for p in [params] if isinstance(params, torch.Tensor) else params:
            p = p[1] if isinstance(p, tuple) else p  # (name, parameter) pairs, as torch takes them
            if isinstance(p, DTensor) and (p.device_mesh.ndim != 1 or p.placements != (Shard(0),)):
                raise ValueError(
                    f"ShardedMuon takes parameters sharded on dimension 0 of a 1-D mesh (fully_shard's "
                    f"default); got placements {p.placements} on a {p.device_mesh.ndim}-D mesh. Shard "
                    "with fully_shard(module, mesh=a 1-D mesh) or use torch.optim.Muon, which runs on "
                    "any placements through DTensor operations (with many more collectives)."
                )
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One step: momentum on the shards, each matrix orthogonalised at its owner, the rows applied."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, buffers = [], [], []
            self._init_group(group, params, grads, buffers)  # torch's: the momentum buffers
            updates = []
            for grad, buffer in zip(grads, buffers):  # elementwise: on each rank's shard
                grad, buffer = _local(grad), _local(buffer)
                buffer.lerp_(grad, 1 - group["momentum"])
                # The buffer's copy when it is the update: the iteration must not change the momentum
                # (torch 2.9 to 2.13 did, for bf16 buffers without nesterov; 2.15 copies).
                updates.append(grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer.clone())
            orthogonal = _orthogonalise(params, updates, group)
            lr = float(group["lr"])  # a float or a 1-element tensor, as torch's Muon takes
            for p, update in zip(params, orthogonal):
                local = _local(p)
                local.mul_(1 - lr * group["weight_decay"])
                local.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _orthogonalise(params: list[torch.Tensor], updates: list[torch.Tensor], group: dict) -> list[torch.Tensor]:
    """Each update orthogonalised as a whole matrix; this rank's rows of each, in order."""
    iterate = dict(ns_coefficients=group["ns_coefficients"], ns_steps=group["ns_steps"], eps=group["eps"])
    result: list[torch.Tensor] = list(updates)
    on_mesh = defaultdict(list)  # the DTensors, by mesh
    for i, p in enumerate(params):
        if isinstance(p, DTensor):
            on_mesh[p.device_mesh].append(i)
        else:  # whole on this rank: torch's Muon
            result[i] = _zeropower_via_newtonschulz(updates[i], **iterate)
    for mesh, indices in on_mesh.items():
        process_group = mesh.get_group()
        if mesh.get_local_rank() != dist.get_rank(process_group):  # a permuted mesh: its rows are not in group order
            raise ValueError("ShardedMuon needs a mesh whose ranks are in order (as init_device_mesh makes them)")
        shapes = [params[i].shape for i in indices]
        rows = _route_and_orthogonalise(process_group, shapes, [updates[i] for i in indices], iterate)
        for i, mine in zip(indices, rows):
            result[i] = mine
    return result


def _owners(shapes, world: int) -> list[int]:
    """The rank that orthogonalises each matrix: the largest first, each to the least loaded rank
    (by elements; ties to the lowest rank). The same on every rank: it depends on the shapes only."""
    load = [0] * world
    owner = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: -shapes[i].numel()):
        owner[i] = min(range(world), key=lambda r: load[r])
        load[owner[i]] += shapes[i].numel()
    return owner


def _all_to_all(group, outgoing: list[torch.Tensor], incoming: list[int]) -> list[torch.Tensor]:
    """``outgoing[r]`` (flat) to rank r; what each rank sent here (``incoming[r]`` elements), by rank."""
    received = outgoing[0].new_empty(sum(incoming))
    sent = [chunk.numel() for chunk in outgoing]
    dist.all_to_all_single(received, torch.cat(outgoing), incoming, sent, group=group)
    return list(received.split(incoming))


def _route_and_orthogonalise(group, shapes, updates, iterate) -> list[torch.Tensor]:
    """Each matrix's rows to its owner (an all-to-all), orthogonalised there, each rank's rows back (another)."""
    world, me, n = dist.get_world_size(group), dist.get_rank(group), len(shapes)
    owner = _owners(shapes, world)
    rows = [_rows(shape[0], world) for shape in shapes]  # rows[i][r]: rank r's rows of matrix i
    for shape, update, split in zip(shapes, updates, rows):
        if update.shape[0] != split[me]:
            raise ValueError(
                f"a parameter of shape {tuple(shape)} whose local rows ({update.shape[0]}) are not "
                "torch.chunk's: ShardedMuon takes fully_shard's (and distribute_tensor's) even split"
            )
    size = [[r * shape[1] for r in rows[i]] for i, shape in enumerate(shapes)]  # elements, likewise
    mine = [i for i in range(n) if owner[i] == me]
    # Sent in the dtype torch's iteration computes in (it casts first: bfloat16 in 2.13), which
    # every rank learns the same way, owner or not; the result is the same, the bytes fewer.
    dtype = _zeropower_via_newtonschulz(updates[0].new_ones(1, 1), **iterate).dtype

    def flat(tensors):
        return torch.cat([t.reshape(-1).to(dtype) for t in tensors] or [updates[0].new_empty(0, dtype=dtype)])

    # Out: to each owner this rank's rows of its matrices. At the owner: each matrix whole.
    outgoing = [flat([updates[i] for i in range(n) if owner[i] == r]) for r in range(world)]
    incoming = _all_to_all(group, outgoing, [sum(size[i][r] for i in mine) for r in range(world)])
    parts = [piece.split([size[i][r] for i in mine]) for r, piece in enumerate(incoming)]
    whole = {
        i: _zeropower_via_newtonschulz(
            torch.cat([parts[r][k].view(rows[i][r], shapes[i][1]) for r in range(world)]), **iterate
        )
        for k, i in enumerate(mine)
    }
    # Back: to each rank its rows of the matrices this rank owns; from each owner, this rank's rows.
    outgoing = [flat([whole[i].split(rows[i])[r] for i in mine]) for r in range(world)]
    owned_by = [[i for i in range(n) if owner[i] == r] for r in range(world)]
    incoming = _all_to_all(group, outgoing, [sum(size[i][me] for i in owned_by[r]) for r in range(world)])
    result = [None] * n
    for r, piece in enumerate(incoming):
        for i, part in zip(owned_by[r], piece.split([size[i][me] for i in owned_by[r]])):
            result[i] = part.view(rows[i][me], shapes[i][1])
    return result
