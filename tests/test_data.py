"""fsdp_guide.data.digits: a fixed split of real data, read by 2 gloo ranks without overlap."""

from __future__ import annotations

import pytest
import torch

from fsdp_guide import launch
from fsdp_guide.data import digits


def _rows(dataset):
    return {tuple(image.flatten().tolist()) + (int(label),) for image, label in dataset}


def test_split_is_fixed_disjoint_and_complete():
    train, test = digits()
    again_train, _ = digits()
    assert torch.equal(train.tensors[0], again_train.tensors[0])  # the same on every call (and rank)
    assert len(train) + len(test) == 1797
    assert not _rows(train) & _rows(test)  # no test image is also a training image
    assert train.tensors[0].min() == 0 and train.tensors[0].max() == 1
    assert sorted(set(test.tensors[1].tolist())) == list(range(10))
    assert not torch.equal(digits(seed=1)[0].tensors[1], train.tensors[1])


@pytest.mark.parametrize("test_size", [0, 1797, -5])
def test_bad_test_size_is_a_value_error(test_size):
    with pytest.raises(ValueError, match=f"test_size={test_size}: expected between 1 and 1796"):
        digits(test_size=test_size)


def _my_indices_in_epochs_1_and_2():
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(digits()[0], shuffle=True, seed=0)
    indices = []
    for epoch in (1, 2):
        sampler.set_epoch(epoch)
        indices.append(list(sampler))
    return indices


def test_two_ranks_read_halves_that_cover_every_training_image_each_epoch():
    (rank0_epoch1, rank0_epoch2), (rank1_epoch1, rank1_epoch2) = launch(_my_indices_in_epochs_1_and_2, output="none")
    for rank0, rank1 in ((rank0_epoch1, rank1_epoch1), (rank0_epoch2, rank1_epoch2)):
        assert len(rank0) == len(rank1) == 719  # 1437 images: one is repeated to even out the halves
        assert len(set(rank0) | set(rank1)) == 1437 and len(set(rank0) & set(rank1)) <= 1
    assert rank0_epoch1 != rank0_epoch2  # set_epoch reshuffles
