"""How a run ends: the stop the ranks agreed on, taken with its checkpoint written; the summary and
a requeue (hvdkit.rank.stops.conclude); what the run holds let go; and after one of hvdkit's
errors, a save in flight finished first. The Session's ``finish()``, its stops and its error hook
come here (hvdkit.session)."""

from __future__ import annotations

from typing import Optional

from hvdkit.rank import startup, stops
from hvdkit.rank.checkpoints import RunCheckpoints
from hvdkit.rank.lifeline import Lifeline
from hvdkit.rank.lockstep import Lockstep
from hvdkit.rank.reports import Reports
from hvdkit.rank.state import RunState
from hvdkit.rank.step import TrainingStep
from hvdkit.rank.watchdog import Watchdog


class Ending:
    """The end of one run, whose state and parts it is handed, and what the run holds until then.
    Made, it says the ``own_errors`` that nothing caught in one line (stops.exit_on_own_errors; the
    ``bad_input`` ones exit 2), then takes the locks of the run's directories (startup.lock_directories)."""

    def __init__(self, cfg, hvd, state: RunState, lockstep: Lockstep, signal: stops.StopSignal,
                 checkpoints: RunCheckpoints, reports: Reports, watchdog: Watchdog, lifeline: Optional[Lifeline],
                 own_errors: tuple, bad_input: tuple) -> None:
        self.cfg, self.hvd, self.state, self.lockstep, self.signal = cfg, hvd, state, lockstep, signal
        self.checkpoints, self.reports, self.watchdog, self.lifeline = checkpoints, reports, watchdog, lifeline
        self.locks: list = []
        self.undo_hook = stops.exit_on_own_errors(hvd.rank(), own_errors, bad_input, self.after_error, self.who_is_gone)
        self.locks = startup.lock_directories(cfg, hvd, state.log_dir)

    def take_stop(self, step: TrainingStep) -> bool:
        """Whether the run stops here: the ranks agreed on a stop, and its checkpoint is now written."""
        state, checkpoints = self.state, self.checkpoints
        if state.stopped or not self.lockstep.signum:
            return state.stopped
        state.stopped = True
        step.settle()
        self.record_saves()  # the save in flight, if written, tells how long this one may take
        checkpoints.warn_if_late(self.signal.grace, self.signal.grace_left())
        if self.cfg.elastic:
            checkpoints.save_elastic(checkpoints.elastic_sampler)
        else:
            checkpoints.save()
        return True

    def record_saves(self) -> None:
        """The metrics gain a record of each checkpoint written (rank 0's): what it held training
        (the stall) and what its write took."""
        for record in self.checkpoints.take_done(self.signal.grace):
            self.reports.metrics().write({"event": "checkpoint", **record})

    def finish(self, step: TrainingStep, summary: Optional[dict]) -> dict:
        """After the ranks met at finish(): the last save durable, a stop concluded (requeued), the
        summary written and returned; the signal handlers go last (see Session.finish)."""
        if not self.cfg.elastic:
            step.settle()
            self.take_stop(step)
        self.checkpoints.finish()  # the last save durable before a requeue reads it and before the exit
        self.checkpoints.drop_snapshots()  # the run ended: no restart will want them
        self.record_saves()
        state, signum = self.state, self.lockstep.signum
        try:
            self.release()
            if state.stopped:
                state.exit_code = stops.conclude(signum, self.hvd.rank(), state.global_step, self.cfg.checkpoint_dir,
                                                 self.cfg.max_requeues, reason=self.signal.reason_for(signum))
            return self.reports.summary({"checkpoints": self.checkpoints.timings(), **(summary or {})}, step.skipped)
        finally:
            self.signal.restore()
            self.undo_hook()

    def release(self, watching: bool = False) -> None:
        """Let go of what this run holds; ``watching`` (after an error) keeps the watches on its
        launcher, which end this rank should its launcher go while it is still ending, and its stacks."""
        self.watchdog.stop(keep_stacks=watching)
        for watch in () if watching else (self.lifeline, self.signal.launcher):
            if watch:
                watch.stop()
        for held in self.locks:
            held.release()

    def who_is_gone(self, exc: BaseException) -> Optional[str]:
        """What this rank adds to the line of the error that ends it; None where it leaves that line
        to a rank below it (rank 0, or the lowest one left after Horovod's shutdown)."""
        said = self.watchdog.after_shutdown(exc, self.hvd.size())
        return said if self.hvd.rank() == 0 or self.watchdog.first_left() else None

    def after_error(self) -> None:
        """One of hvdkit's errors ends this rank (stops.exit_on_own_errors): a save in flight
        is finished first, so that the job ends with it written. Horovod's shutdown can block
        (joining its background thread, itself waiting in Gloo on a rank that is gone or frozen),
        so the watches on the launcher stay until the process exits."""
        self.checkpoints.writer.abandon_parts()  # their ranks may have ended with this one
        self.checkpoints.writer.wait()
        self.release(watching=True)
        if self.reports.sink is not None:
            self.reports.sink.close()
        self.hvd.shutdown()
