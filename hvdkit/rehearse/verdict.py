"""What a chaos run is held to and what it reports (hvdkit.rehearse.chaos): checkpoints read as
one process holds them and compared, bitwise or by distance; the line each attempt ended with;
the report, its table and its file."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch

from hvdkit import checkpoint, nested
from hvdkit.rehearse import goodput, processes
from hvdkit.system import wholefiles
from hvdkit.zero import shards

DEFERS = re.compile(r"another rank ended first|the lines above say|that rank's own line")
TAG = re.compile(r"^\[\d+,\d+\]<std(?:out|err)>:|^\[\d+\]<std(?:out|err)>:")  # mpirun's and horovodrun's
TRAILING_TAG = re.compile(r"\[\d+(?:,\d+)?\]<std(?:out|err)>:$")  # a rank's next line, begun on this one
WORLD_SIZE_CHANGE = re.compile(r"hvdkit: elastic: world size (\d+) -> (\d+), going on from step (\d+); "
                               r"about ([\d.]+) s lost")
ENDING = re.compile(r"error|killed|signal|exited|failed|abort|cannot|stopped|does not answer|refuses|no restart|"
                    r"no space|shut down|is gone|out-of-memory", re.IGNORECASE)


def plain(path: Path) -> dict:
    """Checkpoint ``path`` verified and read as one process would hold it (hvdkit.zero.shards)."""
    return shards.plain_state(path, checkpoint.load_whole(path))


def difference(a, b) -> Optional[str]:
    """Where two states differ, in a few words, or None when they are bitwise equal."""
    ours, theirs = list(nested.leaves(a)), list(nested.leaves(b))
    if [place for place, _ in ours] != [place for place, _ in theirs]:
        only = sorted(map(nested.place_text, {p for p, _ in ours} ^ {p for p, _ in theirs}))
        return f"the state: {only[:4]} are in one only" if only else "the state: its entries are in another order"
    for (place, x), (_, y) in zip(ours, theirs, strict=True):
        where = nested.place_text(place)
        if torch.is_tensor(x) or torch.is_tensor(y):
            if not (torch.is_tensor(x) and torch.is_tensor(y)) or x.shape != y.shape or x.dtype != y.dtype:
                return f"{where}: {_kind(x)} against {_kind(y)}"
            if torch.equal(x, y):
                continue
            if not x.is_floating_point():
                return f"{where} differs"
            return f"{where} differs (largest difference {(x.double() - y.double()).abs().max().item():.3g})"
        if x != y:
            return f"{where}: {x!r} against {y!r}"
    return None


def distance(a, b) -> float:
    """How far state ``a`` is from ``b``: the L2 norm of their floating tensors' differences over
    that of ``b``'s, all taken together (inf where their structures differ)."""
    ours, theirs = dict(nested.leaves(a)), dict(nested.leaves(b))
    if set(ours) != set(theirs):
        return float("inf")
    gap = size = 0.0
    for place, x in ours.items():
        y = theirs[place]
        if torch.is_tensor(x) or torch.is_tensor(y):
            if not (torch.is_tensor(x) and torch.is_tensor(y)) or x.shape != y.shape:
                return float("inf")
            if x.is_floating_point():
                gap += float((x.double() - y.double()).pow(2).sum())
                size += float(y.double().pow(2).sum())
    return (gap / size) ** 0.5 if size else (0.0 if gap == 0 else float("inf"))


def _kind(value) -> str:
    return f"{tuple(value.shape)} {value.dtype}" if torch.is_tensor(value) else type(value).__name__


@dataclass
class Attempt:
    number: int
    code: Optional[int] = None
    line: str = ""
    seconds: float = 0.0
    log: str = ""


@dataclass
class Report:
    seed: int
    faults: list
    command: list
    hosts: int
    checkpoint_dir: str
    reference: dict = field(default_factory=dict)
    strikes: list = field(default_factory=list)
    attempts: list = field(default_factory=list)
    final: dict = field(default_factory=dict)
    left: dict = field(default_factory=dict)
    checkpoints_read: list = field(default_factory=list)
    problems: list = field(default_factory=list)
    not_struck: list = field(default_factory=list)
    world_size_changes: list = field(default_factory=list)  # an elastic job's, as it said them
    seconds: float = 0.0
    goodput: dict = field(default_factory=dict)  # what the faults cost (hvdkit.rehearse.goodput)
    diagnosis: dict = field(default_factory=dict)  # whether each ending said its cause (hvdkit.rehearse.diagnosis)

    def table(self) -> str:
        rows = [("#", "fault", "target", "step", "phase", "ended", "back in", "resumed at", "redone")]
        for s in self.strikes:
            ended = (f"exit {s['ended']['code']}: {s['ended']['line'][:60]}" if s.get("ended") else
                     "restarted in the job" if s.get("restarted_in_job") else "rode it out")
            exact = s.get("seconds_to_next_step") is not None  # from the job's metrics (goodput)
            back = (f"{s['seconds_to_next_step']:.1f} s" if exact else f"{s['back_training_seconds']:.1f} s"
                    if s.get("back_training_seconds") is not None else "-")
            resumed = str(s["resumed_step"]) if s.get("resumed_step") is not None else "-"
            redone = (f"{'' if exact else '>= '}{s['steps_redone']}" if s.get("steps_redone") is not None else "-")
            rows.append((str(s["number"]), f"{s['fault']} {s['signal']}".strip(), s["target"] or "-", str(s["step"]),
                         s["phase"] or "not struck", ended, back, resumed, redone))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        lines += [f"world size {c['from']} -> {c['to']} at step {c['step']}, about {c['seconds_lost']} s lost"
                  for c in self.world_size_changes]
        said = self.diagnosis
        if said.get("endings"):
            lines.append(f"diagnosed {said['diagnosed']} of {said['endings']} endings")
            lines += [f"  not diagnosed: fault {m['number']} ({m['fault']} {m['target'] or ''}): {m['why']}: "
                      f"{m['line'] or '(none)'}" for m in said["misses"]]
        cost = self.goodput
        if cost.get("faults_measured"):
            lines.append(f"goodput: {cost['faults_measured']} faults were followed by a restart: on average "
                         f"{cost['mean_seconds_to_next_step']} s from the fault to the next trained step, "
                         f"{cost['mean_steps_redone']} steps redone; effective training time ratio "
                         f"{cost['effective_training_time_ratio']} ({cost['undisturbed_seconds']} s undisturbed, "
                         f"{cost['disturbed_seconds']} s with the faults)")
        return "\n".join(lines)


def judge(report: Report, ckpt: Path, final: Path, elastic: bool, tolerance: float) -> None:
    """The final checkpoint in ``ckpt`` against the undisturbed run's (``final``), bitwise or (an
    elastic job's) within ``tolerance``; every checkpoint still reads; no temporaries."""
    existing = checkpoint.existing(str(ckpt))
    ours = None  # the newest one's state, read once
    for path in existing:
        try:
            ours = plain(path)
            report.checkpoints_read.append(path.name)
        except checkpoint.CheckpointError as exc:
            ours = None
            report.problems.append(f"checkpoint {path.name} does not read: {exc}")
    left = [str(p) for p in processes.partials(ckpt)]
    if left:
        report.left["temporary_files"] = left
        report.problems.append(f"temporary files left in {ckpt}: {', '.join(left[:3])}")
    if not existing:
        report.problems.append(f"no checkpoint in {ckpt} at the end")
        return
    if ours is None:  # the newest does not read: said above
        return
    reference = plain(final)
    differs = difference(ours, reference)
    report.final = {"checkpoint": str(existing[-1]), "reference": str(final), "equal": differs is None,
                    "difference": differs}
    if elastic:
        _judge_elastic(report, ours, reference, tolerance)
    elif differs:
        struck = [s for s in report.strikes if s.get("phase")] or [{}]
        last = struck[-1]
        after = f" after fault {last['number']} ({last['fault']})" if last else ""
        report.problems.append(f"the final checkpoint differs from the undisturbed run's{after}: {differs}")


def _judge_elastic(report: Report, ours: dict, reference: dict, tolerance: float) -> None:
    """The model within the tolerance (at whatever step the job's own end came: --epochs
    takes more steps at a smaller world size)."""
    gap = distance(ours["model"], reference["model"])
    report.final.update(distance=gap, tolerance=tolerance, step=ours["step"], reference_step=reference["step"])
    if gap > tolerance:
        report.problems.append(
            f"the final model is {gap:.3g} from the undisturbed run's (relative L2 distance of the weights), over "
            f"the tolerance {tolerance} (--tolerance): {report.final['difference']}")


def last_line(log: Path) -> str:
    """The line a job ended with: its last line from hvdkit that says why (not a rank's pointer
    to another's line), else its last that names an error, a signal or a failure (a launcher's),
    else its last line; without a rank's output tag."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ""
    lines = [TAG.sub("", TRAILING_TAG.sub("", line)).strip() for line in text.splitlines()]
    lines = [line for line in lines if line.strip("-= ")]
    own = [lambda line: line.startswith("hvdkit") and ENDING.search(line) and not DEFERS.search(line),
           lambda line: line.startswith("hvdkit") and ENDING.search(line), ENDING.search]
    for wanted in own:
        for line in reversed(lines):
            if wanted(line):
                return line[:300]
    return lines[-1][:300] if lines else ""


def world_size_changes(log: Path) -> list[dict]:
    """An elastic job's changes of world size, from its own lines."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    return [{"from": int(m[1]), "to": int(m[2]), "step": int(m[3]), "seconds_lost": float(m[4])}
            for m in WORLD_SIZE_CHANGE.finditer(text)]


def measure_goodput(report: Report, log_dir: Optional[str], ends: set, began: float, disturbed: float) -> None:
    """Each fault's cost from the job's metrics in ``log_dir`` since ``began`` (wall time: the
    undisturbed run wrote there before; faults named in ``ends`` end a job or one of its
    attempts: a start follows them), and the run's, into the report."""
    struck = [(s["number"], s["struck_wall"]) for s in report.strikes if s["fault"] in ends and s.get("struck_wall")]
    costs = goodput.per_fault(goodput.records(log_dir, began), struck)
    for strike in report.strikes:
        cost = costs.get(strike["number"])
        if cost and not strike.get("ended"):  # a start followed within the attempt: hvdkit launch's restart
            strike["restarted_in_job"] = True
        if cost and "steps_redone" in cost:
            strike.update(at_step=cost["step_at_fault"], resumed_step=cost["went_on_from"],
                          steps_redone=cost["steps_redone"], seconds_to_next_step=cost["seconds_to_next_step"])
    report.goodput = goodput.summary(list(costs.values()), report.reference.get("seconds"), disturbed)


def write_report(report: Report, path: Path) -> None:
    wholefiles.write_whole(path, json.dumps(asdict(report), indent=1, default=str) + "\n")
