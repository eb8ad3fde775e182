"""What runs in each rank of `hvdkit bench allreduce`: every size under raw MPI (mpi4py),
torch.distributed and Horovod, checked once and timed, printing one JSON record."""

from __future__ import annotations

import argparse
import json
import os
import time
from functools import partial
from typing import Callable

from hvdkit import env
from hvdkit.bench.drivers import RunFailed
from hvdkit.bench.environment import environment
from hvdkit.bench.figures import algbw, busbw, default_iterations, format_size, size_range
from hvdkit.bench.workers import apply_defaults, init_torch_distributed


def _time_allreduce(run: Callable[[], None], iterations: int, barrier: Callable[[], None]) -> float:
    """Seconds per call on this rank, after warmup, starting together."""
    for _ in range(max(2, iterations // 10)):
        run()
    barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        run()
    return (time.perf_counter() - start) / iterations


def allreduce_worker(args: argparse.Namespace) -> None:
    """Every size under raw MPI and torch.distributed first, then Horovod: its background
    thread polls once it starts and must not run under the others' measurements. Each
    implementation's result is checked once per size before it is timed."""
    import torch
    import torch.distributed as dist

    from hvdkit.rank.start.startup import performance_settings, place_process

    launch = env.detect()
    if not args.no_tuning:
        import horovod.torch as hvd

        apply_defaults(performance_settings(torch.cuda.is_available(), launch.spans_hosts,
                                             gloo_built=hvd.gloo_built()))
    place_process(launch.local_rank or 0, launch.local_size or 1)
    sizes = size_range(args.sizes)
    init_torch_distributed("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    seconds: dict[str, list[float]] = {}
    skipped: dict[str, str] = {}
    if os.environ.get("HOROVOD_CONTROLLER") == "gloo":
        skipped["mpi4py"] = "a Gloo launch (horovodrun --gloo) has no MPI"
    else:
        seconds["mpi4py"] = _mpi4py_times(args, sizes, rank, size)
    seconds["torch.distributed"] = _torch_times(args, sizes, rank, size)
    import horovod.torch as hvd

    hvd.init()
    seconds.update(_horovod_times(args, hvd, sizes, rank, size))
    _allreduce_report(args, seconds, sizes, skipped, "mpi" if hvd.mpi_enabled() else "gloo")
    hvd.shutdown()


def _checked(name: str, nbytes: int, rank: int, size: int, got: float, average: bool = False) -> None:
    """Every rank gave rank + 1: the sum is size(size + 1)/2 (its average for Horovod's Average)."""
    want = size * (size + 1) / 2 / (size if average else 1)
    if abs(got - want) > 1e-3 * abs(want):
        raise RunFailed(f"{name} allreduce of {format_size(nbytes)} gave {got} on rank {rank}, expected {want}")


def _mpi4py_times(args: argparse.Namespace, sizes: list, rank: int, size: int) -> list[float]:
    import numpy as np
    from mpi4py import MPI

    world, times = MPI.COMM_WORLD, []
    for nbytes in sizes:
        send = np.full(nbytes // 4, rank + 1, dtype=np.float32)
        recv = np.empty_like(send)
        world.Allreduce(send, recv, op=MPI.SUM)
        _checked("mpi4py", nbytes, rank, size, float(recv[-1]))
        times.append(_time_allreduce(partial(world.Allreduce, send, recv, op=MPI.SUM),
                                     args.iters or default_iterations(nbytes), world.Barrier))
    return times


def _torch_times(args: argparse.Namespace, sizes: list, rank: int, size: int) -> list[float]:
    import torch
    import torch.distributed as dist

    times = []
    for nbytes in sizes:
        tensor = torch.full((nbytes // 4,), float(rank + 1))
        dist.all_reduce(tensor)
        _checked("torch.distributed", nbytes, rank, size, float(tensor[-1]))
        tensor.zero_()  # repeated in-place sums of zeros stay finite
        times.append(_time_allreduce(partial(dist.all_reduce, tensor), args.iters or default_iterations(nbytes),
                                     dist.barrier))
    return times


def _horovod_times(args: argparse.Namespace, hvd, sizes: list, rank: int, size: int) -> dict[str, list[float]]:
    """In place (the DistributedOptimizer's path: allreduce_async_ and synchronize) and out of place."""
    import torch

    seconds = {}
    for name in ("horovod in-place", "horovod out-of-place"):
        times = []
        for nbytes in sizes:
            tensor = torch.full((nbytes // 4,), float(rank + 1))
            tag = f"bench.{format_size(nbytes)}"  # one name per size, as gradients have: the response cache hits
            if name == "horovod in-place":
                def run(t=tensor, tag=tag):
                    hvd.synchronize(hvd.allreduce_async_(t, op=hvd.Average, name=tag))
                run()
                got = float(tensor[-1])
            else:
                def run(t=tensor, tag=tag):
                    return hvd.allreduce(t, op=hvd.Average, name=tag + ".out")
                got = float(run()[-1])
            _checked(name, nbytes, rank, size, got, average=True)
            times.append(_time_allreduce(run, args.iters or default_iterations(nbytes), hvd.barrier))
        seconds[name] = times
    return seconds


def _allreduce_report(args: argparse.Namespace, seconds: dict, sizes: list, skipped: dict, controller: str) -> None:
    """Rank 0's JSON record: per size and implementation, the slowest rank's time (the collective's)."""
    import torch.distributed as dist

    names, size = list(seconds), dist.get_world_size()
    gathered = [None] * size
    dist.all_gather_object(gathered, [seconds[n] for n in names])
    if dist.get_rank() != 0:
        return
    rows = []
    for i, nbytes in enumerate(sizes):
        row = {"bytes": nbytes, "count": nbytes // 4}
        for j, name in enumerate(names):
            t = max(per_rank[j][i] for per_rank in gathered)
            bw = algbw(nbytes, t)
            row[name] = {"time_us": t * 1e6, "algbw": bw, "busbw": busbw(bw, size)}
        rows.append(row)
    record = {"event": "bench.allreduce", "world_size": size, "implementations": names, "skipped": skipped,
              "rows": rows, "environment": environment(controller=controller, tuning=not args.no_tuning)}
    print(json.dumps(record), flush=True)


# --- hvdkit bench zero ----------------------------------------------------------------------
