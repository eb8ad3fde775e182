"""Saving: at once (``save``), or in the background (``Writer``, as torch.distributed.checkpoint's
``async_save`` with its staging in the background): the state is copied into host buffers kept
between saves, and a thread serializes, writes, syncs and renames it, and only then deletes the
checkpoints beyond ``keep``. What only the optimizer step changes (the weights, the optimizer's
state; the caller names them) is copied by that thread while the next step's forward and backward
run, and ``before_update()``, called before that optimizer step, waits for the copy; the rest
(buffers such as batch norm's statistics, which a forward changes) is copied before save()
returns. One save is in flight at most."""

from __future__ import annotations

import copy
import functools
import shutil
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import torch

from hvdkit.checkpoint import slots
from hvdkit.checkpoint.format import (
    PREFIX,
    SHARDS,
    SUFFIX,
    CheckpointError,
    existing,
    path_for,
    shard_folder,
    write,
)
from hvdkit.checkpoint.parts import await_parts
from hvdkit.nested import rebuild


class Later:
    """A value of a save known only after save() returns (a collective still in flight): the
    writing thread calls ``resolve()`` before it writes, so that the step need not wait for it."""

    def __init__(self, resolve: Callable[[], object]) -> None:
        self.resolve = resolve

    def __deepcopy__(self, memo: dict) -> "Later":
        return self


def _resolved(state: dict) -> dict:
    return rebuild(state, lambda tensor, place: tensor,
                   lambda leaf, place: leaf.resolve() if isinstance(leaf, Later) else leaf)


def save(directory: str, step: int, state: dict, keep: int, raw: Optional[slots.Mapped] = None) -> Path:
    """Write ``state`` as the checkpoint of ``step`` atomically, then keep only the newest ``keep``
    (and the shard folders of those; a sharded save killed part-way left one of no checkpoint).
    ``raw``: in slots (format.write)."""
    target = path_for(directory, step)
    write(target, state, raw)
    for old in existing(directory)[:-keep]:
        old.unlink(missing_ok=True)
        shutil.rmtree(shard_folder(old), ignore_errors=True)
    for folder in Path(directory).glob(f"{PREFIX}*{SUFFIX}{SHARDS}"):
        if not Path(str(folder).removesuffix(SHARDS)).exists():
            shutil.rmtree(folder, ignore_errors=True)
    return target


class Writer:
    """The saves of one rank, in a background thread unless ``background`` is False. ``stall``
    is what saves held the caller (staging, waiting for the save before, and before_update's
    waits), ``writing`` what the writes took; ``waits`` counts the saves that found the one before
    still in flight."""

    def __init__(self, background: bool = True, raw: bool = False) -> None:
        # raw: the main file's tensors in slots kept mapped (snapshots; parts are torch's, checked by sha256)
        self.background, self.raw = background, slots.Mapped() if raw else None
        self.saves, self.waits = 0, 0
        self.stall, self.writing = 0.0, 0.0  # seconds
        self._thread: Optional[threading.Thread] = None
        self._staged = threading.Event()  # the thread has copied what the next update changes
        self._staged.set()
        self._stalls: dict[int, float] = {}  # step -> what its save held the caller, until take_done()
        self._step = -1  # the step of the save in flight
        self._error: Optional[BaseException] = None
        self._buffers: dict = {}  # host copies of the state's tensors, by their place in it
        self._done: list[dict] = []  # the saves written since take_done(), appended by the thread
        self._ending = threading.Event()  # the job ends: a main file waits no longer for parts

    def save(self, directory: str, step: int, state: Optional[dict], keep: int, deferred: Iterable[torch.Tensor] = (),
             part: Optional[tuple[str, dict]] = None, parts: Sequence[str] = ()) -> Path:
        """Checkpoint ``step``: ``state`` is the main file (rank 0's; None on the other ranks of a
        parted save), ``part`` this rank's part (its file name, its state), ``parts`` the other
        ranks' part files, which the main file waits for (checkpoint.parts). Written when this
        returns if not in the background, else copied, and written by the thread. The ``deferred``
        tensors (those only the optimizer step changes) are copied by the thread: call
        before_update() before they change. The previous save's error, if any, is raised here first."""
        started = time.perf_counter()
        if self.in_flight():
            self.waits += 1
        self.finish()
        self.saves += 1
        self._step = step
        commit = functools.partial(_commit, directory, step, keep, part and part[0], parts, self._ending, self.raw)
        files = {"main": state, "part": part and part[1]}
        if not self.background:
            self._write(directory, step, files, commit, (), None)
        else:
            staged, copies, ready = self._stage(files, {t.data_ptr() for t in deferred if not t.is_cuda})
            self._staged.clear()
            self._thread = threading.Thread(target=self._write, name="hvdkit-checkpoint",  # not a daemon: an
                                            args=(directory, step, staged, commit, copies, ready))  # exit waits
            self._thread.start()
        self._held(step, time.perf_counter() - started)
        return path_for(directory, step)

    def before_update(self) -> None:
        """Wait until the save in flight has copied the tensors the caller deferred; they may
        change from then on."""
        if not self._staged.is_set():
            started = time.perf_counter()
            self._staged.wait()
            self._held(self._step, time.perf_counter() - started)

    def take_done(self) -> list[dict]:
        """The saves written since the last call: step, what each held training and what its write took."""
        count = len(self._done)  # the thread may append meanwhile: take only what was there
        done = self._done[:count]
        del self._done[:count]
        return [{**record, "stall_seconds": round(self._stalls.pop(record["step"], 0.0), 4)} for record in done]

    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def finish(self) -> None:
        """Wait for the save in flight; CheckpointError if it failed (the checkpoint before it stays)."""
        self.wait()
        self.check()

    def abandon_parts(self) -> None:
        """The job ends on an error: a main file still waiting for the parts of other ranks (which
        may have ended) is not written; the checkpoints before it stay."""
        self._ending.set()

    def wait(self) -> None:
        """Wait for the save in flight, keeping its error for check()."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def wait_written(self, timeout: float) -> None:
        """From a thread other than the saving one: wait up to ``timeout`` seconds for the save in
        flight to be written, changing nothing here (the saving thread may be anywhere)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def close(self) -> None:
        """Wait for the save in flight; unmap the slots of raw saves."""
        self.wait()
        if self.raw is not None:
            self.raw.close()

    def check(self) -> None:
        """The background save's error, raised without waiting (none while it still runs)."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _held(self, step: int, seconds: float) -> None:
        self.stall += seconds
        self._stalls[step] = self._stalls.get(step, 0.0) + seconds

    def _write(self, directory: str, step: int, state: dict, commit: Callable, copies: list, ready) -> None:
        started = time.perf_counter()
        try:
            if self.raw is None:
                try:
                    changed = _copy(copies)
                finally:
                    self._staged.set()
                _refuse_changed(changed, directory, step)
            else:  # the slot's copy is the only one: the update waits for it (slots.write calls back)
                self.raw.after_copy = functools.partial(self._copied, copies, directory, step)
                self.raw.resolve = _resolved
            if ready is not None:
                ready.synchronize()  # the copies from the GPU, queued by _stage
            commit(state if self.raw is not None else _resolved(state))
            self._done.append({"step": step, "write_seconds": round(time.perf_counter() - started, 4),
                               "background": self.background})
        except BaseException as exc:  # noqa: B036 -- raised again in the training thread
            if not self.background:
                raise
            self._error = exc if isinstance(exc, CheckpointError) else CheckpointError(
                f"cannot write checkpoint {path_for(directory, step)}: {exc}; the previous checkpoints are untouched")
        finally:
            self._staged.set()
            self.writing += time.perf_counter() - started

    def _copied(self, sources: list, directory: str, step: int) -> None:
        """A raw save's tensors are in their slot: the update may change them now, unless one
        changed while they were copied."""
        changed = sum(source._version != version for _, source, version in sources)
        self._staged.set()
        _refuse_changed(changed, directory, step)

    def _stage(self, state: dict, deferred: set):
        """(a copy of ``state`` whose tensors are in host buffers kept for the next save, pinned
        for a GPU's; the copies left to the thread, of the host tensors in ``deferred`` (by
        data_ptr), each with its version now (a raw save's: copied by the thread straight into
        its slot, no buffer); a CUDA event the writer waits for, or None). The
        copies from a GPU are queued on the current stream, before anything the training does
        next to those tensors."""
        seen: dict = {}  # tensors that share memory stay shared in the copy
        copies: list = []
        on_gpu = False

        def held(value: torch.Tensor, place: tuple) -> torch.Tensor:
            nonlocal on_gpu
            if value.layout != torch.strided:  # sparse: a plain copy
                return value.detach().to("cpu", copy=True)
            key = (value.device, value.data_ptr(), value.dtype, tuple(value.shape), value.stride())
            if value.data_ptr() and key in seen:
                return seen[key]
            if value.data_ptr() in deferred and self.raw is not None:  # copied into its slot by the thread
                copies.append((None, value.detach(), value._version))
                seen[key] = value.detach()
                return seen[key]
            buffer = self._buffers.get(place)
            if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                buffer = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.is_cuda)
                self._buffers[place] = buffer
            if value.data_ptr() in deferred:
                copies.append((buffer, value.detach(), value._version))
            else:
                buffer.copy_(value.detach(), non_blocking=value.is_cuda)
            on_gpu = on_gpu or value.is_cuda
            seen[key] = buffer
            return buffer

        staged = rebuild(state, held, lambda leaf, place: copy.deepcopy(leaf))
        ready = None
        if on_gpu:
            ready = torch.cuda.Event()
            ready.record()
        return staged, copies, ready


def _refuse_changed(changed: int, directory: str, step: int) -> None:
    if changed:
        raise CheckpointError(
            f"checkpoint {path_for(directory, step)} not written: {changed} tensors of the weights or the "
            f"optimizer's state changed in place after the save and before the next optimizer step, while "
            f"being copied in the background; change them in the optimizer step, or save with "
            f"--no-async-checkpoint (async_checkpoint=False); the previous checkpoints are untouched")


def _copy(copies: list) -> int:
    """Make the deferred copies (torch lets the GIL go while it copies); the number of sources
    changed in place meanwhile (their version moved), whose copy may hold either value."""
    changed = 0
    for buffer, source, version in copies:
        buffer.copy_(source)
        changed += source._version != version
    return changed


def _commit(directory: str, step: int, keep: int, part: Optional[str], parts: Sequence[str],
            ending: threading.Event, raw: Optional[slots.Mapped], files: dict) -> None:
    """Write a save: this rank's part, then (rank 0) the main file, once the other ranks' parts
    are durable, naming every part with its checksum."""
    main = path_for(directory, step)
    written = []
    if part is not None:
        written.append({"file": part, "sha256": write(shard_folder(main) / part, files["part"])})
    if files["main"] is None:
        return
    entries = sorted(written + (await_parts(main, parts, ending) if parts else []), key=lambda e: e["file"])
    save(directory, step, {**files["main"], "parts": entries} if entries else files["main"], keep, raw)
