"""The training step's pieces in one process (hvdkit.rank.step): batches split into micro-batches,
the learning rate multiplier per world size."""

from collections import namedtuple

import pytest
import torch

from hvdkit.config import TrainConfig
from hvdkit.rank.step import batch_len, lr_multiplier, split_batch


def test_split_batch_splits_every_nesting():
    Pair = namedtuple("Pair", "x y")
    batch = {"ids": torch.arange(10), "pair": Pair(torch.zeros(10, 3), [torch.ones(10), torch.arange(10) * 2])}
    chunks = split_batch(batch, 4)
    assert [batch_len(c) for c in chunks] == [4, 4, 2]
    assert torch.equal(chunks[2]["ids"], torch.tensor([8, 9]))
    assert isinstance(chunks[1]["pair"], Pair) and torch.equal(chunks[1]["pair"].y[1], torch.tensor([8, 10, 12, 14]))
    x_mask_y = split_batch((torch.zeros(5, 2), torch.ones(5, 2, dtype=torch.bool), torch.arange(5)), 3)
    assert [len(part) for part in x_mask_y] == [3, 3] and torch.equal(x_mask_y[1][2], torch.tensor([3, 4]))
    with pytest.raises(ValueError, match="different numbers of samples"):
        split_batch((torch.zeros(4), torch.zeros(6)), 2)
    with pytest.raises(TypeError, match="cannot split a str"):
        split_batch(("text", torch.zeros(4)), 2)


@pytest.mark.parametrize("scaling, adasum, expected", [
    ("linear", False, 16.0), ("sqrt", False, 4.0), ("none", False, 1.0),
    ("linear", True, 2.0),  # Adasum on CPUs: only K counts
])
def test_lr_multiplier(scaling, adasum, expected):
    cfg = TrainConfig(lr_scaling=scaling, use_adasum=adasum, batches_per_allreduce=2)
    assert lr_multiplier(cfg, size=8, local_size=4, on_gpu_with_nccl=False) == expected


def test_adasum_on_gpus_sums_within_a_node():
    cfg = TrainConfig(use_adasum=True, batches_per_allreduce=2)
    assert lr_multiplier(cfg, size=8, local_size=4, on_gpu_with_nccl=True) == 8.0
