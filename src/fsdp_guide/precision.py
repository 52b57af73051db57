"""``record_dtypes``: which dtype each kind of operation really runs in.

Mixed precision has three layers that each cast (FSDP's parameter cast,
autocast's per-op casts, the dtype of the gradient reduction), and reading
configuration objects says what was asked for, not what ran. A
``TorchDispatchMode`` sees every operation after autocast and FSDP have done
their casting, which is what this records. (torch's ``CommDebugMode`` counts
collectives but does not keep their dtypes.)
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_guide.collectives import _OPS, _nbytes

__all__ = ["record_dtypes", "DtypeRecord", "low_precision_dtype"]

# Schema names (without overload) -> the kind reported, for what computes. Collectives
# come from fsdp_guide.collectives' table (c10d's ops as gloo and NCCL run them, and the
# functional ones), the three kinds FSDP runs; their dtype is that of the tensor sent.
_KINDS = {
    "aten::mm": "matmul",
    "aten::addmm": "matmul",
    "aten::bmm": "matmul",
    "aten::baddbmm": "matmul",
    "aten::_softmax": "softmax",
    "aten::_log_softmax": "softmax",
    "aten::mse_loss": "loss",
    "aten::nll_loss_forward": "loss",  # cross_entropy's
}
_COLLECTIVES = {
    name: found for name, found in _OPS.items() if found[0] in ("all-gather", "reduce-scatter", "all-reduce")
}


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _storage_tensor(t):
    """For a wrapper subclass (torchao's float8 tensors report their original dtype), the data inside.

    The first inner tensor is the data by convention of the subclasses seen here
    (torchao's ``Float8TrainingTensor`` flattens to ``_data``, then ``_scale``).
    """
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    while t is not None and is_traceable_wrapper_subclass(t):
        t = getattr(t, t.__tensor_flatten__()[0][0])
    return t


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class DtypeRecord(TorchDispatchMode):
    """What ran, per ``(phase, kind)``; phase is ``forward`` or ``backward``.

    ``seen``: the dtype names; ``count``: how many operations; ``nbytes``: for a
    collective, the bytes of the tensor it sent or filled (an all-gather's whole
    gathered output, a reduce-scatter's input, an all-reduce's buffer).
    """

    def __init__(self):
        super().__init__()
        self.seen: dict[tuple[str, str], set[str]] = defaultdict(set)
        self.count: dict[tuple[str, str], int] = defaultdict(int)
        self.nbytes: dict[tuple[str, str], int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        if name in _COLLECTIVES:
            # What goes on the wire: an all-gather's gathered buffer (same dtype, all the
            # bytes), a reduce-scatter's input, an all-reduce's buffer (the table's argument).
            kind, which = _COLLECTIVES[name]
            sent = out if which is None else args[which]
            self._record(kind, [_first_tensor(sent)], _nbytes(sent))
        elif (kind := _KINDS.get(name)) is not None:
            # A matmul's operands are what it computes in; a softmax's or a loss's output is.
            if kind == "matmul":  # both matrices (addmm and baddbmm take the added term first)
                tensors = [_storage_tensor(t) for t in (args[1:3] if "add" in name else args[:2])]
            else:
                tensors = [_first_tensor(out)]
            self._record(kind, tensors)
        return out

    def _record(self, kind: str, tensors: list, nbytes: int | None = None) -> None:
        """One operation of ``kind``; ``nbytes`` defaults to the first tensor's."""
        tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
        if not tensors:
            return
        # Private but long-standing: -1 outside autograd's backward pass.
        phase = "forward" if torch._C._current_graph_task_id() == -1 else "backward"
        self.seen[(phase, kind)].update(_short(t.dtype) for t in tensors)
        self.count[(phase, kind)] += 1
        self.nbytes[(phase, kind)] += tensors[0].numel() * tensors[0].element_size() if nbytes is None else nbytes

    def get(self, phase: str, kind: str) -> str:
        """The dtypes seen for ``kind`` in ``phase``, e.g. ``'bfloat16'``; ``'-'`` if none ran."""
        return "/".join(sorted(self.seen.get((phase, kind), ()))) or "-"


def record_dtypes() -> DtypeRecord:
    """A context manager that records the dtype of each matmul (its operands), softmax, loss and collective.

    Kinds: ``matmul``, ``softmax`` (and log-softmax), ``loss`` (``mse_loss``, and the
    ``nll_loss`` of ``cross_entropy``), ``all-gather``, ``reduce-scatter``, ``all-reduce``.

    Collectives are those dispatched on plain tensors, as FSDP's are; the ones a
    ``DTensor`` operation runs inside its own dispatch (``full_tensor()``,
    ``redistribute``) are not seen: torch's ``CommDebugMode`` counts those.

    Example:

    >>> import torch
    >>> from fsdp_guide.precision import record_dtypes
    >>> layer = torch.nn.Linear(4, 4)
    >>> with record_dtypes() as dtypes, torch.autocast("cpu", dtype=torch.bfloat16):
    ...     layer(torch.ones(2, 4)).float().softmax(-1).sum().backward()
    >>> dtypes.get("forward", "matmul"), dtypes.get("forward", "softmax"), dtypes.get("backward", "matmul")
    ('bfloat16', 'float32', 'bfloat16')
    >>> layer.weight.grad.dtype  # the gradient is accumulated into the fp32 parameter's dtype
    torch.float32
    """
    return DtypeRecord()


def low_precision_dtype() -> torch.dtype:
    """bfloat16 where the hardware computes in it, else float16: the one setting to fall back on.

    torch computes in bfloat16 on any CPU (natively with AVX512-BF16 or AMX, else
    emulated); on CUDA it needs compute capability 8.0 (Ampere) or newer, else float16,
    which needs a gradient scaler. On ROCm ``torch.cuda.is_bf16_supported`` returns
    ``True`` for every device (it checks ``torch.version.hip`` first), so this is
    bfloat16 there. The device asked about is this rank's (:func:`fsdp_guide.device`): a
    rank kept on the CPU of a GPU machine gets bfloat16. ``fsdp_config``'s
    ``"precision": "auto"`` is this choice.

    Example:

    >>> from fsdp_guide.precision import low_precision_dtype
    >>> low_precision_dtype()  # on any CPU and Ampere or newer GPUs; float16 on older GPUs
    torch.bfloat16
    """
    from fsdp_guide.devices import device

    where = device()
    if where.type == "cuda":
        with torch.cuda.device(where):
            if not torch.cuda.is_bf16_supported(including_emulation=False):
                return torch.float16
    return torch.bfloat16
