"""The checkpoint file: its name (``ckpt-step000000050.pt``, its shard folder beside it), and its
format, a one-line header with the checksum of the payload that follows, written through a
temporary file that is flushed, fsynced and renamed, so that a reader sees the previous checkpoint
or the complete new one, also when the writer is killed or the disk fills mid-write. Every other
module reads names through these functions (tests/test_layout.py).

Two payloads: torch.save's, with its sha256 (checkpoints); and a snapshot's (``raw``), its
tensors in a slot beside it (hvdkit.checkpoint.slots), with xxh3-128."""

from __future__ import annotations

import hashlib
import io
import re
from pathlib import Path
from typing import Optional

import torch

from hvdkit.checkpoint import slots
from hvdkit.system import wholefiles

PREFIX = "ckpt-step"
SUFFIX = ".pt"
PATTERN = f"{PREFIX}*{SUFFIX}"  # every checkpoint file's name, as a glob
MAGIC = b"HVDKIT-CHECKPOINT 1 sha256="
SHARDS = ".shards"


class CheckpointError(Exception):
    """A checkpoint that cannot be written or used; the message names the file."""


def path_for(directory: str, step: int) -> Path:
    return Path(directory) / f"{PREFIX}{step:09d}{SUFFIX}"


def step_of(path: Path) -> int:
    """The step of checkpoint ``path`` (path_for's name)."""
    return int(path.name.removeprefix(PREFIX).removesuffix(SUFFIX))


def step_in(name: str) -> Optional[int]:
    """The step a checkpoint's file, its temporary or its shard folder belongs to, read from the
    name; None for any other file."""
    match = re.search(rf"{PREFIX}(\d+)", name)
    return int(match[1]) if match else None


def rank_of_part(name: str) -> Optional[int]:
    """The rank that writes a part, read from its name or its temporary's (part_name's, or a ZeRO
    shard's ``rank-N-of-M`` in checkpoints before one protocol for parts); None for any other file."""
    match = re.search(r"(?:part|rank)-(\d+)-of-\d+\.pt", name)
    return int(match[1]) if match else None


def is_shard_folder(name: str) -> bool:
    """Whether ``name`` is a checkpoint's shard folder (shard_folder's name)."""
    return name.startswith(PREFIX) and name.endswith(SUFFIX + SHARDS)


def existing(directory: str) -> list[Path]:
    """Checkpoint files, oldest first (the step is zero-padded in the name)."""
    return sorted(Path(directory).glob(PATTERN))


def shard_folder(path: Path) -> Path:
    """Where the ranks write their parts of checkpoint ``path`` (hvdkit.checkpoint.parts)."""
    return Path(f"{path}{SHARDS}")


def clean_partials(directory: str) -> None:
    """Remove the temporaries of saves that were killed mid-write (the checkpoints stay as they were)."""
    for stale in Path(directory).glob(f".{PREFIX}*{SUFFIX}.*{wholefiles.PARTIAL}"):
        stale.unlink(missing_ok=True)


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


def write(target: Path, state: dict, raw: Optional[slots.Mapped] = None) -> str:
    """``state`` in ``target``, atomically, with its checksum; returns the checksum. The header's
    checksum is written last, over a placeholder of its length, once the payload is streamed.
    ``raw``: the tensors in a slot beside it, kept mapped there (hvdkit.checkpoint.slots), for
    snapshots."""
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
        if raw is not None:
            newest = existing(str(target.parent))
            return slots.write(target, state, newest[-1] if newest else None, raw)
        wholefiles.write_whole(target, stream, durable=True)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {target}: {exc.strerror or exc}; "
                              f"the previous checkpoints are untouched") from None
    return hashed[0]


def load(path: Path) -> dict:
    """The state in ``path``; CheckpointError if it is truncated, altered or not a checkpoint."""
    return read_checked(path)[1]


def read_checked(path: Path) -> tuple[str, dict]:
    """(the checksum ``path``'s header holds and its payload has, the state it holds)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror}") from None
    header, newline, payload = data.partition(b"\n")
    raw = header.startswith(slots.MAGIC)
    if not (raw or header.startswith(MAGIC)) or not newline:
        raise CheckpointError(f"{path} is not an hvdkit checkpoint")
    digest = slots.checksum(payload) if raw else hashlib.sha256(payload).hexdigest()
    if digest.encode() != header[len(slots.MAGIC if raw else MAGIC):]:
        raise CheckpointError(f"{path} is corrupted (checksum mismatch)")
    if raw:
        return digest, slots.read(path, payload, lambda why: CheckpointError(f"{path} is corrupted: {why}"))
    return digest, torch.load(io.BytesIO(payload), weights_only=False)
