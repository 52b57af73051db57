"""``estimate`` and ``measure``: per-rank memory of model states, predicted and counted.

Model states are what training keeps for every parameter: the parameter itself,
its gradient, and the optimizer's state (for Adam two moments, plus an fp32
master copy when parameters are in low precision). ``estimate`` predicts the
bytes per rank for each sharding strategy, with the accounting of the ZeRO paper
(Rajbhandari et al., 2020); ``measure`` counts the same three quantities from the
tensors a rank actually holds, so the two can be compared.
"""

from __future__ import annotations

import collections
import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

__all__ = [
    "MemoryBreakdown",
    "estimate",
    "host_peak_rise",
    "measure",
    "saved_for_backward",
    "tensor_peak_rise",
    "STRATEGIES",
]

STRATEGIES = ("DDP", "NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD")
_STATES_PER_PARAM = {"adam": 2, "adamw": 2, "sgd": 0, "sgd_momentum": 1}


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes of parameters, gradients and optimizer state on one rank."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def __str__(self) -> str:
        gb = lambda n: f"{n / 1e9:.4g} GB"  # noqa: E731  (decimal GB, as the ZeRO paper uses)
        return (
            f"params {gb(self.params)}, grads {gb(self.grads)}, optimizer {gb(self.optimizer)}, total {gb(self.total)}"
        )


def _itemsize(dtype: torch.dtype, name: str) -> int:
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name}={dtype!r}: expected a torch dtype such as torch.float32 or torch.bfloat16")
    return torch.empty((), dtype=dtype).element_size()


def estimate(
    num_params: int,
    world_size: int,
    strategy: str,
    *,
    param_dtype: torch.dtype = torch.float32,
    grad_dtype: torch.dtype | None = None,
    optimizer: str = "adam",
    master_weights: bool = False,
) -> MemoryBreakdown:
    """Per-rank bytes of model states for ``strategy``, as the ZeRO paper counts them.

    ``DDP`` and ``NO_SHARD`` keep everything on every rank; ``SHARD_GRAD_OP`` (ZeRO
    stage 2) shards gradients and optimizer state and keeps full parameters (FSDP
    holds them from forward through backward); ``FULL_SHARD`` (ZeRO stage 3)
    shards all three. Optimizer state is kept in the parameters' dtype (as
    ``torch.optim`` does), or in fp32 with a 4-byte fp32 master copy per parameter
    when ``master_weights=True`` (mixed-precision Adam: the paper's K = 12).

    Example, the paper's Figure 1 (7.5B parameters, 64 devices, fp16 parameters
    and gradients, mixed-precision Adam):

    >>> import torch
    >>> from fsdp_guide.memory import estimate
    >>> for strategy in ("DDP", "SHARD_GRAD_OP", "FULL_SHARD"):
    ...     m = estimate(7.5e9, 64, strategy, param_dtype=torch.float16, master_weights=True)
    ...     print(f"{strategy:14} {m.total / 1e9:.1f} GB")
    DDP            120.0 GB
    SHARD_GRAD_OP  16.6 GB
    FULL_SHARD     1.9 GB
    """
    if isinstance(num_params, bool) or not isinstance(num_params, (int, float)) or not num_params >= 0:
        raise ValueError(f"num_params={num_params!r}: expected a number of parameters >= 0")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: expected a positive int")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r}: expected one of {', '.join(STRATEGIES)}")
    if optimizer not in _STATES_PER_PARAM:
        raise ValueError(f"optimizer={optimizer!r}: expected one of {', '.join(_STATES_PER_PARAM)}")
    param = _itemsize(param_dtype, "param_dtype")
    grad = _itemsize(param_dtype if grad_dtype is None else grad_dtype, "grad_dtype")
    state = 4 if master_weights else param
    per_param_optimizer = _STATES_PER_PARAM[optimizer] * state + (4 if master_weights else 0)

    def sharded(nbytes: float) -> int:
        return math.ceil(nbytes / world_size)

    p, g, o = num_params * param, num_params * grad, num_params * per_param_optimizer
    if strategy in ("DDP", "NO_SHARD"):
        return MemoryBreakdown(math.ceil(p), math.ceil(g), math.ceil(o))
    if strategy == "SHARD_GRAD_OP":
        return MemoryBreakdown(math.ceil(p), sharded(g), sharded(o))
    return MemoryBreakdown(sharded(p), sharded(g), sharded(o))


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # a DTensor: this rank's part
    return to_local() if callable(to_local) else t


def _fsdp2_param_groups(model: nn.Module) -> list:
    """FSDP2's parameter groups: what it holds for each unit beside the registered parameters."""
    from torch.distributed.fsdp import FSDPModule

    groups = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()  # private: there is no public way to reach them
            groups += filter(
                None, getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
            )
    return groups


def _fsdp2_sharded_params(model: nn.Module) -> list[torch.Tensor]:
    """FSDP2's own sharded parameters: between forward and backward they are not the registered ones."""
    return [fsdp_param.sharded_param for group in _fsdp2_param_groups(model) for fsdp_param in group.fsdp_params]


def _fsdp2_accumulating_grads(model: nn.Module) -> list[torch.Tensor]:
    """Gradients FSDP2 holds outside ``.grad`` while it accumulates over micro-batches.

    With ``set_requires_gradient_sync(False)``: full-size gradients on its unsharded
    parameters (or in ``unsharded_accumulated_grad`` when the reduction runs in another
    dtype). With HSDP's ``set_requires_all_reduce(False)``: the reduce-scattered shards,
    summed in the unit's ``_partial_reduce_output`` until the all-reduce.
    """
    grads = []
    for group in _fsdp2_param_groups(model):
        grads.append(getattr(group, "_partial_reduce_output", None))
        for fsdp_param in group.fsdp_params:
            unsharded = getattr(fsdp_param, "_unsharded_param", None)  # exists after the first all-gather
            grads += [getattr(unsharded, "grad", None), getattr(fsdp_param, "unsharded_accumulated_grad", None)]
    return [g for g in grads if g is not None]


def _fsdp1_flat_shards(model: nn.Module) -> list[torch.Tensor]:
    """FSDP1's flat parameters and their local shards: while gathered, the modules see only the full one."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    tensors = []
    for unit in FSDP.fsdp_modules(model):
        flat = getattr(unit, "_flat_param", None)  # private: FSDP1 has no public handle on it
        if flat is not None:
            tensors += [flat, getattr(flat, "_local_shard", None)]
    return tensors


class _Storages:
    """Bytes of distinct storages: views into one buffer count once, at the buffer's full size.

    Storages are told apart by their C++ object, not their address: FSDP frees a
    gathered buffer's memory while a saved tensor still holds the storage object,
    and the allocator gives the address to the next buffer.
    """

    def __init__(self):
        self.seen: set[int] = set()

    def bytes(self, tensors) -> int:
        total = 0
        for t in tensors:
            if t is None:
                continue
            for plain in _plain_tensors(_local(t)):
                storage = plain.untyped_storage()
                if storage.nbytes() and storage._cdata not in self.seen:
                    self.seen.add(storage._cdata)
                    total += storage.nbytes()
        return total


def _plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that own memory: a wrapper subclass (e.g. torchao's float8 weight) holds them inside."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(t):
        return [t]
    inner_names, _ = t.__tensor_flatten__()
    return [plain for name in inner_names for plain in _plain_tensors(getattr(t, name))]


def measure(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> MemoryBreakdown:
    """The model states this rank holds now, counted from the live tensors.

    Parameters are the ones the modules hold (this rank's shard of each DTensor, or
    FSDP1's flat shard) plus FSDP's own sharded copies while the modules hold
    gathered ones (from forward to backward); gradients are those parameters' ``.grad``, plus
    what FSDP2 accumulates outside them over micro-batches (whole gradients while gradient
    sync is off, HSDP's shards while its all-reduce is off); optimizer state is
    every tensor in ``optimizer.state`` except the 0-dimensional step counters, plus
    any tensor the optimizer steps that the model does not hold (a master copy, as
    optimizers that keep fp32 master weights have). Each storage counts once, at its
    full size, so FSDP's padding is included.

    Example:

    >>> import torch
    >>> from fsdp_guide.memory import measure
    >>> model = torch.nn.Linear(1000, 1000)
    >>> optimizer = torch.optim.Adam(model.parameters())
    >>> model(torch.ones(1, 1000)).sum().backward(); optimizer.step()
    >>> print(measure(model, optimizer))
    params 0.004004 GB, grads 0.004004 GB, optimizer 0.008008 GB, total 0.01602 GB
    """
    storages = _Storages()
    params = list(model.parameters()) + _fsdp2_sharded_params(model)
    param_bytes = storages.bytes(params + _fsdp1_flat_shards(model))
    grad_bytes = storages.bytes(
        [p.grad for p in params if p.is_leaf]  # a non-leaf (a view) has no .grad of its own
        + _fsdp2_accumulating_grads(model)
    )
    state = (
        []
        if optimizer is None
        else [
            t
            for per_param in optimizer.state.values()
            for t in per_param.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        ]
        # the parameters it holds: the model's own, counted already, so left out of the sum
        + [p for group in optimizer.param_groups for p in group["params"]]
    )
    return MemoryBreakdown(param_bytes, grad_bytes, storages.bytes(state))


class _SavedBytes:
    """What :func:`saved_for_backward` counts: ``nbytes`` as saved, ``held_at_exit`` when the block ended."""

    def __init__(self):
        self.nbytes = 0
        self.held_at_exit = 0
        self.kinds: collections.Counter[tuple[str, tuple[int, ...]]] = collections.Counter()  # (dtype, shape) -> count
        self._storages = _Storages()
        self._saved: list[torch.Tensor] = []  # only while the block runs

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.nbytes += self._storages.bytes([t])
        self.kinds[str(t.dtype).removeprefix("torch."), tuple(t.shape)] += 1
        self._saved.append(t)
        return t

    def close(self) -> None:
        # Current sizes: FSDP frees a gathered weight by shrinking its storage to 0 bytes
        # after the forward, though autograd still holds it (and regathers it for backward).
        self.held_at_exit = _Storages().bytes(self._saved)
        self._saved.clear()


@contextlib.contextmanager
def saved_for_backward():
    """A context manager counting the bytes autograd saves for backward (activations, and weights).

    ``nbytes`` counts each tensor when it is saved; ``held_at_exit`` counts the same
    tensors' memory still allocated when the block ends. Around a forward under FSDP
    the two differ by the gathered weights: autograd saves them, then FSDP frees their
    memory after the forward (and gathers them again in backward), so ``held_at_exit``
    is what the forward leaves for backward. Distinct storages count once, at their
    real size: torchao's float8 tensors count one byte per element, though they report
    their original dtype. ``kinds`` counts the saved tensors by dtype and shape, each
    time one is saved.

    Example:

    >>> import torch
    >>> from fsdp_guide.memory import saved_for_backward
    >>> layer = torch.nn.Linear(1000, 10)
    >>> with saved_for_backward() as saved:
    ...     loss = layer(torch.ones(32, 1000)).sum()
    >>> saved.nbytes, saved.held_at_exit  # the input (32 x 1000 float32), kept to compute the weight's gradient
    (128000, 128000)
    >>> dict(saved.kinds)
    {('float32', (32, 1000)): 1}
    """
    counter = _SavedBytes()
    try:
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
            yield counter
    finally:
        counter.close()


def host_peak_rise(fn):
    """Run ``fn()``; return its result and how far this process's memory rose above the start, at its peak, in MiB.

    Two figures: all resident memory (Linux's ``VmHWM``, reset just before, so the exact
    peak, file pages mapped into the process included), and the private part
    (``RssAnon``: memory the process allocated, sampled every millisecond, so a lower bound
    on its peak). Linux only: both come from ``/proc/self``.

    glibc's threshold for giving large blocks their own mapping is fixed at 1 MiB, from then
    on in this process (glibc's default, which adjusts itself, cannot be restored): left to
    itself, glibc raises the threshold after such a block is freed and keeps later tensors
    in its heap, so the peak would count freed memory, by an amount that varies with thread
    timing.

    Example:

    >>> import torch
    >>> from fsdp_guide.memory import host_peak_rise
    >>> total, resident, private = host_peak_rise(lambda: torch.ones(64 * 2**20 // 4).sum().item())
    >>> total, 60 < resident < 80, 60 < private < 80  # 64 MiB of float32, held while summed
    (16777216.0, True, True)
    """
    import ctypes
    import gc
    import threading
    from pathlib import Path

    def status(field):
        lines = Path("/proc/self/status").read_text().splitlines()
        return int(next(line.split()[1] for line in lines if line.startswith(field))) / 1024

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 2**20)  # M_MMAP_THRESHOLD: each allocation over 1 MiB mapped, and unmapped when freed
    gc.collect()
    libc.malloc_trim(0)  # hand freed memory back, so the rise counts every new byte
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM, the peak, to the current RSS
    rss, anon = status("VmRSS:"), status("RssAnon:")
    peak_anon, done = [anon], threading.Event()

    def sample():  # the kernel keeps no peak of the private part: look every millisecond
        while not done.wait(0.001):
            peak_anon[0] = max(peak_anon[0], status("RssAnon:"))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        result = fn()
    finally:
        done.set()
        sampler.join()
    return result, status("VmHWM:") - rss, max(peak_anon[0], status("RssAnon:")) - anon


def tensor_peak_rise(fn):
    """Run ``fn()``; return its result and the peak, in MiB, of the tensors it created and held, on all devices at once.

    Counted by torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``, private),
    a dispatch mode that follows each tensor's storage from its creation until it is
    freed, on the CPU and on accelerators alike: the gathered tensors of a sync, a state
    dict, a buffer. Not counted: what a library holds outside tensors (gloo's or NCCL's
    buffers, the allocator's free lists), which :func:`host_peak_rise` sees for the host.

    Example:

    >>> import torch
    >>> from fsdp_guide.memory import tensor_peak_rise
    >>> def work():
    ...     a = torch.ones(4 * 2**20)  # 16 MiB
    ...     b = a * 2  # 16 MiB more, while a lives
    ...     del a
    ...     return b.to(torch.bfloat16).sum().item()  # 8 MiB, after a is gone
    >>> total, peak = tensor_peak_rise(work)
    >>> total, round(peak)
    (8388608.0, 32)
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        result = fn()
    return result, sum(by_kind["Total"] for by_kind in tracker.get_tracker_snapshot("peak").values()) / 2**20
