"""What runs in each rank: Horovod's synthetic benchmark (hvdkit, its own-loop, Horovod's loop,
DDP) and the checkpoint saves, each printing one JSON record; the allreduce timings are in
hvdkit.bench.allreduce_worker, the sharded optimizers' in hvdkit.bench.zero_worker."""

from __future__ import annotations

import argparse
import atexit
import json
import os
import socket
import statistics
import sys
import time
from typing import Callable, Optional

from hvdkit import env
from hvdkit.bench.environment import environment
from hvdkit.bench.figures import (
    BenchError,
    cross_rank_total,
    rate_stats,
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


def init_torch_distributed(backend: str) -> None:
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


def apply_defaults(settings: dict) -> None:
    for name, value in settings.items():
        os.environ.setdefault(name, value)  # what the user exported wins, as in the Trainer


def synthetic_worker(args: argparse.Namespace) -> None:
    """Horovod's synthetic benchmark on one rank: a fixed random batch, warmup, then
    num_iters timings of num_batches_per_iter steps each."""
    import torch

    from hvdkit import models

    device, comm, session, hvd = _start(args)
    torch.manual_seed(args.seed)
    model = models.build(args.model, 3, args.image_size, args.num_classes).to(device)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    labels = torch.randint(0, args.num_classes, (args.batch_size,), device=device)
    if args.impl in ("hvdkit", "own-loop"):
        step, counted = _session_step(args, session, model, images, labels)
    elif args.impl == "ddp":
        step, counted = _ddp_step(args, model, images, labels, device), None
    else:
        step, counted = _horovod_step(args, hvd, model, images, labels, device)

    kind = "GPU" if device.type == "cuda" else "CPU"
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    say(f"Model: {args.model}\nBatch size: {args.batch_size}\nNumber of {kind}s: {comm.size}\nRunning warmup...",
        flush=True)
    for _ in range(args.num_warmup_batches):
        step()
    say("Running benchmark...", flush=True)
    times = session.step_times if session else None
    if times:
        times.clear()
    rates, cpu_ms = _timed(args, step, device, lambda i, rate: say(f"Iter #{i}: {rate:.1f} img/sec per {kind}",
                                                                     flush=True))
    rows = comm.allgather_rows([*rate_stats(rates), *cpu_ms])  # per rank: rate mean, conf, CPU, training thread
    comm.allgather_rows([0.0])  # every rank starts the compute-only timing together
    compute_ms = max(row[0] for row in comm.allgather_rows([_compute_seconds(args, device, images, labels) * 1e3]))
    steps = args.num_iters * args.num_batches_per_iter
    per_rank = _per_rank(session, times, steps) if times else []
    profiled = profile_steps(step, device) if args.profile else None
    duties = _counted(step, counted, args.num_iters * args.num_batches_per_iter) if args.counters and counted else None
    if comm.rank == 0:
        gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        _report(args, comm, kind, rows, compute_ms, gradient_bytes, per_rank, profiled, duties)
    if args.impl == "ddp":
        _end_torch_distributed()


def _end_torch_distributed() -> None:
    """Every rank waits until all are done with the group, then exits without tearing it down:
    torn down at exit while a peer was closing its sockets, Gloo's threads aborted a rank now and
    then, after the results (exit 134). This leg started no MPI, which would want a finalize."""
    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _start(args: argparse.Namespace):
    """(device, collectives for the results, Session or None, Horovod or None): each implementation
    started as its users start it, with the settings it would have."""
    import torch

    from hvdkit.rank.start.startup import performance_settings, place_process
    from hvdkit.session import Session

    launch = env.detect()
    if args.impl == "horovod":
        import horovod.torch as hvd

        apply_defaults(performance_settings(torch.cuda.is_available(), launch.spans_hosts,
                                             gloo_built=hvd.gloo_built()))
    if args.impl in ("hvdkit", "own-loop"):  # the Session applies the same settings itself
        session = Session(batch_size=args.batch_size, fp16_allreduce=args.fp16_allreduce, amp=args.amp,
                          seed=args.seed)
        return session.device, _horovod_comm(session.hvd), session, None
    if args.impl == "ddp":
        device = place_process(launch.local_rank or 0, launch.local_size or 1)
        # NCCL for the gradients, Gloo for the results gathered as CPU tensors (NCCL has no CPU backend).
        init_torch_distributed("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
        return device, _torch_comm(), None, None
    import horovod.torch as hvd

    hvd.init()
    device = place_process(hvd.local_rank(), hvd.local_size())
    if device.type == "cuda":  # as Horovod's pytorch_synthetic_benchmark.py does
        torch.backends.cudnn.benchmark = True
    return device, _horovod_comm(hvd), None, hvd


def _counted(step: Callable[[], None], install: Callable, steps: int) -> dict:
    """As many steps as were timed, with a timer on each of their duties (hvdkit.bench.counters)."""
    from hvdkit.bench import counters

    timers = counters.Counters()
    install(timers)
    return counters.count_steps(timers, step, steps)


def _optimizer(args: argparse.Namespace, parameters):
    """The bench's optimizer, the same for every arm: SGD, or --optimizer adamw."""
    import torch

    if args.optimizer == "adamw":
        return torch.optim.AdamW(parameters, lr=args.lr)
    return torch.optim.SGD(parameters, lr=args.lr)


def _session_step(args: argparse.Namespace, session, model, images, labels):
    """(step, its counters' installer): hvdkit: the Trainer's step; own-loop: the README's own
    loop on the Session API."""
    import torch.nn.functional as F

    from hvdkit.bench.counters import count_session
    from hvdkit.trainer import classification_loss, train_step

    model, optimizer = session.setup(model, _optimizer(args, model.parameters()))
    counted = lambda timers: count_session(timers, session, model)  # noqa: E731
    if args.impl == "hvdkit":
        return (lambda: train_step(session, model, classification_loss, (images, labels))), counted

    def step() -> None:
        optimizer.zero_grad()
        for x, y in session.micro_batches((images, labels)):
            with session.autocast():
                loss = F.cross_entropy(model(x), y)
            session.backward(loss)
            session.log(len(y), loss=loss)
        session.step()
    return step, counted


def _ddp_step(args: argparse.Namespace, model, images, labels, device) -> Callable[[], None]:
    """torch DistributedDataParallel's loop, as its tutorial writes it (the fp16 hook for --fp16-allreduce)."""
    import torch
    import torch.nn.functional as F

    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    if args.fp16_allreduce:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    optimizer = _optimizer(args, model.parameters())
    amp_dtype, scaler = _amp(args, device)

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
    return step


def _horovod_step(args: argparse.Namespace, hvd, model, images, labels, device):
    """(step, its counters' installer): Horovod's pytorch_synthetic_benchmark.py, as users write it."""
    import torch
    import torch.nn.functional as F

    from hvdkit.bench.counters import count_horovod

    optimizer = hvd.DistributedOptimizer(
        _optimizer(args, model.parameters()), named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    amp_dtype, scaler = _amp(args, device)

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
    return step, lambda timers: count_horovod(timers, optimizer, model)


def _amp(args: argparse.Namespace, device):
    """The autocast dtype, and a GradScaler where fp16 needs one (CUDA)."""
    import torch

    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    return amp_dtype, torch.amp.GradScaler("cuda") if args.amp and device.type == "cuda" else None


def _timed(args: argparse.Namespace, step: Callable[[], None], device, said: Callable[[int, float], None]):
    """(the rate of each of num_iters timings, and ms of CPU per step: the whole process's and
    the training thread's). On a rank with one core, what the other threads (the allreduces)
    spend is taken from the training."""
    import torch

    rates: list[float] = []
    cpu, thread_cpu = time.process_time(), time.thread_time()
    for _ in range(args.num_iters):
        start = time.perf_counter()
        for _ in range(args.num_batches_per_iter):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        rates.append(args.batch_size * args.num_batches_per_iter / (time.perf_counter() - start))
        said(len(rates) - 1, rates[-1])
    steps = args.num_iters * args.num_batches_per_iter
    return rates, [(time.process_time() - cpu) * 1e3 / steps, (time.thread_time() - thread_cpu) * 1e3 / steps]


def _report(args: argparse.Namespace, comm: _Comm, kind: str, rows: list, compute_ms: float, gradient_bytes: int,
            per_rank: list, profiled, duties: Optional[dict]) -> None:
    """Rank 0's lines, as Horovod's benchmark prints them, then the JSON record the driver reads."""
    result = cross_rank_total([row[:2] for row in rows])
    print(f"Img/sec per {kind}: {result['img_sec_per_device']:.1f} +-{result['img_sec_per_device_conf']:.1f}")
    print(f"Total img/sec on {comm.size} {kind}(s): {result['total_img_sec']:.1f} "
          f"+-{result['total_img_sec_conf']:.1f}")
    for row in per_rank:
        print(f"Rank {row['rank']} on {row['host']}: compute {row['compute_ms']:.1f} ms, "
              f"waiting for the gradients {row['wait_ms']:.1f} ms per step")
    record = {"event": "bench.synthetic", "impl": args.impl, "model": args.model, "batch_size": args.batch_size,
              "image_size": args.image_size, "world_size": comm.size, "device": kind, **result,
              "compute_ms": compute_ms, "gradient_bytes": gradient_bytes, "fp16_allreduce": args.fp16_allreduce,
              "cpu_ms_per_step": statistics.fmean(row[2] for row in rows),
              "training_thread_cpu_ms_per_step": statistics.fmean(row[3] for row in rows),
              "per_rank": per_rank, "environment": environment(controller=comm.controller, impl=args.impl)}
    if profiled:
        record["profile"] = profiled
    if duties:
        record["counters"] = duties
    print(json.dumps(record), flush=True)


def _per_rank(session, times, steps: int) -> list[dict]:
    """Each rank's compute and wait per step over the timed batches (hvdkit.rank.agree.stragglers), with its host."""
    hvd = session.hvd
    hosts = hvd.allgather_object(socket.gethostname(), name="bench.hosts")
    times.reported(hvd.allreduce(times.row(), op=hvd.Sum, name="bench.per_rank").tolist(), steps, hosts)
    return times.table(hosts)


def _compute_seconds(args: argparse.Namespace, device, images, labels) -> float:
    """Seconds per step of forward, backward and SGD alone, on a copy of the model that no
    allreduce hook is attached to, while every rank computes at once: the compute term of the
    scaling estimate (hvdkit bench estimate)."""
    import torch
    import torch.nn.functional as F

    from hvdkit import models

    plain = models.build(args.model, 3, args.image_size, args.num_classes).to(device)
    optimizer = _optimizer(args, plain.parameters())
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


def checkpoint_worker(args: argparse.Namespace) -> None:
    """One rank of `bench checkpoint`: a Session loop over a stack of linear layers (or a built-in
    model on random images) with Adam (12 bytes a parameter in its checkpoint), saving every
    ``checkpoint_every`` steps (``--impl none``: never) in the training thread (``sync``), in the
    background (``async``), in the background with a part per rank (``sharded``), or as snapshots
    into host memory (``snapshot``, under hvdkit launch --max-restarts). Rank 0 prints the rate of
    the timed steps and the Session's timings of the saves; ``--dir`` is the run's own folder,
    which the driver made and removes."""
    import torch
    import torch.nn.functional as F

    from hvdkit import models
    from hvdkit.session import Session

    every = 0 if args.impl == "none" else args.checkpoint_every
    snapshot = args.impl == "snapshot"
    folder = args.dir
    session = Session(batch_size=args.batch_size, checkpoint_dir=folder if every else None,
                      checkpoint_steps=None if snapshot else (every or None), snapshot_steps=every if snapshot else 0,
                      keep_checkpoints=2, async_checkpoint=args.impl in ("async", "sharded"),
                      sharded_checkpoint=args.impl == "sharded", logger="none", log_dir=os.path.join(folder, "logs"),
                      resume=False, seed=0)
    torch.manual_seed(0)
    if args.model == "linear":
        width = args.width
        layers = max(1, round(args.params / (width * width + width)))
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        inputs = targets = torch.randn(args.batch_size, width)
        loss_of = F.mse_loss
    else:
        model = models.build(args.model, 3, 32, 10)
        inputs, targets = torch.randn(args.batch_size, 3, 32, 32), torch.randint(0, 10, (args.batch_size,))
        loss_of = F.cross_entropy
    model, optimizer = session.setup(model, torch.optim.Adam(model.parameters(), lr=1e-5))
    inputs, targets = inputs.to(session.device), targets.to(session.device)

    def step() -> None:
        optimizer.zero_grad()
        session.backward(loss_of(model(inputs), targets))
        session.step()

    for _ in range(int(args.warmup)):
        step()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    seconds = time.perf_counter() - start  # the saves' stalls included; a write still in flight is not
    summary = session.finish()
    if session.rank == 0:
        parameters = sum(p.numel() for p in model.parameters())
        saves = summary["checkpoints"]["snapshots"] if snapshot else summary["checkpoints"]
        print(json.dumps({"event": "bench.checkpoint", "impl": args.impl, "world_size": session.size,
                          "parameters": parameters, "checkpoint_bytes": parameters * 12, "steps": args.steps,
                          "steps_per_sec": args.steps / seconds, "checkpoints": saves}), flush=True)
