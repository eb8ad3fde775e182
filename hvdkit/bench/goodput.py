"""`hvdkit bench goodput`: one storm of faults at random moments (`hvdkit rehearse --chaos`, on
namespace hosts, one seed) against each way of coming back from them, side by side: hvdkit with
in-job restarts and snapshots in host memory (``restarts``), and hvdkit restarted from its disk
checkpoints as a scheduler requeues a job (``disk``), and torch DistributedDataParallel under
``torchrun --max-restarts`` with the same checkpoint interval (``torchrun``: the peer users would
pick; hvdkit.bench.ddp_job). Each arm's report holds, per fault, the
seconds until the next trained step and the steps redone, and the effective training time ratio
(undisturbed seconds / disturbed seconds); the arms' undisturbed runs are timed each in its own
rehearsal."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from hvdkit.bench.drivers import out_dir
from hvdkit.bench.figures import BenchError
from hvdkit.system import wholefiles

ARMS = ("restarts", "disk", "torchrun")
RESTARTS = 100  # --max-restarts of the restarts arm: more than any storm here strikes
EPOCHS = 1000  # hvdkit train's epochs: enough that --steps ends it, as it ends the torchrun arm's loop


def train_command(args: argparse.Namespace, ckpt: Path, logs: Path) -> list[str]:
    """The job every arm trains: hvdkit train on synthetic images, a report per step (the faults'
    costs are read from them), checkpoints every --checkpoint-steps."""
    return ["hvdkit", "train", "--model", args.model, "--dataset", "synthetic", "--image-size", str(args.image_size),
            "--epochs", str(EPOCHS), "--max-steps", str(args.steps), "--checkpoint-steps", str(args.checkpoint_steps),
            "--warmup-epochs", "0",
            "--lr-schedule", "none", "--log-interval", "1", "--checkpoint-dir", str(ckpt), "--log-dir", str(logs)]


def arm_command(arm: str, args: argparse.Namespace, ckpt: Path, logs: Path) -> list[str]:
    """What the rehearsal runs on node0 for ``arm``."""
    if arm == "torchrun":
        return [sys.executable, "-m", "hvdkit.bench.ddp_job", "launch", "--nodes", str(args.np), "--max-restarts",
                str(RESTARTS), "--", "--model", args.model, "--image-size", str(args.image_size), "--max-steps",
                str(args.steps), "--checkpoint-steps", str(args.checkpoint_steps), "--checkpoint-dir", str(ckpt),
                "--log-dir", str(logs)]
    train = train_command(args, ckpt, logs)
    # One torch thread a rank, as the torchrun arm's agents give theirs: the rehearsal's hosts share
    # this machine's cores, and each would otherwise take every core for its one rank.
    launch = ["hvdkit", "launch", "-np", str(args.np), "-x", "OMP_NUM_THREADS=1"]
    if arm == "restarts":
        return [*launch, "--max-restarts", str(RESTARTS), "--", *train, "--snapshot-steps", str(args.snapshot_steps)]
    return [*launch, "--", *train]


def rehearse_command(arm: str, args: argparse.Namespace, out: Path) -> list[str]:
    """`hvdkit rehearse --chaos` of ``arm``'s job, its report and the job's files under ``out``."""
    return [sys.executable, "-m", "hvdkit", "rehearse", "--hosts", str(args.np), "--chaos", str(args.faults_count),
            "--chaos-seed", str(args.seed), "--faults", args.faults, "--out", str(out / "rehearsal"), "--",
            *arm_command(arm, args, out / "ckpt", out / "logs")]


def run(args: argparse.Namespace) -> int:
    """Each arm's rehearsal in turn, then their costs side by side."""
    out = out_dir(args, "goodput")
    reports = {}
    for arm in args.arms:
        folder = out / arm
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        command = rehearse_command(arm, args, folder)
        print(f"== {arm}: {' '.join(command[2:])}", flush=True)
        with open(folder / "rehearse.log", "w") as log:
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
        report = folder / "rehearsal" / "report.json"
        if not report.is_file():
            raise BenchError(f"{arm}: the rehearsal wrote no report (exit {code}); its output: "
                             f"{folder / 'rehearse.log'}")
        reports[arm] = json.loads(report.read_text())
        reports[arm]["exit_code"] = code
        shutil.rmtree(folder / "ckpt", ignore_errors=True)
    table = {arm: _row(report) for arm, report in reports.items()}
    print(f"\n{args.faults_count} faults ({args.faults}) at random moments, seed {args.seed}, np={args.np} on "
          f"{args.np} hosts, {args.steps} steps, checkpoints every {args.checkpoint_steps}, snapshots every "
          f"{args.snapshot_steps} (restarts)")
    print(f"{'arm':<9} {'faults':>7} {'s to next step':>15} {'steps redone':>13} {'undisturbed s':>14} "
          f"{'start-up s':>11} {'steady ms':>10} {'steps':>6} {'disturbed s':>12} {'ETTR':>6}  held")
    for arm, row in table.items():
        print(f"{arm:<9} {row['faults_measured']:>7} {_text(row['mean_seconds_to_next_step']):>15} "
              f"{_text(row['mean_steps_redone']):>13} {_text(row['undisturbed_seconds']):>14} "
              f"{_text(row['startup_seconds']):>11} {_text(row['steady_step_ms']):>10} "
              f"{_text(row['trained_steps']):>6} "
              f"{_text(row['disturbed_seconds']):>12} {_text(row['effective_training_time_ratio']):>6}  "
              f"{row['held']}")
    record = {"event": "bench.goodput", "seed": args.seed, "faults": args.faults, "count": args.faults_count,
              "np": args.np, "steps": args.steps, "checkpoint_steps": args.checkpoint_steps,
              "snapshot_steps": args.snapshot_steps, "table": table}
    wholefiles.write_whole(out / "goodput.json", json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}/goodput.json", flush=True)
    return 0


def _row(report: dict) -> dict:
    held = "yes" if not report["problems"] else f"no: {report['problems'][0][:80]}"
    reference = report.get("reference") or {}
    pace = {key: reference.get(key)
            for key in ("startup_seconds", "steady_step_ms", "trained_steps", "training_seconds")}
    return {**report["goodput"], **pace, "held": held, "exit_code": report["exit_code"],
            "per_fault": [{k: s.get(k) for k in ("number", "fault", "target", "at_step", "resumed_step",
                                                 "steps_redone", "seconds_to_next_step")} for s in report["strikes"]]}


def _text(value) -> str:
    return "-" if value is None else f"{value:g}"
