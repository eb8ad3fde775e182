"""A split model's gradients across its tensor-parallel group: where each parameter's gradient is
(the parameters' own, or the slices ZeRO holds within the data-parallel set), and sequence
parallelism's sums.

Under sequence parallelism each rank of a tensor-parallel group runs the norms, and adds the
row-parallel layers' biases, on its part of the sequence only: those parameters are replicated,
marked ``sequence_parallel`` (hvdkit.parallel.plan), and each rank's gradient is of its part. The
whole gradient is the group's sum, taken after the data-parallel average (both are sums, so the
order does not change the result) and before anything reads the gradients (clipping, the
finiteness check, the step): Megatron's finalize_model_grads sums its norms' gradients at the same
point. One allreduce per dtype carries them all.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
from torch import nn

from hvdkit.parallel.ops import all_reduce_


def sliced(optimizer) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
    """Each (parameter, the part of this rank's gradient slice that is of it) of a ZeRO optimizer
    (hvdkit.zero.optimizer.ShardedOptimizer): a view into the slice, in the buckets' order, skipping
    the buckets without a gradient this step."""
    for piece, bucket in zip(optimizer.slices, optimizer.buckets, strict=True):
        if piece.grad is None:
            continue
        start = optimizer.rank * len(piece)
        for index, offset, shape in zip(bucket.params, bucket.offsets, bucket.shapes, strict=True):
            lo, hi = max(start, offset), min(start + len(piece), offset + math.prod(shape))
            if lo < hi:
                yield optimizer.params[index], piece.grad[lo - start:hi - start]


def has_sequence_parallel(model: nn.Module) -> bool:
    """Whether a plan made any of ``model``'s parameters sequence-parallel."""
    return any(getattr(param, "sequence_parallel", False) for param in model.parameters())


def sequence_parallel_grads(holder) -> list[torch.Tensor]:
    """The gradients of the parameters marked ``sequence_parallel`` that this rank holds: of a model
    (nn.Module) or an optimizer's parameters, or, for a ZeRO optimizer, the parts of its slices
    that are of them."""
    if hasattr(holder, "slices"):
        return [grad for param, grad in sliced(holder) if getattr(param, "sequence_parallel", False)]
    params = holder.parameters() if isinstance(holder, nn.Module) else (
        param for group in holder.param_groups for param in group["params"])
    return [param.grad for param in params if getattr(param, "sequence_parallel", False) and param.grad is not None]


def sum_sequence_parallel_grads(holder, group, name: str) -> None:
    """Sum over the tensor-parallel ``group`` the gradients of the sequence-parallel parameters of
    ``holder`` (a model, or its optimizer, ZeRO's included), in place, in one allreduce per dtype.
    Every rank of the group calls it alike, after the data-parallel average (a loop's
    ``optimizer.synchronize()``) and before the gradients are clipped or stepped; the Session's
    optimizer calls it inside its synchronize (hvdkit.rank.step.buckets)."""
    all_reduce_(sequence_parallel_grads(holder), group, name)
