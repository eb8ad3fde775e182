"""Checkpoints that are never half-written and never silently wrong.

Each file is a one-line header with the sha256 of the torch payload that follows. It is
written to a temporary file in the same directory, flushed, fsynced and renamed, so a reader
sees the previous checkpoint or the complete new one, also when the writer is killed or the
disk fills mid-write. Loading verifies the checksum and falls back to the previous file.
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
from pathlib import Path
from typing import Callable, Optional

import torch

PREFIX = "ckpt-step"
SUFFIX = ".pt"
MAGIC = b"HVDKIT-CHECKPOINT 1 sha256="


class CheckpointError(Exception):
    """A checkpoint that cannot be written or used; the message names the file."""


def path_for(directory: str, step: int) -> Path:
    return Path(directory) / f"{PREFIX}{step:09d}{SUFFIX}"


def existing(directory: str) -> list[Path]:
    """Checkpoint files, oldest first (the step is zero-padded in the name)."""
    return sorted(Path(directory).glob(f"{PREFIX}*{SUFFIX}"))


def save(directory: str, step: int, state: dict, keep: int) -> Path:
    """Write ``state`` as the checkpoint of ``step`` atomically, then keep only the newest ``keep``."""
    target = path_for(directory, step)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getbuffer()
    header = MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n"
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        for stale in target.parent.glob(f".{PREFIX}*{SUFFIX}.*.tmp"):  # left by a save that was killed
            stale.unlink(missing_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        tmp = None
        dir_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # make the rename itself durable
        finally:
            os.close(dir_fd)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {target}: {exc.strerror or exc}; "
                              f"the previous checkpoints are untouched") from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    for old in existing(directory)[:-keep]:
        old.unlink(missing_ok=True)
    return target


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


def load_latest(directory: str, warn: Callable[[str], None]) -> Optional[tuple[Path, dict]]:
    """The newest checkpoint that verifies, warning about each newer one that does not.

    None when the directory holds no checkpoint; CheckpointError when it holds only bad ones.
    """
    files = existing(directory)
    problems = []
    for path in reversed(files):
        try:
            state = load(path)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        for problem in problems:
            warn(f"{problem}; using {path.name} instead")
        return path, state
    if problems:
        raise CheckpointError(f"no valid checkpoint in {directory}: " + "; ".join(problems))
    return None
