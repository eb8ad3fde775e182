"""The gradient's global norm across a tensor-parallel mesh, and clipping by it.

A split parameter (``tp_dim`` set by hvdkit.parallel.plan) holds a different block on each rank of
its tensor-parallel group, a replicated one the same values on every rank: the whole model's
squared norm is the group's sum of the blocks' squares plus the replicated parameters' squares
counted once. Each rank adds its blocks' squares and its replicated squares over the group's
size, and one allreduce of that one value gives every rank of the group the same norm. The
data-parallel replicas hold the same (averaged) gradients, so every rank of the mesh computes
the same norm, clips alike, and skips a step alike where the norm is not finite. Under ZeRO within
the data-parallel set each rank holds slices of its block's gradient instead (``sharded_clip_grad_norm_``).
A pipeline's stages hold disjoint parameters: a second allreduce of that one value over the
pipeline's group (``stages``) adds the other stages' squares; an embedding tied to the output layer
(``pipeline_tied``, hvdkit.parallel.pipeline.stages) is held by the first and the last stage, the
same gradient on both once summed, and counts half on each.

Nothing is read on the host: the norm stays a tensor (a GPU keeps it in flight).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from hvdkit.parallel.grads import sliced
from hvdkit.parallel.ops import all_reduce


def grad_norm(parameters: Iterable[torch.Tensor], group, name: str, stages=None) -> torch.Tensor:
    """The 2-norm of the whole model's gradient (a 0-dim float64 tensor), from this rank's
    ``parameters`` of a model split over ``group``; every rank of the group calls it alike. With
    ``stages`` (a pipeline's group: this rank's peers holding the other stages), the stages'
    squares are summed too, each stage's parameters its own."""
    squares = torch.zeros((), dtype=torch.float64)
    for weight, grads in _weighted_grads(parameters, group.size, stages is not None).items():
        squares = squares + weight * torch.stack([g.detach().double().square().sum() for g in grads]).sum()
    squares = all_reduce(squares.reshape(1), group, name)
    if stages is not None:
        squares = all_reduce(squares, stages, f"{name}.stages")
    return squares.reshape(()).sqrt()


def _share(param, group_size: int, stages: bool) -> float:
    """How much of ``param``'s squares this rank counts toward the whole model's: all of a split
    block, 1/group_size of a replicated one, half again of one tied across the pipeline's ends."""
    share = 1.0 if getattr(param, "tp_dim", None) is not None else 1.0 / group_size
    return share / 2 if stages and getattr(param, "pipeline_tied", False) else share


def _weighted_grads(parameters: Iterable[torch.Tensor], group_size: int, stages: bool) -> dict[float, list]:
    weighted: dict[float, list] = {}
    for param in parameters:
        if param.grad is not None:
            weighted.setdefault(_share(param, group_size, stages), []).append(param.grad)
    return weighted


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, group, name: str,
                    stages=None) -> torch.Tensor:
    """Scale the gradients of ``parameters`` so that the whole model's gradient norm is at most
    ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` does on the whole model; returns the norm
    before clipping. Every rank of ``group`` calls it alike; a non-finite norm scales by NaN,
    as torch's does (the caller skips the step: every rank sees the same norm). ``stages``: as
    ``grad_norm``'s, the whole pipeline's norm."""
    parameters = [p for p in parameters if p.grad is not None]
    norm = grad_norm(parameters, group, name, stages)
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for param in parameters:
        param.grad.mul_(scale.to(param.grad.dtype))
    return norm


def sharded_clip_grad_norm_(optimizer, max_norm: Optional[float], group, dp_group, name: str,
                            stages=None) -> torch.Tensor:
    """The whole model's gradient norm from ZeRO's slices (hvdkit.zero.optimizer.ShardedOptimizer over
    ``dp_group``'s set) of a model split over ``group``, and, with ``max_norm``, each slice's gradient
    scaled as ``clip_grad_norm_`` scales the parameters'. A slice's squares count once where they are
    of a split parameter, over the group's size where of a replicated one; one allreduce over the
    data-parallel set gives each rank its block's sum, one over the group the whole model's (and one
    over ``stages``, a pipeline's group, the whole pipeline's). Every rank of the mesh calls it alike."""
    squares = torch.zeros((), dtype=torch.float64)
    for param, grad in sliced(optimizer):
        squares = squares + _share(param, group.size, stages is not None) * grad.detach().double().square().sum()
    squares = all_reduce(all_reduce(squares.reshape(1), dp_group, f"{name}.dp"), group, name)
    if stages is not None:
        squares = all_reduce(squares, stages, f"{name}.stages")
    norm = squares.reshape(()).sqrt()
    if max_norm is not None:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for piece in optimizer.slices:
            if piece.grad is not None:
                piece.grad.mul_(scale.to(piece.grad.dtype))
    return norm
