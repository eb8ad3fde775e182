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
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Optional, Sequence

if TYPE_CHECKING:  # imported where used: a rank and `hvdkit doctor` may run without psutil
    import subprocess

    import psutil


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
# (hvdkit.rank.orphan), hvdkit launch among its children (hvdkit.launch.supervise).
MPI_LAUNCHERS = ("mpirun", "mpiexec", "orterun", "prterun")  # they pass a signal on to the ranks on every host
MPI_DAEMONS = ("orted", "prted", "hydra_pmi_proxy")  # what they start on each host, the ranks' parents
HOROVODRUN = "horovodrun"
SRUN = "srun"  # Slurm ends its tasks itself when srun goes

JOB_DIR = "HVDKIT_JOB_DIR"  # set by `hvdkit launch` for its ranks: where they leave exit records
STOP_GRACE = "HVDKIT_STOP_GRACE"
GRACE_SECONDS = 10.0  # as Slurm's KillWait and Kubernetes' grace period, shorter: a stopped job holds its nodes
KILL_AFTER_GRACE = 3.0  # the ranks' own count ends them first, each saying where it was
PROBE_SECONDS = 2.0  # how often a host (hvdkit launch) or a launcher (a rank's lifeline) is probed
LOST_SECONDS = 15.0  # no answer for this long: it is gone (a link flap shorter than this is not)


def probe(address: str, port: int, timeout: float = PROBE_SECONDS) -> Optional[bool]:
    """One TCP connection to ``address:port``: True if accepted, False if refused (the host is
    up, nothing listens there), None if nothing answered within ``timeout``. A rank probes its
    launcher's server this way (hvdkit.rank.lifeline), `hvdkit launch` the other hosts."""
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:  # timed out, unreachable
        return None


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


def unless_nohup(signals: Sequence[int]) -> list[int]:
    """``signals`` less SIGHUP where it is ignored: `nohup` ignores it so that a job outlives its
    terminal, and hvdkit keeps it so."""
    return [sig for sig in signals if sig != signal.SIGHUP or signal.getsignal(sig) != signal.SIG_IGN]


class Handlers:
    """The one way hvdkit handles signals: ``handler`` for ``signals`` from ``install()`` (or the
    start of a ``with`` block) until ``restore()`` (or its end), the previous handlers after.
    nohup's SIGHUP stays ignored (unless_nohup). Only the main thread can set handlers: in any
    other, nothing is set (the job still ends with its caller, by PR_SET_PDEATHSIG)."""

    def __init__(self, signals: Sequence[int], handler) -> None:
        self.signals, self.handler = signals, handler
        self.previous: dict = {}  # signal: the handler before, to restore or to pass a signal on to

    def install(self) -> "Handlers":
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self.handler) for sig in unless_nohup(self.signals)}
        return self

    def restore(self) -> None:
        previous, self.previous = self.previous, {}
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    __enter__ = install

    def __exit__(self, *exc) -> None:
        self.restore()


def wait_child(proc: "subprocess.Popen", timeout: Optional[float] = None) -> Optional[int]:
    """``proc``'s exit code (None after ``timeout`` seconds), once a reaper thread has it. A
    signal handler that raises interrupts this sleep, never Popen.wait: raised inside it, it can
    leave its lock held (between its acquire and its try), and the next wait then blocks for
    good (a caller ended by `timeout 20` hung so, its job gone)."""
    if getattr(proc, "_hvdkit_reaper", None) is None:
        proc._hvdkit_reaper = threading.Thread(target=proc.wait, name="hvdkit-reaper", daemon=True)
        proc._hvdkit_reaper.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    while proc.returncode is None:
        if deadline is not None and time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    return proc.returncode


def end_rank(code: int, line: str) -> None:
    """A rank's last line, recorded, and its exit, from the thread that ends it (the watchdog, a
    stop's countdown, the lifeline). The line may have nowhere to go, its reader's launcher gone
    (BrokenPipeError): that must not keep the rank alive. Raised here, it ended the thread
    instead, and a rank on another host outlived its job (found once Gloo's 30 s timeout no
    longer ended such ranks first)."""
    with contextlib.suppress(OSError, ValueError):
        print(f"hvdkit: {line}", file=sys.stderr, flush=True)
    record_exit(code, line)
    os._exit(code)


PARTIAL = ".partial"  # write_whole's temporary: ``.NAME.PID.partial`` beside the file


def write_whole(path: Path, data, durable: bool = False) -> None:
    """Write ``data`` (bytes, text, a tuple of bytes-like parts: no copy joins them, or a function
    that writes into the open file: a checkpoint streamed) to ``path`` through a temporary beside
    it, replaced in one step: a reader (another rank, the launcher, a
    resume) sees the old file or the new, never half. The temporary is this process's own, so
    ranks writing one path do not collide. ``durable`` (checkpoints) also syncs the data and the
    directory entry, so that a machine's crash keeps the file, and then lets the page cache drop
    it: a checkpoint of gigabytes would push the training data out, and slow each next write
    while the cache is full of them (docs/performance-notes.md#figures-behind-the-code). A
    heartbeat or a record that the next write replaces needs neither."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}{PARTIAL}")
    try:
        with open(partial, "wb") as file:
            if callable(data):
                data(file)
            else:
                for part in data if isinstance(data, tuple) else (data,):
                    file.write(part.encode() if isinstance(part, str) else part)
            if durable:
                file.flush()
                os.fsync(file.fileno())
                with contextlib.suppress(OSError):  # advice: a filesystem may not take it
                    os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    if durable:
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


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


def rank_exit_code(directory: Path) -> Optional[int]:
    """The first documented exit code a rank recorded, after repeating its message."""
    records = sorted(directory.glob("exit-*"), key=lambda p: p.stat().st_mtime) if directory.is_dir() else []
    for path in records:
        code, _, message = path.read_text().strip().partition(" ")
        print(f"hvdkit launch: {message}", file=sys.stderr, flush=True)
        return int(code)
    return None


# ---------------------------------------------------------------------------
# Ending processes: by PID, only what we started.
# ---------------------------------------------------------------------------

def tree(pid: int) -> list["psutil.Process"]:
    """The process ``pid`` and every process below it; none once it has ended and been reaped."""
    import psutil

    try:
        top = psutil.Process(pid)
        return [*top.children(recursive=True), top]
    except psutil.NoSuchProcess:
        return []


def processes(pids: Sequence[int]) -> list["psutil.Process"]:
    """The processes of ``pids`` still running (for end_processes)."""
    import psutil

    found = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            found.append(psutil.Process(pid))
    return found


def end_processes(processes: Sequence["psutil.Process"], grace: float) -> None:
    """The one way hvdkit ends processes (a launcher's leftovers, a rehearsal's hosts, a test
    cluster's daemons). End ``processes``, by PID, those already gone passed over: SIGTERM, then
    SIGKILL to what is left after ``grace`` seconds (SIGKILL at once where ``grace`` is 0); waits
    until they are gone. A child of ours is left for its owner to collect (a Popen's wait gets its
    real code; psutil's wait_procs would reap it and leave the Popen 0)."""
    import psutil

    alive = list(processes)
    if grace > 0:
        for process in alive:
            with contextlib.suppress(psutil.Error):
                process.terminate()
        alive = _wait_gone(alive, grace)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    _wait_gone(alive, max(grace, 5.0))


def _wait_gone(processes: Sequence["psutil.Process"], timeout: float) -> list:
    """Those of ``processes`` still running after ``timeout`` seconds; an exited child (a zombie)
    counts as gone, not collected."""
    import psutil

    def running(process) -> bool:
        try:
            return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    deadline = time.monotonic() + timeout
    alive = [p for p in processes if running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.02)
        alive = [p for p in alive if running(p)]
    return alive
