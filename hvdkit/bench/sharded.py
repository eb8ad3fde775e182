"""`hvdkit bench zero`: the sharded optimizer beside its peers, on a model whose Adam state dominates.

Four loops train the same GPT with Adam on the same random tokens, each launched by `hvdkit
launch` in turn, in alternating order over rounds: hvdkit's ShardedOptimizer at stage 1 and 2,
Horovod's DistributedOptimizer (Horovod's own loop), and torch's ZeroRedundancyOptimizer under
DistributedDataParallel. Each rank reports its samples per second, the bytes of weights,
gradients and optimizer state it holds (from the tensors) and its peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from hvdkit import env
from hvdkit.bench.drivers import launch_command, out_dir, run_launch
from hvdkit.bench.figures import BenchError

IMPLS = ("zero1", "zero2", "horovod", "torch-zero")


def add_arguments(p: argparse.ArgumentParser) -> None:
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


def _worker_args(args: argparse.Namespace, impl: str) -> list[str]:
    return ["zero", "--impl", impl, "--width", str(args.width), "--layers", str(args.layers), "--seq-len",
            str(args.seq_len), "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--warmup",
            str(args.warmup)]


def worker(args: argparse.Namespace) -> None:
    """One rank of one loop: warm up, time the steps, report rates and bytes on rank 0."""
    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F

    from hvdkit.bench.workers import _init_torch_distributed
    from hvdkit.models import TinyGPT
    from hvdkit.rank.memory import PhasePeaks
    from hvdkit.rank.startup import place_process
    from hvdkit.zero import optimizer as zero

    launch = env.detect()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT(256, args.seq_len, args.width, args.layers, heads=8)
    if args.impl == "torch-zero":
        import torch.distributed as dist
        from torch.distributed.optim import ZeroRedundancyOptimizer

        place_process(launch.local_rank or 0, launch.local_size or 1)
        _init_torch_distributed("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
        model = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4)
        gather = _torch_gather
    else:
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        adam = torch.optim.Adam(model.parameters(), lr=1e-4)
        optimizer = (hvd.DistributedOptimizer(adam, named_parameters=model.named_parameters())
                     if args.impl == "horovod" else zero.ShardedOptimizer(adam, hvd, int(args.impl[-1])))
        gather = hvd.allgather_object
    tokens = torch.randint(0, 256, (args.batch_size, args.seq_len + 1), generator=torch.Generator().manual_seed(rank))

    peaks = PhasePeaks()

    def step(when: str) -> None:
        with peaks.phase(f"{when}: forward and backward"):
            optimizer.zero_grad()
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        with peaks.phase(f"{when}: optimizer step"):
            optimizer.step()

    for n in range(args.warmup):
        step("first step" if n == 0 else "steady")
    start = time.perf_counter()
    for _ in range(args.steps):
        step("steady")
    rate = args.batch_size * args.steps / (time.perf_counter() - start)
    held = {**_held(model, optimizer, zero), "phases": peaks.summary()}
    rows = gather({"samples_per_sec": rate, **held})
    if rank == 0:
        print(json.dumps({"event": "bench.zero", "impl": args.impl, "world_size": size,
                          "samples_per_sec": sum(r["samples_per_sec"] for r in rows), "ranks": rows}), flush=True)


def _held(model, optimizer, zero) -> dict:
    """This rank's bytes after a step, counted from the tensors, and its peak resident memory."""
    from hvdkit.rank.memory import peak_rss

    if isinstance(optimizer, zero.ShardedOptimizer):
        return zero.memory_of(optimizer)
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer steps its shard with this
    params = list(model.parameters())
    return {**zero.held_bytes(params, params, local.state.values()), "peak_rss": peak_rss()}


def _torch_gather(value):
    import torch.distributed as dist

    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, value)
    return rows


def compare(args: argparse.Namespace) -> int:
    """Every implementation in each round, order alternating; medians of per-round ratios."""
    if env.detect().rank is not None:
        raise BenchError("zero launches its own ranks: run it without a launcher, with -np N")
    runs: dict[str, list[dict]] = {impl: [] for impl in IMPLS}
    for round_index in range(args.repeats):
        for impl in IMPLS if round_index % 2 == 0 else IMPLS[::-1]:
            print(f"== {impl}: np={args.np}, gpt width {args.width} x {args.layers} layers, batch {args.batch_size} "
                  f"(round {round_index + 1} of {args.repeats})", flush=True)
            runs[impl].append(run_launch(launch_command(args, args.np, _worker_args(args, impl)), "bench.zero", impl,
                                         args.timeout))
    ratios = {f"{a}/{b}": statistics.median(x["samples_per_sec"] / y["samples_per_sec"]
                                            for x, y in zip(runs[a], runs[b], strict=True))
              for a in ("zero1", "zero2") for b in ("horovod", "torch-zero")}
    table = {impl: {"samples_per_sec": statistics.median(r["samples_per_sec"] for r in results),
                    **{key: max(rank[key] for rank in results[-1]["ranks"])
                       for key in ("params", "grads", "optimizer_state", "peak_rss")}}
             for impl, results in runs.items()}
    for impl, results in runs.items():  # each phase's peak, the largest rank's, in the last round
        table[impl]["phases"] = {phase: max(rank["phases"][phase] for rank in results[-1]["ranks"])
                                 for phase in results[-1]["ranks"][0]["phases"] if phase != "unit"}
    whole = table["horovod"]["optimizer_state"]
    print(f"\n{'implementation':<12} {'samples/sec':>12} {'optimizer MB':>13} {'x unsharded':>12} {'grads MB':>9} "
          f"{'weights MB':>11} {'peak RSS MB':>12}   (bytes: the largest rank)")
    for impl, row in table.items():
        print(f"{impl:<12} {row['samples_per_sec']:>12.2f} {row['optimizer_state'] / 2**20:>13.1f} "
              f"{row['optimizer_state'] / whole:>12.2f} {row['grads'] / 2**20:>9.1f} {row['params'] / 2**20:>11.1f} "
              f"{row['peak_rss'] / 2**20:>12.0f}")
    phases = list(table["horovod"]["phases"])
    print(f"\npeak RSS MB per phase (the largest rank): {' | '.join(phases)}")
    for impl, row in table.items():
        print(f"{impl:<12} " + " ".join(f"{row['phases'][phase] / 2**20:>8.0f}" for phase in phases))
    print("\nthroughput, median of per-round ratios: "
          + ", ".join(f"{name} {value:.3f}" for name, value in ratios.items()))
    out = out_dir(args, "zero")
    record = {"event": "bench.zero.compare", "np": args.np, "width": args.width, "layers": args.layers,
              "batch_size": args.batch_size, "seq_len": args.seq_len, "repeats": args.repeats, "table": table,
              "ratios": ratios, "runs": {impl: [r["samples_per_sec"] for r in rs] for impl, rs in runs.items()}}
    (out / "zero.json").write_text(json.dumps(record, indent=1) + "\n")
    _plot(table, out / "zero.png")
    print(f"wrote {out}/zero.json and zero.png")
    print(json.dumps(record), flush=True)
    return 0


def _plot(table: dict, path) -> None:
    from hvdkit.bench.plots import _pyplot

    plt = _pyplot()
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
