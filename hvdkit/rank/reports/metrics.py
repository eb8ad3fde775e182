"""Where rank 0's metrics go: a progress bar or plain lines, metrics.jsonl, and the trackers
chosen with --logger (TensorBoard by default; hvdkit.rank.reports.loggers).

Other ranks get a sink that drops everything, so the loop calls it unconditionally and
only rank 0 prints or writes.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from hvdkit.rank.reports.loggers import Trackers, scalars


class Metrics:
    """``trackers``: rank 0's loggers, already started (hvdkit.rank.reports.loggers); other ranks' are empty.
    ``total_steps``: the run's length as known at each report (the loop's epochs() sets it after
    the sink is made, at setup)."""

    def __init__(self, log_dir: Optional[str], total_steps: Callable[[], int], enabled: bool,
                 trackers: Trackers) -> None:
        self.enabled = enabled
        self.total_steps = total_steps
        self.started: Optional[tuple] = None  # (time, step) of the first report: the rate and ETA count from it
        self.bar = None
        self.jsonl = None
        self.trackers = trackers
        if not enabled:
            return
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps() or None, unit="step", dynamic_ncols=True)
        if log_dir:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            self.jsonl = open(Path(log_dir) / "metrics.jsonl", "a")

    def record(self, event: str, step: int, values: dict, position: Optional[int] = None) -> None:
        """One report: to the bar (or a plain line), one JSONL line, each tracker's ``event/key`` scalars."""
        if not self.enabled:
            return
        values = finite_or_none(values)
        if self.bar is not None:
            self.bar.total = self.total_steps() or None  # set by epochs() after the bar was made
            if position is not None:
                self.bar.update(position - self.bar.n)
            self.bar.set_postfix({k: _short(v) for k, v in values.items() if k in _SHOWN})
        else:  # under a launcher stderr is a pipe: a line per report, with what the bar would show
            shown = " ".join(f"{k} {_short(v)}" for k, v in values.items() if k in _SHOWN)
            now = time.monotonic()
            self.started = self.started or (now, step)
            where = progress_text(step, self.total_steps(), now - self.started[0], step - self.started[1])
            print(f"[{event}] {where} {shown}", file=sys.stderr, flush=True)
        self.write({"event": event, "step": step, **values})
        self.trackers.log(step, scalars(event, {key: value for key, value in values.items() if key != "epoch"}))

    def finish(self, record: dict) -> None:
        """The run's summary: its JSONL line, and each tracker's summary."""
        self.write(record)
        if self.enabled:
            self.trackers.finish(record["steps"], finite_or_none(record))

    def write(self, record: dict) -> None:
        """One JSONL line, stamped with the wall time (elastic changes are timed from it)."""
        if self.jsonl is not None:
            record = {**record, "time": round(time.time(), 3)}
            self.jsonl.write(json.dumps(finite_or_none(record), allow_nan=False) + "\n")
            self.jsonl.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.jsonl is not None:
            self.jsonl.close()
        self.trackers.close()


_SHOWN = ("epoch", "loss", "accuracy", "bits_per_byte", "lr", "samples_per_sec", "tokens_per_sec")


def finite_or_none(record):
    """``record`` with NaN and infinities as None: strict JSON has no NaN."""
    if isinstance(record, float) and not math.isfinite(record):
        return None
    if isinstance(record, dict):
        return {key: finite_or_none(value) for key, value in record.items()}
    if isinstance(record, (list, tuple)):
        return [finite_or_none(value) for value in record]
    return record


def progress_text(step: int, total: int, elapsed: float, steps_done: int) -> str:
    """'step 50/360 (14%), 3.21 steps/s, ETA 1:36': the bar's facts as text; no total, no ETA."""
    if not total:
        return f"step {step}"
    text = f"step {step}/{total} ({100 * step // total}%)"
    if steps_done > 0 and elapsed > 0:
        rate = steps_done / elapsed
        remaining = round(max(0, total - step) / rate)
        text += f", {rate:.3g} steps/s, ETA {remaining // 3600}:{remaining // 60 % 60:02d}:{remaining % 60:02d}"
    return text + ","


def _short(value):
    if isinstance(value, float):
        return f"{value:.4g}"
    return value


def world_size_changes(records: list) -> list:
    """Each change of an elastic job's world size, from its metrics.jsonl records: the sizes,
    the step training went on from, and the seconds lost. Lost is the wall time between the
    last train report before the change and the first after it, less the time the steps
    between them take (at the new size's pace, else the old one's): it counts detecting the
    change, the new rendezvous, a joining worker's start and the steps redone since the last
    commit. Resets with no train report between them are one change. A change before the first
    train report is timed from the last timed record before it, at the config's world size."""
    changes, reports, reset, size, first = [], [], None, None, None
    for record in records:
        event = record.get("event")
        if event == "config":
            size = record.get("world_size")
        elif event == "reset" and (reports or first):
            if not reports:
                reports.append(first)
            reset = reset or record
        elif event == "train" and "time" in record:
            reports.append(record)
            if reset is not None:
                changes.append({"from": reports[-2].get("world_size"), "to": record.get("world_size"),
                                "step": reset["step"], "_at": len(reports) - 1})
                reset = None
        elif not reports and size is not None and "time" in record and "step" in record:
            first = {"step": record["step"], "time": record["time"], "world_size": size}
    for change in changes:
        at = change.pop("_at")
        before, after = reports[at - 1], reports[at]
        pace = (_seconds_per_step(after, reports[at + 1] if at + 1 < len(reports) else None)
                or _seconds_per_step(reports[at - 2] if at >= 2 else None, before))
        lost = after["time"] - before["time"] - pace * max(0, after["step"] - before["step"])
        change["lost_seconds"] = round(max(0.0, lost), 2)
    return changes


def _seconds_per_step(first: Optional[dict], second: Optional[dict]) -> float:
    """Seconds per step between two train reports at one world size; 0.0 when unknown."""
    if first is None or second is None or second["step"] <= first["step"] or \
            first.get("world_size") != second.get("world_size"):
        return 0.0
    return (second["time"] - first["time"]) / (second["step"] - first["step"])
