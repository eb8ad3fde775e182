"""Elastic runs (``elastic: true``, under horovodrun's ``--host-discovery-script``): the same loop,
run inside Horovod's ``hvd.elastic.run``.

The training loader is over Horovod's ElasticSampler (hvdkit.rank.start.loaders), which shares what is
left of an epoch among the ranks of the moment. ``run(loop)`` applies the checkpoint read in
setup(), makes Horovod's TorchState of the model, optimizer, sampler, epoch and step, and calls
``loop()``; after a change of hosts Horovod restores the last commit on every rank and ``run``
calls ``loop()`` again, from that epoch and step. A step records its batch in the sampler and
commits every ``commit_steps`` (first writing the checkpoint where one is due); an epoch's end
commits with a checkpoint.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Optional

from hvdkit.rank.agree.lockstep import Lockstep
from hvdkit.rank.agree.stragglers import StepTimes
from hvdkit.rank.reports.report import Reports
from hvdkit.rank.resume.checkpoints import RunCheckpoints
from hvdkit.rank.start.loaders import Loaders
from hvdkit.rank.state import RunState


class Elastic:
    """The elastic side of one run, whose state and parts it is handed; ``settle`` reads the
    steps' non-finite flags before a checkpoint (TrainingStep.settle)."""

    def __init__(self, cfg, hvd, state: RunState, loaders: Loaders, checkpoints: RunCheckpoints, reports: Reports,
                 times: StepTimes, lockstep: Lockstep, settle: Callable[[], None]) -> None:
        self.cfg, self.hvd, self.state, self.loaders, self.checkpoints = cfg, hvd, state, loaders, checkpoints
        self.reports, self.times, self.lockstep, self.settle = reports, times, lockstep, settle
        self.committed: Optional[Any] = None  # Horovod's TorchState, made by run()

    def run(self, loop: Callable[[], Any]) -> Any:
        run, hvd = self.state, self.hvd
        sampler = self.loaders.elastic_sampler()
        self.checkpoints.load_elastic(sampler)  # a restarted job goes on from its checkpoint
        state = self.committed = hvd.elastic.TorchState(model=run.model, optimizer=run.optimizer, sampler=sampler,
                                                        epoch=run.epoch, step=run.global_step)
        state.register_reset_callbacks([lambda: self.reset(state.step)])

        @hvd.elastic.run
        def attempt(state) -> Any:
            # Horovod's sync gave a joining worker's empty optimizer its state with a zero-gradient
            # step, which with weight decay moves that worker's weights alone: rank 0's once more.
            hvd.broadcast_parameters(run.model.state_dict(), root_rank=0)
            run.global_step, run.epoch = state.step, state.epoch
            self._rates_now()
            return loop()

        return attempt(state)

    def _rates_now(self) -> None:
        """The scheduler's rates at this step and world size: what was restored was set at the
        committed step, for the world size of then."""
        scheduler = self.state.scheduler
        if scheduler is None or not hasattr(scheduler, "lr_lambdas"):
            return
        for group, base_lr, factor in zip(self.state.optimizer.param_groups, scheduler.base_lrs,
                                          scheduler.lr_lambdas, strict=True):
            group["lr"] = base_lr * factor(self.state.global_step)

    def before_update(self) -> None:
        """The step's batch is done: the sampler's position, which the scheduler's rate reads, moves
        on. (A loop of its own inside ``hvd.elastic.run``, not run(), records and commits itself.)"""
        if self.committed is not None:
            self.loaders.elastic_sampler().record_batch(0, self.loaders.made[0].batch_size)

    def stepped(self, stopping: bool) -> None:
        """After a step: commit every ``commit_steps``, with a checkpoint every ``checkpoint_steps``
        (none when the ranks agreed to stop: the stop's checkpoint is written instead)."""
        if self.committed is None:
            return
        step, cfg = self.state.global_step, self.cfg
        checkpoint_due = bool(cfg.checkpoint_steps) and step % cfg.checkpoint_steps == 0
        if not stopping and (step % cfg.commit_steps == 0 or checkpoint_due):
            self.commit(checkpoint_due)

    def commit(self, checkpoint_due: bool = True) -> None:
        """Horovod's commit of the state, where it also applies a change of hosts; the checkpoint
        first, since the commit may hand over to a new set of hosts."""
        run, state = self.state, self.committed
        state.epoch, state.step = run.epoch, run.global_step
        if checkpoint_due:
            self.settle()
            self.checkpoints.save_elastic(self.loaders.elastic_sampler())
        state.commit()

    def epochs(self, count: int, max_steps: Optional[int]) -> Iterator[int]:
        """Session.epochs() of an elastic run: an epoch ends when its samples are processed, by
        whichever ranks there were; then the sampler starts the next, and a commit with its checkpoint."""
        if self.committed is None:
            raise RuntimeError("hvdkit: an elastic run's session.epochs() runs inside session.run(loop)")
        run, sampler = self.state, self.loaders.elastic_sampler()
        run.total_steps = max_steps
        while run.epoch < count and not run.stopped and run.global_step < (max_steps or math.inf):
            yield run.epoch
            if run.stopped:
                return
            finished = self.loaders.epoch_ended()
            if finished:
                run.epoch += 1
                sampler.set_epoch(run.epoch)
            self.commit()
            if not finished:  # max_steps ended it part-way
                return

    def reset(self, step: int) -> None:
        """Horovod's reset callback: recorded in rank 0's sink (which may now be another process);
        a meeting started before it belongs to the old ranks."""
        self.lockstep.abandon()
        self.reports.elastic_reset(step)
        self.times.resize(self.hvd.rank(), self.hvd.size())  # the table has a row per rank
