"""`hvdkit plot RUN_DIR [RUN_DIR ...]`: pictures of runs from the metrics.jsonl each already writes.

Three figures, each with every run given (one line per run, labelled by its directory):
``metrics.png`` (loss, accuracy and the other metrics over steps, training and test),
``throughput.png`` (samples per second over steps) and ``ranks.png`` (each rank's compute and
wait per step: a straggler is the rank whose compute stands above the others while they
wait). Written to ``--out`` (default: RUN_DIR/plots for one run, ./plots for several).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from hvdkit import job

# Keys of a report that are not metrics to draw over steps.
NOT_METRICS = {"event", "step", "time", "epoch", "per_rank", "world_size", "samples_per_sec", "tokens_per_sec"}
RATES = ("samples_per_sec", "tokens_per_sec")


class PlotError(ValueError):
    """Bad input to `hvdkit plot`: the message is its one line."""


@dataclass
class Run:
    name: str
    records: list[dict]

    def reports(self, event: str) -> list[dict]:
        return [record for record in self.records if record.get("event") == event]


def load(run_dir: str) -> Run:
    """A run's records from RUN_DIR/metrics.jsonl (or that file given itself)."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{run_dir}: no metrics.jsonl there (a run's --log-dir holds one, runs/<date>-<time> "
                        "by default)")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise PlotError(f"{path} line {number} is not JSON: not a metrics.jsonl hvdkit wrote") from None
    run = Run(str(run_dir).rstrip("/").removesuffix("/metrics.jsonl") or path.parent.name, records)
    if not run.reports("train"):
        raise PlotError(f"{path}: no training report yet (the first comes after log_interval steps)")
    return run


def figures(runs: Sequence[Run]) -> dict:
    """{file name: matplotlib Figure} for these runs."""
    from hvdkit.bench.plots import pyplot

    plt = pyplot()
    metrics = sorted({key for run in runs for event in ("train", "test") for record in run.reports(event)
                      for key, value in record.items() if key not in NOT_METRICS and _number(value)})
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        for index, run in enumerate(runs):  # a colour per run: training solid, test dashed with points
            for event, style in (("train", "-"), ("test", "o--")):
                points = [r for r in run.reports(event) if _number(r.get(metric))]
                if points:
                    ax.plot([r["step"] for r in points], [r[metric] for r in points], style, color=f"C{index}",
                            label=f"{run.name} {event}")
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.legend(fontsize="small")
    fig.tight_layout()
    found = {"metrics.png": fig}

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        rate = next((key for key in RATES if any(key in r for r in run.reports("train"))), RATES[0])
        points = [r for r in run.reports("train") if _number(r.get(rate))]
        if points:
            ax.plot([r["step"] for r in points], [r[rate] for r in points],
                    label=f"{run.name} ({rate.replace('_', ' ')})")
    ax.set_xlabel("step")
    ax.set_ylabel("per second, all ranks")
    ax.set_title("throughput")
    ax.legend(fontsize="small")
    fig.tight_layout()
    found["throughput.png"] = fig

    fig, axes = plt.subplots(1, len(runs), figsize=(7 * len(runs), 4), squeeze=False)
    for ax, run in zip(axes[0], runs, strict=True):
        rows = [(r["step"], row) for r in run.reports("train") for row in r.get("per_rank") or []]
        for rank in sorted({row["rank"] for _, row in rows}):
            mine = [(step, row) for step, row in rows if row["rank"] == rank]
            line, = ax.plot([s for s, _ in mine], [row["compute_ms"] for _, row in mine], label=f"rank {rank} compute")
            ax.plot([s for s, _ in mine], [row["wait_ms"] for _, row in mine], "--", color=line.get_color(),
                    label=f"rank {rank} wait")
        ax.set_title(f"{run.name}: per rank, ms per step")
        ax.set_xlabel("step")
        ax.set_ylabel("ms per step")
        if rows:
            ax.legend(fontsize="small")
    fig.tight_layout()
    found["ranks.png"] = fig
    return found


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from hvdkit.args import OneLineParser

    parser = OneLineParser(prog="hvdkit plot", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="a run's log directory (holding metrics.jsonl)")
    parser.add_argument("--out", help="where the PNGs go (default: RUN_DIR/plots for one run, ./plots for several)")
    args = parser.parse_args(argv)
    try:
        runs = [load(run_dir) for run_dir in args.runs]
    except PlotError as exc:
        print(f"hvdkit plot: {exc}", file=sys.stderr)
        return job.BAD_INPUT
    out = Path(args.out or (Path(args.runs[0]) / "plots" if len(args.runs) == 1 else "plots"))
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"hvdkit plot: --out {out}: {exc.strerror}", file=sys.stderr)
        return job.BAD_INPUT
    from hvdkit.bench.plots import pyplot

    for name, fig in figures(runs).items():
        fig.savefig(out / name, dpi=110)
        pyplot().close(fig)
        print(f"wrote {out / name}")
    return job.OK
