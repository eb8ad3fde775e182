"""hvdkit's autograd functions over Horovod's collectives that carry no autograd of their own
(``mpi_ops._allgather_async`` and ``_reducescatter_async``): each a forward and a backward of a
few lines, the collective in each stated by its name.

Horovod's own autograd collectives do not fit model parallelism: ``hvd.allgather``'s backward is
an averaging allreduce and a slice, with a blocking allgather of the sizes on every call, and
``hvd.reducescatter``'s multiplies by the set's size under Sum and changes its input in place.
Every collective here is named by the caller, the same on every rank and from step to step, its
backward's with ``.grad`` added: an unnamed collective takes its name from a counter of the whole
process, and ranks that have issued different numbers of them wait for each other forever.

Called on every rank of ``process_set`` (the whole job by default), in the same order; the
outputs are new tensors (Horovod sizes them), nothing is read on the host.

Tensor parallelism's operators are Megatron's (its tensor_parallel/mappings.py), each over one
group of hvdkit.parallel.mesh: into and out of a tensor-parallel region (``copy_to_tp`` and
``reduce_from_tp``, conjugate: identity one way, a sum the other), a block of the last dimension
and its gather, and sequence parallelism's gather and reduce-scatter along the sequence. Each
waits for its collective (the next layer needs the result); nothing is read on the host.
"""

from __future__ import annotations

from typing import Optional

import torch


def gather_shards(shard: torch.Tensor, name: str, process_set=None) -> torch.Tensor:
    """The whole 1-D tensor from every rank's equal 1-D ``shard``, in rank order (ZeRO stage 3's
    weights before a forward or a backward). Its backward hands each rank the gradient of its own
    shard averaged over the set, as data parallelism averages: the ranks' whole gradients
    (each of its own batch) reduce-scattered with Horovod's Average."""
    return _GatherShards.apply(shard, name, process_set)


class _GatherShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard: torch.Tensor, name: str, process_set) -> torch.Tensor:
        from horovod.torch import mpi_ops

        ctx.name, ctx.process_set = name, _set(process_set)
        if shard.dim() != 1:
            raise ValueError(f"gather_shards {name}: a shard is a 1-D tensor, not {tuple(shard.shape)}")
        handle = mpi_ops._allgather_async(shard.detach().contiguous(), shard.new_empty(0), name, ctx.process_set)
        return mpi_ops.synchronize(handle)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from horovod.torch import mpi_ops

        handle = mpi_ops._reducescatter_async(grad.contiguous(), grad.new_empty(0), f"{ctx.name}.grad",
                                              mpi_ops.Average, ctx.process_set, 1.0, 1.0)
        return mpi_ops.synchronize(handle), None, None


def _set(process_set: Optional[object]):
    from horovod.torch.mpi_ops import global_process_set

    return global_process_set if process_set is None else process_set


# -- tensor parallelism: Megatron's operators over a group (hvdkit.parallel.mesh.Group) ----------------
# Each is the identity where the group is one rank. ``dim``: the tensor's dimension that is split
# across the group (the last for the tensor-parallel region, the sequence's for sequence parallelism).

def copy_to_tp(x: torch.Tensor, group, name: str) -> torch.Tensor:
    """Into a tensor-parallel region: the forward passes ``x`` on, the backward sums the ranks'
    gradients (each rank's computes from its shard of the weights)."""
    return x if group.size == 1 else _CopyToTP.apply(x, group, name)


def reduce_from_tp(x: torch.Tensor, group, name: str) -> torch.Tensor:
    """Out of a tensor-parallel region: the forward sums the ranks' partial results, the backward
    passes the gradient on (every rank's is the same)."""
    return x if group.size == 1 else _ReduceFromTP.apply(x, group, name)


def scatter_to_tp(x: torch.Tensor, group, name: str, dim: int = -1) -> torch.Tensor:
    """This rank's block of ``x`` along ``dim``; the backward gathers the blocks' gradients."""
    return x if group.size == 1 else _Scatter.apply(x, group, name, dim, False)


def gather_from_tp(x: torch.Tensor, group, name: str, dim: int = -1) -> torch.Tensor:
    """Every rank's block joined along ``dim`` in rank order; the backward keeps this rank's block."""
    return x if group.size == 1 else _Gather.apply(x, group, name, dim, False)


def gather_from_sp(x: torch.Tensor, group, name: str, dim: int) -> torch.Tensor:
    """Sequence parallelism into a tensor-parallel region: every rank's part of the sequence joined
    along ``dim``; the backward reduce-scatters (sums) the gradients, whose sum each rank's weights
    shard only a part of."""
    return x if group.size == 1 else _Gather.apply(x, group, name, dim, True)


def reduce_scatter_to_sp(x: torch.Tensor, group, name: str, dim: int) -> torch.Tensor:
    """Out of a tensor-parallel region into sequence parallelism: the ranks' partial results summed,
    each rank keeping its part of the sequence along ``dim``; the backward gathers the gradient."""
    return x if group.size == 1 else _ReduceScatter.apply(x, group, name, dim)


def scatter_to_sp(x: torch.Tensor, group, name: str, dim: int) -> torch.Tensor:
    """Into sequence parallelism: this rank's part of the sequence; the backward gathers."""
    return x if group.size == 1 else _Scatter.apply(x, group, name, dim, False)


def all_reduce(x: torch.Tensor, group, name: str, op=None) -> torch.Tensor:
    """The group's sum (or ``op``: Horovod's Max, Min) of ``x``, a new tensor; no autograd."""
    from horovod.torch import mpi_ops

    if group.size == 1:
        return x
    x = x.detach().contiguous()
    handle = mpi_ops._allreduce_async(x, x.new_empty(x.shape), name, mpi_ops.Sum if op is None else op, 1.0, 1.0,
                                      group.process_set)
    return mpi_ops.synchronize(handle)


def all_reduce_(tensors: list[torch.Tensor], group, name: str) -> None:
    """Each of ``tensors`` replaced by the group's sum, in place, in one allreduce per dtype (the
    tensors flattened into one vector): many small sums, as sequence parallelism's norms' gradients
    are, cost one collective. Views are written through; no autograd."""
    if group.size == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for dtype, same in by_dtype.items():
        summed = all_reduce(torch.cat([t.detach().reshape(-1) for t in same]), group, f"{name}.{dtype}".replace(
            "torch.", ""))
        for tensor, part in zip(same, summed.split([t.numel() for t in same]), strict=True):
            tensor.detach().copy_(part.view_as(tensor))


def all_gather(x: torch.Tensor, group, name: str, dim: int) -> torch.Tensor:
    """Every rank's ``x`` of ``group`` joined along ``dim`` in rank order, a new tensor; no autograd."""
    from horovod.torch import mpi_ops

    front = x.detach().movedim(dim, 0).contiguous()  # Horovod joins along the first dimension
    handle = mpi_ops._allgather_async(front, front.new_empty(0), name, group.process_set)
    return mpi_ops.synchronize(handle).movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, group, name: str, dim: int) -> torch.Tensor:
    from horovod.torch import mpi_ops

    front = x.detach().movedim(dim, 0).contiguous()
    if front.shape[0] % group.size:
        raise ValueError(f"{name}: {front.shape[0]} along dimension {dim} does not split over {group.size} ranks")
    handle = mpi_ops._reducescatter_async(front, front.new_empty(0), name, mpi_ops.Sum, group.process_set, 1.0, 1.0)
    return mpi_ops.synchronize(handle).movedim(0, dim).contiguous()


def block(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's block of ``x`` along ``dim`` (the group's equal blocks in rank order), a view
    where it is contiguous; ValueError where the group does not divide the width."""
    width = x.shape[dim]
    if width % group.size:
        raise ValueError(f"its {width} along dimension {dim} do not split over {group.size} ranks; give a tp that "
                         f"divides them")
    return x.narrow(dim, group.rank * (width // group.size), width // group.size).contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, name):
        ctx.group, ctx.name = group, name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group, f"{ctx.name}.grad"), None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, name):
        return all_reduce(x, group, name)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, name, dim, _):
        ctx.group, ctx.name, ctx.dim = group, name, dim
        return block(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group, f"{ctx.name}.grad", ctx.dim), None, None, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, name, dim, summed):
        ctx.group, ctx.name, ctx.dim, ctx.summed = group, name, dim, summed
        return all_gather(x, group, name, dim)

    @staticmethod
    def backward(ctx, grad):
        if ctx.summed:
            return _reduce_scatter(grad, ctx.group, f"{ctx.name}.grad", ctx.dim), None, None, None, None
        return block(grad, ctx.group, ctx.dim), None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, name, dim):
        ctx.group, ctx.name, ctx.dim = group, name, dim
        return _reduce_scatter(x, group, name, dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group, f"{ctx.name}.grad", ctx.dim), None, None, None
