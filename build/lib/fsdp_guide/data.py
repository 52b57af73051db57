"""``digits``: a small real dataset that ships inside scikit-learn (nothing is downloaded).

The tutorials train on real data, but may not download it at run time. The 1,797
handwritten digits of scikit-learn's ``load_digits`` (8x8 greyscale, 10 classes)
are installed with the package; this splits them the same way on every rank.
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

__all__ = ["digits"]


def digits(test_size: int = 360, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Train and test sets of scikit-learn's handwritten digits, as tensors.

    Images are ``float32`` of shape ``(1, 8, 8)`` scaled to ``[0, 1]``; labels are
    ``int64`` class indices. The split is a seeded permutation, identical on every
    rank and every run.

    Example:

    >>> from fsdp_guide.data import digits
    >>> train, test = digits()
    >>> len(train), len(test), tuple(train[0][0].shape), train.tensors[1].dtype
    (1437, 360, (1, 8, 8), torch.int64)
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:  # an optional dependency of the package
        raise ImportError("digits() needs scikit-learn: pip install scikit-learn") from err
    data = load_digits()
    if not 0 < test_size < len(data.target):
        raise ValueError(f"test_size={test_size}: expected between 1 and {len(data.target) - 1}")
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixel values are 0..16
    labels = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    test, train = order[:test_size], order[test_size:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])
