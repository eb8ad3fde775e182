"""What runs in each rank: Horovod's synthetic benchmark (hvdkit, its own-loop, Horovod's loop,
DDP) and the allreduce timings (mpi4py, torch.distributed, Horovod), each printing one JSON record."""

from __future__ import annotations

import argparse
import atexit
import json
import os
import socket
import statistics
import time
from functools import partial
from typing import Callable

from hvdkit import env
from hvdkit.bench.drivers import RunFailed
from hvdkit.bench.environment import environment
from hvdkit.bench.figures import (
    BenchError,
    algbw,
    busbw,
    cross_rank_total,
    default_iterations,
    format_size,
    rate_stats,
    size_range,
)
from hvdkit.bench.profile import profile_steps

SYNTHETIC_IMPLS = ("hvdkit", "own-loop", "horovod", "horovod-defaults", "ddp")


IMPL_HELP = ("hvdkit: the Trainer's step and defaults; own-loop: the README's own loop on hvdkit.Session; "
             "horovod: a hand-written Horovod loop (Horovod's "
             "example) with the same settings; horovod-defaults: that loop with Horovod's own defaults; "
             "ddp: torch DistributedDataParallel (NCCL on GPUs, Gloo on CPUs)")


class _Comm:
    """The collectives a worker needs besides the one it measures: Horovod's or torch's."""

    def __init__(self, rank: int, size: int, allgather_rows: Callable, controller: str) -> None:
        self.rank, self.size, self.allgather_rows, self.controller = rank, size, allgather_rows, controller


def _horovod_comm(hvd) -> _Comm:
    import torch

    def rows(values: list[float]) -> list[list[float]]:
        return hvd.allgather(torch.tensor([values], dtype=torch.float64), name="bench.gather").tolist()

    return _Comm(hvd.rank(), hvd.size(), rows, "mpi" if hvd.mpi_enabled() else "gloo")


def _torch_comm() -> _Comm:
    import torch
    import torch.distributed as dist

    def rows(values: list[float]) -> list[list[float]]:
        gathered = [torch.zeros(len(values), dtype=torch.float64) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, torch.tensor(values, dtype=torch.float64))
        return [t.tolist() for t in gathered]

    return _Comm(dist.get_rank(), dist.get_world_size(), rows, dist.get_backend())


def _init_torch_distributed(backend: str) -> None:
    """torch.distributed from the launcher's ranks and the driver's MASTER_ADDR/PORT."""
    import torch.distributed as dist

    launch = env.detect()
    if launch.rank is None or "MASTER_PORT" not in os.environ:
        raise BenchError("torch.distributed needs a launcher's ranks and MASTER_ADDR/MASTER_PORT; "
                         "run the benchmark without a launcher and give -np, it launches the ranks itself")
    dist.init_process_group(backend, rank=launch.rank, world_size=launch.size)
    # Gloo's threads, still running when the interpreter ends, abort the process now and then
    # (signal 6 after the results were printed): end the group first.
    atexit.register(dist.destroy_process_group)


def _apply_defaults(settings: dict) -> None:
    for name, value in settings.items():
        os.environ.setdefault(name, value)  # what the user exported wins, as in the Trainer


def synthetic_worker(args: argparse.Namespace) -> None:
    """Horovod's synthetic benchmark on one rank: a fixed random batch, warmup, then
    num_iters timings of num_batches_per_iter steps each."""
    import torch
    import torch.nn.functional as F

    from hvdkit import models
    from hvdkit.rank.startup import performance_settings, place_process
    from hvdkit.session import Session
    from hvdkit.trainer import classification_loss, train_step

    impl = args.impl
    launch = env.detect()
    if impl == "horovod":
        _apply_defaults(performance_settings(torch.cuda.is_available(), launch.spans_hosts))
    if impl in ("hvdkit", "own-loop"):  # the Session applies the same settings itself
        session = Session(batch_size=args.batch_size, fp16_allreduce=args.fp16_allreduce, amp=args.amp,
                          seed=args.seed)
        device = session.device
        comm = _horovod_comm(session.hvd)
    elif impl == "ddp":
        device = place_process(launch.local_rank or 0, launch.local_size or 1)
        # NCCL for the gradients, Gloo for the results gathered as CPU tensors (NCCL has no CPU backend).
        _init_torch_distributed("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
        comm = _torch_comm()
    else:
        import horovod.torch as hvd

        hvd.init()
        device = place_process(hvd.local_rank(), hvd.local_size())
        comm = _horovod_comm(hvd)
        if device.type == "cuda":  # as Horovod's pytorch_synthetic_benchmark.py does
            torch.backends.cudnn.benchmark = True

    torch.manual_seed(args.seed)
    model = models.build(args.model, 3, args.image_size, args.num_classes).to(device)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    labels = torch.randint(0, args.num_classes, (args.batch_size,), device=device)
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    scaler = torch.amp.GradScaler("cuda") if args.amp and device.type == "cuda" else None

    if impl == "hvdkit":  # the Trainer's step
        model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=args.lr))

        def step() -> None:
            train_step(session, model, classification_loss, (images, labels))
    elif impl == "own-loop":  # the README's own loop on the Session API
        model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=args.lr))

        def step() -> None:
            optimizer.zero_grad()
            for x, y in session.micro_batches((images, labels)):
                with session.autocast():
                    loss = F.cross_entropy(model(x), y)
                session.backward(loss)
                session.log(len(y), loss=loss)
            session.step()
    elif impl == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
        if args.fp16_allreduce:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)

        def step() -> None:
            optimizer.zero_grad()
            with torch.autocast(device.type, dtype=amp_dtype, enabled=args.amp):
                loss = F.cross_entropy(model(images), labels)
            if scaler:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
    else:  # Horovod's pytorch_synthetic_benchmark.py, as users write it
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=args.lr), named_parameters=model.named_parameters(),
            compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)

        def step() -> None:
            optimizer.zero_grad()
            with torch.autocast(device.type, dtype=amp_dtype, enabled=args.amp):
                loss = F.cross_entropy(model(images), labels)
            if scaler:
                scaler.scale(loss).backward()
                optimizer.synchronize()
                scaler.unscale_(optimizer)
                with optimizer.skip_synchronize():
                    scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()

    def timed_batches() -> float:
        start = time.perf_counter()
        for _ in range(args.num_batches_per_iter):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    kind = "GPU" if device.type == "cuda" else "CPU"
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    say(f"Model: {args.model}\nBatch size: {args.batch_size}\nNumber of {kind}s: {comm.size}\nRunning warmup...",
        flush=True)
    for _ in range(args.num_warmup_batches):
        step()
    say("Running benchmark...", flush=True)
    times = session.step_times if impl in ("hvdkit", "own-loop") else None
    if times:
        times.clear()
    rates = []
    # CPU time of the whole process and of this (the training) thread: on a rank with one core,
    # what the other threads (the allreduces) spend is taken from the training.
    cpu, thread_cpu = time.process_time(), time.thread_time()
    for i in range(args.num_iters):
        rates.append(args.batch_size * args.num_batches_per_iter / timed_batches())
        say(f"Iter #{i}: {rates[-1]:.1f} img/sec per {kind}", flush=True)
    steps = args.num_iters * args.num_batches_per_iter
    cpu_ms = [(time.process_time() - cpu) * 1e3 / steps, (time.thread_time() - thread_cpu) * 1e3 / steps]
    rows = comm.allgather_rows([*rate_stats(rates), *cpu_ms])  # per rank: rate mean, conf, CPU, training thread
    result = cross_rank_total([row[:2] for row in rows])
    comm.allgather_rows([0.0])  # every rank starts the compute-only timing together
    compute_ms = max(row[0] for row in comm.allgather_rows([_compute_seconds(args, device, images, labels) * 1e3]))
    per_rank = _per_rank(session, times, steps) if times else []
    profiled = profile_steps(step, device) if args.profile else None
    if comm.rank == 0:
        print(f"Img/sec per {kind}: {result['img_sec_per_device']:.1f} +-{result['img_sec_per_device_conf']:.1f}")
        print(f"Total img/sec on {comm.size} {kind}(s): {result['total_img_sec']:.1f} "
              f"+-{result['total_img_sec_conf']:.1f}")
        for row in per_rank:
            print(f"Rank {row['rank']} on {row['host']}: compute {row['compute_ms']:.1f} ms, "
                  f"waiting for the gradients {row['wait_ms']:.1f} ms per step")
        gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        record = {"event": "bench.synthetic", "impl": impl, "model": args.model, "batch_size": args.batch_size,
                  "image_size": args.image_size, "world_size": comm.size, "device": kind, **result,
                  "compute_ms": compute_ms, "gradient_bytes": gradient_bytes, "fp16_allreduce": args.fp16_allreduce,
                  "cpu_ms_per_step": statistics.fmean(row[2] for row in rows),
                  "training_thread_cpu_ms_per_step": statistics.fmean(row[3] for row in rows),
                  "per_rank": per_rank, "environment": environment(controller=comm.controller, impl=impl)}
        if profiled:
            record["profile"] = profiled
        print(json.dumps(record), flush=True)


def _per_rank(session, times, steps: int) -> list[dict]:
    """Each rank's compute and wait per step over the timed batches (hvdkit.rank.stragglers), with its host."""
    hvd = session.hvd
    hosts = hvd.allgather_object(socket.gethostname(), name="bench.hosts")
    times.reported(hvd.allreduce(times.row(), op=hvd.Sum, name="bench.per_rank"), steps, hosts)
    return times.table(hosts)


def _compute_seconds(args: argparse.Namespace, device, images, labels) -> float:
    """Seconds per step of forward, backward and SGD alone, on a copy of the model that no
    allreduce hook is attached to, while every rank computes at once: the compute term of the
    scaling estimate (hvdkit bench estimate)."""
    import torch
    import torch.nn.functional as F

    from hvdkit import models

    plain = models.build(args.model, 3, args.image_size, args.num_classes).to(device)
    optimizer = torch.optim.SGD(plain.parameters(), lr=args.lr)
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16

    def step() -> None:
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=amp_dtype, enabled=args.amp):
            loss = F.cross_entropy(plain(images), labels)
        loss.backward()
        optimizer.step()

    step()
    start = time.perf_counter()
    for _ in range(args.num_batches_per_iter):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / args.num_batches_per_iter


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
    import numpy as np
    import torch
    import torch.distributed as dist

    from hvdkit.rank.startup import performance_settings, place_process

    launch = env.detect()
    if not args.no_tuning:
        _apply_defaults(performance_settings(torch.cuda.is_available(), launch.spans_hosts))
    place_process(launch.local_rank or 0, launch.local_size or 1)
    sizes = size_range(args.sizes)
    _init_torch_distributed("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    seconds: dict[str, list[float]] = {}
    skipped: dict[str, str] = {}
    expected_sum = size * (size + 1) / 2

    def check(name: str, nbytes: int, got: float, want: float) -> None:
        if abs(got - want) > 1e-3 * abs(want):
            raise RunFailed(f"{name} allreduce of {format_size(nbytes)} gave {got} on rank {rank}, expected {want}")

    if os.environ.get("HOROVOD_CONTROLLER") == "gloo":
        skipped["mpi4py"] = "a Gloo launch (horovodrun --gloo) has no MPI"
    else:
        from mpi4py import MPI
        world = MPI.COMM_WORLD
        times = []
        for nbytes in sizes:
            send = np.full(nbytes // 4, rank + 1, dtype=np.float32)
            recv = np.empty_like(send)
            world.Allreduce(send, recv, op=MPI.SUM)
            check("mpi4py", nbytes, float(recv[-1]), expected_sum)
            times.append(_time_allreduce(partial(world.Allreduce, send, recv, op=MPI.SUM),
                                         args.iters or default_iterations(nbytes), world.Barrier))
        seconds["mpi4py"] = times

    times = []
    for nbytes in sizes:
        tensor = torch.full((nbytes // 4,), float(rank + 1))
        dist.all_reduce(tensor)
        check("torch.distributed", nbytes, float(tensor[-1]), expected_sum)
        tensor.zero_()  # repeated in-place sums of zeros stay finite
        times.append(_time_allreduce(partial(dist.all_reduce, tensor), args.iters or default_iterations(nbytes),
                                     dist.barrier))
    seconds["torch.distributed"] = times

    import horovod.torch as hvd

    hvd.init()
    for name in ("horovod in-place", "horovod out-of-place"):
        times = []
        for nbytes in sizes:
            tensor = torch.full((nbytes // 4,), float(rank + 1))
            tag = f"bench.{format_size(nbytes)}"  # one name per size, as gradients have: the response cache hits
            if name == "horovod in-place":  # the DistributedOptimizer's path: allreduce_async_ + synchronize
                def run(t=tensor, tag=tag):
                    hvd.synchronize(hvd.allreduce_async_(t, op=hvd.Average, name=tag))
                run()
                got = float(tensor[-1])
            else:
                def run(t=tensor, tag=tag):
                    return hvd.allreduce(t, op=hvd.Average, name=tag + ".out")
                got = float(run()[-1])
            check(name, nbytes, got, expected_sum / size)
            times.append(_time_allreduce(run, args.iters or default_iterations(nbytes), hvd.barrier))
        seconds[name] = times

    # The slowest rank's time is the collective's time.
    names = list(seconds)
    gathered = [None] * size
    dist.all_gather_object(gathered, [seconds[n] for n in names])
    if rank == 0:
        rows = []
        for i, nbytes in enumerate(sizes):
            row = {"bytes": nbytes, "count": nbytes // 4}
            for j, name in enumerate(names):
                t = max(per_rank[j][i] for per_rank in gathered)
                bw = algbw(nbytes, t)
                row[name] = {"time_us": t * 1e6, "algbw": bw, "busbw": busbw(bw, size)}
            rows.append(row)
        record = {"event": "bench.allreduce", "world_size": size, "implementations": names, "skipped": skipped,
                  "rows": rows, "environment": environment(controller="mpi" if hvd.mpi_enabled() else "gloo",
                                                           tuning=not args.no_tuning)}
        print(json.dumps(record), flush=True)
    hvd.shutdown()
