"""Peak memory per phase of training: where in a step a rank's memory peaks, and what it holds.

What decides whether a model fits is the peak, not the bytes held after a step, and the peak
moves between phases (the first step, which creates the optimizer state; the backward pass;
the optimizer step; a checkpoint's save; a resume). A phase's peak on the CPU is the largest
resident set size while it ran: Linux keeps a high-water mark (VmHWM) that writing "5" to
/proc/self/clear_refs lowers to the current size, so each phase starts from where it begins.
On a GPU it is the CUDA allocator's peak, reset the same way. Where the high-water mark cannot
be reset, a phase's peak is the process's peak so far (still an upper bound).

A steady step's phases peak alike from step to step, so a step's phases are measured on the
first steps and every ``STEP_PHASES_EVERY`` steps after (``step_phase``), not at every step,
which would cost each phase three system calls; between them the high-water mark keeps
rising, so the process's peak (``peak_rss``, the out-of-memory line's) misses nothing."""

from __future__ import annotations

import contextlib
import os
import resource
from typing import Iterator, Optional

import torch

from hvdkit.zero.held import held_bytes
from hvdkit.zero.optimizer import ShardedOptimizer

CLEAR_REFS = "/proc/self/clear_refs"

STEP_PHASES_FIRST = 3  # steps measured from the start: the first creates the optimizer state
STEP_PHASES_EVERY = 50  # then one step in this many
_UNMEASURED = contextlib.nullcontext()

_highest = 0  # the largest high-water mark read before a reset: the reset lowers ru_maxrss too
_clear_refs = (0, -1)  # (pid, fd): kept open, as a phase is entered every step (0.8 µs a write, 20 µs an open)


def peak_rss() -> int:
    """This process's peak resident memory since its start, in bytes."""
    return max(_highest, _high_water_mark())


def _high_water_mark() -> int:
    """The resident high-water mark since the last reset (Linux's VmHWM), in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _note(peak: int) -> None:
    global _highest
    _highest = max(_highest, peak)


def _reset_high_water_mark() -> bool:
    global _clear_refs
    _note(peak_rss())
    pid, fd = _clear_refs
    try:
        if pid != os.getpid():  # not yet opened, or opened before a fork: /proc/self was the parent
            fd = os.open(CLEAR_REFS, os.O_WRONLY | os.O_CLOEXEC)
            _clear_refs = (os.getpid(), fd)
        os.write(fd, b"5")
        return True
    except OSError:
        return False


class PhasePeaks:
    """The largest peak seen in each named phase, in bytes: RSS on the CPU, the CUDA allocator's
    on a GPU (``device``)."""

    def __init__(self, device: Optional[torch.device] = None) -> None:
        self.device = device or torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.peaks: dict[str, int] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        resettable = self._reset()
        try:
            yield
        finally:
            peak = self._read() if resettable else peak_rss()
            self.peaks[name] = max(self.peaks.get(name, 0), peak)
            if not self.cuda:
                _note(peak)

    def step_phase(self, name: str, step: int, first: Optional[str] = None):
        """``phase(name)`` on the steps whose phases are measured (the module docstring), a
        context that does nothing on the others; ``step``: the steps taken before this one;
        ``first``: the name of the phase's first measure, where it is one of its own."""
        if step < STEP_PHASES_FIRST or step % STEP_PHASES_EVERY == 0:
            return self.phase(first if first and first not in self.peaks else name)
        return _UNMEASURED

    def _reset(self) -> bool:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            return True
        return _reset_high_water_mark()

    def _read(self) -> int:
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device)
        return _high_water_mark()

    def summary(self) -> dict:
        """{phase: peak bytes}, and the unit they are in."""
        return {"unit": "cuda_allocated" if self.cuda else "rss", **self.peaks}


def memory_of(optimizer) -> dict:
    """This rank's bytes of weights, gradients and optimizer state, sharded or not, and its peak
    resident memory."""
    if isinstance(optimizer, ShardedOptimizer):
        held = optimizer.memory()
    else:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        held = held_bytes(params, params, optimizer.state.values())
    return {**held, "peak_rss": peak_rss()}
