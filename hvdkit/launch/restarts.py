"""In-job restarts (``hvdkit launch --max-restarts N``), as torchrun's ``--max-restarts``: a job that
failed (a rank died or was killed, the job stalled past ``--stall-timeout``, a host stopped
answering, a rank failed) is ended whole and started again at the same world size, up to N
times; its ranks resume from the newest checkpoint, as a rerun by hand would. Each restart is one
line: what ended the attempt, ``restart k of N``, on which hosts. A host that stopped answering is
left out of the restarts after it: the hosts listed beyond -np's need (spares) take its ranks;
where none is left, the job ends with its line.

A stop is not a failure: a signal to hvdkit launch, or a stop a rank recorded (a preemption,
SIGTERM from the scheduler) checkpoints and exits as without restarts. Neither is bad input, nor a
model over its memory cap: a restart would end alike. The ranks see the attempt's number in
``HVDKIT_RESTART`` (0 first), as torchrun's ``TORCHELASTIC_RESTART_COUNT``, and in
``HVDKIT_SNAPSHOT_DIR`` where to keep snapshots (``snapshot_steps``: the state in host memory,
newer than the newest checkpoint), which a restart resumes from and which go when the job ends.
"""

from __future__ import annotations

import enum
import os
import shutil
import signal
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Callable, Mapping, Optional

from hvdkit import job
from hvdkit.launch.hostfile import LaunchError
from hvdkit.launch.supervise import FORWARDED, Ended
from hvdkit.system.sighandlers import Handlers

SHM = "/dev/shm"
SNAPSHOT_PREFIX = "hvdkit-snapshots-"
# Set by hvdkit rehearse: its jobs' snapshot folders carry it, so that it tells them from those of
# another rehearsal's job on the same machine (it removes what a job leaves).
SNAPSHOT_TAG = "HVDKIT_SNAPSHOT_TAG"


class Why(enum.Enum):
    """How an attempt ended, as the restarts read it (as torch elastic's WorkerState)."""
    STOPPED = "stopped"  # a signal to hvdkit launch, or a stop a rank recorded: checkpointed, not restarted
    FINISHED = "finished"
    REFUSED = "refused"  # bad input, or a model over its memory cap: a restart would end alike
    HOST_LOST = "host lost"  # a host stopped answering: left out of the restarts after it
    RANK_ENDED = "rank ended"  # a rank's guard said how (a signal, the out-of-memory killer), or its recorded line
    SIGNALLED = "signalled"  # the launcher's exit code for a signal, no rank's word
    FAILED = "failed"  # any other exit code (job.EXIT_CODES)


RESTARTED = frozenset({Why.HOST_LOST, Why.RANK_ENDED, Why.SIGNALLED, Why.FAILED})


def why(ended: Ended) -> Why:
    """How ``ended`` ended, from its code, its stop and what its ranks and hosts said."""
    if ended.stopped or (ended.recorded or 0) > job.stopped_by(0):
        return Why.STOPPED
    if ended.code in (job.OK, job.BAD_INPUT, job.OVER_CAP):
        return Why.FINISHED if ended.code == job.OK else Why.REFUSED
    if ended.lost:
        return Why.HOST_LOST
    if ended.cause:
        return Why.RANK_ENDED
    if ended.code - job.stopped_by(0) in {number.value for number in signal.Signals}:  # mpirun has codes above too
        return Why.SIGNALLED
    return Why.FAILED


def cause(ended: Ended) -> Optional[str]:
    """What ended a failed attempt, in words; None where the job is not to be started again."""
    kind = why(ended)
    if kind not in RESTARTED:
        return None
    if kind is Why.HOST_LOST:
        return ended.lost
    if kind is Why.RANK_ENDED:
        return ended.cause
    if kind is Why.SIGNALLED:
        return f"a rank or its launcher was ended by {signal.Signals(ended.code - job.stopped_by(0)).name} " \
               f"(exit {ended.code})"
    meaning = {entry.code: entry.meaning for entry in job.EXIT_CODES}.get(ended.code, "a failure")
    return f"exit {ended.code}: {meaning.split(':')[0].split(';')[0]}"


def snapshot_place(environ: Mapping[str, str] = os.environ) -> str:
    """Where each host keeps this job's snapshots (session.snapshot_steps): host memory, a name of
    the job's own, so that no other job's are taken."""
    tag = "".join(c for c in environ.get(SNAPSHOT_TAG, "") if c.isalnum())
    return str(Path(SHM if os.path.isdir(SHM) else tempfile.gettempdir()) /
               f"{SNAPSHOT_PREFIX}{tag + '-' if tag else ''}{uuid.uuid4().hex}")


def run(start: Callable[[Mapping[str, str], frozenset], Ended], max_restarts: int,
        hosts: Callable[[frozenset], str], remove_elsewhere: Callable[[str, frozenset], None] = lambda *_: None) -> int:
    """Start the job with ``start(extra environment, lost hosts)`` and again after each failure, up
    to ``max_restarts`` times; the last attempt's exit code. ``hosts(lost)``: where it runs without
    the hosts lost so far (spares in their place), for the lines; LaunchError where it cannot.
    The job's snapshots go when it ends: this host's here; the other hosts' (their ranks remove
    them at a run's end, but a killed rank does not) by ``remove_elsewhere`` after a failure."""
    stops: list[int] = []  # a stop signal between two attempts (during one, the attempt takes it)
    lost: set[str] = set()
    place = snapshot_place() if max_restarts else ""
    with Handlers(FORWARDED, lambda signum, frame: stops.append(signum)):
        try:
            code = _attempts(start, max_restarts, hosts, place, stops, lost)
        finally:
            if place:
                shutil.rmtree(place, ignore_errors=True)
        if place and code != job.OK:
            remove_elsewhere(place, frozenset(lost))
    return code


def _attempts(start: Callable[[Mapping[str, str], frozenset], Ended], max_restarts: int,
              hosts: Callable[[frozenset], str], place: str, stops: list[int], lost: set[str]) -> int:
    number = 0
    while not stops:
        # SNAPSHOTS is set without restarts too, empty (snapshots refused): mpirun's -x warns of a variable not set.
        ended = start({job.RESTART: str(number), job.SNAPSHOTS: place}, frozenset(lost))
        why = cause(ended)
        if why is None or not max_restarts:
            return ended.code
        if number == max_restarts:
            print(f"hvdkit launch: {why}; no restart left (--max-restarts {max_restarts}); exit {ended.code}",
                  file=sys.stderr, flush=True)
            return ended.code
        lost.update([ended.host] if ended.host else [])
        try:
            where = hosts(frozenset(lost))
        except LaunchError as exc:
            print(f"hvdkit launch: {why}; no restart without {', '.join(sorted(lost))}: {exc}; exit {ended.code}",
                  file=sys.stderr, flush=True)
            return ended.code
        number += 1
        without = f" (without {', '.join(sorted(lost))})" if lost else ""
        print(f"hvdkit launch: {why}; restart {number} of {max_restarts} on {where}{without}, from the newest "
              f"checkpoint", file=sys.stderr, flush=True)
    code = job.stopped_by(stops[0])
    print(f"hvdkit launch: stopped by {signal.Signals(stops[0]).name} before restart {number} of {max_restarts}; "
          f"the newest checkpoint stays; exit {code}", file=sys.stderr, flush=True)
    return code
