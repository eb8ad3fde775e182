"""The training step's pieces in one process (hvdkit.rank.step.training): batches split into micro-batches,
the learning rate multiplier per world size, the fused optimizers that skip a step on the device."""

from collections import namedtuple

import pytest
import torch

from hvdkit.config import TrainConfig
from hvdkit.data import batch_len
from hvdkit.rank.step.training import (
    lr_multiplier,
    prepare_momentum,
    skips_on_device,
    split_batch,
    use_fused_kernels,
)


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


def _weights_after(steps, optimizer_class, **options):
    """Weights after ``steps`` (each a found_inf value: 1.0 skips) of a fused optimizer made fused
    by use_fused_kernels, from the same start and gradients."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(3))]
    optimizer = optimizer_class(params, lr=0.1, **options)
    assert use_fused_kernels(optimizer) and skips_on_device(optimizer)
    for found_inf in steps:
        for p in params:
            p.grad = torch.full_like(p, 0.5)
        prepare_momentum(optimizer)
        optimizer.found_inf = torch.tensor(found_inf)
        optimizer.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("optimizer_class, options", [
    (torch.optim.SGD, {"momentum": 0.9, "weight_decay": 1e-4}), (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
    (torch.optim.Adam, {}), (torch.optim.AdamW, {"weight_decay": 0.1})])
def test_a_skipped_step_changes_nothing_even_the_first(optimizer_class, options):
    """A skipped first step of fused SGD would leave torch.empty_like momentum buffers behind
    (prepare_momentum makes them zeros); Adam's step count is taken back on the device."""
    once = _weights_after([0.0], optimizer_class, **options)
    assert all(torch.equal(a, b) for a, b in zip(_weights_after([1.0, 0.0], optimizer_class, **options), once,
                                                 strict=True))
    assert all(torch.equal(a, b) for a, b in zip(_weights_after([0.0, 1.0], optimizer_class, **options), once,
                                                 strict=True))


def test_fused_kernels_only_where_the_optimizer_left_the_choice_to_torch():
    params = [torch.nn.Parameter(torch.randn(3))]
    assert not use_fused_kernels(torch.optim.SGD(params, lr=0.1, foreach=True))
    assert not use_fused_kernels(torch.optim.Adam(params, fused=False))
    assert not use_fused_kernels(torch.optim.RMSprop(params))
    dampened = torch.optim.SGD(params, lr=0.1, momentum=0.9, dampening=0.5)
    assert use_fused_kernels(dampened) and not skips_on_device(dampened), "its first step is not a plain one"


def _bucket_views(inner, buckets: int):
    """What TrainingStep._overlaps reads of hvdkit's bucket views (hvdkit.rank.step.buckets): a
    subclass of the user's optimizer class over its param groups, with buckets (``landed``) and
    their count. The bucket views themselves need a Horovod job: tests/programs/differential.py
    runs them against Horovod's optimizer."""
    methods = {"__init__": lambda self: setattr(self, "param_groups", inner.param_groups),
               "landed": lambda self: iter(()), "bucket_count": lambda self: buckets}
    return type(type(inner).__name__, (type(inner),), methods)()


class _ClippingSGD(torch.optim.SGD):
    """A user's SGD whose step may look at every parameter: not known to be elementwise."""


@pytest.mark.parametrize("keys, make, device, buckets, scaler, overlapped", [
    ({}, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "cpu", 2, False, True),
    ({}, lambda p: torch.optim.AdamW(p, lr=0.1), "cpu", 2, False, True),
    ({}, lambda p: _ClippingSGD(p, lr=0.1), "cpu", 2, False, False),  # a subclass: its step() may be global
    ({"elementwise_optimizer": True}, lambda p: _ClippingSGD(p, lr=0.1), "cpu", 2, False, True),  # declared
    ({}, lambda p: torch.optim.LBFGS(p), "cpu", 2, False, False),
    ({}, lambda p: torch.optim.SGD(p, lr=0.1), "cpu", 1, False, False),  # one bucket: nothing to overlap
    ({"clip_grad_norm": 1.0}, lambda p: torch.optim.SGD(p, lr=0.1), "cpu", 2, False, False),
    ({"on_nonfinite": "skip"}, lambda p: torch.optim.SGD(p, lr=0.1), "cpu", 2, False, False),
    ({"use_adasum": True}, lambda p: torch.optim.SGD(p, lr=0.1), "cpu", 2, False, False),
    ({}, lambda p: torch.optim.SGD(p, lr=0.1), "cpu", 2, True, False),  # fp16 GradScaler
    ({}, lambda p: torch.optim.SGD(p, lr=0.1), "cuda", 2, False, False),  # a host sync per bucket
    ({}, lambda p: torch.optim.SGD(p, lr=0.1, fused=True), "cuda", 2, False, True),  # skips on the device
    ({"snapshot_steps": 5}, lambda p: torch.optim.SGD(p, lr=0.1, fused=True), "cuda", 2, False, False),
])
def test_which_steps_update_each_bucket_as_it_lands(keys, make, device, buckets, scaler, overlapped):
    """The overlapped update's defaults (docs/own-loop.md#each-bucket-stepped-as-it-lands): on for
    torch's own elementwise classes (not their subclasses, unless declared) over several buckets
    with on_nonfinite stop; off for clipping, skip, Adasum, GradScaler, and a GPU optimizer that
    cannot skip on the device."""
    from hvdkit.parallel.mesh import Mesh
    from hvdkit.rank.state import RunState
    from hvdkit.rank.step.training import TrainingStep

    inner = make([torch.nn.Parameter(torch.randn(3))])
    state = RunState(optimizer=_bucket_views(inner, buckets), inner=inner, scaler=object() if scaler else None)
    step = TrainingStep(TrainConfig(**keys), None, torch.device(device), state, None, lambda: "", Mesh(1))
    assert step._overlaps(state.optimizer) is overlapped
