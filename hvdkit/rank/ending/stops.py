"""How a run ends: stopping cleanly when asked to (a signal, one agreed step, a checkpoint, and
an exit code that says what happened), and hvdkit's own errors as one line.

Four signals stop a run. SIGUSR1 is Slurm's warning before a time limit (`--signal=USR1@120`)
or a preemption on demand (`scancel --signal=USR1`): the job is requeued and resumes. SIGTERM
is what Slurm sends at a time limit without --signal, on `scancel` and on preemption, what
mpirun and srun forward when they are told to stop, and what `kill` sends; SIGINT is Ctrl-C;
SIGHUP is a closed terminal or a dropped ssh connection (torchrun stops on it as on SIGTERM).
Those three stop without a requeue: rerun (or resubmit) the same command to resume. The
handler only records the signal; the loop agrees on it at the next step (one tiny allreduce
per step, in the same Horovod cycle as the gradients), rank 0 writes the checkpoint of that
step, and the process exits with 128 + the signal's number, as a shell reports a process a
signal ended. A second Ctrl-C stops at once, saving nothing more.

A stop always ends: a rank that has not exited ``job.stop_grace()`` seconds (10 by
default, HVDKIT_STOP_GRACE) after its first stop signal, or after its launcher went away, is
blocked where no step boundary comes (a collective another rank never joins, a hung read):
it says where it was and exits with the signal's code, without a checkpoint. Python runs a
signal's handler only when the main thread gets back to it, so the count starts in a thread
woken by the signal itself (signal.set_wakeup_fd).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Optional

from hvdkit import job
from hvdkit.config import ConfigError
from hvdkit.rank.liveness import link, orphan
from hvdkit.system import sighandlers

if TYPE_CHECKING:
    from hvdkit.rank.liveness.watchdog import Watchdog

SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
REQUEUE_SIGNAL = signal.SIGUSR1


class StopSignal:
    """Remembers that a stop was asked for, once install()ed (by the Session's start; for the
    loop's lifetime, until restore())."""

    def __init__(self, rank: int = 0, watchdog: Optional["Watchdog"] = None) -> None:
        try:
            self.grace = job.stop_grace()  # checked now, not when the stop comes
        except ValueError as exc:  # HVDKIT_STOP_GRACE
            raise ConfigError(str(exc)) from None
        self.received: Optional[int] = None
        self.reason: Optional[str] = None  # why, when it was not a signal (hvdkit.rank.liveness.orphan)
        self.output_file: Optional[Path] = None  # for output nothing reads any more (orphan.keep_output)
        self.launcher: Optional[orphan.LauncherWatch] = None  # set by hvdkit.rank.liveness.orphan.watch
        self.step = 0  # the loop's step, for the message of a second Ctrl-C
        self._handlers = sighandlers.Handlers(SIGNALS, self._handle)
        self.installed = False
        # The watchdog says where the rank is, writes its stacks when the stop is overdue, and knows
        # from the heartbeats which rank is gone when the stop is a launcher ending the job after it.
        self.rank, self.watchdog = rank, watchdog
        self.since: Optional[float] = None  # time.monotonic() of the first stop
        self._countdown: Optional[threading.Timer] = None
        self._said = ""  # who is gone, as said at a stop
        self._wakeup: Optional[tuple[int, int]] = None

    def install(self) -> "StopSignal":
        """Its handlers installed (nohup's SIGHUP stays ignored), and the thread that hears of a
        signal in whatever thread it arrives started. Returns itself."""
        if not self.installed:
            self._handlers.install()
            self._wakeup = self._wake_on_signals()
            self.installed = True
        return self

    def _wake_on_signals(self) -> tuple[int, int]:
        """(the pipe's writing end, the wakeup fd it replaced): the C-level handler writes each
        signal's number to a pipe, in whatever thread it arrives, and a thread reads it there."""
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)

        def read() -> None:
            while True:
                try:
                    woken = os.read(read_end, 64)
                except OSError:
                    return
                if not woken:
                    return
                if previous != -1:  # whoever set a wakeup fd before us (an event loop) still hears of it
                    with contextlib.suppress(OSError):
                        os.write(previous, woken)
                for signum in woken:
                    if signum in SIGNALS:
                        self._count_down(signal.Signals(signum).name, job.stopped_by(signum))

        threading.Thread(target=read, name="hvdkit-stop-signals", daemon=True).start()
        return write_end, previous

    def _count_down(self, why: str, code: int) -> None:
        """From the first stop: end this process if it still runs after the grace period. At each
        stop, who is gone by then, if not said yet (a launcher's SIGTERM after a rank died while a
        preemption's stop was saving)."""
        gone = self.watchdog.gone_at_a_stop() if self.watchdog else ""
        if gone and gone != self._said:
            self._said = gone
            print(f"hvdkit: rank {self.rank} was told to stop by {why}: {gone}", file=sys.stderr, flush=True)
        if self._countdown is not None:
            return
        grace, self.since = self.grace, time.monotonic()

        def overdue() -> None:
            where = f"{self.watchdog.where}{self.watchdog.write_stacks()}" if self.watchdog else "its loop"
            line = (f"rank {self.rank} did not reach a step boundary within {grace:g} s of {why} (it was in "
                    f"{where}); ending it without a checkpoint")
            job.end_rank(code, line)

        self._countdown = threading.Timer(grace, overdue)
        self._countdown.daemon = True
        self._countdown.start()

    def grace_left(self) -> float:
        """Seconds until the count of the first stop ends this process (all of them before one)."""
        return self.grace if self.since is None else max(0.0, self.grace - (time.monotonic() - self.since))

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            print(f"hvdkit: second interrupt: stopping now at step {self.step}; progress since the last "
                  f"checkpoint is lost", file=sys.stderr, flush=True)
            os._exit(job.stopped_by(signal.SIGINT))
        self.received = self.received or signum
        if self.watchdog:
            self.watchdog.told_to_stop()
        if self.output_file:  # a launcher that relayed our output may be gone (horovodrun --gloo's, killed)
            orphan.keep_output(self.output_file)

    def launcher_gone(self, reason: str) -> None:
        """The rank's launcher ended (hvdkit.rank.liveness.orphan): stop as on SIGTERM, saying why."""
        if self.output_file:
            orphan.keep_output(self.output_file)
        if self.received is None:
            self.reason, self.received = reason, signal.SIGTERM
        self._count_down("its launcher's end", job.stopped_by(signal.SIGTERM))

    def reason_for(self, agreed: int) -> Optional[str]:
        """Why the ranks stopped where no signal asked for it: this rank's launcher is gone (it
        may have noticed after another rank did, or after mpirun passed that rank's exit on)."""
        if self.reason and self.received == agreed:
            return self.reason
        return self.launcher.gone() if self.launcher else None

    def restore(self) -> None:
        """The handlers as they were. A count already started goes on: the process is ending."""
        self._handlers.restore()
        if self._wakeup:
            write_end, previous = self._wakeup
            signal.set_wakeup_fd(previous)
            os.close(write_end)
            self._wakeup = None


def requeue(environ: Mapping[str, str], max_requeues: int) -> str:
    """Requeue this Slurm job unless it has been requeued max_requeues times; say what happened."""
    stopped = job.stopped_by(REQUEUE_SIGNAL)
    job_id = environ.get("SLURM_JOB_ID")
    if not job_id:
        return "not a Slurm job: rerun the same command to resume"
    restarts = int(environ.get("SLURM_RESTART_COUNT", "0"))
    if restarts >= max_requeues:
        return f"not requeued: job {job_id} was restarted {restarts} times already (--max-requeues {max_requeues})"
    if shutil.which("scontrol") is None:
        return (f"not requeued from here: no scontrol on PATH (a container?); every rank exits {stopped} for "
                f"the job script to requeue job {job_id}")
    result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    if result.returncode != 0:
        return f"requeue of job {job_id} failed: {result.stderr.strip() or result.stdout.strip()}"
    return f"requeued job {job_id} (restart {restarts + 1} of at most {max_requeues})"


def will_requeue(signum: int, environ: Mapping[str, str], max_requeues: int) -> bool:
    return (signum == REQUEUE_SIGNAL and "SLURM_JOB_ID" in environ
            and int(environ.get("SLURM_RESTART_COUNT", "0")) < max_requeues and shutil.which("scontrol") is not None)


def after_stop(signum: int, environ: Mapping[str, str], max_requeues: int) -> tuple[str, int]:
    """(what happens next, exit code) once a run stopped for ``signum`` and saved its checkpoint:
    SIGUSR1 requeues the Slurm job and exits 0 when that worked, so the job goes on; anything
    else exits 128 + signum, so that a job script does not take the stop for success."""
    if signum == REQUEUE_SIGNAL:
        outcome = requeue(environ, max_requeues)
        if outcome.startswith("requeued"):
            return outcome, 0
        return outcome, job.stopped_by(signum)
    return "rerun the same command (or resubmit the job) to resume", job.stopped_by(signum)


def save_outlasts_grace(seconds: float, grace: float, left: Optional[float] = None) -> Optional[str]:
    """A warning's line where a checkpoint that takes ``seconds`` to write would not be written
    within a stop's grace (``left`` of it, at a stop); None where it fits."""
    if seconds <= (grace if left is None else left):
        return None
    given = f"the {grace:g} s a stop gives a rank to save and end ({job.STOP_GRACE})"
    took = f"the last checkpoint took {seconds:.1f} s to write"
    what = (f"{took}, more than {given}; at a stop it would be cut off" if left is None else
            f"{took} and {left:.0f} s are left of {given}; this one may be cut off")
    return (f"{what} and the run would resume from the checkpoint before: raise {job.STOP_GRACE}, and under "
            f"Slurm the lead time of --signal (USR1@N) above it")


def conclude(signum: int, rank: int, step: int, checkpoint_dir: Optional[str], max_requeues: int,
             environ: Mapping[str, str] = os.environ, reason: Optional[str] = None) -> int:
    """After an agreed stop, whose checkpoint is written: rank 0 requeues (SIGUSR1 under Slurm)
    and says in one line what was saved and what happens next. The rank's exit code. ``reason``:
    rank 0's own, where no signal stopped it (its launcher is gone)."""
    saved = (f"checkpoint of step {step} saved in {checkpoint_dir}" if checkpoint_dir
             else "no checkpoint_dir, so progress since the start is lost")
    if rank != 0:
        return 0 if will_requeue(signum, environ, max_requeues) else job.stopped_by(signum)
    outcome, code = after_stop(signum, environ, max_requeues)
    why = f"at step {step} because {reason}" if reason else f"by {signal.Signals(signum).name} at step {step}"
    line = f"stopped {why}; {saved}; {outcome}"
    print(f"hvdkit: {line}", file=sys.stderr, flush=True)
    if code:
        job.record_exit(code, line)
    return code


SPEAKER_GRACE = 5.0  # seconds another rank leaves rank 0 to say why the job ends


def defer_to_rank0(rank: Optional[int]) -> None:
    """Before a rank other than 0 exits with one of hvdkit's errors, which rank 0 says: the ranks
    mostly meet such an error together (a bad config, a lockstep mistake, Horovod shut down by a
    rank that raised), and horovodrun and mpirun end every rank as soon as the first exits
    non-zero, so another rank leaving first would cut rank 0's line off. It waits up to
    SPEAKER_GRACE seconds, with the stop signals' defaults back, for the launcher to end it once
    rank 0 has spoken and exited."""
    if not rank:
        return
    sighandlers.Handlers(SIGNALS, signal.SIG_DFL).install()  # for good: this rank is ending
    time.sleep(SPEAKER_GRACE)


def exit_on_own_errors(rank: int, own: tuple, bad_input: tuple, end: Optional[Callable[[], None]] = None,
                       explain: Optional[Callable[[BaseException], str]] = None) -> Callable[[], None]:
    """From now on, an exception of the ``own`` types that nothing caught ends this rank with
    its message once (rank 0's, as one line) instead of a traceback on every rank: ``end()``
    (a bound method: Horovod's shutdown; none before hvd.init), then exit with the exception's
    ``exit_code``, else 2 for ``bad_input`` types, else 1; ``explain(exc)`` (a bound method too) adds to
    its line (who is gone, after Horovod's shutdown), or is None where a rank below says it. Returns the undo.

    The other ranks leave rank 0 the word (``defer_to_rank0``) after Horovod's shutdown; where
    rank 0 is gone, the lowest rank left says it (``explain``)."""
    previous = sys.excepthook
    end = weakref.WeakMethod(end) if end else (lambda: None)  # the hook must not keep a Session alive
    explained = weakref.WeakMethod(explain) if explain else (lambda: None)

    def hook(kind, exc, tb) -> None:
        if not issubclass(kind, own):
            previous(kind, exc, tb)
            return
        code = job.code_for(exc, bad_input)
        line = str(exc).splitlines()[0] if str(exc) else kind.__name__
        explain_now = explained()
        said = explain_now(exc) if explain_now else ("" if rank == 0 else None)
        if said is not None or getattr(exc, "said_by_its_rank", False):  # an error of this rank alone
            line += said or ""
            print(f"hvdkit: error: {line}", file=sys.stderr, flush=True)
            job.record_exit(code, line)
        link.leaving()  # before Horovod's shutdown, which may block until this rank is killed
        shutdown = end()
        if shutdown is not None:
            shutdown()
        sys.stdout.flush()
        defer_to_rank0(rank if said is None else None)
        os._exit(code)

    sys.excepthook = hook

    def undo() -> None:
        if sys.excepthook is hook:
            sys.excepthook = previous

    return undo
