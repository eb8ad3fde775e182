"""The step: micro-batches, mixed precision, backward and the optimizer step with its guard
(training), over the gradient buckets that make the optimizer distributed (buckets); with a
pipeline, a step's forward and backward passes through this rank's stage (pipelined).

``hvdkit.rank.step.NonFiniteError`` is the documented name of the guard's error (docs/own-loop.md)."""

from hvdkit.rank.step.training import NonFiniteError

__all__ = ["NonFiniteError"]
