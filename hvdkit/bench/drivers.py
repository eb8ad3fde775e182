"""The drivers: launch the workers with `hvdkit launch`, the same way for every implementation,
alternate them over rounds, and read back rank 0's records."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from hvdkit import env
from hvdkit.args import bits_per_second
from hvdkit.bench import counters, estimate, profile
from hvdkit.bench.environment import print_environment
from hvdkit.bench.figures import (
    BenchError,
    format_size,
    ratio_rows,
    ratio_summary,
    scaling_table,
)
from hvdkit.bench.plots import (
    plot_allreduce,
    plot_scaling,
    write_allreduce_csv,
)
from hvdkit.checks.selftest import mpi_root_env, parse_records
from hvdkit.launch.hostfile import several
from hvdkit.launch.mpi import find_program
from hvdkit.launch.planner import job_hosts, local_slots
from hvdkit.launch.rank_output import untagged
from hvdkit.system import wholefiles


class RunFailed(RuntimeError):
    """A launch that failed or gave a wrong result; printed as one line, exit code 1."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def launch_command(args: argparse.Namespace, np: int, worker: Sequence[str],
                   knobs_set: Optional[dict] = None, options: Sequence[str] = ()) -> list[str]:
    """`hvdkit launch` of ``worker`` on ``np`` ranks, with ``knobs_set`` in every rank and a
    rendezvous for torch.distributed on rank 0's host: the first of the hosts the launch runs on,
    whether -H, a rehearsal or a Slurm allocation lists them; this machine where none does."""
    hosts = job_hosts(args.hosts, None, os.environ)
    master = hosts[0].name if hosts else "127.0.0.1"
    cmd = [find_program("hvdkit") or "hvdkit", "launch", "-np", str(np), "--launcher", args.launcher, *options,
           "-x", f"MASTER_ADDR={master}", "-x", f"MASTER_PORT={free_port()}"]
    for name, value in (knobs_set or {}).items():
        cmd += ["-x", f"{name}={value}"]
    if args.hosts:
        cmd += ["-H", args.hosts]
    if args.controller:
        cmd.append(f"--{args.controller}")
    return cmd + ["--", sys.executable, "-m", "hvdkit.bench", *worker]


def run_launch(command: Sequence[str], event: str, label: str, timeout: float,
               declined: Optional[str] = None) -> Optional[dict]:
    """Run one launch; echo rank 0's human lines; return its ``event`` record, or None where a
    rank printed a ``declined`` record (and ended the launch on purpose)."""
    try:
        proc = subprocess.run(command, env=mpi_root_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RunFailed(f"{label}: no result within {timeout:.0f} s") from None
    if declined and parse_records(proc.stdout, declined):
        return None
    records = parse_records(proc.stdout, event)
    if proc.returncode != 0 or not records:
        # The ranks' errors go to stderr; a run that printed none there says what it did on stdout.
        tail = [line for line in (proc.stderr.strip() or proc.stdout).splitlines() if line.strip()][-3:]
        raise RunFailed(f"{label} failed (exit code {proc.returncode}): {' | '.join(tail)}")
    for line in untagged(proc.stdout).splitlines():  # rank 0's lines, as from one process
        if '{"event": "bench.' not in line and line.strip():
            print(f"  {line}", flush=True)
    return records[0]


def synthetic_worker_args(args: argparse.Namespace, impl: str) -> list[str]:
    worker = ["synthetic", "--impl", impl, "--model", args.model, "--batch-size", str(args.batch_size),
              "--image-size", str(args.image_size), "--num-classes", str(args.num_classes),
              "--num-warmup-batches", str(args.num_warmup_batches),
              "--num-batches-per-iter", str(args.num_batches_per_iter), "--num-iters", str(args.num_iters),
              "--lr", str(args.lr), "--seed", str(args.seed)]
    return worker + ["--fp16-allreduce"] * args.fp16_allreduce + ["--amp"] * args.amp + ["--profile"] * args.profile \
        + ["--counters"] * args.counters + ["--optimizer", args.optimizer]


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
            command = launch_command(args, np, synthetic_worker_args(args, impl), knob)
            runs[label].append(run_launch(command, "bench.synthetic", label, args.timeout))
    if args.profile:
        write_profiles(args, runs)
    if args.counters:
        write_counters(args, runs)
    print_environment(runs["hvdkit"][-1]["environment"])
    summary = {label: statistics.fmean(r["total_img_sec"] for r in results) for label, results in runs.items()}
    kind = runs["hvdkit"][-1]["device"]
    width = max(18, *(len(label) for label in summary))
    # CPU per step and rank: all threads, and all but the training thread (the allreduces' cost)
    cpu = {label: (statistics.fmean(r["cpu_ms_per_step"] for r in results),
                   statistics.fmean(r["cpu_ms_per_step"] - r["training_thread_cpu_ms_per_step"] for r in results))
           for label, results in runs.items()}
    # hvdkit / it within each round, where the two ran minutes apart: the spread the means hide
    per_round = {label: [h["total_img_sec"] / r["total_img_sec"] for h, r in zip(runs["hvdkit"], results, strict=True)]
                 for label, results in runs.items() if label != "hvdkit"}
    compute_ms = statistics.fmean(r["compute_ms"] for results in runs.values() for r in results)
    gradient_bytes = runs["hvdkit"][-1]["gradient_bytes"]
    floor = estimate.floor(compute_ms, gradient_bytes / (2 if args.fp16_allreduce else 1), args.batch_size, np,
                           bits_per_second(args.link_rate) / 1e9 if args.link_rate else None,
                           several(job_hosts(args.hosts, None, os.environ)))
    of_floor = {label: total / floor["img_sec"] for label, total in summary.items()} if floor else {}
    print(f"\n{'implementation':<{width}} {'total img/sec':>14} {'per ' + kind:>10} {'hvdkit / it':>12} "
          f"{'per round':>12} {'CPU ms/step':>12} {'not training':>13} {'of floor':>9}")
    for label, total in summary.items():
        spread = f"{min(per_round[label]):.2f}-{max(per_round[label]):.2f}" if label in per_round else "-"
        print(f"{label:<{width}} {total:>14.1f} {total / np:>10.1f} {summary['hvdkit'] / total:>12.3f} "
              f"{spread:>12} {cpu[label][0]:>12.0f} {cpu[label][1]:>13.0f} "
              + (f"{of_floor[label]:>9.2f}" if floor else f"{'-':>9}"))
    print(floor_line(floor, np))
    ratios = {f"hvdkit/{label}": summary["hvdkit"] / total for label, total in summary.items() if label != "hvdkit"}
    print(f"\ncompute per step without allreduce: {compute_ms:.1f} ms per rank (all runs' mean); gradients: "
          f"{gradient_bytes} bytes; for many ranks: hvdkit bench estimate --compute-ms {compute_ms:.1f} "
          f"--gradient-bytes {gradient_bytes} --batch-size {args.batch_size}"
          + " --fp16-allreduce" * args.fp16_allreduce)
    print(json.dumps({"event": "bench.compare", "np": np, "model": args.model, "batch_size": args.batch_size,
                      "compute_ms": compute_ms, "gradient_bytes": gradient_bytes,
                      "fp16_allreduce": args.fp16_allreduce,
                      "image_size": args.image_size, "repeats": args.repeats, "total_img_sec": summary,
                      "cpu_ms_per_step": {label: c[0] for label, c in cpu.items()},
                      "other_threads_cpu_ms_per_step": {label: c[1] for label, c in cpu.items()},
                      "ratios": ratios, "floor": floor, "of_floor": of_floor,
                      "round_ratios": {f"hvdkit/{label}": r for label, r in per_round.items()},
                      "runs": {label: [r["total_img_sec"] for r in rs] for label, rs in runs.items()},
                      "knobs": {label: rs[-1]["environment"]["knobs"] for label, rs in runs.items()},
                      "environment": runs["hvdkit"][-1]["environment"]}), flush=True)
    return 0


def floor_line(floor: Optional[dict], np: int) -> str:
    """What the floor column is measured against, in one line."""
    if floor is None:
        return ("network floor: not known, the ranks span hosts whose link rate was not given "
                "(--link-rate 10gbit, or $HVDKIT_LINK_RATE)")
    made_of = f"compute {floor['compute_ms']:.1f} ms"
    if floor["gbit"] is not None:
        made_of += (f", ring allreduce of {floor['gradient_bytes'] / 1e6:.1f} MB over {np} ranks on "
                    f"{floor['gbit']:g} Gbit/s: {floor['allreduce_ms']:.1f} ms")
    else:
        made_of += ", no link between the ranks"
    return (f"network floor: a step takes at least {floor['step_ms']:.1f} ms ({made_of}; {floor['bound']}-bound, "
            f"fully overlapped): {floor['img_sec']:.1f} img/sec")


def write_profiles(args: argparse.Namespace, runs: dict[str, list[dict]]) -> None:
    """Each implementation's profile of its last round: profile-<label>.json and .txt."""
    _write_last_rounds(args, runs, "profile", profile.text)


def write_counters(args: argparse.Namespace, runs: dict[str, list[dict]]) -> None:
    """Each implementation's duty counters of its last round: counters-<label>.json and .txt."""
    _write_last_rounds(args, runs, "counters", counters.text)


def _write_last_rounds(args: argparse.Namespace, runs: dict[str, list[dict]], key: str, text) -> None:
    """The ``key`` summary each implementation's last round recorded, as <key>-<label>.json and
    .txt (``text(label, summary)``, also printed), in the synthetic bench's folder."""
    folder = out_dir(args, "synthetic")
    for label, results in runs.items():
        summary = results[-1].get(key)
        if summary:
            name = re.sub(r"[^A-Za-z0-9_.=-]+", "_", label)
            (folder / f"{key}-{name}.json").write_text(json.dumps(summary, indent=1) + "\n")
            (folder / f"{key}-{name}.txt").write_text(text(label, summary))
            print(text(label, summary), end="", flush=True)
    print(f"{key} written to {folder}", flush=True)


def scaling(args: argparse.Namespace) -> int:
    """Throughput of one implementation at each world size, same per-rank batch."""
    totals, records = {}, {}
    for np in args.np_list:
        print(f"== {args.impl}: np={np}", flush=True)
        command = launch_command(args, np, synthetic_worker_args(args, args.impl))
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
    out = out_dir(args, "scaling")
    plot_scaling(table, args, out / "scaling.png")
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
    out = out_dir(args, "allreduce")
    write_allreduce_csv(record, out / "allreduce.csv")
    (out / "allreduce.json").write_text(json.dumps(record, indent=1) + "\n")
    plot_allreduce(record, out / "allreduce.png")
    print(f"wrote {out}/allreduce.csv, allreduce.json and allreduce.png")
    print(json.dumps({**record, "event": "bench.allreduce", "ratios": summary["ratios"]}), flush=True)
    return 0


def print_estimate(args: argparse.Namespace) -> int:
    """The ring-allreduce model's step time and efficiency per link speed and world size."""
    nbytes = args.gradient_bytes / (2 if args.fp16_allreduce else 1)
    rows = estimate.table(args.compute_ms, nbytes, args.batch_size, args.np_list, args.gbit, args.latency_us)
    print(f"ring allreduce of {nbytes / 2**20:.1f} MiB per step, {args.compute_ms:.1f} ms compute per rank, "
          f"{args.latency_us:g} us per hop; no overlap .. full overlap of compute and allreduce")
    for gbit in args.gbit:
        print(f"\n{gbit:g} Gbit/s\n{'np':>5} {'allreduce ms':>13} {'step ms':>17} {'total img/sec':>21} "
              f"{'efficiency':>15}")
        for r in (r for r in rows if r["gbit"] == gbit):
            print(f"{r['np']:>5} {r['allreduce_ms']:>13.1f} {r['step_ms_no_overlap']:>8.1f} .. "
                  f"{r['step_ms_overlap']:<6.1f} {r['img_sec_no_overlap']:>10.0f} .. {r['img_sec_overlap']:<8.0f} "
                  f"{r['efficiency_no_overlap']:>6.0%} .. {r['efficiency_overlap']:<5.0%}")
    print(json.dumps({"event": "bench.estimate", "compute_ms": args.compute_ms, "gradient_bytes": nbytes,
                      "batch_size": args.batch_size, "latency_us": args.latency_us, "rows": rows}), flush=True)
    return 0


def out_dir(args: argparse.Namespace, kind: str) -> Path:
    out = Path(args.out) if args.out else Path("runs/bench") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BenchError(f"--out {out}: {exc.strerror}") from None
    return out


def save_record(args: argparse.Namespace, kind: str, record: dict) -> int:
    """A self-launched benchmark's end: rank 0's ``record`` written to ``<kind>.json`` under --out
    (or a new folder in runs/bench), the file named, the record printed as one JSON line; 0."""
    out = out_dir(args, kind)
    (out / f"{kind}.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}/{kind}.json")
    print(json.dumps(record), flush=True)
    return 0


def default_np() -> int:
    """One rank per GPU, or per core without GPUs."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else local_slots()


# sharded: in the background, a part per rank; snapshot: in the background, into each host's memory
CHECKPOINT_IMPLS = ("none", "sync", "async", "sharded", "snapshot")
CHECKPOINT_LABELS = {"none": "none", "sync": "in the training thread (`--no-async-checkpoint`)",
                     "async": "in the background (default)",
                     "sharded": "in the background, a part per rank (`--sharded-checkpoint`)",
                     "snapshot": "snapshots in host memory (`--snapshot-steps`)"}


def checkpoint_compare(args: argparse.Namespace) -> int:
    """`hvdkit bench checkpoint`: the same training without saves and with each arm's (--arms):
    checkpoints written in the training thread, in the background, in the background a part per
    rank, and snapshots into host memory, in alternating order over rounds. The stall is what a
    save held the training thread (the Session's own timing; for ``sync`` the whole write); the
    cost, the throughput lost against the run without saves. Medians over rounds."""
    if env.detect().rank is not None:
        raise BenchError("checkpoint launches its own ranks: run it without a launcher, with -np N")
    arms = args.arms
    runs: dict[str, list[dict]] = {impl: [] for impl in arms}
    what = "linear layers" if args.model == "linear" else args.model
    for round_index in range(args.repeats):
        for impl in arms if round_index % 2 == 0 else arms[::-1]:
            print(f"== {impl}: np={args.np}, {what}, a save every {args.checkpoint_every} steps "
                  f"(round {round_index + 1} of {args.repeats})", flush=True)
            folder = tempfile.mkdtemp(prefix="hvdkit-bench-checkpoint-", dir=args.dir)
            worker = ["checkpoint", "--impl", impl, "--model", args.model, "--params", str(args.params), "--width",
                      str(args.width), "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--warmup",
                      str(args.warmup), "--checkpoint-every", str(args.checkpoint_every), "--dir", folder]
            options = ["--max-restarts", "1"] if impl == "snapshot" else []  # it names where snapshots go
            try:
                runs[impl].append(run_launch(launch_command(args, args.np, worker, options=options),
                                             "bench.checkpoint", impl, args.timeout))
            finally:
                shutil.rmtree(folder, ignore_errors=True)

    def per_save(results: list, key: str) -> Optional[float]:
        saved = [r["checkpoints"] for r in results if r["checkpoints"]["saves"]]
        return statistics.median(c[key] / c["saves"] for c in saved) if saved else None

    table = {impl: {"steps_per_sec": statistics.median(r["steps_per_sec"] for r in results),
                    "stall_per_save": per_save(results, "stall_seconds"),
                    "write_per_save": per_save(results, "write_seconds"),
                    "waited_for_previous": sum(r["checkpoints"]["waited_for_previous"] for r in results)}
             for impl, results in runs.items()}
    for impl in arms[1:]:  # each round's against the run without saves next to it: this machine is noisy
        ratios = [r["steps_per_sec"] / plain["steps_per_sec"] for r, plain in zip(runs[impl], runs["none"],
                                                                                     strict=True)]
        table[impl]["throughput_lost"] = 1 - statistics.median(ratios)
        table[impl]["round_ratios"] = [round(ratio, 4) for ratio in ratios]
    stall_ratio = (table["async"]["stall_per_save"] / table["sync"]["stall_per_save"]
                   if {"async", "sync"} <= set(arms) else None)
    last = runs["none"][-1]
    size = last["checkpoint_bytes"]
    print(f"\nstate of {size / 1e9:.2f} GB ({what}, {last['parameters'] / 1e6:.1f}M parameters with Adam), "
          f"np={args.np}, a save every {args.checkpoint_every} of {args.steps} timed steps; medians of "
          f"{args.repeats} rounds (throughput lost: the median of each round's ratio to the run without saves)")
    print(f"{'saves':<9} {'steps/s':>9} {'stall s/save':>13} {'write s/save':>13} {'throughput lost':>16}")
    for impl, row in table.items():
        stall = "-" if row["stall_per_save"] is None else f"{row['stall_per_save']:.3f}"
        write = "-" if row["write_per_save"] is None else f"{row['write_per_save']:.3f}"
        lost = f"{row['throughput_lost']:.1%}" if "throughput_lost" in row else "-"
        print(f"{impl:<9} {row['steps_per_sec']:>9.3f} {stall:>13} {write:>13} {lost:>16}")
    if stall_ratio is not None:
        print(f"stall per save, background / training thread: {stall_ratio:.3f}")
    out = out_dir(args, "checkpoint")
    record = {"event": "bench.checkpoint.compare", "np": args.np, "model": args.model,
              "parameters": last["parameters"], "checkpoint_bytes": size, "checkpoint_every": args.checkpoint_every,
              "steps": args.steps, "repeats": args.repeats, "table": table, "stall_ratio": stall_ratio,
              "runs": {impl: rs for impl, rs in runs.items()}}
    wholefiles.write_whole(out / "checkpoint.json", json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}/checkpoint.json")
    print(json.dumps(record), flush=True)
    return 0
