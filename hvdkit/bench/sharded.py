"""`hvdkit bench zero`: the sharded optimizer beside its peers, on a model whose Adam state dominates.

Four loops train the same model (a GPT on random tokens, or a torchvision model on random
images) with Adam or AdamW, each launched by `hvdkit launch` in turn, in alternating order over
rounds: hvdkit's ShardedOptimizer at stage 1 and 2, Horovod's DistributedOptimizer (Horovod's
own loop), and torch's ZeroRedundancyOptimizer under DistributedDataParallel. Each rank reports
its samples per second, the bytes of weights, gradients and optimizer state it holds (from the
tensors) and its peak memory per phase of a step: resident memory on CPUs, the CUDA allocator's
peak on GPUs (one GPU per rank).

``--max-model --memory-cap SIZE`` asks what a user buys ZeRO for: the largest GPT each loop
trains with every rank's peak memory under SIZE. It bisects a ladder of GPT widths and depths
per loop; a rank that passes the cap ends its run at once (on a GPU the allocator refuses what
would pass it: torch.cuda.set_per_process_memory_fraction).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import time
from typing import Optional

from hvdkit import env, job
from hvdkit.bench.drivers import launch_command, out_dir, run_launch
from hvdkit.bench.figures import BenchError, parse_size

IMPLS = ("zero1", "zero2", "horovod", "torch-zero")
LADDER_WIDTHS = (512, 640, 768, 896, 1024, 1152, 1280, 1536)
LADDER_STEP = 1.03  # neighbouring models of the ladder differ by at least 3% of parameters
BASELINE_RSS = 1100 * 2**20  # a rank's resident memory before its model: torch, Horovod, MPI (none on a GPU)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt", help="gpt (default), or a torchvision model such as resnet50, on "
                                                  "random images")
    p.add_argument("--optimizer", choices=("adam", "adamw"), default="adam", help="the optimizer (default adam)")
    p.add_argument("--image-size", type=int, default=32, help="image side for a torchvision model (default 32)")
    p.add_argument("--num-classes", type=int, default=10, help="classes of a torchvision model (default 10)")
    p.add_argument("--max-model", action="store_true", help="the largest GPT each loop trains under --memory-cap")
    p.add_argument("--memory-cap", type=_size, help="with --max-model: every rank's peak memory (resident; on a "
                                                         "GPU the allocator's) must stay below this (e.g. 3584M)")
    p.add_argument("--width", type=int, default=512, help="GPT width (default 512)")
    p.add_argument("--layers", type=int, default=12, help="GPT blocks (default 12: 38M parameters, 300 MB of Adam "
                                                          "state unsharded)")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sample (default 32)")
    p.add_argument("--batch-size", type=int, default=4, help="samples per rank per step (default 4)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per run (default 6)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--repeats", type=int, default=3, help="rounds over the implementations (default 3)")
    p.add_argument("-np", "--np", dest="np", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--impl", choices=IMPLS, help=argparse.SUPPRESS)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except BenchError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _worker_args(args: argparse.Namespace, impl: str) -> list[str]:
    cap = ["--memory-cap", str(args.memory_cap)] if args.memory_cap else []
    return ["zero", "--impl", impl, "--model", args.model, "--optimizer", args.optimizer, "--image-size",
            str(args.image_size), "--num-classes", str(args.num_classes), "--width", str(args.width), "--layers",
            str(args.layers), "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--steps",
            str(args.steps), "--warmup", str(args.warmup), *cap]


def worker(args: argparse.Namespace) -> None:
    """One rank of one loop: warm up, time the steps, report rates and bytes on rank 0."""
    import horovod.torch as hvd
    import torch

    from hvdkit.bench.workers import _init_torch_distributed
    from hvdkit.rank.memory import PhasePeaks
    from hvdkit.rank.startup import place_process
    from hvdkit.zero import optimizer as zero

    launch = env.detect()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    device = torch.device("cuda", launch.local_rank or 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.memory_cap:
        _end_above(args.memory_cap, device)
    model, inputs, loss_of = _model(args)
    model.to(device)
    optimizer_class = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[args.optimizer]
    if args.impl == "torch-zero":
        import torch.distributed as dist
        from torch.distributed.optim import ZeroRedundancyOptimizer

        place_process(launch.local_rank or 0, launch.local_size or 1)
        _init_torch_distributed("nccl" if device.type == "cuda" else "gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class, lr=1e-4)
        gather = _torch_gather
    else:
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        inner = optimizer_class(model.parameters(), lr=1e-4)
        optimizer = (hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())
                     if args.impl == "horovod" else zero.ShardedOptimizer(inner, hvd, int(args.impl[-1])))
        gather = hvd.allgather_object
    batch = [part.to(device) for part in inputs(torch.Generator().manual_seed(rank))]

    peaks = PhasePeaks(device)

    def step(when: str) -> None:
        with peaks.phase(f"{when}: forward and backward"):
            optimizer.zero_grad()
            loss_of(model, batch).backward()
        with peaks.phase(f"{when}: optimizer step"):
            optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    try:
        for n in range(args.warmup):
            step("first step" if n == 0 else "steady")
        start = time.perf_counter()
        for _ in range(args.steps):
            step("steady")
    except torch.cuda.OutOfMemoryError:  # past --memory-cap on a GPU
        print(json.dumps({"event": "bench.zero.over", "cuda_allocated": torch.cuda.max_memory_allocated(device),
                          "cap": args.memory_cap}), flush=True)
        os._exit(job.OVER_CAP)
    rate = args.batch_size * args.steps / (time.perf_counter() - start)
    phases = peaks.summary()
    held = {**_held(model, optimizer, zero), "phases": phases}
    # The peak the cap and the table speak of: resident memory on a CPU, the allocator's on a GPU.
    held["peak"] = held["peak_rss"] if device.type == "cpu" else max(v for k, v in phases.items() if k != "unit")
    rows = gather({"samples_per_sec": rate, **held})
    if rank == 0:
        print(json.dumps({"event": "bench.zero", "impl": args.impl, "world_size": size, "model": args.model,
                          "parameters": sum(p.numel() for p in model.parameters()),
                          "samples_per_sec": sum(r["samples_per_sec"] for r in rows), "ranks": rows}), flush=True)


def _model(args: argparse.Namespace):
    """(model, inputs, loss_of): the model, a function of a generator giving one rank's batch,
    and the loss of a batch."""
    import torch
    import torch.nn.functional as F

    from hvdkit import models

    if args.model == "gpt":
        def tokens(generator):
            return [torch.randint(0, 256, (args.batch_size, args.seq_len + 1), generator=generator)]

        def next_token_loss(model, batch):
            (tokens,) = batch
            return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())

        return gpt(args.width, args.layers, args.seq_len), tokens, next_token_loss

    def images(generator):
        return [torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=generator),
                torch.randint(0, args.num_classes, (args.batch_size,), generator=generator)]

    def class_loss(model, batch):
        return F.cross_entropy(model(batch[0]), batch[1])

    return models.build(args.model, 3, args.image_size, args.num_classes), images, class_loss


def _model_name(args: argparse.Namespace) -> str:
    if args.model == "gpt":
        return f"gpt width {args.width} x {args.layers} layers"
    return f"{args.model} on {args.image_size} px images, {args.num_classes} classes, {args.optimizer}"


def gpt(width: int, layers: int, seq_len: int):
    """The bench's GPT: bytes in, 8 heads."""
    from hvdkit.models import TinyGPT

    return TinyGPT(256, seq_len, width, layers, heads=8)


def _end_above(cap: int, device) -> None:
    """Watch this rank's resident memory from a thread; past ``cap``, say so and end the process
    (its launcher then ends the others): a model that does not fit need not finish its steps.
    On a GPU the allocator itself refuses to pass the cap (the worker ends on its error)."""
    import threading

    import torch

    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(device).total_memory, device)
        return
    page = os.sysconf("SC_PAGE_SIZE")

    def watch() -> None:
        with open("/proc/self/statm") as statm:
            while True:
                statm.seek(0)
                resident = int(statm.read().split()[1]) * page
                if resident > cap:
                    print(json.dumps({"event": "bench.zero.over", "rss": resident, "cap": cap}), flush=True)
                    os._exit(job.OVER_CAP)
                time.sleep(0.01)

    threading.Thread(target=watch, name="hvdkit-memory-cap", daemon=True).start()


def _held(model, optimizer, zero) -> dict:
    """This rank's bytes after a step, counted from the tensors, and its peak resident memory."""
    from hvdkit.rank.memory import memory_of, peak_rss

    if isinstance(optimizer, zero.ShardedOptimizer):
        return memory_of(optimizer)
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer steps its shard with this
    params = list(model.parameters())
    return {**zero.held_bytes(params, params, local.state.values()), "peak_rss": peak_rss()}


def _torch_gather(value):
    import torch.distributed as dist

    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, value)
    return rows


def run(args: argparse.Namespace) -> int:
    """The comparison, or with --max-model the search; bad flags end in one line first."""
    if env.detect().rank is not None:
        raise BenchError("zero launches its own ranks: run it without a launcher, with -np N")
    if args.max_model and not args.memory_cap:
        raise BenchError("zero --max-model needs --memory-cap SIZE: the peak memory each rank may reach")
    if args.memory_cap and not args.max_model:
        raise BenchError("zero: --memory-cap goes with --max-model")
    if args.max_model and args.model != "gpt":
        raise BenchError(f"zero --max-model grows a GPT; it does not take --model {args.model}")
    return max_model(args) if args.max_model else compare(args)


def compare(args: argparse.Namespace) -> int:
    """Every implementation in each round, order alternating; medians of per-round ratios."""
    runs: dict[str, list[dict]] = {impl: [] for impl in IMPLS}
    for round_index in range(args.repeats):
        for impl in IMPLS if round_index % 2 == 0 else IMPLS[::-1]:
            print(f"== {impl}: np={args.np}, {_model_name(args)}, batch {args.batch_size} "
                  f"(round {round_index + 1} of {args.repeats})", flush=True)
            runs[impl].append(run_launch(launch_command(args, args.np, _worker_args(args, impl)), "bench.zero", impl,
                                         args.timeout))
    ratios = {f"{a}/{b}": statistics.median(x["samples_per_sec"] / y["samples_per_sec"]
                                            for x, y in zip(runs[a], runs[b], strict=True))
              for a in ("zero1", "zero2") for b in ("horovod", "torch-zero")}
    # Bytes held: the largest rank's, the same every round. Peaks: the largest rank's, median over
    # the rounds, as a rank's peak moves by tens of MB from run to run with the allocator's luck.
    table = {impl: {"samples_per_sec": statistics.median(r["samples_per_sec"] for r in results),
                    **{key: max(rank[key] for rank in results[-1]["ranks"])
                       for key in ("params", "grads", "optimizer_state")},
                    "peak": statistics.median(max(rank["peak"] for rank in r["ranks"]) for r in results)}
             for impl, results in runs.items()}
    for impl, results in runs.items():
        table[impl]["phases"] = {phase: statistics.median(max(rank["phases"][phase] for rank in r["ranks"])
                                                          for r in results)
                                 for phase in results[-1]["ranks"][0]["phases"] if phase != "unit"}
    whole = table["horovod"]["optimizer_state"]
    peak_name = _peak_name(runs["horovod"][-1])
    print(f"\n{'implementation':<12} {'samples/sec':>12} {'optimizer MB':>13} {'x unsharded':>12} {'grads MB':>9} "
          f"{'weights MB':>11} {'peak MB':>12}   (peak: {peak_name}; bytes: the largest rank; peaks: its median "
          "over rounds)")
    for impl, row in table.items():
        print(f"{impl:<12} {row['samples_per_sec']:>12.2f} {row['optimizer_state'] / 2**20:>13.1f} "
              f"{row['optimizer_state'] / whole:>12.2f} {row['grads'] / 2**20:>9.1f} {row['params'] / 2**20:>11.1f} "
              f"{row['peak'] / 2**20:>12.0f}")
    phases = list(table["horovod"]["phases"])
    print(f"\npeak MB ({peak_name}) per phase (the largest rank, median over rounds): {' | '.join(phases)}")
    for impl, row in table.items():
        print(f"{impl:<12} " + " ".join(f"{row['phases'][phase] / 2**20:>8.0f}" for phase in phases))
    print("\nthroughput, median of per-round ratios: "
          + ", ".join(f"{name} {value:.3f}" for name, value in ratios.items()))
    saving = peak_saving(table, args.np)
    print(f"peak ({peak_name}) below DistributedOptimizer's (medians), of what the formula saves: "
          + ", ".join(f"{impl} {row['measured'] / 2**20:.0f} MB of {row['formula'] / 2**20:.0f} MB "
                      + (f"({row['ratio']:.2f})" if row["ratio"] is not None else "(one rank shards nothing)")
                      for impl, row in saving.items()))
    out = out_dir(args, "zero")
    record = {"event": "bench.zero.compare", "np": args.np, "model": args.model, "optimizer": args.optimizer,
              "parameters": runs["horovod"][-1]["parameters"], "width": args.width, "layers": args.layers,
              "batch_size": args.batch_size, "seq_len": args.seq_len, "repeats": args.repeats, "table": table,
              "peak_unit": peak_name, "ratios": ratios, "peak_saving": saving,
              "runs": {impl: [r["samples_per_sec"] for r in rs] for impl, rs in runs.items()}}
    (out / "zero.json").write_text(json.dumps(record, indent=1) + "\n")
    _plot(table, out / "zero.png")
    print(f"wrote {out}/zero.json and zero.png")
    print(json.dumps(record), flush=True)
    return 0


def peak_saving(table: dict, size: int) -> dict:
    """Each stage's peak below DistributedOptimizer's, beside what DeepSpeed's formula says
    sharding saves for fp32 Adam (16 bytes a parameter unsharded): 8(1 - 1/N) bytes a parameter
    at stage 1, 12(1 - 1/N) at stage 2."""
    parameters = table["horovod"]["params"] / 4
    rows = {}
    for impl, per_parameter in (("zero1", 8), ("zero2", 12)):
        measured = table["horovod"]["peak"] - table[impl]["peak"]
        formula = per_parameter * (1 - 1 / size) * parameters
        rows[impl] = {"measured": measured, "formula": formula, "ratio": measured / formula if formula else None}
    return rows


def ladder(cap: int, size: int, seq_len: int) -> list[tuple[int, int, int]]:
    """(parameters, width, layers) of GPTs in increasing size, neighbours at least LADDER_STEP
    apart, up to the largest that the formula lets any loop fit in ``cap`` (stage 2's 4 + 12/N
    bytes a parameter)."""
    import torch

    most = cap / (4 + 12 / size)
    found = []
    for width in LADDER_WIDTHS:
        for layers in range(1, 97):
            with torch.device("meta"):
                count = sum(p.numel() for p in gpt(width, layers, seq_len).parameters())
            if count > most:
                break
            found.append((count, width, layers))
    rungs: list[tuple[int, int, int]] = []
    for rung in sorted(found):
        if not rungs or rung[0] >= rungs[-1][0] * LADDER_STEP:
            rungs.append(rung)
    return rungs


def largest(fits, count: int, first: int) -> int:
    """The largest index below ``count`` for which ``fits`` (true up to some index, false after)
    holds, -1 if none: probing from ``first`` outwards in growing steps, then bisecting."""
    low, high, step = -1, count, 1
    probe = min(max(first, 0), count - 1)
    if fits(probe):
        low = probe
        while low + step < high and fits(low + step):
            low, step = low + step, step * 2
        high = min(high, low + step)
    else:
        high = probe
        while high - step > low and not fits(high - step):
            high, step = high - step, step * 2
        low = max(low, high - step)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


# Bytes a parameter each loop needed with fp32 Adam at the peak, measured at np=2 (weights,
# gradients, state, the optimizer's temporaries): where the search for each starts, nothing more.
def _guess(impl: str, size: int) -> float:
    return {"horovod": 17.5, "torch-zero": 12 + 8 / size, "zero1": 8 + 10 / size, "zero2": 4 + 13 / size}[impl]


def max_model(args: argparse.Namespace) -> int:
    """The largest GPT each loop trains under the memory cap, at -np ranks."""
    rungs = ladder(args.memory_cap, args.np, args.seq_len)
    found = {impl: _search(args, impl, rungs) for impl in IMPLS}
    whole = found["horovod"]["parameters"]
    print(f"\nthe largest GPT under {args.memory_cap / 2**20:.0f} MB per rank, np={args.np}:")
    print(f"{'implementation':<12} {'parameters':>11} {'x horovod':>10} {'width x layers':>15} {'peak MB':>12}")
    for impl, row in found.items():
        print(f"{impl:<12} {row['parameters'] / 1e6:>10.1f}M {row['parameters'] / whole:>10.2f} "
              f"{row['width']:>8} x {row['layers']:<4} {row['peak'] / 2**20:>12.0f}")
    phases = list(found["horovod"]["phases"])
    print(f"\npeak MB per phase of those models: {' | '.join(phases)}")
    for impl, row in found.items():
        print(f"{impl:<12} " + " ".join(f"{row['phases'][phase] / 2**20:>8.0f}" for phase in phases))
    out = out_dir(args, "zero")
    record = {"event": "bench.zero.max_model", "np": args.np, "memory_cap": args.memory_cap,
              "optimizer": args.optimizer, "seq_len": args.seq_len, "batch_size": args.batch_size,
              "largest": found, "ratios": {impl: row["parameters"] / whole for impl, row in found.items()}}
    path = out / f"zero-max-model-np{args.np}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")
    print(json.dumps(record), flush=True)
    return 0


def _search(args: argparse.Namespace, impl: str, rungs: list[tuple[int, int, int]]) -> dict:
    """The largest rung of the ladder ``impl`` trains under the cap, and its peaks."""
    results: dict[int, Optional[dict]] = {}

    def fits(index: int) -> bool:
        count, width, layers = rungs[index]
        results[index] = _probe(args, impl, width, layers)
        peak = max(r["peak"] for r in results[index]["ranks"]) if results[index] else None
        print(f"  {impl}: {count / 1e6:.1f}M parameters (width {width} x {layers} layers): "
              + (f"peak {peak / 2**20:.0f} MB, fits" if peak else "over the cap"), flush=True)
        return results[index] is not None

    import torch

    baseline = 0 if torch.cuda.is_available() else BASELINE_RSS
    first = bisect.bisect(rungs, ((args.memory_cap - baseline) / _guess(impl, args.np),)) - 1
    print(f"== {impl}: np={args.np}, cap {args.memory_cap / 2**20:.0f} MB per rank", flush=True)
    index = largest(fits, len(rungs), first)
    if index < 0:
        raise BenchError(f"{impl}: not even the smallest GPT ({rungs[0][0] / 1e6:.1f}M parameters) trains "
                         f"under {args.memory_cap / 2**20:.0f} MB per rank")
    count, width, layers = rungs[index]
    ranks = results[index]["ranks"]
    phases = [phase for phase in ranks[0]["phases"] if phase != "unit"]
    return {"parameters": count, "width": width, "layers": layers, "peak": max(r["peak"] for r in ranks),
            "phases": {phase: max(r["phases"][phase] for r in ranks) for phase in phases}, "probes": len(results)}


def _probe(args: argparse.Namespace, impl: str, width: int, layers: int) -> Optional[dict]:
    """One run of ``impl`` on a GPT of that size, the first and a steady step untimed and one
    timed: its record if every rank stayed under the cap, None if one passed it."""
    sized = argparse.Namespace(**{**vars(args), "width": width, "layers": layers, "warmup": 2, "steps": 1,
                                  "model": "gpt"})
    record = run_launch(launch_command(args, args.np, _worker_args(sized, impl)), "bench.zero", impl, args.timeout,
                        declined="bench.zero.over")
    if record is None or max(r["peak"] for r in record["ranks"]) > args.memory_cap:  # a peak the watch missed
        return None
    return record


def _peak_name(record: dict) -> str:
    """What a run's peaks are: "rss" on CPUs, "cuda_allocated" on GPUs (hvdkit.rank.memory)."""
    return record["ranks"][0]["phases"]["unit"]


def _plot(table: dict, path) -> None:
    from hvdkit.bench.plots import pyplot

    plt = pyplot()
    fig, (rate_ax, bytes_ax) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(table)
    rate_ax.bar(names, [table[n]["samples_per_sec"] for n in names])
    rate_ax.set_ylabel("samples/sec (all ranks)")
    for offset, key in enumerate(("params", "grads", "optimizer_state")):
        bytes_ax.bar([i + 0.27 * (offset - 1) for i in range(len(names))], [table[n][key] / 2**20 for n in names],
                     width=0.27, label=key)
    bytes_ax.set_xticks(range(len(names)), names)
    bytes_ax.set_ylabel("MB held by one rank")
    bytes_ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
