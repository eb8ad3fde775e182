"""Checkpoints that are never half-written and never silently wrong.

Each file is a one-line header with the sha256 of the torch payload that follows. It is
written to a temporary file in the same directory, flushed, fsynced and renamed, so a reader
sees the previous checkpoint or the complete new one, also when the writer is killed or the
disk fills mid-write. Loading verifies the checksum and falls back to the previous file.

A ``Writer`` saves in the background (torch.distributed.checkpoint's ``async_save`` with its
staging in the background): the state is copied into host buffers kept between saves, and a
thread serializes, writes, syncs and renames it, and only then deletes the checkpoints beyond
``keep``. What only the optimizer step changes (the weights, the optimizer's state; the caller
names them) is copied by that thread while the next step's forward and backward run, and
``before_update()``, called before that optimizer step, waits for the copy; the rest (buffers
such as batch norm's statistics, which a forward changes) is copied before save() returns. One
save is in flight at most.

A sharded save (``split``) has every rank write a part of what every rank holds alike (the
weights and, under DistributedOptimizer, the optimizer state), tensors balanced by bytes, into the
checkpoint's shard folder; rank 0's main file holds the rest and a ``Part`` in place of each
tensor another rank wrote, and is written only once every part is durable, with their checksums:
the checkpoint exists whole or not at all. Reading it joins the parts back into one state.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import io
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from hvdkit.system import wholefiles

PREFIX = "ckpt-step"
SUFFIX = ".pt"
MAGIC = b"HVDKIT-CHECKPOINT 1 sha256="
SHARDS = ".shards"


class CheckpointError(Exception):
    """A checkpoint that cannot be written or used; the message names the file."""


def path_for(directory: str, step: int) -> Path:
    return Path(directory) / f"{PREFIX}{step:09d}{SUFFIX}"


def step_of(path: Path) -> int:
    """The step of checkpoint ``path`` (path_for's name)."""
    return int(path.name.removeprefix(PREFIX).removesuffix(SUFFIX))


def existing(directory: str) -> list[Path]:
    """Checkpoint files, oldest first (the step is zero-padded in the name)."""
    return sorted(Path(directory).glob(f"{PREFIX}*{SUFFIX}"))


def save(directory: str, step: int, state: dict, keep: int) -> Path:
    """Write ``state`` as the checkpoint of ``step`` atomically, then keep only the newest ``keep``
    (and the shard folders of those; a sharded save killed part-way left one of no checkpoint)."""
    target = path_for(directory, step)
    write(target, state)
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

    def __init__(self, background: bool = True) -> None:
        self.background = background
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

    def save(self, directory: str, step: int, state: dict, keep: int, deferred: Iterable[torch.Tensor] = (),
             part: Optional[str] = None, parts: Sequence[str] = ()) -> Path:
        """Checkpoint ``state`` as ``step``'s: written when this returns if not in the
        background, else copied, and written by the thread. The ``deferred`` tensors (those only
        the optimizer step changes) are copied by the thread: call before_update() before they
        change. A sharded save: ``part`` is this rank's file in the shard folder (``state`` its
        tensors), or ``parts`` the other ranks' files, which the main file waits for. The previous
        save's error, if any, is raised here first."""
        started = time.perf_counter()
        if self.in_flight():
            self.waits += 1
        self.finish()
        self.saves += 1
        self._step = step
        commit = functools.partial(_commit, directory, step, keep, part, parts, self._ending)
        if not self.background:
            self._write(directory, step, state, commit, (), None)
        else:
            staged, copies, ready = self._stage(state, {t.data_ptr() for t in deferred if not t.is_cuda})
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
            try:
                changed = _copy(copies)
            finally:
                self._staged.set()
            if changed:
                raise CheckpointError(
                    f"checkpoint {path_for(directory, step)} not written: {changed} tensors of the weights or the "
                    f"optimizer's state changed in place after the save and before the next optimizer step, while "
                    f"being copied in the background; change them in the optimizer step, or save with "
                    f"--no-async-checkpoint (async_checkpoint=False); the previous checkpoints are untouched")
            if ready is not None:
                ready.synchronize()  # the copies from the GPU, queued by _stage
            commit(state)
            self._done.append({"step": step, "write_seconds": round(time.perf_counter() - started, 4),
                               "background": self.background})
        except BaseException as exc:  # noqa: B036 -- raised again in the training thread
            if not self.background:
                raise
            self._error = exc if isinstance(exc, CheckpointError) else CheckpointError(
                f"cannot write checkpoint {path_for(directory, step)}: {exc}; the previous checkpoints are untouched")
        finally:
            self.writing += time.perf_counter() - started

    def _stage(self, state: dict, deferred: set):
        """(a copy of ``state`` whose tensors are in host buffers kept for the next save, pinned
        for a GPU's; the copies left to the thread, of the host tensors in ``deferred`` (by
        data_ptr), each with its version now; a CUDA event the writer waits for, or None). The
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

        staged = _rebuild(state, held, copy.deepcopy)
        ready = None
        if on_gpu:
            ready = torch.cuda.Event()
            ready.record()
        return staged, copies, ready


def _copy(copies: list) -> int:
    """Make the deferred copies (torch lets the GIL go while it copies); the number of sources
    changed in place meanwhile (their version moved), whose copy may hold either value."""
    changed = 0
    for buffer, source, version in copies:
        buffer.copy_(source)
        changed += source._version != version
    return changed


def _rebuild(value: Any, tensor: Callable[[torch.Tensor, tuple], Any], other: Callable[[Any], Any],
             place: tuple = ()) -> Any:
    """``value`` with each tensor replaced by ``tensor(it, its place)`` and each other leaf by
    ``other(it)``; dicts are copied shallowly, keeping their class and attributes (a state_dict's
    _metadata), lists and tuples rebuilt."""
    if isinstance(value, torch.Tensor):
        return tensor(value, place)
    if isinstance(value, dict):
        copied = copy.copy(value)
        for key, item in value.items():
            copied[key] = _rebuild(item, tensor, other, (*place, key))
        return copied
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_rebuild(item, tensor, other, (*place, i)) for i, item in enumerate(value))
    return other(value)


def _commit(directory: str, step: int, keep: int, part: Optional[str], parts: Sequence[str],
            ending: threading.Event, state: dict) -> None:
    """Write a save: this rank's part, or the main file (once the parts it names are durable)."""
    main = path_for(directory, step)
    if part is not None:
        write(shard_folder(main) / part, state)
        return
    if parts:
        state = {**state, "parts": _await_parts(main, parts, ending)}
    save(directory, step, state, keep)


class Part:
    """In a sharded checkpoint's main file, a tensor another rank wrote: its part file in the
    shard folder and its number there."""

    def __init__(self, file: str, number: int) -> None:
        self.file, self.number = file, number


def part_name(rank: int, size: int) -> str:
    return f"part-{rank:05d}-of-{size:05d}.pt"


def split(state: dict, shared: Iterable[torch.Tensor], size: int) -> tuple[dict, list[dict]]:
    """(the main file's state, each rank's part: number -> tensor) of a sharded save. The tensors
    in ``shared`` (the same on every rank) are split among the ranks by bytes, the largest first
    to the rank with the fewest, so that every rank computes the same split; rank 0 keeps its own
    in the main file, where each other rank's is a Part."""
    shared_ptrs = {t.data_ptr() for t in shared if t.layout == torch.strided and t.numel()}
    numbers: dict[tuple, int] = {}  # a tensor's memory, shape and dtype -> its number
    tensors: list[torch.Tensor] = []

    def identity(value: torch.Tensor) -> tuple:
        return value.data_ptr(), tuple(value.shape), value.stride(), value.dtype

    def number(value: torch.Tensor, place: tuple) -> torch.Tensor:
        if value.layout == torch.strided and value.data_ptr() in shared_ptrs and identity(value) not in numbers:
            numbers[identity(value)] = len(tensors)
            tensors.append(value)
        return value

    _rebuild(state, number, lambda leaf: leaf)
    owner, load = {}, [0] * size
    for n in sorted(range(len(tensors)), key=lambda n: -tensors[n].nbytes):
        owner[n] = rank = load.index(min(load))
        load[rank] += tensors[n].nbytes
    parts: list[dict] = [{} for _ in range(size)]
    for n, rank in owner.items():
        if rank:
            parts[rank][n] = tensors[n]

    def placed(value: torch.Tensor, place: tuple) -> Any:
        n = numbers.get(identity(value)) if value.layout == torch.strided else None
        return value if n is None or not owner[n] else Part(part_name(owner[n], size), n)

    return _rebuild(state, placed, lambda leaf: leaf), parts


PART_WAIT_SECONDS = 600.0  # a rank whose part does not appear by then failed, or does not share the directory


def _await_parts(main: Path, names: Sequence[str], ending: threading.Event) -> list[dict]:
    """The parts of checkpoint ``main`` as the other ranks finish them (each is renamed into place
    once durable), with the checksums their headers hold; CheckpointError once ``ending`` is set."""
    folder, found = shard_folder(main), {}
    deadline = time.monotonic() + PART_WAIT_SECONDS
    while len(found) < len(names):
        for name in names:
            if name not in found:
                try:
                    with open(folder / name, "rb") as f:
                        found[name] = f.readline()[len(MAGIC):].strip().decode()
                except FileNotFoundError:
                    pass
        if len(found) < len(names):
            missing = ", ".join(name for name in names if name not in found)
            if ending.is_set():
                raise CheckpointError(f"checkpoint {main} not written: the job ended before {missing} appeared in "
                                      f"{folder}; the previous checkpoints are untouched")
            if time.monotonic() > deadline:
                raise CheckpointError(f"checkpoint {main} not written: {missing} did not appear in {folder} within "
                                      f"{PART_WAIT_SECONDS:g} s (a rank failed to write it, or {main.parent} is not "
                                      f"shared by every host); the previous checkpoints are untouched")
            ending.wait(0.02)
    return [{"file": name, "sha256": found[name]} for name in names]


def join_parts(path: Path, state: dict) -> dict:
    """A sharded checkpoint's state whole, its parts read back in place of their Parts;
    CheckpointError if a part is missing, altered, or not the one the main file committed."""
    entries = state.get("parts")
    if not entries:
        return state
    tensors = {}
    for entry in entries:
        try:
            digest, part = _read(shard_folder(path) / entry["file"])
        except CheckpointError as exc:
            raise CheckpointError(f"{path} is incomplete: {exc}") from None
        if digest != entry["sha256"]:
            raise CheckpointError(f"{path} is corrupted: its part {entry['file']} is not the one it was written with")
        tensors.update({(entry["file"], n): tensor for n, tensor in part.items()})
    whole = {key: value for key, value in state.items() if key != "parts"}
    return _rebuild(whole, lambda tensor, place: tensor,
                    lambda leaf: tensors[leaf.file, leaf.number] if isinstance(leaf, Part) else leaf)


def clean_partials(directory: str) -> None:
    """Remove the temporaries of saves that were killed mid-write (the checkpoints stay as they were)."""
    for stale in Path(directory).glob(f".{PREFIX}*{SUFFIX}.*{wholefiles.PARTIAL}"):
        stale.unlink(missing_ok=True)


def shard_folder(path: Path) -> Path:
    """Where the ranks of a sharded run write their parts of checkpoint ``path`` (hvdkit.zero.shards)."""
    return Path(f"{path}{SHARDS}")


class _Hashing:
    """A file that hashes what is written to it: torch.save streams into the file, with no copy of
    the whole payload in memory, and the checksum is known at its end."""

    def __init__(self, file) -> None:
        self.file, self.sha256 = file, hashlib.sha256()
        self.error: Optional[OSError] = None  # torch.save turns it into a RuntimeError without its reason

    def write(self, data) -> int:
        self.sha256.update(data)
        try:
            return self.file.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.file.flush()


def write(target: Path, state: dict) -> str:
    """``state`` in ``target``, atomically, with its checksum; returns the checksum. The header's
    checksum is written last, over a placeholder of its length, once the payload is streamed."""
    hashed: list = []

    def stream(file) -> None:
        file.write(MAGIC + b"0" * 64 + b"\n")
        payload = _Hashing(file)
        try:
            torch.save(state, payload)
        except RuntimeError:
            if payload.error is not None:
                raise payload.error from None
            raise
        hashed.append(payload.sha256.hexdigest())
        file.seek(len(MAGIC))
        file.write(hashed[0].encode())

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.name.startswith(PREFIX):
            clean_partials(str(target.parent))
        else:
            for stale in target.parent.glob(f".{target.name}.*{wholefiles.PARTIAL}"):  # left by a save that was killed
                stale.unlink(missing_ok=True)
        wholefiles.write_whole(target, stream, durable=True)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {target}: {exc.strerror or exc}; "
                              f"the previous checkpoints are untouched") from None
    return hashed[0]


def load(path: Path) -> dict:
    """The state in ``path``; CheckpointError if it is truncated, altered or not a checkpoint."""
    return _read(path)[1]


def _read(path: Path) -> tuple[str, dict]:
    """(the checksum ``path``'s header holds and its payload has, the state it holds)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror}") from None
    header, newline, payload = data.partition(b"\n")
    if not header.startswith(MAGIC) or not newline:
        raise CheckpointError(f"{path} is not an hvdkit checkpoint")
    digest = hashlib.sha256(payload).hexdigest()
    if digest.encode() != header[len(MAGIC):]:
        raise CheckpointError(f"{path} is corrupted (checksum mismatch)")
    return digest, torch.load(io.BytesIO(payload), weights_only=False)


def load_whole(path: Path) -> dict:
    """The state of checkpoint ``path`` with its parts joined, after checking that a sharded run's
    shards are all there and intact; CheckpointError if any is not."""
    state = join_parts(path, load(path))
    check_shards(path, state)
    return state


def check_shards(path: Path, state: dict) -> None:
    """CheckpointError unless every shard a sharded checkpoint names is there and intact
    (read in chunks: no rank holds them all)."""
    manifest = state.get("optimizer")
    if not (isinstance(manifest, dict) and "shards" in manifest):
        return
    for entry in manifest["shards"]:
        shard = shard_folder(path) / entry["file"]
        digest = hashlib.sha256()
        try:
            with open(shard, "rb") as f:
                f.readline()
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
        except OSError as exc:
            raise CheckpointError(f"{path} is incomplete: its shard {shard.name} cannot be read "
                                  f"({exc.strerror})") from None
        if digest.hexdigest() != entry["sha256"]:
            raise CheckpointError(f"{path} is corrupted: its shard {shard.name} fails its checksum")


def load_latest(directory: str, warn: Callable[[str], None]) -> Optional[tuple[Path, dict]]:
    """The newest checkpoint that verifies, warning about each newer one that does not.

    None when the directory holds no checkpoint; CheckpointError when it holds only bad ones.
    """
    files = existing(directory)
    problems = []
    for path in reversed(files):
        try:
            state = load_whole(path)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        for problem in problems:
            warn(f"{problem}; using {path.name} instead")
        return path, state
    if problems:
        raise CheckpointError(f"no valid checkpoint in {directory}: " + "; ".join(problems))
    return None
