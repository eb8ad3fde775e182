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
