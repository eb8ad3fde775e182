"""How a run ends: the stop the ranks agreed on, taken with its checkpoint written; the summary and
a requeue (hvdkit.rank.ending.stops.conclude); what the run holds let go; and after one of hvdkit's
errors, a save in flight finished first. The Session's ``finish()``, its stops and its error hook
come here (hvdkit.session)."""

from __future__ import annotations

import weakref
from typing import Optional

from hvdkit import job
from hvdkit.rank.agree.lockstep import Lockstep
from hvdkit.rank.ending import lock, stops
from hvdkit.rank.liveness import link
from hvdkit.rank.liveness.lifeline import Lifeline
from hvdkit.rank.liveness.watchdog import Watchdog
from hvdkit.rank.reports.report import Reports
from hvdkit.rank.resume.checkpoints import RunCheckpoints
from hvdkit.rank.state import RunState
from hvdkit.rank.step.training import TrainingStep


class Ending:
    """The end of one run, whose state and parts it is handed, and what the run holds until then.
    Made, it holds nothing; start() (the Session's start, every rank) has the ``own_errors`` that
    nothing caught said in one line (stops.exit_on_own_errors; the ``bad_input`` ones exit 2), a
    save in flight finished before the launcher ends this rank (link.before_end), then takes the
    locks of the run's directories (lock.lock_directories)."""

    def __init__(self, cfg, hvd, state: RunState, lockstep: Lockstep, signal: stops.StopSignal,
                 checkpoints: RunCheckpoints, reports: Reports, watchdog: Watchdog, lifeline: Optional[Lifeline],
                 own_errors: tuple, bad_input: tuple) -> None:
        self.cfg, self.hvd, self.state, self.lockstep, self.signal = cfg, hvd, state, lockstep, signal
        self.checkpoints, self.reports, self.watchdog, self.lifeline = checkpoints, reports, watchdog, lifeline
        self.errors = own_errors, bad_input
        self.locks: list = []
        self.undo_hook = self.undo_before_end = lambda: None

    def start(self) -> None:
        """The hooks installed, the lifeline's probes started, then the locks taken (ConfigError
        where another run holds one)."""
        self.undo_hook = stops.exit_on_own_errors(self.hvd.rank(), *self.errors, self.after_error, self.who_is_gone)
        later = weakref.WeakMethod(self.before_end)  # the hook must not keep the run's parts (its loaders) alive
        self.undo_before_end = link.before_end(lambda: later() and later()())
        if self.lifeline:
            self.lifeline.start()
        self.locks = lock.lock_directories(self.cfg, self.hvd, self.state.log_dir)

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
            self.undo_before_end()

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
        return said if self.hvd.rank() == 0 or self.watchdog.lowest_rank_left() else None

    def before_end(self) -> None:
        """Another rank died, and the launcher ends this one (hvdkit.rank.liveness.link, in its thread): the
        save in flight is written first, within the stop grace, for the restart to resume from."""
        self.checkpoints.writer.abandon_parts()  # a main file's parts from the rank that died will not come
        self.checkpoints.writer.wait_written(job.stop_grace())

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
