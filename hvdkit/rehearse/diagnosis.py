"""Whether each ending of a chaos run said what ended it (hvdkit.rehearse.chaos): the job's line
for an attempt a fault ended, or hvdkit launch's restart line for one it restarted within the job,
must name the fault's cause (killed, out of memory, stalled, host lost, partition, disk full,
preempted) and the rank or the host it struck. The report counts "diagnosed D of E endings" and
lists each miss with the line that was printed; ``--min-diagnosed`` fails a run below it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

# hvdkit's lines, and the launchers' own where they name the rank and the host: mpirun's "exited on
# signal 9", horovodrun's (patched: hvdkit.build) "rank 1 on node1 exited with code 137". A survivor's
# "rank 1 (host node1, pid 4242) is gone" (its heartbeat stopped) stands for a kill or a lost host:
# from where it stands the two read alike.
KILLED = r"killed by SIGKILL|ended without a word|exited on signal 9 |exited with code 137\b|\bis gone\b"
LOST = r"stopped answering|does not answer|unreachable|\blost\b|refuses ssh|\bis gone\b"
# What a line must say for each fault that may end a job (the faults a job rides out have no ending).
CAUSES = {
    "kill": KILLED,
    "in-write": KILLED,
    "while-resuming": KILLED,
    "oom": r"out-of-memory killer|out of memory",
    "stall": r"made no progress|stopped responding|frozen|stalled",
    "host-lost": LOST,
    "partition": LOST,
    "slow": LOST,
    "disk-full": r"no space|disk is full|ENOSPC",
    "preempt": r"SIGTERM|SIGUSR1|preempt",
}
CAUSE_WORDS = {"kill": "killed", "in-write": "killed", "while-resuming": "killed", "oom": "out of memory",
               "stall": "stalled", "host-lost": "host lost", "partition": "partition", "slow": "host lost",
               "disk-full": "disk full", "preempt": "preempted"}
RESTART = re.compile(r"^hvdkit launch: (.*); restart \d+ of \d+ on ")
TARGET_RANK = re.compile(r"rank (\d+) \(([^)\s]+)\)")  # the last in a target: while-resuming's second kill


def restart_lines(log: Path) -> list[str]:
    """hvdkit launch's restart lines in an attempt's output, in order: what ended each attempt within the job."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    return [found.group(1) for found in map(RESTART.match, text.splitlines()) if found]


def missed(fault: str, target: str, line: str) -> Optional[str]:
    """Why ``line`` does not diagnose ``fault`` struck at ``target``; None where it does."""
    if not line:
        return "no line"
    if not re.search(CAUSES.get(fault, r"(?!)"), line, re.IGNORECASE):
        return f"it does not say {CAUSE_WORDS.get(fault, fault)}"
    rank = ([None] + list(TARGET_RANK.finditer(target)))[-1]
    if rank and not (re.search(rf"\brank {rank.group(1)}\b", line) or re.search(rf"\b{re.escape(rank.group(2))}\b",
                                                                                 line)):
        return f"it does not name {target}"
    if not rank and target.startswith("node") and not re.search(rf"\b{re.escape(target)}\b", line):
        return f"it does not name {target}"
    return None


def score(strikes: list[dict], out: Path) -> dict:
    """{'diagnosed': D, 'endings': E, 'misses': [...]}: the endings are the strikes whose attempt
    ended (their line) and those restarted within the job (the restart lines of their attempt's
    output, in the order they struck)."""
    restarts: dict[int, list[str]] = {}
    endings = []
    for strike in sorted(strikes, key=lambda s: s["number"]):
        if strike.get("ended"):
            endings.append((strike, strike["ended"]["line"]))
        elif strike.get("restarted_in_job"):
            lines = restarts.setdefault(strike["attempt"], restart_lines(out / f"attempt-{strike['attempt']}.log"))
            endings.append((strike, lines.pop(0) if lines else ""))
    misses = []
    for strike, line in endings:
        # Another fault that struck the same attempt may be what ended it (a preemption's stop, then a kill
        # as the ranks saved): a line naming any of them is right.
        others = [s for s in strikes if s is not strike and s.get("attempt") == strike.get("attempt")
                  and s.get("phase") and s["fault"] in CAUSES]
        whys = [missed(strike["fault"], strike.get("target") or "", line),
                *(missed(s["fault"], _struck_in_its_attempt(s), line) for s in others)]
        why = None if None in whys else whys[0]
        if why:
            misses.append({"number": strike["number"], "fault": strike["fault"], "target": strike.get("target"),
                           "line": line, "why": why})
    return {"diagnosed": len(endings) - len(misses), "endings": len(endings), "misses": misses}


def _struck_in_its_attempt(strike: dict) -> str:
    """What a strike hit in the attempt it is recorded in: a while-resuming's first rank there
    ('rank 1 (node1), then rank 2 (node2)': rank 1), its second in the restart after."""
    target = strike.get("target") or ""
    return target.split(", then ")[0] if strike["fault"] == "while-resuming" else target


def below(diagnosis: dict, least: Optional[float]) -> Optional[str]:
    """The problem of a run diagnosed below ``least`` (a fraction of its endings), or None."""
    if least is None or not diagnosis.get("endings"):
        return None
    if diagnosis["diagnosed"] / diagnosis["endings"] >= least:
        return None
    return (f"diagnosed {diagnosis['diagnosed']} of {diagnosis['endings']} endings "
            f"({share(diagnosis['diagnosed'], diagnosis['endings'])}), below --min-diagnosed {least:g}")


def share(diagnosed: int, endings: int) -> str:
    """The fraction cut, not rounded, to two places: 36 of 38 reads 0.94, below a --min-diagnosed 0.95."""
    return f"{diagnosed * 100 // endings / 100:.2f}"


def total(reports: list[Path]) -> list[str]:
    """Lines summing several runs' diagnoses (a soak's, tests/programs/chaos_soak.sh): each miss
    with its run, then 'diagnosed D of E endings (F)'."""
    diagnosed = endings = 0
    lines = []
    for report in reports:
        said = json.loads(Path(report).read_text()).get("diagnosis") or {}
        diagnosed, endings = diagnosed + said.get("diagnosed", 0), endings + said.get("endings", 0)
        lines += [f"not diagnosed: {Path(report).parent.name} fault {miss['number']} ({miss['fault']} "
                  f"{miss['target']}): {miss['why']}: {miss['line']}" for miss in said.get("misses", [])]
    fraction = f" ({share(diagnosed, endings)})" if endings else ""
    return [*lines, f"diagnosed {diagnosed} of {endings} endings{fraction}"]
