"""What a rank and the process that launched it agree on: the exit codes, the job directory
and the exit records ranks leave in it, and the grace period of a stop.

The rank side (hvdkit.rank, the Session) and the launcher side (hvdkit.launch) both import
this module and never each other: a rank ends the job with a documented code and says why in
its record; `hvdkit launch` exits with that code where the launcher (mpirun, horovodrun: 1)
would have hidden it.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from hvdkit.system.wholefiles import write_whole


@dataclass(frozen=True)
class ExitCode:
    name: str
    code: int
    meaning: str
    who: str


# The table docs/stops-and-recovery.md shows (a test compares them). hvdkit's own codes lie in
# sysexits' range (64-78: 75 is its EX_TEMPFAIL, a retry may succeed), so that job scripts can
# tell them from a Python error (1), bad input (2) and a signal (128 + n).
EXIT_CODES = (
    ExitCode("OK", 0, "finished; or stopped, saved and requeued", "every rank, hvdkit launch"),
    ExitCode("FAILED", 1, "an error in the script (its traceback), or the launcher's own failure",
             "Python, mpirun, horovodrun"),
    ExitCode("BAD_INPUT", 2, "bad input, named in one line: an option, the config, a loop shape that cannot work",
             "every rank, every hvdkit command"),
    ExitCode("STALLED", 75, "no progress within --stall-timeout; the stalled rank named", "the watchdog"),
    ExitCode("LOST", 76, "a host or the launcher stopped answering", "hvdkit launch, a rank's lifeline"),
    ExitCode("DIVERGED", 77, "the ranks' copies of the model differ", "the consistency check"),
    ExitCode("OVER_CAP", 78, "a rank's memory passed --memory-cap: that model does not fit",
             "hvdkit bench zero's ranks"),
    ExitCode("STOPPED", 128, "128 + the signal: stopped (143 SIGTERM, 130 SIGINT, 129 SIGHUP, 138 SIGUSR1), "
             "the step's checkpoint saved", "every rank, hvdkit launch, hvdkit rehearse"),
)
_CODES = {entry.name: entry.code for entry in EXIT_CODES}
OK, FAILED, BAD_INPUT = _CODES["OK"], _CODES["FAILED"], _CODES["BAD_INPUT"]
STALLED, LOST, DIVERGED, OVER_CAP = _CODES["STALLED"], _CODES["LOST"], _CODES["DIVERGED"], _CODES["OVER_CAP"]


def code_for(exc: BaseException, bad_input: tuple) -> int:
    """The exit code for one of hvdkit's errors: its own ``exit_code`` (a divergence's 77, a
    lockstep mistake's 2), else BAD_INPUT for the ``bad_input`` types, else FAILED."""
    return getattr(exc, "exit_code", BAD_INPUT if isinstance(exc, bad_input) else FAILED)


def stopped_by(signum: int) -> int:
    """128 + the signal's number, as a shell reports a process a signal ended."""
    return _CODES["STOPPED"] + signum


def shell_code(returncode: int) -> int:
    """A child's exit code as a shell reports it: Popen's -N (ended by signal N) is 128 + N."""
    return stopped_by(-returncode) if returncode < 0 else returncode


# The programs that start ranks, by process name: a rank looks for them among its ancestors
# (hvdkit.rank.liveness.orphan), hvdkit launch among its children (hvdkit.launch.supervise).
JOB_DIR = "HVDKIT_JOB_DIR"  # set by `hvdkit launch` for its ranks: where they leave exit records
RESTART = "HVDKIT_RESTART"  # set by `hvdkit launch` for its ranks: the attempt's number, 0 first (--max-restarts)
SNAPSHOTS = "HVDKIT_SNAPSHOT_DIR"  # set by `hvdkit launch --max-restarts`: where each host keeps its snapshots
LINK = "HVDKIT_LAUNCHER_LINK"  # set by `hvdkit launch --max-restarts`: address:port of its line to the ranks
# "1" in the ranks of the next attempt, which `hvdkit launch --max-restarts` starts ahead of need:
# they import what they need, then wait on their line until told to GO (empty for the others).
STANDBY = "HVDKIT_STANDBY"
# On that line (hvdkit.launch.links, hvdkit.rank.liveness.link) a rank says HELLO and LEAVING, a standby's
# READY; the launcher WELCOME (to HELLO), END, STOP or GO.
HELLO, WELCOME, LEAVING, END, STOP, READY, GO = "hello", "welcome", "leaving", "end", "stop", "ready", "go"
# Set by the guard `hvdkit launch` starts each rank under (hvdkit.launch.guard): the descriptor of a
# page of memory on which the rank's watchdog keeps what the guard's line needs: its last step
# (8 bytes, little-endian, -1 before the first) and a JSON record after it, ended by a zero byte.
GUARD = "HVDKIT_GUARD_FD"
GUARD_PAGE = 4096
STOP_GRACE = "HVDKIT_STOP_GRACE"
GRACE_SECONDS = 10.0  # as Slurm's KillWait and Kubernetes' grace period, shorter: a stopped job holds its nodes
KILL_AFTER_GRACE = 3.0  # the ranks' own count ends them first, each saying where it was
PROBE_SECONDS = 2.0  # how often a host (hvdkit launch) or a launcher (a rank's lifeline) is probed
LOST_SECONDS = 15.0  # no answer for this long: it is gone (a link flap shorter than this is not)


def restarting(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether `hvdkit launch --max-restarts` starts this job again after a failure (it gives the
    ranks a place for snapshots then, and an empty one otherwise)."""
    return bool(environ.get(SNAPSHOTS))


def stop_grace(environ: Mapping[str, str] = os.environ) -> float:
    """Seconds between a stop signal and the end of whatever has not ended: HVDKIT_STOP_GRACE,
    else GRACE_SECONDS. A checkpoint must be written within it. ValueError naming the variable
    if it is not a number of seconds (hvdkit launch and the Session check it at start)."""
    text = environ.get(STOP_GRACE, "")
    try:
        seconds = float(text) if text else GRACE_SECONDS
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise ValueError(f"{STOP_GRACE}={text!r}: expected the seconds a stopped rank has to save and end, "
                         f"a number >= 0 (default {GRACE_SECONDS:g})")
    return seconds


def end_rank(code: int, line: str) -> None:
    """A rank's last line, recorded, and its exit, from the thread that ends it (the watchdog, a
    stop's countdown, the lifeline). The line may have nowhere to go, its reader's launcher gone
    (BrokenPipeError): that must not keep the rank alive, as it would were the thread ended
    by the error instead."""
    with contextlib.suppress(OSError, ValueError):
        print(f"hvdkit: {line}", file=sys.stderr, flush=True)
    record_exit(code, line)
    os._exit(code)


def record_exit(code: int, message: str) -> None:
    """Called by a rank that ends the job with a documented code, so that `hvdkit launch` exits
    with it where the launcher reports another (the first rank to end: one it ended, say)."""
    directory = os.environ.get(JOB_DIR)
    if not directory:
        return
    try:
        write_whole(Path(directory, f"exit-{os.getpid()}"), f"{code} {message}\n")
    except OSError:
        pass


def record_cause(line: str) -> None:
    """Called by a rank's guard (hvdkit.launch.guard) where a signal or the out-of-memory killer
    ended the rank: what `hvdkit launch` says last for an ending no rank recorded a code for."""
    directory = os.environ.get(JOB_DIR)
    if directory:
        with contextlib.suppress(OSError):
            write_whole(Path(directory, f"cause-{os.getpid()}"), f"{line}\n")


def rank_cause(directory: Path) -> Optional[str]:
    """The first cause a guard recorded (record_cause), if any."""
    records = sorted(directory.glob("cause-*"), key=lambda p: p.stat().st_mtime) if directory.is_dir() else []
    for path in records:
        with contextlib.suppress(OSError):
            return path.read_text().strip()
    return None


def rank_exit(directory: Path) -> Optional[tuple[int, str]]:
    """The first documented exit code a rank recorded and its message, after repeating the message."""
    records = sorted(directory.glob("exit-*"), key=lambda p: p.stat().st_mtime) if directory.is_dir() else []
    for path in records:
        code, _, message = path.read_text().strip().partition(" ")
        print(f"hvdkit launch: {message}", file=sys.stderr, flush=True)
        return int(code), message
    return None
