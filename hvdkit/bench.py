"""`hvdkit bench`: throughput and bandwidth beside the peers, measured in one run.

Each benchmark is a driver that starts its ranks with `hvdkit launch`, the same launcher
for every implementation it compares, and reads the JSON record rank 0 prints. Run under
a launcher instead (`horovodrun -np 2 hvdkit bench synthetic`), `synthetic` is Horovod's
own synthetic benchmark with the same output. The figures come from the small functions
below, which the tests check on tiny inputs; no test times anything.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from hvdkit import env
from hvdkit.launch import find_program, local_slots
from hvdkit.selftest import mpi_root_env, parse_records

SYNTHETIC_IMPLS = ("hvdkit", "own-loop", "horovod", "horovod-defaults", "ddp")
IMPL_HELP = ("hvdkit: the Trainer's step and defaults; own-loop: the README's own loop on hvdkit.Session; "
             "horovod: a hand-written Horovod loop (Horovod's "
             "example) with the same settings; horovod-defaults: that loop with Horovod's own defaults; "
             "ddp: torch DistributedDataParallel (NCCL on GPUs, Gloo on CPUs)")
ALLREDUCE_IMPLS = ("mpi4py", "torch.distributed", "horovod in-place", "horovod out-of-place")
KNOB_PREFIXES = ("HOROVOD_", "NCCL_", "GLOO_", "OMPI_MCA_mpi_", "OMPI_MCA_btl", "OMPI_MCA_pml", "OMPI_MCA_coll",
                 "OMP_NUM_THREADS", "MKL_NUM_THREADS")
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


class BenchError(ValueError):
    """Bad benchmark input; printed as one line, exit code 2."""


class RunFailed(RuntimeError):
    """A launch that failed or gave a wrong result; printed as one line, exit code 1."""


# ---------------------------------------------------------------------------
# Figures.
# ---------------------------------------------------------------------------

def parse_size(text: str) -> int:
    """Bytes in ``4K``, ``256M``, ``1G`` or ``4096`` (binary units, as nccl-tests)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)I?B?\s*", text.upper())
    nbytes = int(match.group(1)) * _UNITS[match.group(2)] if match else 0
    if nbytes < 4 or nbytes % 4:
        raise BenchError(f"size {text!r}: expected a multiple of 4 bytes (float32) like 4096, 4K, 16M or 1G")
    return nbytes


def size_range(spec: str) -> list[int]:
    """``4K..256M``: every power of two from the first to the last (nccl-tests' -b/-e/-f 2);
    ``4K,1M,64M``: those sizes."""
    if ".." in spec:
        low_text, high_text = spec.split("..", 1)
        low, high = parse_size(low_text), parse_size(high_text)
        if high < low:
            raise BenchError(f"sizes {spec!r}: the last size is smaller than the first")
        sizes = []
        while low <= high:
            sizes.append(low)
            low *= 2
        return sizes
    return [parse_size(part) for part in spec.split(",")]


def format_size(nbytes: int) -> str:
    for unit in ("G", "M", "K"):
        if nbytes >= _UNITS[unit] and nbytes % _UNITS[unit] == 0:
            return f"{nbytes // _UNITS[unit]}{unit}"
    return str(nbytes)


def algbw(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes, as nccl-tests): the buffer size over the time."""
    return nbytes / seconds / 1e9


def busbw(algorithm_bandwidth: float, ranks: int) -> float:
    """Bus bandwidth of an allreduce: algbw x 2(n-1)/n, what each rank's link must carry,
    comparable across world sizes and with the hardware's peak (nccl-tests' definition)."""
    return algorithm_bandwidth * 2 * (ranks - 1) / ranks


def rate_stats(rates: Sequence[float]) -> tuple[float, float]:
    """(mean, 1.96 x standard deviation) of per-iteration rates, as Horovod's benchmark prints."""
    mean = statistics.fmean(rates)
    return mean, 1.96 * (statistics.pstdev(rates) if len(rates) > 1 else 0.0)


def cross_rank_total(rank_rates: Sequence[Sequence[float]]) -> dict:
    """Totals from every rank's own (mean, conf): measured on each rank, not rank 0's x N."""
    total = sum(mean for mean, _ in rank_rates)
    conf = sum(conf for _, conf in rank_rates)
    return {"total_img_sec": total, "total_img_sec_conf": conf,
            "img_sec_per_device": total / len(rank_rates), "img_sec_per_device_conf": conf / len(rank_rates),
            "rank_img_sec": [mean for mean, _ in rank_rates]}


def scaling_table(totals: dict[int, float]) -> list[dict]:
    """Per world size: throughput, speedup and efficiency against the smallest size run
    (np=1 when it was), with the same per-rank batch."""
    base_np = min(totals)
    base_per_rank = totals[base_np] / base_np
    return [{"np": n, "total_img_sec": totals[n], "per_rank_img_sec": totals[n] / n,
             "speedup": totals[n] / totals[base_np], "efficiency": totals[n] / (n * base_per_rank)}
            for n in sorted(totals)]


def default_iterations(nbytes: int) -> int:
    """Enough iterations that a small size is not all launch noise, few for large sizes."""
    return max(10, min(1000, (256 << 20) // nbytes))


# ---------------------------------------------------------------------------
# Environment: what makes two results comparable.
# ---------------------------------------------------------------------------

def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def knobs(environ=os.environ) -> dict:
    """The Horovod, NCCL, Gloo, MPI and thread settings in force."""
    return {k: v for k, v in sorted(environ.items()) if k.startswith(KNOB_PREFIXES)}


def environment(**seen) -> dict:
    import torch

    facts = {"host": socket.gethostname(), "python": platform.python_version(), "torch": torch.__version__,
             "torchvision": _version("torchvision"), "horovod": _version("horovod"), "mpi4py": _version("mpi4py"),
             "hvdkit": _version("hvdkit"), "cpus": local_slots(), "torch_threads": torch.get_num_threads(),
             "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    return {**facts, **seen, "knobs": knobs()}


def print_environment(facts: dict) -> None:
    print("# environment")
    for key, value in facts.items():
        if key != "knobs":
            print(f"#   {key}: {value}")
    print("#   knobs: " + (" ".join(f"{k}={v}" for k, v in facts["knobs"].items()) or "(none set)"), flush=True)


# ---------------------------------------------------------------------------
# Workers: one per rank, started by the driver's launch or by the user's launcher.
# ---------------------------------------------------------------------------

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


def _apply_defaults(settings: dict) -> None:
    for name, value in settings.items():
        os.environ.setdefault(name, value)  # what the user exported wins, as in the Trainer


def synthetic_worker(args: argparse.Namespace) -> None:
    """Horovod's synthetic benchmark on one rank: a fixed random batch, warmup, then
    num_iters timings of num_batches_per_iter steps each."""
    import torch
    import torch.nn.functional as F

    from hvdkit import models
    from hvdkit.session import Session, performance_settings, place_process
    from hvdkit.trainer import classification_loss, train_step

    impl = args.impl
    if impl == "horovod":
        _apply_defaults(performance_settings(torch.cuda.is_available()))
    launch = env.detect()
    if impl in ("hvdkit", "own-loop"):  # the Session applies the same settings itself
        session = Session(batch_size=args.batch_size, fp16_allreduce=args.fp16_allreduce, amp=args.amp,
                          seed=args.seed)
        device = session.device
        comm = _horovod_comm(session.hvd)
    elif impl == "ddp":
        device = place_process(launch.local_rank or 0, launch.local_size or 1)
        _init_torch_distributed("nccl" if device.type == "cuda" else "gloo")
        comm = _torch_comm()
    else:
        import horovod.torch as hvd

        hvd.init()
        device = place_process(hvd.local_rank(), hvd.local_size())
        comm = _horovod_comm(hvd)

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
    rates = []
    for i in range(args.num_iters):
        rates.append(args.batch_size * args.num_batches_per_iter / timed_batches())
        say(f"Iter #{i}: {rates[-1]:.1f} img/sec per {kind}", flush=True)
    result = cross_rank_total(comm.allgather_rows(list(rate_stats(rates))))
    if comm.rank == 0:
        print(f"Img/sec per {kind}: {result['img_sec_per_device']:.1f} +-{result['img_sec_per_device_conf']:.1f}")
        print(f"Total img/sec on {comm.size} {kind}(s): {result['total_img_sec']:.1f} "
              f"+-{result['total_img_sec_conf']:.1f}")
        record = {"event": "bench.synthetic", "impl": impl, "model": args.model, "batch_size": args.batch_size,
                  "image_size": args.image_size, "world_size": comm.size, "device": kind, **result,
                  "environment": environment(controller=comm.controller, impl=impl)}
        print(json.dumps(record), flush=True)


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

    from hvdkit.session import performance_settings, place_process

    if not args.no_tuning:
        _apply_defaults(performance_settings(torch.cuda.is_available()))
    launch = env.detect()
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
            times.append(_time_allreduce(lambda: world.Allreduce(send, recv, op=MPI.SUM),
                                         args.iters or default_iterations(nbytes), world.Barrier))
        seconds["mpi4py"] = times

    times = []
    for nbytes in sizes:
        tensor = torch.full((nbytes // 4,), float(rank + 1))
        dist.all_reduce(tensor)
        check("torch.distributed", nbytes, float(tensor[-1]), expected_sum)
        tensor.zero_()  # repeated in-place sums of zeros stay finite
        times.append(_time_allreduce(lambda: dist.all_reduce(tensor), args.iters or default_iterations(nbytes),
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


# ---------------------------------------------------------------------------
# Drivers: launch the workers, read rank 0's record, print tables and ratios.
# ---------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def launch_command(args: argparse.Namespace, np: int, worker: Sequence[str],
                   knobs_set: Optional[dict] = None) -> list[str]:
    """`hvdkit launch` of ``worker`` on ``np`` ranks, with ``knobs_set`` in every rank and a
    rendezvous for torch.distributed on the first host (this machine unless -H says otherwise)."""
    master = "127.0.0.1"
    if args.hosts:
        master = args.hosts.split(",")[0].split(":")[0]
    cmd = [find_program("hvdkit") or "hvdkit", "launch", "-np", str(np), "--launcher", args.launcher,
           "-x", f"MASTER_ADDR={master}", "-x", f"MASTER_PORT={_free_port()}"]
    for name, value in (knobs_set or {}).items():
        cmd += ["-x", f"{name}={value}"]
    if args.hosts:
        cmd += ["-H", args.hosts]
    if args.controller:
        cmd.append(f"--{args.controller}")
    return cmd + ["--", sys.executable, "-m", "hvdkit.bench", *worker]


def run_launch(command: Sequence[str], event: str, label: str, timeout: float) -> dict:
    """Run one launch; echo rank 0's human lines; return its ``event`` record."""
    try:
        proc = subprocess.run(command, env=mpi_root_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RunFailed(f"{label}: no result within {timeout:.0f} s") from None
    records = parse_records(proc.stdout, event)
    if proc.returncode != 0 or not records:
        tail = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()][-3:]
        raise RunFailed(f"{label} failed (exit code {proc.returncode}): {' | '.join(tail)}")
    for line in proc.stdout.splitlines():
        if '{"event": "bench.' not in line and line.strip():
            print(f"  {line}", flush=True)
    return records[0]


def _synthetic_worker_args(args: argparse.Namespace, impl: str) -> list[str]:
    worker = ["synthetic", "--impl", impl, "--model", args.model, "--batch-size", str(args.batch_size),
              "--image-size", str(args.image_size), "--num-classes", str(args.num_classes),
              "--num-warmup-batches", str(args.num_warmup_batches),
              "--num-batches-per-iter", str(args.num_batches_per_iter), "--num-iters", str(args.num_iters),
              "--lr", str(args.lr), "--seed", str(args.seed)]
    return worker + ["--fp16-allreduce"] * args.fp16_allreduce + ["--amp"] * args.amp


def compare_synthetic(args: argparse.Namespace) -> int:
    """hvdkit, each --compare implementation and hvdkit under each --knob, alternating order
    over --repeats rounds so that drift on a shared machine falls on all of them alike."""
    entries = [("hvdkit", "hvdkit", {})]
    entries += [(impl, impl, {}) for impl in args.compare if impl != "hvdkit"]
    entries += [(f"hvdkit {name}={value}", "hvdkit", {name: value}) for name, value in args.knob]
    np = args.np or default_np()
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in entries}
    for round_index in range(args.repeats):
        for label, impl, knob in (entries if round_index % 2 == 0 else entries[::-1]):
            print(f"== {label}: np={np}, {args.model}, batch {args.batch_size}, "
                  f"{args.image_size}x{args.image_size} (round {round_index + 1} of {args.repeats})", flush=True)
            command = launch_command(args, np, _synthetic_worker_args(args, impl), knob)
            runs[label].append(run_launch(command, "bench.synthetic", label, args.timeout))
    print_environment(runs["hvdkit"][-1]["environment"])
    summary = {label: statistics.fmean(r["total_img_sec"] for r in results) for label, results in runs.items()}
    kind = runs["hvdkit"][-1]["device"]
    width = max(18, *(len(label) for label in summary))
    print(f"\n{'implementation':<{width}} {'total img/sec':>14} {'per ' + kind:>10} {'hvdkit / it':>12}")
    for label, total in summary.items():
        print(f"{label:<{width}} {total:>14.1f} {total / np:>10.1f} {summary['hvdkit'] / total:>12.3f}")
    ratios = {f"hvdkit/{label}": summary["hvdkit"] / total for label, total in summary.items() if label != "hvdkit"}
    print(json.dumps({"event": "bench.compare", "np": np, "model": args.model, "batch_size": args.batch_size,
                      "image_size": args.image_size, "repeats": args.repeats, "total_img_sec": summary,
                      "ratios": ratios, "runs": {label: [r["total_img_sec"] for r in rs] for label, rs in runs.items()},
                      "knobs": {label: rs[-1]["environment"]["knobs"] for label, rs in runs.items()},
                      "environment": runs["hvdkit"][-1]["environment"]}), flush=True)
    return 0


def scaling(args: argparse.Namespace) -> int:
    """Throughput of one implementation at each world size, same per-rank batch."""
    totals, records = {}, {}
    for np in args.np_list:
        print(f"== {args.impl}: np={np}", flush=True)
        command = launch_command(args, np, _synthetic_worker_args(args, args.impl))
        records[np] = run_launch(command, "bench.synthetic", f"{args.impl} at np={np}", args.timeout)
        totals[np] = records[np]["total_img_sec"]
    table = scaling_table(totals)
    print_environment(records[max(totals)]["environment"])
    for row in table:  # a rank alone on a node gets all its cores: say so beside the figures
        row["torch_threads"] = records[row["np"]]["environment"]["torch_threads"]
    print(f"\n{'np':>4} {'threads/rank':>12} {'total img/sec':>14} {'per rank':>10} {'speedup':>8} {'efficiency':>11}")
    for row in table:
        print(f"{row['np']:>4} {row['torch_threads']:>12} {row['total_img_sec']:>14.1f} "
              f"{row['per_rank_img_sec']:>10.1f} {row['speedup']:>8.2f} {row['efficiency']:>10.1%}")
    out = _out_dir(args, "scaling")
    _plot_scaling(table, args, out / "scaling.png")
    record = {"event": "bench.scaling", "impl": args.impl, "model": args.model, "batch_size": args.batch_size,
              "rows": table, "environment": records[max(totals)]["environment"]}
    (out / "scaling.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}/scaling.json and scaling.png")
    print(json.dumps(record), flush=True)
    return 0


def allreduce(args: argparse.Namespace) -> int:
    np = args.np or default_np()
    worker = ["allreduce", "--worker", "--sizes", args.sizes] + (["--iters", str(args.iters)] if args.iters else [])
    worker += ["--no-tuning"] * args.no_tuning
    print(f"== allreduce: np={np}, sizes {args.sizes}", flush=True)
    record = run_launch(launch_command(args, np, worker), "bench.allreduce", "allreduce benchmark", args.timeout)
    print_environment(record["environment"])
    for name, why in record["skipped"].items():
        print(f"# skipped {name}: {why}")
    names = record["implementations"]
    print("\n" + f"{'size':>6} " + " ".join(f"{n[:22]:>24}" for n in names) + "  busbw ratio: in-place/")
    print(f"{'':>6} " + " ".join(f"{'time(us)  busbw(GB/s)':>24}" for _ in names)
          + "  " + " ".join(f"{o:>8}" for o in names if not o.startswith("horovod")))
    ratios = ratio_rows(record)
    for row, ratio in zip(record["rows"], ratios, strict=True):
        cells = " ".join(f"{row[n]['time_us']:>11.1f} {row[n]['busbw']:>12.3f}" for n in names)
        print(f"{format_size(row['bytes']):>6} {cells}  "
              + " ".join(f"{ratio[o]:>8.2f}" for o in names if not o.startswith("horovod")))
    summary = ratio_summary(record)
    for line in summary["lines"]:
        print(line)
    out = _out_dir(args, "allreduce")
    write_allreduce_csv(record, out / "allreduce.csv")
    (out / "allreduce.json").write_text(json.dumps(record, indent=1) + "\n")
    _plot_allreduce(record, out / "allreduce.png")
    print(f"wrote {out}/allreduce.csv, allreduce.json and allreduce.png")
    print(json.dumps({**record, "event": "bench.allreduce", "ratios": summary["ratios"]}), flush=True)
    return 0


def ratio_rows(record: dict) -> list[dict]:
    """Per size: the gradient path's (Horovod in-place) busbw over each peer's."""
    peers = [n for n in record["implementations"] if not n.startswith("horovod")]
    return [{peer: row["horovod in-place"]["busbw"] / row[peer]["busbw"] if row[peer]["busbw"] else math.nan
             for peer in peers} for row in record["rows"]]


def ratio_summary(record: dict, large: int = 16 << 20) -> dict:
    """The issue's targets as figures: in-place vs raw MPI at >= 16 MiB, vs torch at every size."""
    rows, ratios = record["rows"], ratio_rows(record)
    found, lines = {}, []
    if "mpi4py" in record["implementations"]:
        big = [r["mpi4py"] for row, r in zip(rows, ratios) if row["bytes"] >= large]
        if big:
            found["in-place/mpi4py min >=16M"] = min(big)
            lines.append(f"horovod in-place / mpi4py busbw, sizes >= 16M: min {min(big):.2f}")
    found["in-place/torch min"] = min(r["torch.distributed"] for r in ratios)
    lines.append(f"horovod in-place / torch.distributed busbw, every size: min {found['in-place/torch min']:.2f}")
    return {"ratios": found, "lines": lines}


def write_allreduce_csv(record: dict, path: Path) -> None:
    lines = ["implementation,bytes,count,time_us,algbw_GBps,busbw_GBps"]
    for row in record["rows"]:
        for name in record["implementations"]:
            cell = row[name]
            lines.append(f"{name},{row['bytes']},{row['count']},{cell['time_us']:.3f},{cell['algbw']:.6f},"
                         f"{cell['busbw']:.6f}")
    path.write_text("\n".join(lines) + "\n")


def _out_dir(args: argparse.Namespace, kind: str) -> Path:
    out = Path(args.out) if args.out else Path("runs/bench") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BenchError(f"--out {out}: {exc.strerror}") from None
    return out


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on a cluster node
    import matplotlib.pyplot as plt
    return plt


def _plot_allreduce(record: dict, path: Path) -> None:
    plt = _pyplot()
    fig, (bw_ax, time_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    sizes = [row["bytes"] for row in record["rows"]]
    for name in record["implementations"]:
        bw_ax.plot(sizes, [row[name]["busbw"] for row in record["rows"]], marker="o", label=name)
        time_ax.plot(sizes, [row[name]["time_us"] for row in record["rows"]], marker="o", label=name)
    for ax, label in ((bw_ax, "bus bandwidth (GB/s)"), (time_ax, "time per allreduce (us)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [format_size(s) for s in sizes], rotation=60)
        ax.set_xlabel("message size")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    time_ax.set_yscale("log")
    bw_ax.legend()
    fig.suptitle(f"allreduce, {record['world_size']} ranks, {record['environment']['host']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_scaling(table: list[dict], args: argparse.Namespace, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    nps = [row["np"] for row in table]
    base = table[0]["total_img_sec"] / table[0]["np"]
    ax.plot(nps, [row["total_img_sec"] for row in table], marker="o", label=f"{args.impl} measured")
    ax.plot(nps, [n * base for n in nps], linestyle="--", label="linear")
    for row in table:
        ax.annotate(f"{row['efficiency']:.0%}", (row["np"], row["total_img_sec"]), textcoords="offset points",
                    xytext=(4, -12))
    ax.set_xticks(nps)
    ax.set_xlabel("ranks (np)")
    ax.set_ylabel("images/sec, all ranks")
    ax.set_title(f"{args.model}, batch {args.batch_size} per rank")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def default_np() -> int:
    """One rank per GPU, or per core without GPUs."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else local_slots()


# ---------------------------------------------------------------------------
# The command line.
# ---------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _np_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a list like 1,2,4, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"world sizes must be >= 1, got {text!r}")
    return sorted(set(values))


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def _compare_list(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in SYNTHETIC_IMPLS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown implementation {', '.join(unknown) or text!r}; "
                                         f"choose from {', '.join(SYNTHETIC_IMPLS)}")
    return names


def _knob(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE like HOROVOD_CYCLE_TIME=1, got {text!r}")
    return name, value


def _launch_arguments(p: argparse.ArgumentParser, files: bool) -> None:
    p.add_argument("--launcher", choices=("auto", "horovodrun", "mpirun", "srun"), default="auto",
                   help="how to start the ranks (as hvdkit launch; default: auto)")
    ctl = p.add_mutually_exclusive_group()
    ctl.add_argument("--gloo", dest="controller", action="store_const", const="gloo",
                     help="Horovod's Gloo controller (horovodrun --gloo)")
    ctl.add_argument("--mpi", dest="controller", action="store_const", const="mpi", help="Horovod's MPI controller")
    p.add_argument("-H", "--hosts", help="host1:N,host2:N (default: this machine or the Slurm allocation)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one launch may take (default 1800)")
    if files:
        p.add_argument("--out", help="folder for the CSV/JSON/PNG (default runs/bench/<kind>-<time>)")


def _synthetic_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="resnet50", help="torchvision model or hvdkit model (default resnet50)")
    p.add_argument("--batch-size", type=_positive, default=32, help="images per rank per step (default 32)")
    p.add_argument("--image-size", type=_positive, default=224, help="side of the square images (default 224)")
    p.add_argument("--num-classes", type=_positive, default=1000, help="default 1000, as ImageNet")
    p.add_argument("--num-warmup-batches", type=int, default=10, help="default 10")
    p.add_argument("--num-batches-per-iter", type=_positive, default=10, help="default 10")
    p.add_argument("--num-iters", type=_positive, default=10, help="default 10")
    p.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to fp16 for the allreduce")
    p.add_argument("--amp", action="store_true", help="mixed precision: bf16 on CPUs, fp16 + GradScaler on GPUs")
    p.add_argument("--lr", type=float, default=0.01, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=42, help=argparse.SUPPRESS)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hvdkit bench", description="Benchmarks that print figures, ratios and their environment.")
    sub = p.add_subparsers(dest="bench", required=True, metavar="BENCHMARK", parser_class=_Parser)

    syn = sub.add_parser("synthetic", help="Horovod's synthetic benchmark; --compare runs the peers in the same run")
    _synthetic_arguments(syn)
    syn.add_argument("-np", "--num-proc", dest="np", type=_positive,
                     help="ranks to launch (default: one per GPU, else per core); under a launcher, its ranks")
    syn.add_argument("--compare", type=_compare_list, default=[], metavar="IMPL[,IMPL]",
                     help=f"also run these, launched the same way: {IMPL_HELP}")
    syn.add_argument("--knob", type=_knob, action="append", default=[], metavar="NAME=VALUE",
                     help="also run hvdkit with this setting (HOROVOD_*, OMPI_MCA_*, NCCL_*, ...), one run "
                          "per --knob; repeatable")
    syn.add_argument("--repeats", type=_positive, default=1, help="rounds over the implementations (default 1)")
    syn.add_argument("--impl", choices=SYNTHETIC_IMPLS, help=argparse.SUPPRESS)
    _launch_arguments(syn, files=False)

    scale = sub.add_parser("scaling", help="throughput and efficiency per world size, same per-rank batch")
    _synthetic_arguments(scale)
    scale.add_argument("--np", dest="np_list", type=_np_list, default=[1, 2], metavar="N[,N]",
                       help="world sizes (default 1,2)")
    scale.add_argument("--impl", choices=SYNTHETIC_IMPLS, default="hvdkit", help="which loop (default hvdkit)")
    _launch_arguments(scale, files=True)

    ar = sub.add_parser("allreduce", help="allreduce bandwidth per size: Horovod beside raw MPI and torch.distributed")
    ar.add_argument("--sizes", default="4K..256M", help="4K..256M (powers of two) or 4K,1M,64M (default 4K..256M)")
    ar.add_argument("--iters", type=_positive, help="timed allreduces per size (default: 1000 for small sizes "
                                                    "down to 10 for large)")
    ar.add_argument("-np", "--num-proc", dest="np", type=_positive, help="ranks (default: one per GPU, else per core)")
    ar.add_argument("--no-tuning", action="store_true",
                    help="leave Horovod's and MPI's defaults, without the Trainer's settings")
    ar.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    _launch_arguments(ar, files=True)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    under_launcher = env.detect().rank is not None
    try:
        if args.bench == "allreduce":
            size_range(args.sizes)  # bad sizes fail here, before anything starts
            if args.worker:
                allreduce_worker(args)
                return 0
            if under_launcher:
                raise BenchError("allreduce launches its own ranks: run it without a launcher, with -np N")
            return allreduce(args)
        if args.bench == "scaling":
            if under_launcher:
                raise BenchError("scaling launches its own ranks: run it without a launcher, with --np 1,2")
            return scaling(args)
        if args.impl or (under_launcher and not args.compare and not args.knob):
            args.impl = args.impl or "hvdkit"
            synthetic_worker(args)
            return 0
        if under_launcher:
            raise BenchError("--compare and --knob launch each run themselves: run it without a launcher, with -np N")
        return compare_synthetic(args)
    except (BenchError, RunFailed) as exc:
        print(f"hvdkit bench: {exc}", file=sys.stderr, flush=True)
        return 2 if isinstance(exc, BenchError) else 1


if __name__ == "__main__":
    sys.exit(main())
