"""The training step: micro-batches, mixed precision, backward, and the optimizer step with its
finiteness check.

A step is K micro-batches (``batches_per_allreduce``) whose backward passes accumulate locally;
the last one's backward starts Horovod's allreduce. ``TrainingStep.apply`` then waits for the
averaged gradients once, unscales (fp16) and clips them, checks that they are finite, and steps
the optimizer without a second wait, then the GradScaler and the scheduler.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import torch
from torch import nn

from hvdkit.config import TrainConfig
from hvdkit.rank.state import RunState, say
from hvdkit.rank.stragglers import StepTimes

MAX_SKIPS_IN_A_ROW = 10


class NonFiniteError(RuntimeError):
    """The loss or gradients of a step are NaN or infinite; the message names the step."""


def lr_multiplier(cfg: TrainConfig, size: int, local_size: int, on_gpu_with_nccl: bool) -> float:
    """How much larger than base_lr the peak learning rate is, by ``cfg.lr_scaling``.

    A step averages size x K micro-batches' gradients (linear: Goyal et al.; sqrt: Krizhevsky's
    rule, common for Adam). Adasum adapts to the gradients instead, so only K counts, and on
    GPUs the sum within a node (Horovod's rule)."""
    ranks = (local_size if on_gpu_with_nccl else 1) if cfg.use_adasum else size
    batches = ranks * cfg.batches_per_allreduce
    return {"linear": float(batches), "sqrt": math.sqrt(batches), "none": 1.0}[cfg.lr_scaling]


def split_batch(batch: Any, size: int) -> list:
    """``batch`` (tensors nested in tuples, lists and dicts) as chunks of at most ``size`` samples."""
    if isinstance(batch, torch.Tensor):
        return list(batch.split(size))
    if isinstance(batch, dict):
        parts = {key: split_batch(value, size) for key, value in batch.items()}
        count = _same_count(parts.values())
        return [{key: chunks[i] for key, chunks in parts.items()} for i in range(count)]
    if isinstance(batch, (tuple, list)):
        parts = [split_batch(value, size) for value in batch]
        count = _same_count(parts)
        return [type(batch)(chunks[i] for chunks in parts) if not _is_namedtuple(batch)
                else type(batch)(*(chunks[i] for chunks in parts)) for i in range(count)]
    raise TypeError(f"batch: cannot split a {type(batch).__name__}; batches are tensors nested in "
                    f"tuples, lists and dicts")


def _same_count(parts) -> int:
    counts = {len(chunks) for chunks in parts}
    if len(counts) != 1:
        raise ValueError("batch: its tensors hold different numbers of samples")
    return counts.pop()


def _is_namedtuple(value) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor moved to ``device`` (asynchronously from pinned memory)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    if _is_namedtuple(batch):
        return type(batch)(*(to_device(value, device) for value in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(value, device) for value in batch)
    return batch


def batch_len(batch: Any) -> int:
    """Samples in a batch: the leading size of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return len(batch)
    values = batch.values() if isinstance(batch, dict) else batch
    for value in values:
        with contextlib.suppress(TypeError):
            return batch_len(value)
    raise TypeError("batch: holds no tensor")


class TrainingStep:
    """The step of one run: it steps the state's model, optimizer, scaler and scheduler, timed by
    ``times``; ``kept()`` says which checkpoint a run stopped by a non-finite step leaves."""

    def __init__(self, cfg, hvd, device, state: RunState, times: StepTimes, kept: Callable[[], str]) -> None:
        self.cfg, self.hvd, self.device, self.state, self.times, self.kept = cfg, hvd, device, state, times, kept
        self.micro_count = cfg.batches_per_allreduce  # of the step under way
        self.skipped, self.skips_in_a_row = 0, 0  # on_nonfinite: skip

    def micro_batches(self, batch: Any, micro_size: int) -> list:
        """``batch`` on this device, split into the micro-batches of one optimizer step."""
        chunks = split_batch(batch, micro_size) if self.cfg.batches_per_allreduce > 1 else [batch]
        self.micro_count = len(chunks)
        return [to_device(chunk, self.device) for chunk in chunks]

    def backward(self, loss: torch.Tensor) -> None:
        loss = loss / self.micro_count
        scaler = self.state.scaler
        (scaler.scale(loss) if scaler else loss).backward()

    def apply(self) -> None:
        """Wait for the averaged gradients, unscale and clip them, then step without a second
        synchronize. Adasum combines the ranks' updates inside step() instead, so there the
        local gradients are unscaled and clipped. Then the GradScaler and the scheduler."""
        cfg, optimizer, scaler = self.cfg, self.state.optimizer, self.state.scaler
        if not cfg.use_adasum:
            self.times.waiting()
            optimizer.synchronize()
            self.times.waited()
        if scaler:
            scaler.unscale_(optimizer)
            if cfg.zero:  # each rank checked only its own slices for an overflow
                optimizer.agree_on_overflow(scaler)
        if self._gradients_finite():
            with contextlib.nullcontext() if cfg.use_adasum else optimizer.skip_synchronize():
                if scaler:
                    scaler.step(optimizer)
                else:
                    optimizer.step()
        if scaler:
            scaler.update()
        if self.state.scheduler is not None:
            self.state.scheduler.step()
        self.micro_count = cfg.batches_per_allreduce

    def _gradients_finite(self) -> bool:
        """Clip the gradients and tell whether they are finite. Averaged gradients are the same
        on every rank, so every rank decides alike; Adasum's are local, so there the ranks agree
        in an allreduce. With fp16 loss scaling, GradScaler skips non-finite steps itself.

        on_nonfinite=stop raises NonFiniteError before the step, so the weights and the last
        checkpoint stay good; skip leaves the weights as they were and goes on, up to
        MAX_SKIPS_IN_A_ROW steps in a row."""
        cfg, state = self.cfg, self.state
        parameters, optimizer = list(state.model.parameters()), state.optimizer
        grads = [p.grad for p in parameters if p.grad is not None]
        if cfg.zero:  # the norm of the whole gradient, from every rank's slices
            if cfg.clip_grad_norm:
                norm = optimizer.clip_grad_norm_(cfg.clip_grad_norm)
            elif state.scaler is None:
                norm = optimizer.grad_norm()
            else:
                return True
        elif cfg.clip_grad_norm:
            norm = nn.utils.clip_grad_norm_(parameters, cfg.clip_grad_norm)
        elif state.scaler is None and grads:
            norm = nn.utils.get_total_norm(grads)
        else:
            return True
        if state.scaler is not None:
            return True
        finite = torch.isfinite(norm).float().cpu()
        if cfg.use_adasum:
            finite = self.hvd.allreduce(finite, op=self.hvd.Min, name="hvdkit.finite")
        if finite.item():
            self.skips_in_a_row = 0
            return True
        step, kept = state.global_step + 1, self.kept()
        if cfg.on_nonfinite == "stop":
            raise NonFiniteError(f"the loss or gradients of step {step} (epoch {state.epoch + 1}) are not finite; "
                                 f"stopped before applying them, {kept}; lower --base-lr, set "
                                 f"--clip-grad-norm, or pass --on-nonfinite skip")
        self.skipped += 1
        self.skips_in_a_row += 1
        if self.skips_in_a_row >= MAX_SKIPS_IN_A_ROW:
            raise NonFiniteError(f"the loss or gradients were not finite for {self.skips_in_a_row} steps in a row "
                                 f"(the last, step {step}); stopped, {kept}; lower --base-lr or set "
                                 f"--clip-grad-norm")
        say(self.hvd, f"hvdkit: warning: the loss or gradients of step {step} are not finite; step skipped "
                      f"({self.skipped} so far)")
        if cfg.zero:
            optimizer.zero_grad()  # the slices' gradients too
        else:
            for grad in grads:
                grad.zero_()
        return False
