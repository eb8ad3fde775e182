"""Checkpoints that are never half-written and never silently wrong.

Each file is a one-line header with the sha256 of the torch payload that follows. It is
written to a temporary file in the same directory, flushed, fsynced and renamed, so a reader
sees the previous checkpoint or the complete new one, also when the writer is killed or the
disk fills mid-write. Loading verifies the checksum and falls back to the previous file.
"""

from __future__ import annotations

import hashlib
import io
import shutil
from pathlib import Path
from typing import Callable, Optional

import torch

from hvdkit import job

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


def shard_folder(path: Path) -> Path:
    """Where the ranks of a sharded run write their parts of checkpoint ``path`` (hvdkit.zero.shards)."""
    return Path(f"{path}{SHARDS}")


def write(target: Path, state: dict) -> str:
    """``state`` in ``target``, atomically, with its checksum; returns the checksum."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getbuffer()
    digest = hashlib.sha256(payload).hexdigest()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        stem = f"{PREFIX}*{SUFFIX}" if target.name.startswith(PREFIX) else target.name
        for stale in target.parent.glob(f".{stem}.*{job.PARTIAL}"):  # left by a save that was killed
            stale.unlink(missing_ok=True)
        job.write_whole(target, (MAGIC + digest.encode() + b"\n", payload), durable=True)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {target}: {exc.strerror or exc}; "
                              f"the previous checkpoints are untouched") from None
    return digest


def load(path: Path) -> dict:
    """The state in ``path``; CheckpointError if it is truncated, altered or not a checkpoint."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror}") from None
    header, newline, payload = data.partition(b"\n")
    if not header.startswith(MAGIC) or not newline:
        raise CheckpointError(f"{path} is not an hvdkit checkpoint")
    if hashlib.sha256(payload).hexdigest().encode() != header[len(MAGIC):]:
        raise CheckpointError(f"{path} is corrupted (checksum mismatch)")
    return torch.load(io.BytesIO(payload), weights_only=False)


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
            state = load(path)
            check_shards(path, state)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        for problem in problems:
            warn(f"{problem}; using {path.name} instead")
        return path, state
    if problems:
        raise CheckpointError(f"no valid checkpoint in {directory}: " + "; ".join(problems))
    return None
