"""Model FLOPs utilisation (MFU): how much of the accelerators' dense peak the model's own arithmetic uses.

    MFU = tokens per second x FLOPs per token / (accelerators x dense peak FLOP/s of one)

Three things make it right (the three classic mistakes are their opposites):

- **FLOPs per token from the whole model.** A forward and backward pass does 6 FLOPs per
  matmul parameter per token (2 forward, 4 backward), plus attention's own two matmuls
  (scores and weighted values), 12 x layers x heads x head size x sequence length, the
  causal mask's savings not subtracted by convention (PaLM, appendix B; torchtitan's
  ``get_dense_model_nparams_and_flops``). An embedding lookup is not a matmul: its
  parameters count only when they are tied to the output head, which is one. Under FSDP
  count the model's parameters, not a rank's shard: a DTensor's ``numel()`` is the whole
  parameter's, its ``to_local()`` only this rank's.
- **The dense peak.** Datasheets print the peak with 2:4 sparsity in the large type, twice
  the dense one that training runs at (``PEAK_BF16_DENSE``).
- **Attention included.** Left out (6N alone), MFU comes out low, and more so the longer
  the sequence.

Recomputation (activation checkpointing) is not counted: it is work the hardware does,
not work the model needs (that ratio is hardware FLOPs utilisation, HFU).
"""

from __future__ import annotations

import re

import torch.nn as nn

__all__ = ["PEAK_BF16_DENSE", "flops_per_token", "matmul_parameters", "mfu", "peak_flops"]

# Dense bf16 tensor-core peaks of one accelerator, FLOP/s: half the figure NVIDIA's datasheets
# print, which is with 2:4 sparsity, rounded down to a TFLOP/s as torchtitan's get_peak_flops does.
PEAK_BF16_DENSE = {
    "A100": 312e12,  # 624 sparse, SXM and PCIe alike: https://www.nvidia.com/en-us/data-center/a100/
    "H100 SXM": 989e12,  # 1,979 sparse: https://www.nvidia.com/en-us/data-center/h100/
    "H100 NVL": 835e12,  # 1,671 sparse, per GPU (same page)
    "H100 PCIe": 756e12,  # 1,513 sparse (same page)
    "H200 SXM": 989e12,  # 1,979 sparse: https://www.nvidia.com/en-us/data-center/h200/
    "H200 NVL": 835e12,  # 1,671 sparse (same page)
    "B200": 2250e12,  # 4.5 PFLOP/s sparse, per GPU: https://www.nvidia.com/en-us/data-center/hgx/
}

# The parts torch.cuda.get_device_name() names, and what else the name may say about the same
# part (its memory): "NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3" (SXM), "NVIDIA H200".
_FAMILY = re.compile(r"(?<![A-Z0-9])(A100|H100|H200|B200)(?![0-9])")
_SAME_PART = re.compile(r"\d+GB|HBM\dE?|SXM\d?|NVIDIA|-")


def _part(device_name: str) -> str | None:
    """The key of PEAK_BF16_DENSE for a device name, or None: a family's variant that the table
    does not name (an H100 CNX, an H800, a GH200) never falls through to another part's peak."""
    upper = device_name.upper()
    found = _FAMILY.search(upper)
    if found is None:
        return None
    family, rest = found[1], upper[: found.start()] + " " + upper[found.end() :]
    words = [w for w in re.split(r"[\s-]+", rest) if w and not _SAME_PART.fullmatch(w)]
    if family == "A100":
        return family if words in ([], ["PCIE"]) else None
    if family == "B200":
        return family if not words else None
    variant = {(): "SXM", ("NVL",): "NVL", ("PCIE",): "PCIe"}.get(tuple(words))
    return f"{family} {variant}" if variant and f"{family} {variant}" in PEAK_BF16_DENSE else None


def peak_flops(device_name: str) -> float:
    """The dense bf16 peak of one accelerator, from its name (``torch.cuda.get_device_name()``).

    >>> from fsdp_guide.mfu import peak_flops
    >>> peak_flops("NVIDIA H100 PCIe") / 1e12
    756.0
    >>> peak_flops("NVIDIA H200 NVL") / 1e12
    835.0
    >>> peak_flops("cpu")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: no dense bf16 peak known for 'cpu' (known: A100, H100 SXM, ...); pass the peak from the accelerator's...
    """
    part = _part(device_name)
    if part is None:
        raise ValueError(
            f"no dense bf16 peak known for {device_name!r} (known: {', '.join(PEAK_BF16_DENSE)}); pass "
            "the peak from the accelerator's datasheet, dense (without sparsity), in FLOP/s"
        )
    return PEAK_BF16_DENSE[part]


def matmul_parameters(model: nn.Module) -> int:
    """The model's parameters that take part in a matmul: all of them (whole, also when
    sharded), less the embeddings that are only looked up (not tied to a Linear)."""
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    lookups = {
        id(m.weight): m.weight.numel()
        for m in model.modules()
        if isinstance(m, nn.Embedding) and id(m.weight) not in linear_weights
    }
    return sum(p.numel() for p in model.parameters()) - sum(lookups.values())


def flops_per_token(n_params: int | nn.Module, *, n_layers: int, n_heads: int, head_dim: int, seq_len: int) -> int:
    """FLOPs of a forward and backward pass per token: 6 per matmul parameter (2 forward, 4
    backward), plus attention's two matmuls, 12 x layers x heads x head size x sequence
    length (the causal mask's savings not subtracted, by convention). Recomputation is not counted.

    ``n_params``: the matmul parameters, or a model to count them in (:func:`matmul_parameters`).
    """
    if isinstance(n_params, nn.Module):
        n_params = matmul_parameters(n_params)
    return 6 * n_params + 12 * n_layers * n_heads * head_dim * seq_len


def mfu(tokens_per_second: float, flops_per_token: int, peak: float | str, devices: int = 1) -> float:
    """The fraction of ``devices`` accelerators' dense peak that ``tokens_per_second`` (all of
    theirs together) uses: model FLOPs utilisation.

    ``flops_per_token``: the whole model's, forward and backward (:func:`flops_per_token`).
    ``peak``: the dense FLOP/s of one accelerator, or its name (:func:`peak_flops`).

    >>> from fsdp_guide.mfu import flops_per_token, mfu
    >>> per_token = flops_per_token(8_000_000_000, n_layers=32, n_heads=32, head_dim=128, seq_len=8192)
    >>> f"{per_token:.4g}"
    '6.088e+10'
    >>> f"{mfu(6_000, per_token, 'NVIDIA H100 80GB HBM3'):.3f}"  # 6,000 tokens/s on one H100 SXM
    '0.369'
    """
    if isinstance(peak, str):
        peak = peak_flops(peak)
    if tokens_per_second < 0 or peak <= 0 or devices < 1:
        raise ValueError(
            f"mfu: tokens_per_second={tokens_per_second}, peak={peak}, devices={devices}: expected "
            "tokens_per_second >= 0, a positive peak in FLOP/s and at least one device"
        )
    return tokens_per_second * flops_per_token / (peak * devices)
