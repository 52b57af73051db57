"""How far two results are apart, with a NaN shown as NaN.

Python's ``max`` over floats skips a NaN unless it comes first (``max(1e-3, nan)`` is
``1e-3``: ``nan > 1e-3`` is False), so ``max((a - b).abs().max().item() for ...)`` prints a
small error over weights that have become NaN. ``largest_difference`` is that expression
with the NaN kept: torch's own reductions propagate it, and the largest difference over
pairs is taken by one (``torch.stack(...).max()``), not by Python's ``max``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def largest_difference(pairs: Iterable[tuple], relative: bool = False) -> float:
    """The largest ``|a - b|`` over pairs of tensors (or numbers), as a float: NaN if any pair's is.

    With ``relative``, each pair's largest difference is divided by the largest ``|b|``
    (``b`` is the reference; against a reference of zeros, a difference is infinite and a
    match is 0). Pairs must have the same shape: broadcasting one against the
    other would compare something else. Tensors on another device are compared on
    ``a``'s; a DTensor is compared whole (``full_tensor``); Python numbers in float64.
    Equal infinities differ by NaN (``inf - inf``): a result that is not finite is not
    reported as matching.

    Example:

    >>> import torch
    >>> from fsdp_guide.compare import largest_difference
    >>> a = torch.tensor([1.0, 2.0])
    >>> round(largest_difference([(a, a + 0.5), (a, a)]), 6)
    0.5
    >>> largest_difference([(a, a + 0.5), (a, torch.tensor([float("nan"), 2.0]))])  # Python's max would say 0.5
    nan
    >>> largest_difference([(0.25, 0.5), (1.0, 1.0)], relative=True)
    0.5
    """
    per_pair = []
    for index, (a, b) in enumerate(pairs):
        a, b = _whole(a), _whole(b)
        if a.shape != b.shape:
            raise ValueError(
                f"pair {index}: shapes {tuple(a.shape)} and {tuple(b.shape)} differ; "
                "compare tensors of one shape (each parameter with its own reference)"
            )
        b = b.to(device=a.device, dtype=torch.promote_types(a.dtype, b.dtype))
        gap = (a.to(b.dtype) - b).abs().max() if a.numel() else torch.zeros((), dtype=b.dtype, device=a.device)
        if relative and b.numel():  # an exact match is 0 even against a reference of zeros (0 / 0 would be NaN)
            gap = torch.where(gap == 0, gap, gap / b.abs().max())
        per_pair.append(gap.double().cpu())
    if not per_pair:
        raise ValueError("no pairs to compare: an empty comparison would say nothing differs")
    return torch.stack(per_pair).max().item()


def _whole(value) -> torch.Tensor:
    if hasattr(value, "full_tensor"):  # a DTensor: the whole tensor, gathered from its shards
        value = value.full_tensor()
    if isinstance(value, (int, float)):  # a Python number (a loss): float64, as Python computes with it
        return torch.tensor(value, dtype=torch.float64)
    return torch.as_tensor(value).detach()
