"""Where a rank computes: the one rule that the launcher, ``shard``, checkpoints and the recipe share.

A worker function asks :func:`fsdp_guide.device` once and puts its model, data and
collective tensors there, so the same code trains on two CPU processes (gloo)
and on a node of GPUs (NCCL)::

    device = fsdp_guide.device()
    x, y = x.to(device), y.to(device)

The rule reads what torchrun tells each process about its node (``LOCAL_RANK``
and ``LOCAL_WORLD_SIZE``), never the global ``WORLD_SIZE``: on two 8-GPU nodes
(``WORLD_SIZE=16``) every rank still gets a GPU of its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["device", "backend", "Placement", "placement", "DEVICE_ENV"]

# "cpu" keeps a GPU machine's ranks on the CPU; "cuda" puts them on GPUs even when they
# must share them (fewer GPUs than local ranks: gloo then carries the CUDA tensors).
DEVICE_ENV = "FSDP_GUIDE_DEVICE"
# Set by launch: this node's ranks were started together and all see the same GPUs,
# so one visible GPU is not "a GPU per task" (see _one_gpu_per_task).
SAME_GPUS_ENV = "FSDP_GUIDE_SAME_GPUS"


@dataclass(frozen=True)
class Placement:
    """Where this rank computes, and why.

    Attributes:
        device: the rank's device.
        shared: several ranks of this node compute on this one GPU (only gloo allows that).
        reason: the rule that decided, in words.
    """

    device: torch.device
    shared: bool
    reason: str


def _local_rank_and_size() -> tuple[int, int]:
    """This process's place on its node, as torchrun (and ``launch``) set it; one process if unset."""
    try:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
    except ValueError as exc:
        raise ValueError(f"LOCAL_RANK and LOCAL_WORLD_SIZE must be integers (as torchrun sets them): {exc}") from exc
    if not 0 <= local_rank < local_size:
        raise ValueError(f"LOCAL_RANK={local_rank} must be >= 0 and < LOCAL_WORLD_SIZE={local_size}")
    return local_rank, local_size


def _requested() -> str:
    value = os.environ.get(DEVICE_ENV, "").strip().lower()
    if value not in ("", "cpu", "cuda"):
        raise ValueError(
            f"{DEVICE_ENV}={os.environ[DEVICE_ENV]!r}: expected 'cpu', 'cuda' or unset (choose by the rule)"
        )
    return value


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _gloo_only_group() -> bool:
    """A default group that can only run CPU collectives: its creator asked for the CPU."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and str(dist.get_backend()) == "gloo"


def _one_gpu_per_task() -> bool:
    """A scheduler showed this process one GPU of its own (SLURM ``--gpus-per-task=1``:
    ``CUDA_VISIBLE_DEVICES`` names one device, different for each task).

    Not so when one launcher started this node's ranks together with the same
    visible devices (torchrun sets ``TORCHELASTIC_RUN_ID``; ``launch`` sets
    ``FSDP_GUIDE_SAME_GPUS``): they would all land on the same GPU."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    started_together = "TORCHELASTIC_RUN_ID" in os.environ or SAME_GPUS_ENV in os.environ
    return len(visible) == 1 and not started_together


def placement() -> Placement:
    """The rule of :func:`fsdp_guide.device`, with whether the GPU is shared and the reason, for logs and records.

    Raises:
        ValueError: ``FSDP_GUIDE_DEVICE`` is not ``cpu``/``cuda``, it asks for ``cuda`` where
            no GPU is visible, or ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` are inconsistent.
    """
    requested = _requested()
    local_rank, local_size = _local_rank_and_size()
    gpus = _gpu_count()
    cpu = torch.device("cpu")
    if requested == "cpu":
        return Placement(cpu, False, f"{DEVICE_ENV}=cpu")
    if gpus == 0:
        if requested == "cuda":
            raise ValueError(
                f"{DEVICE_ENV}=cuda but no GPU is visible to this process "
                "(torch.cuda.is_available() is False); unset it to compute on the CPU"
            )
        return Placement(cpu, False, "no GPU is visible")
    if requested != "cuda" and _gloo_only_group():
        return Placement(cpu, False, "the process group is gloo-only")
    if gpus >= local_size:
        return Placement(
            torch.device("cuda", local_rank), False, f"{gpus} GPU(s) for {local_size} local rank(s): cuda:LOCAL_RANK"
        )
    if gpus == 1 and _one_gpu_per_task():
        return Placement(torch.device("cuda", 0), False, "one GPU visible to this task (CUDA_VISIBLE_DEVICES)")
    if requested == "cuda":
        return Placement(
            torch.device("cuda", local_rank % gpus),
            True,
            f"{DEVICE_ENV}=cuda with {gpus} GPU(s) for {local_size} local ranks: shared, cuda:LOCAL_RANK % {gpus}",
        )
    return Placement(cpu, False, f"{gpus} GPU(s) for {local_size} local ranks: not one each")


def device() -> torch.device:
    """The device this rank computes on: its own GPU where it has one, else the CPU.

    The rule, in order:

    1. ``FSDP_GUIDE_DEVICE=cpu`` in the environment: the CPU.
    2. No GPU visible, or, unless ``FSDP_GUIDE_DEVICE=cuda``, a default process group
       that is gloo-only (its creator chose CPU collectives): the CPU.
    3. At least as many visible GPUs as ranks on this node (``LOCAL_WORLD_SIZE``):
       ``cuda:LOCAL_RANK``. This is torchrun's one-GPU-per-process layout, on one
       node or many.
    4. One visible GPU, given to this task alone by a scheduler (``CUDA_VISIBLE_DEVICES``
       naming one device, and this node's ranks not started together by torchrun or
       :func:`fsdp_guide.launch`): ``cuda:0``.
    5. ``FSDP_GUIDE_DEVICE=cuda`` with fewer GPUs than local ranks: ranks share them,
       ``cuda:LOCAL_RANK % GPUs``; the group must then be gloo (NCCL refuses two ranks
       on one GPU).
    6. Otherwise (fewer GPUs than local ranks): the CPU.

    Works with or without an initialised process group; outside any launcher it is
    the single process's device.

    Example:

    >>> import fsdp_guide
    >>> fsdp_guide.device()  # this machine has no GPU
    device(type='cpu')
    """
    return placement().device


def backend(requested: str = "auto") -> str:
    """The process-group backend for this rank's :func:`fsdp_guide.device`.

    ``"auto"`` gives ``"cpu:gloo,cuda:nccl"`` on a GPU of the rank's own (NCCL for
    FSDP's collectives, gloo beside it for CPU tensors: object collectives, CPU
    offload), else ``"gloo"`` (CPU tensors, or CUDA tensors on shared GPUs, which gloo
    copies through host memory). Any other value is returned unchanged.

    Example:

    >>> backend()  # no GPU here
    'gloo'
    >>> backend("nccl")
    'nccl'
    """
    if requested != "auto":
        return requested
    where = placement()
    return "cpu:gloo,cuda:nccl" if where.device.type == "cuda" and not where.shared else "gloo"
