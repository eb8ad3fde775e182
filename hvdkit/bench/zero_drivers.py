"""`hvdkit bench zero`: the sharded optimizer beside Horovod's DistributedOptimizer and torch's
ZeroRedundancyOptimizer, and the largest model each trains under a memory cap; launched as the
other drivers launch (hvdkit.bench.drivers)."""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
from typing import Optional

from hvdkit import env
from hvdkit.bench.drivers import launch_command, out_dir, run_launch
from hvdkit.bench.figures import (
    BASELINE_RSS,
    TP_IMPLS,
    BenchError,
    ladder,
    largest,
    peak_saving,
    zero_guess,
)
from hvdkit.bench.plots import plot_zero


def zero(args: argparse.Namespace) -> int:
    """`hvdkit bench zero`: the sharded optimizer beside its peers, on a model whose Adam state
    dominates. Four loops train the same model (a GPT on random tokens, or a torchvision model on
    random images) with Adam or AdamW, each launched in turn, in alternating order over rounds:
    hvdkit's ShardedOptimizer at stage 1 and 2, Horovod's DistributedOptimizer, and torch's
    ZeroRedundancyOptimizer under DDP. Each rank reports its samples per second, the bytes of
    weights, gradients and optimizer state it holds and its peak memory per phase of a step
    (resident on CPUs, the CUDA allocator's on GPUs). ``--max-model --memory-cap SIZE`` finds
    instead the largest GPT each loop trains with every rank's peak under SIZE, bisecting a ladder
    of widths and depths; a rank past the cap ends its run at once. Bad flags end in one line first."""
    if env.detect().rank is not None:
        raise BenchError("zero launches its own ranks: run it without a launcher, with -np N")
    if args.max_model and not args.memory_cap:
        raise BenchError("zero --max-model needs --memory-cap SIZE: the peak memory each rank may reach")
    if args.memory_cap and not args.max_model:
        raise BenchError("zero: --memory-cap goes with --max-model")
    if args.max_model and args.model != "gpt":
        raise BenchError(f"zero --max-model grows a GPT; it does not take --model {args.model}")
    if args.model != "gpt" and set(args.impls) & set(TP_IMPLS):
        raise BenchError(f"zero: tensor parallelism ({', '.join(TP_IMPLS)}) splits the GPT by its plan; it does not "
                         f"take --model {args.model}")
    return zero_max_model(args) if args.max_model else zero_compare(args)


def zero_compare(args: argparse.Namespace) -> int:
    """Every implementation in each round, order alternating; medians of per-round ratios."""
    impls = args.impls
    runs: dict[str, list[dict]] = {impl: [] for impl in impls}
    for round_index in range(args.repeats):
        for impl in impls if round_index % 2 == 0 else impls[::-1]:
            print(f"== {impl}: np={args.np}, {_zero_model_name(args)}, batch {args.batch_size} "
                  f"(round {round_index + 1} of {args.repeats})", flush=True)
            command = launch_command(args, args.np, _zero_worker_args(args, impl))
            runs[impl].append(run_launch(command, "bench.zero", impl, args.timeout))
    per_round = {f"{a}/{b}": [x["samples_per_sec"] / y["samples_per_sec"]
                              for x, y in zip(runs[a], runs[b], strict=True)]
                 for a, b in RATIOS if a in runs and b in runs}
    ratios = {name: statistics.median(values) for name, values in per_round.items()}
    # Bytes held: the largest rank's, the same every round. Peaks: the largest rank's, median over
    # the rounds, as a rank's peak moves by tens of MB from run to run with the allocator's luck.
    table = {impl: {"samples_per_sec": statistics.median(r["samples_per_sec"] for r in results),
                    **{key: max(rank[key] for rank in results[-1]["ranks"])
                       for key in ("params", "grads", "optimizer_state")},
                    "peak": statistics.median(max(rank["peak"] for rank in r["ranks"]) for r in results),
                    "cpu_ms_per_step": statistics.median(1000 * r["ranks"][0]["cpu_per_step"] for r in results),
                    "baseline": max(rank["baseline"] for rank in results[-1]["ranks"])}
             for impl, results in runs.items()}
    for impl, results in runs.items():
        table[impl]["phases"] = {phase: statistics.median(max(rank["phases"][phase] for rank in r["ranks"])
                                                          for r in results)
                                 for phase in results[-1]["ranks"][0]["phases"] if phase != "unit"}
    unsharded = [table[impl]["optimizer_state"] for impl in ("horovod",) if impl in table]
    whole = unsharded[0] if unsharded else args.np * max(row["optimizer_state"] for row in table.values())
    peak_name = _peak_name(runs[impls[0]][-1])
    print(f"\n{'implementation':<12} {'samples/sec':>12} {'cpu ms/step':>12} {'optimizer MB':>13} {'x unsharded':>12} "
          f"{'grads MB':>9} {'weights MB':>11} {'peak MB':>12}   (peak: {peak_name}; bytes: the largest rank; peaks: "
          "its median over rounds; cpu: rank 0's training thread)")
    for impl, row in table.items():
        print(f"{impl:<12} {row['samples_per_sec']:>12.2f} {row['cpu_ms_per_step']:>12.1f} "
              f"{row['optimizer_state'] / 2**20:>13.1f} {row['optimizer_state'] / whole:>12.2f} "
              f"{row['grads'] / 2**20:>9.1f} {row['params'] / 2**20:>11.1f} {row['peak'] / 2**20:>12.0f}")
    phases = list(table[impls[0]]["phases"])
    print(f"\npeak MB ({peak_name}) per phase (the largest rank, median over rounds): {' | '.join(phases)}")
    for impl, row in table.items():
        print(f"{impl:<12} " + " ".join(f"{row['phases'][phase] / 2**20:>8.0f}" for phase in phases))
    print("\nthroughput, median of per-round ratios: "
          + ", ".join(f"{name} {value:.3f}" for name, value in ratios.items()))
    for name, values in per_round.items():
        print(f"  {name} by round: " + " ".join(f"{value:.3f}" for value in values))
    for impl, results in runs.items():  # hvdkit's tensor parallelism: the waits the step could not overlap
        if "exposed_per_step" in results[-1]["ranks"][0]:
            exposed = statistics.median(1000 * max(rank["exposed_per_step"] for rank in r["ranks"]) for r in results)
            table[impl]["exposed_ms_per_step"] = exposed
            step_ms = 1000 * args.batch_size * args.np / table[impl]["samples_per_sec"]  # a group's global batch
            print(f"{impl}: exposed communication {exposed:.1f} ms of a {step_ms:.1f} ms step "
                  f"({exposed / step_ms:.0%}; the training thread's waits in Horovod's synchronize, the slowest rank, "
                  f"median over rounds)")
    saving = peak_saving(table, args.np) if "horovod" in table else {}
    if saving:
        print(f"peak ({peak_name}) below DistributedOptimizer's (medians), of what the formula saves: "
              + ", ".join(f"{impl} {row['measured'] / 2**20:.0f} MB of {row['formula'] / 2**20:.0f} MB "
                          + (f"({row['ratio']:.2f})" if row["ratio"] is not None else "(one rank shards nothing)")
                          for impl, row in saving.items()))
    out = out_dir(args, "zero")
    record = {"event": "bench.zero.compare", "np": args.np, "model": args.model, "optimizer": args.optimizer,
              "parameters": runs[impls[0]][-1]["parameters"], "width": args.width, "layers": args.layers,
              "batch_size": args.batch_size, "seq_len": args.seq_len, "repeats": args.repeats, "table": table,
              "peak_unit": peak_name, "ratios": ratios, "ratios_by_round": per_round, "peak_saving": saving,
              "runs": {impl: [r["samples_per_sec"] for r in rs] for impl, rs in runs.items()}}
    (out / "zero.json").write_text(json.dumps(record, indent=1) + "\n")
    plot_zero(table, out / "zero.png")
    print(f"wrote {out}/zero.json and zero.png")
    print(json.dumps(record), flush=True)
    return 0


def zero_max_model(args: argparse.Namespace) -> int:
    """The largest GPT each loop trains under the memory cap, at -np ranks."""
    rungs = ladder(args.memory_cap, args.np, args.seq_len)
    found = {impl: _zero_search(args, impl, rungs) for impl in args.impls}
    base = "horovod" if "horovod" in found else args.impls[0]
    whole = found[base]["parameters"]
    print(f"\nthe largest GPT under {args.memory_cap / 2**20:.0f} MB per rank, np={args.np}:")
    print(f"{'implementation':<12} {'parameters':>11} {'x ' + base:>12} {'width x layers':>15} {'peak MB':>12}")
    for impl, row in found.items():
        print(f"{impl:<12} {row['parameters'] / 1e6:>10.1f}M {row['parameters'] / whole:>12.2f} "
              f"{row['width']:>8} x {row['layers']:<4} {row['peak'] / 2**20:>12.0f}")
    phases = list(found[base]["phases"])
    print(f"\npeak MB per phase of those models: {' | '.join(phases)}")
    for impl, row in found.items():
        print(f"{impl:<12} " + " ".join(f"{row['phases'][phase] / 2**20:>8.0f}" for phase in phases))
    out = out_dir(args, "zero")
    record = {"event": "bench.zero.max_model", "np": args.np, "memory_cap": args.memory_cap,
              "optimizer": args.optimizer, "seq_len": args.seq_len, "batch_size": args.batch_size,
              "largest": found, "ratios_to": base,
              "ratios": {impl: row["parameters"] / whole for impl, row in found.items()}}
    path = out / f"zero-max-model-np{args.np}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")
    print(json.dumps(record), flush=True)
    return 0


def _zero_search(args: argparse.Namespace, impl: str, rungs: list[tuple[int, int, int]]) -> dict:
    """The largest rung of the ladder ``impl`` trains under the cap, and its peaks."""
    results: dict[int, Optional[dict]] = {}

    def fits(index: int) -> bool:
        count, width, layers = rungs[index]
        results[index] = _zero_probe(args, impl, width, layers)
        peak = max(r["peak"] for r in results[index]["ranks"]) if results[index] else None
        print(f"  {impl}: {count / 1e6:.1f}M parameters (width {width} x {layers} layers): "
              + (f"peak {peak / 2**20:.0f} MB, fits" if peak else "over the cap"), flush=True)
        return results[index] is not None

    import torch

    baseline = 0 if torch.cuda.is_available() else BASELINE_RSS
    first = bisect.bisect(rungs, ((args.memory_cap - baseline) / zero_guess(impl, args.np),)) - 1
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


def _zero_probe(args: argparse.Namespace, impl: str, width: int, layers: int) -> Optional[dict]:
    """One run of ``impl`` on a GPT of that size, the first and a steady step untimed and one
    timed: its record if every rank stayed under the cap, None if one passed it."""
    sized = argparse.Namespace(**{**vars(args), "width": width, "layers": layers, "warmup": 2, "steps": 1,
                                  "model": "gpt"})
    record = run_launch(launch_command(args, args.np, _zero_worker_args(sized, impl)), "bench.zero", impl, args.timeout,
                        declined="bench.zero.over")
    if record is None or max(r["peak"] for r in record["ranks"]) > args.memory_cap:  # a peak the watch missed
        return None
    return record


# The throughput ratios the comparison prints, where both loops ran: each stage against Horovod's
# and torch's unsharded or optimizer-sharded loops, stage 3 against FSDP2 and stage 2.
RATIOS = (("zero1", "horovod"), ("zero1", "torch-zero"), ("zero2", "horovod"), ("zero2", "torch-zero"),
          ("zero3", "fsdp2"), ("zero3", "zero2"), ("zero3", "horovod"), ("tp", "torch-tp"), ("tp", "horovod"),
          ("tp-sp", "tp"))


def _zero_worker_args(args: argparse.Namespace, impl: str) -> list[str]:
    cap = ["--memory-cap", str(args.memory_cap)] if args.memory_cap else []
    return ["zero", "--impl", impl, "--model", args.model, "--optimizer", args.optimizer, "--image-size",
            str(args.image_size), "--num-classes", str(args.num_classes), "--width", str(args.width), "--layers",
            str(args.layers), "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--steps",
            str(args.steps), "--warmup", str(args.warmup), *cap]


def _zero_model_name(args: argparse.Namespace) -> str:
    if args.model == "gpt":
        return f"gpt width {args.width} x {args.layers} layers"
    return f"{args.model} on {args.image_size} px images, {args.num_classes} classes, {args.optimizer}"


def _peak_name(record: dict) -> str:
    """What a run's peaks are: "rss" on CPUs, "cuda_allocated" on GPUs (hvdkit.rank.memory)."""
    return record["ranks"][0]["phases"]["unit"]
