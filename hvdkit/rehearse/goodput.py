"""What a chaos run's faults cost, read from the job's own metrics.jsonl: its train reports, each
stamped with the wall time, and the config record each start of the job writes. Per fault that
ended the job or one of its attempts (a start follows it): the step training had reached when it
struck, the step the job went on from, the steps redone between them, and the seconds from the
fault until the next trained step. Exact to the step with ``--log-interval 1``; with a larger
interval, steps are known only at its multiples."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Optional, Sequence


def records(log_dir: Optional[str], since: float = 0.0) -> list[dict]:
    """The job's metrics.jsonl records stamped ``since`` (wall time) or later, in order (an
    undisturbed run before wrote there too); none where it wrote none."""
    if not log_dir:
        return []
    path = Path(log_dir) / "metrics.jsonl"
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # a line cut by a kill
            continue
        if isinstance(record, dict) and record.get("time", 0.0) >= since:
            found.append(record)
    return found


def per_fault(found: Sequence[dict], struck: Sequence[tuple[int, float]]) -> dict[int, dict]:
    """For each (strike number, wall time it struck) after which the job started again: seconds
    until the next trained step (with a larger log interval: the next report); with a log
    interval of 1, also the step reached, the step gone on from and the steps redone."""
    trains = [(r["time"], r["step"]) for r in found if r.get("event") == "train" and "time" in r and "step" in r]
    starts = [(r["time"], r.get("log_interval", 1)) for r in found if r.get("event") == "config" and "time" in r]
    costs = {}
    for number, when in struck:
        start = next(((t, interval) for t, interval in starts if t > when), None)
        first = next(((t, step) for t, step in trains if start is not None and t > start[0]), None)
        if first is None:
            continue
        cost = {"seconds_to_next_step": round(first[0] - when, 2)}
        if start[1] == 1:  # the first report after a start is then of the step after its resume
            reached = max((step for t, step in trains if t <= when), default=0)
            cost.update(step_at_fault=reached, went_on_from=first[1] - 1, steps_redone=max(0, reached - first[1] + 1))
        costs[number] = cost
    return costs


def summary(costs: Sequence[dict], undisturbed: Optional[float], disturbed: float) -> dict:
    """Means over the faults that ended an attempt, and the effective training time ratio
    (undisturbed seconds over the disturbed run's seconds)."""
    return {"faults_measured": len(costs),
            "mean_seconds_to_next_step": round(statistics.mean(c["seconds_to_next_step"] for c in costs), 2)
            if costs else None,
            "mean_steps_redone": round(statistics.mean(c["steps_redone"] for c in costs), 2)
            if costs and all("steps_redone" in c for c in costs) else None,
            "effective_training_time_ratio": round(undisturbed / disturbed, 3) if undisturbed and disturbed else None,
            "undisturbed_seconds": undisturbed, "disturbed_seconds": round(disturbed, 1)}


def pace(found: Sequence[dict], began: float) -> dict:
    """An undisturbed run's start-up and steady step, from its train reports (``--log-interval 1``)
    stamped with the wall time, ``began`` being when it was launched: seconds from the launch to
    the first trained step, and the median seconds from one trained step to the next (a step's
    own report included, a checkpoint's step among them)."""
    times = [r["time"] for r in found if r.get("event") == "train" and "time" in r]
    if not times:
        return {}
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return {"startup_seconds": round(times[0] - began, 2), "trained_steps": len(times),
            "steady_step_ms": round(statistics.median(gaps) * 1e3, 2) if gaps else None,
            "training_seconds": round(times[-1] - times[0], 2)}

