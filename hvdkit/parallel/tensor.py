"""Tensor parallelism's layers (Megatron's tensor_parallel/layers.py and cross_entropy.py, torch's
``ColwiseParallel`` and ``RowwiseParallel``), built from hvdkit.parallel.ops over one
tensor-parallel group (hvdkit.parallel.mesh.Group).

Each layer is made from the whole layer it replaces, keeping this rank's block of its weights,
so that a model built whole (from a seed) and parallelized computes what the whole model does.
A column-parallel linear layer holds a block of the output features, a row-parallel one a block
of the input features (its bias whole, added once the ranks' partial sums are summed); a
vocabulary-parallel embedding holds a block of the rows; ``vocab_parallel_cross_entropy`` takes
each rank's block of the logits and never joins them.

Sequence parallelism (a column-parallel layer's ``input="sequence"``, the others'
``sequence_parallel=True``): between the tensor-parallel regions each rank
holds its part of the sequence (along ``seq_dim``; 1 for batch-first tensors, as torch's
``SequenceParallel``): a column-parallel layer gathers the sequence first, a row-parallel one
reduce-scatters its result into the parts. What a rank then computes on its part alone (a norm's
weights, a row-parallel bias) has a gradient of its part only: those parameters are marked
``sequence_parallel`` and their gradients summed over the group
(hvdkit.parallel.grads.sum_sequence_parallel_grads).

Every collective is named from the layer's ``name`` (its module path: the same on every rank and
from step to step); every rank of the group calls each layer in the same order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hvdkit.parallel.ops import (
    all_reduce,
    block,
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
)


def _block(tensor: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's block of a whole weight, a tensor of its own."""
    return block(tensor.detach(), group, dim).clone()


class ColumnParallelLinear(nn.Module):
    """``whole`` (an nn.Linear) with this rank's block of its output features: its output is this
    rank's block of the whole output (joined where ``gather_output``). Its ``input``, one of INPUTS:
    "whole", the same on every rank, copied into the region (the backward sums the ranks'
    gradients); "sequence", each rank's part of the sequence, gathered here (the backward
    reduce-scatters); "gathered", whole, gathered by a module before it whose backward sums
    (hvdkit.parallel.plan.SequenceParallel's ``gather_output``: one gather for the q, k and v
    layers that read it), so nothing is done here."""

    INPUTS = ("whole", "sequence", "gathered")

    def __init__(self, whole: nn.Linear, group, name: str, gather_output: bool = False, input: str = "whole",
                 seq_dim: int = 1) -> None:
        super().__init__()
        if input not in self.INPUTS:
            raise ValueError(f"the input {input!r} is not one of {', '.join(self.INPUTS)}")
        self.group, self.name = group, name
        self.gather_output, self.input, self.seq_dim = gather_output, input, seq_dim
        self.in_features, self.out_features = whole.in_features, whole.out_features
        self.weight = nn.Parameter(_block(whole.weight, group, 0), requires_grad=whole.weight.requires_grad)
        self.bias = None if whole.bias is None else nn.Parameter(_block(whole.bias, group, 0),
                                                                 requires_grad=whole.bias.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input == "sequence":
            x = gather_from_sp(x, self.group, f"{self.name}.sequence", self.seq_dim)
        elif self.input == "whole":
            x = copy_to_tp(x, self.group, f"{self.name}.input")
        out = F.linear(x, self.weight, self.bias)
        return gather_from_tp(out, self.group, f"{self.name}.output") if self.gather_output else out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} / {self.group.size} ranks"


class RowParallelLinear(nn.Module):
    """``whole`` (an nn.Linear) with this rank's block of its input features: its input is this
    rank's block of the whole input (a column-parallel layer's output), its output the whole
    output on every rank (sequence parallel: each rank's part of the sequence), bias added once."""

    def __init__(self, whole: nn.Linear, group, name: str, sequence_parallel: bool = False,
                 seq_dim: int = 1) -> None:
        super().__init__()
        self.group, self.name, self.sequence_parallel, self.seq_dim = group, name, sequence_parallel, seq_dim
        self.in_features, self.out_features = whole.in_features, whole.out_features
        self.weight = nn.Parameter(_block(whole.weight, group, 1), requires_grad=whole.weight.requires_grad)
        self.bias = None if whole.bias is None else nn.Parameter(whole.bias.detach().clone(),
                                                                 requires_grad=whole.bias.requires_grad)
        if self.bias is not None and sequence_parallel:
            self.bias.sequence_parallel = True  # added to this rank's part of the sequence only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            out = reduce_scatter_to_sp(partial, self.group, f"{self.name}.output", self.seq_dim)
        else:
            out = reduce_from_tp(partial, self.group, f"{self.name}.output")
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} / {self.group.size} ranks, out_features={self.out_features}"


class VocabParallelEmbedding(nn.Module):
    """``whole`` (an nn.Embedding) with this rank's block of its rows: each rank looks up the ids
    in its block, zeros elsewhere, and the ranks' results are summed (sequence parallel:
    reduce-scattered into each rank's part of the sequence)."""

    def __init__(self, whole: nn.Embedding, group, name: str, sequence_parallel: bool = False,
                 seq_dim: int = 1) -> None:
        super().__init__()
        if whole.padding_idx is not None or whole.max_norm is not None or whole.sparse:
            raise ValueError("an embedding with padding_idx, max_norm or sparse gradients is not split by "
                             "vocabulary rows")
        self.group, self.name, self.sequence_parallel, self.seq_dim = group, name, sequence_parallel, seq_dim
        self.num_embeddings, self.embedding_dim = whole.num_embeddings, whole.embedding_dim
        self.weight = nn.Parameter(_block(whole.weight, group, 0), requires_grad=whole.weight.requires_grad)
        self.first = group.rank * self.weight.shape[0]  # this rank's first row of the vocabulary

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.first) | (ids >= self.first + self.weight.shape[0])
        local = (ids - self.first).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sp(out, self.group, f"{self.name}.output", self.seq_dim)
        return reduce_from_tp(out, self.group, f"{self.name}.output")


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group, name: str) -> torch.Tensor:
    """Each token's cross-entropy (``F.cross_entropy(..., reduction="none")`` of the whole logits)
    from this rank's block of the vocabulary's logits (the last dimension, in rank order), the
    whole logits never joined: three allreduces of one value per token (the max, the target's
    logit, the sum of exponentials). Every rank of ``group`` gets every token's loss."""
    if group.size == 1:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                               reduction="none").view(target.shape)
    return _VocabParallelCrossEntropy.apply(logits, target, group, name)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, name):
        from horovod.torch import mpi_ops

        width = logits.shape[-1]
        first = group.rank * width
        peak = all_reduce(logits.detach().amax(dim=-1), group, f"{name}.max", mpi_ops.Max)
        shifted = logits.detach() - peak.unsqueeze(-1)
        outside = (target < first) | (target >= first + width)
        local = (target - first).masked_fill(outside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        picked = all_reduce(picked, group, f"{name}.target")
        exp = shifted.exp()
        total = all_reduce(exp.sum(dim=-1), group, f"{name}.sum")
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), local, outside)
        return total.log() - picked

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside = ctx.saved_tensors
        grad_logits = softmax.clone()
        grad_logits.scatter_add_(-1, local.unsqueeze(-1), -(~outside).to(softmax.dtype).unsqueeze(-1))
        return grad_logits.mul_(grad.unsqueeze(-1)), None, None, None

