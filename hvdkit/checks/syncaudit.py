"""Counts what blocks the training thread in a step: reads of a tensor's value and Horovod waits.

On a GPU a read of a tensor's value (``.item()``, ``.cpu()``, ``.tolist()``, ``bool()``,
``float()`` or ``int()`` of a tensor, ``torch.cuda.synchronize()``) blocks the host until the GPU
has finished everything queued, so the next step's kernels cannot be queued meanwhile. On a CPU
the same calls cost nothing, which is why they slip in; counted here, they are seen on any
machine. Host tensors that are meant to be read (the lockstep meeting's rows, which Horovod
returns in host memory on every device) are read with ``.numpy()``, which refuses a GPU tensor:
those are counted apart, as host reads, so that a new one is seen too.

A Horovod *wait point* is where the training thread starts waiting in ``synchronize()`` after it
submitted collectives: the waits for a step's gradients, one handle after another, are one;
a collective submitted and waited for on its own (``hvd.allreduce``) is one more.

``SyncAudit`` patches torch and horovod.torch while it is entered, in this process only, and
counts only calls made on the thread that entered it.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from typing import Callable

import torch

READS = ("item", "cpu", "tolist", "__bool__", "__float__", "__int__")


class _Submissions(dict):
    """horovod.torch.mpi_ops' handle map: every collective submitted adds its handle here."""

    def __init__(self, items, on_submit: Callable[[], None]) -> None:
        super().__init__(items)
        self.on_submit = on_submit

    def __setitem__(self, key, value) -> None:
        self.on_submit()
        super().__setitem__(key, value)


class SyncAudit:
    """``with SyncAudit() as audit:`` ... ``audit.take()`` gives the counts since the last take:
    ``{"reads": {"Tensor.item at file:line": n}, "host_reads": {...}, "waits": n, "wait_seconds": s}``."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.reads: collections.Counter = collections.Counter()
        self.host_reads: collections.Counter = collections.Counter()  # Tensor.numpy: host memory only
        self.waits = 0
        self.wait_seconds = 0.0
        self._submitted = False
        self._undo: list[tuple] = []

    def __enter__(self) -> "SyncAudit":
        self.thread = threading.get_ident()
        for name in READS:
            self._patch(torch.Tensor, name, self._read_counter(f"Tensor.{name}", getattr(torch.Tensor, name)))
        self._patch(torch.Tensor, "numpy", self._read_counter("Tensor.numpy", torch.Tensor.numpy, self.host_reads))
        self._patch(torch.cuda, "synchronize", self._read_counter("torch.cuda.synchronize", torch.cuda.synchronize))
        self._patch_horovod()
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._undo):
            current = getattr(owner, name)
            if isinstance(current, _Submissions):  # collectives still in flight keep their handles
                original.clear()
                original.update(current)
            setattr(owner, name, original)
        self._undo.clear()

    def take(self) -> dict:
        counts = {"reads": dict(self.reads), "host_reads": dict(self.host_reads), "waits": self.waits,
                  "wait_seconds": self.wait_seconds}
        self.reads.clear()
        self.host_reads.clear()
        self.waits, self.wait_seconds = 0, 0.0
        return counts

    def _patch(self, owner, name: str, replacement) -> None:
        self._undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    def _read_counter(self, label: str, original, counter=None):
        audit, counter = self, self.reads if counter is None else counter

        def counted(*args, **kwargs):
            if threading.get_ident() == audit.thread:
                caller = sys._getframe(1)
                counter[f"{label} at {caller.f_code.co_filename}:{caller.f_lineno}"] += 1
            return original(*args, **kwargs)

        return counted

    def _patch_horovod(self) -> None:
        if "horovod.torch" not in sys.modules:
            return
        mpi_ops = sys.modules["horovod.torch.mpi_ops"]
        original = mpi_ops.synchronize
        audit = self

        def synchronize(handle):
            if threading.get_ident() != audit.thread:
                return original(handle)
            if audit._submitted:
                audit.waits += 1
                audit._submitted = False
            started = time.perf_counter()
            try:
                return original(handle)
            finally:
                audit.wait_seconds += time.perf_counter() - started

        def submitted() -> None:
            if threading.get_ident() == audit.thread:
                audit._submitted = True

        self._patch(mpi_ops, "_handle_map", _Submissions(mpi_ops._handle_map, submitted))
        for module in ("horovod.torch.mpi_ops", "horovod.torch", "horovod.torch.optimizer"):
            if module in sys.modules and getattr(sys.modules[module], "synchronize", None) is original:
                self._patch(sys.modules[module], "synchronize", synchronize)
