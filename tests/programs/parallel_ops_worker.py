"""hvdkit.parallel.ops in every rank of a real job, against the same arithmetic in one process: each
rank rebuilds every rank's inputs from their seeds, so the one-process reference needs no
collective. Three steps under the same names (the names are the same from step to step), in the
whole job and, at 4 ranks, in two process sets of 2 made at hvd.init. fp64; rank 0 prints
"parallel ops: ok in <sets>" or fails with the assertion.

    mpirun -np N python tests/programs/parallel_ops_worker.py
"""

import horovod.torch as hvd
import torch

from hvdkit import env
from hvdkit.parallel.ops import gather_shards

SHARD = 5


def shard_of(rank: int, step: int) -> torch.Tensor:
    return torch.randn(SHARD, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * step + rank))


def weights_of(rank: int, step: int, size: int) -> torch.Tensor:
    """What rank ``rank``'s loss weighs each element of the whole by: its own batch's gradient."""
    generator = torch.Generator().manual_seed(1000 + 10 * step + rank)
    return torch.randn(SHARD * size, dtype=torch.float64, generator=generator)


def check_gather_shards(members: list[int], process_set, where: str) -> None:
    """The whole is every member's shard in order; each shard's gradient is its block of the members'
    whole gradients, averaged. The whole is used twice in the loss, as a tied weight is."""
    me, size = members.index(hvd.rank()), len(members)
    for step in range(3):
        shard = shard_of(hvd.rank(), step).requires_grad_()
        whole = gather_shards(shard, f"test.gather.{where}", process_set)
        expected = torch.cat([shard_of(rank, step) for rank in members])
        assert torch.equal(whole, expected), (where, step)
        weights = weights_of(hvd.rank(), step, size)
        ((whole * weights).sum() + (whole * whole).sum()).backward()
        grads = [weights_of(rank, step, size) + 2 * expected for rank in members]
        want = (sum(grads) / size)[me * SHARD:(me + 1) * SHARD]
        torch.testing.assert_close(shard.grad, want, rtol=0, atol=1e-12, msg=f"{where} step {step}")


def main() -> None:
    size = env.detect().size  # the launcher's: process sets are made at hvd.init, before Horovod knows it
    halves = [list(range(0, size // 2)), list(range(size // 2, size))] if size == 4 else []
    sets = [hvd.ProcessSet(half) for half in halves]
    hvd.init(process_sets=sets or None)
    check_gather_shards(list(range(hvd.size())), None, "job")
    for half, process_set in zip(halves, sets, strict=True):
        if hvd.rank() in half:
            check_gather_shards(half, process_set, f"set{halves.index(half)}")
    hvd.barrier()
    if hvd.rank() == 0:
        print(f"parallel ops: ok in {'the job and two sets' if sets else 'the job'}", flush=True)


if __name__ == "__main__":
    main()
