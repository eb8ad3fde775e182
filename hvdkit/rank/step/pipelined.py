"""A pipelined step's forward and backward passes (``pp``): ``session.pipeline``.

With pipeline parallelism a rank holds one stage of the model (``session.parallelize``), and a
step's batch goes through the stages as micro-batches in the schedule's order
(hvdkit.parallel.pipeline): the loop hands the whole batch over instead of calling the model and
``session.backward`` per micro-batch::

    model, optimizer = session.setup(session.parallelize(model), optimizer)
    for batch in loader:                                  # (inputs, targets)
        optimizer.zero_grad()
        losses = session.pipeline.step(batch, loss_fn)    # loss_fn(output, target) on the last stage
        for loss in losses:                               # the last stage's, one per micro-batch
            session.log(len(batch[1]) // len(losses), loss=loss)
        session.step()                                    # averaged over dp, clipped over the pipeline

The optimizer step is the Session's (hvdkit.rank.step.training): the gradients averaged within each
stage's data-parallel set, an embedding tied to the output layer summed over the pipeline's ends,
then clipped and checked by the whole pipeline's norm, so that every stage steps or skips alike.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch

from hvdkit.config import ConfigError
from hvdkit.parallel.pipeline.stages import Pipeline
from hvdkit.rank.state import RunState
from hvdkit.rank.step.training import to_device


class PipelinePasses:
    """The passes of a run's pipeline stage: made by the Session on every rank (starts nothing);
    ``begin_step``, the Session's, is called as a step's passes begin (its meeting starts there, as
    in ``session.backward``); ``beat``, the watchdog's, is told each action of the schedule as it
    begins, so that a stalled pipeline is named by its stage and micro-batch."""

    def __init__(self, cfg, mesh, device, state: RunState, begin_step: Callable[[], Any],
                 beat: Callable[[str], None]) -> None:
        self.cfg, self.mesh, self.device, self.state, self.beat = cfg, mesh, device, state, beat
        self.begin_step = weakref.WeakMethod(begin_step)  # a Session's method: the part must not keep it alive
        self._pipeline: Optional[Pipeline] = None

    @property
    def stage(self) -> int:
        """This rank's stage: 0 to pp - 1."""
        return self.mesh.pp_group.rank

    @property
    def is_last(self) -> bool:
        """This rank holds the last stage: its passes compute the loss."""
        return self.stage == self.mesh.pp - 1

    @property
    def times(self):
        """The last step's span and waits on this stage (hvdkit.parallel.pipeline.schedules.StageTimes)."""
        return self._of_model().times

    def _of_model(self) -> Pipeline:
        model = self.state.model
        if self.mesh.pp == 1 or model is None:
            raise ConfigError("session.pipeline: the pipeline is pp's; set pp > 1, and call it after setup()")
        if self._pipeline is None or self._pipeline.module is not model:
            if self.cfg.pp_schedule == "1f1b" and self.cfg.batches_per_allreduce < self.mesh.pp:
                raise ConfigError(f"pp: 1f1b over {self.mesh.pp} stages needs at least {self.mesh.pp} micro-batches a "
                                  f"step, and this run has {self.cfg.batches_per_allreduce}; give pp_schedule gpipe")
            self._pipeline = Pipeline(model, self.mesh, self.cfg.pp_schedule, self.cfg.batches_per_allreduce)
        return self._pipeline

    def step(self, batch, loss_fn: Callable[[torch.Tensor, Any], torch.Tensor]) -> list[torch.Tensor]:
        """One step's forward and backward passes through this rank's stage: ``batch`` (inputs, targets;
        every stage of a pipeline is given the same, as its loader reads them) split into the step's
        micro-batches (``batches_per_allreduce``) and run by ``pp_schedule``; ``loss_fn(output,
        target)`` on the last stage. The gradients accumulate the batch's mean loss, for the Session's
        ``step()``. Returns each micro-batch's loss (detached) on the last stage, [] on the others.
        Every rank calls it at the same point of the loop."""
        pipeline = self._of_model()
        inputs, targets = to_device(batch, self.device)
        self.begin_step()()
        step, stage = self.state.global_step + 1, self.stage

        def where(action) -> None:
            self.beat(f"training step {step}, pipeline stage {stage}: the "
                      f"{'forward' if action.kind == 'F' else 'backward'} of micro-batch {action.micro_batch}")

        with self.state.peaks.step_phase("forward and backward", self.state.global_step):
            return pipeline.step(inputs, targets, loss_fn, where)

    def forward(self, inputs: torch.Tensor) -> Optional[torch.Tensor]:
        """The whole model's output for ``inputs`` on the last stage, None on the others: a pass
        through the stages in the step's micro-batches (hvdkit.parallel.pipeline.Pipeline.forward),
        for evaluation (under ``torch.no_grad()``). Every rank of a pipeline calls it alike."""
        return self._of_model().forward(to_device(inputs, self.device))
