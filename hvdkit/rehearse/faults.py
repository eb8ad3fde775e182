"""The faults `hvdkit rehearse --chaos` draws from, and its schedule: what the command line needs
to answer at once (no torch here; hvdkit.rehearse.chaos strikes them)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class Fault:
    name: str
    hosts: int  # the fewest hosts it needs
    ends: bool  # it ends the job (a restart follows); otherwise the job rides it out


# What each does: docs/rehearse.md#chaos---chaos-k, and hvdkit.rehearse.chaos.Chaos._strike.
FAULTS = {f.name: f for f in (
    Fault("kill", 1, True),  # SIGKILL of one rank
    Fault("stall", 1, False),  # SIGSTOP of one rank for a few seconds, then SIGCONT
    Fault("host-lost", 2, True),  # a host other than node0 lost: processes killed, link down; back to restart
    Fault("partition", 2, False),  # a host other than node0 off the network for a few seconds
    Fault("slow", 2, False),  # a host other than node0 on a slow link for a few seconds
    Fault("preempt", 1, True),  # SIGTERM or SIGUSR1 to every rank, as a scheduler's preemption; requeued
    Fault("in-write", 1, True),  # SIGKILL of the rank writing a checkpoint, while its temporary file is there
    Fault("disk-full", 1, True),  # the checkpoint directory's filesystem full before a save; space back to restart
    Fault("while-resuming", 1, True),  # SIGKILL of one rank, then of another as the restarted job resumes
    Fault("oom", 1, True),  # one rank confined to a memory cgroup of OOM_BYTES: the kernel's OOM killer ends it
)}
OOM_BYTES = 8 << 20  # the oom fault's limit (what the rank holds already stays charged elsewhere)
OOM_EXCESS = 64 << 20  # what a process started in that cgroup then holds: past the limit, the rank is ended
# What an elastic job is rehearsed with: the faults it rides out, hosts coming back. Preemption,
# a full disk and the kills around a write or a resume end it as they end a fixed-size job,
# which the fixed-size rehearsal covers.
ELASTIC_FAULTS = ("kill", "stall", "host-lost", "partition", "slow")
# How far an elastic job's final model may be from the undisturbed run's, by default: the relative
# L2 distance of their weights (docs/rehearse.md#elastic-jobs says what it measured). Not the
# optimizer's state: momentum holds the last steps' gradients, of other batches at another size.
ELASTIC_TOLERANCE = 0.25


def menu(names: Optional[str], hosts: int, elastic: bool = False) -> tuple[list[str], Optional[str]]:
    """The faults to draw from (--faults, or all that ``hosts`` allow) and what is wrong, in one line."""
    allowed = ELASTIC_FAULTS if elastic else tuple(FAULTS)
    if names is None:
        return [n for n in allowed if FAULTS[n].hosts <= hosts], None
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    for name in chosen:
        if name not in FAULTS:
            return [], f"--faults: unknown fault {name!r}; the menu: {', '.join(FAULTS)}"
        if name not in allowed:
            return [], (f"--faults {name}: an elastic job is rehearsed with the faults it rides out: "
                        f"{', '.join(ELASTIC_FAULTS)}")
        if FAULTS[name].hosts > hosts:
            return [], (f"--faults {name} needs --hosts {FAULTS[name].hosts} or more: it fails a host other than "
                        f"node0, which runs the command")
    if not chosen:
        return [], "--faults: name at least one fault: " + ", ".join(FAULTS)
    return chosen, None


@dataclass
class Strike:
    """One fault of the schedule, and what became of it."""
    number: int
    fault: str
    step: int  # it strikes once a checkpoint of this step or later is written (in-write: being written; see Chaos._due)
    pick: float  # which rank or host: a fraction of those there are
    seconds: float  # how long a stall, partition or slow link lasts; the start delay of while-resuming's second kill
    signal: str = ""  # preempt's
    target: str = ""
    phase: str = ""
    attempt: int = 0
    struck_after: float = 0.0  # seconds since the chaos began
    ended: Optional[dict] = None  # the attempt it ended: exit code and its line
    resumed_step: Optional[int] = None
    back_training_seconds: Optional[float] = None
    at_step: Optional[int] = None  # the newest checkpoint written, or being written, when it struck
    steps_redone: Optional[int] = None  # from at_step back to the step it resumed at (at least that many)
    delay: float = 0.0  # after its moment, this fraction of the time between two checkpoints passes first
    struck_wall: Optional[float] = None  # when it struck (time.time(): the job's metrics are stamped so)
    seconds_to_next_step: Optional[float] = None  # from the fault to the next trained step (goodput)

    def describe(self) -> str:
        what = f"{self.fault} {self.signal}".strip()
        return f"fault {self.number} ({what}{' ' + self.target if self.target else ''} at checkpoint step {self.step})"


AT_ONCE = ("in-write", "disk-full")  # their moment is a write's: no delay after it
LATEST = 0.8  # the latest moment between two checkpoints, as a fraction of the time between them


def plan(seed: int, count: int, faults: Sequence[str], steps: Sequence[int]) -> list[Strike]:
    """``count`` strikes drawn from ``seed``: the faults in shuffled rounds of the menu, so that
    every fault comes once before any comes twice; their steps from ``steps`` (a checkpoint's,
    not the last: a fault must find the job running), in order; and each a moment between that
    checkpoint and the next (a delay, drawn from a stream of its own so that a seed's faults and
    steps are what they were before moments were drawn)."""
    rng = random.Random(seed)
    names: list[str] = []
    while len(names) < count:
        names += rng.sample(list(faults), len(faults))
    names = names[:count]
    candidates = list(steps[:-1]) or list(steps)
    at = sorted(rng.choice(candidates) for _ in names)
    strikes = [Strike(i + 1, name, step, rng.random(), round(rng.uniform(2.0, 6.0), 1),
                      rng.choice(["SIGTERM", "SIGUSR1"]) if name == "preempt" else "")
               for i, (name, step) in enumerate(zip(names, at, strict=True))]
    moments = random.Random(f"moments {seed}")
    for strike in strikes:
        strike.delay = 0.0 if strike.fault in AT_ONCE else round(moments.uniform(0.0, LATEST), 3)
    return strikes


def command_option(command: Sequence[str], option: str) -> Optional[str]:
    """The value the command gives ``option`` (``--checkpoint-dir DIR`` or ``--checkpoint-dir=DIR``)."""
    for i, word in enumerate(command):
        if word == option and i + 1 < len(command):
            return command[i + 1]
        if word.startswith(f"{option}="):
            return word.split("=", 1)[1]
    return None


def command_checkpoint_dir(command: Sequence[str], environ: dict) -> Optional[str]:
    """Where the command's job writes its checkpoints: its --checkpoint-dir, else HVDKIT_CHECKPOINT_DIR."""
    return command_option(command, "--checkpoint-dir") or environ.get("HVDKIT_CHECKPOINT_DIR")
