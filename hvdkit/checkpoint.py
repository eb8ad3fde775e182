"""Checkpoints that are never half-written: temporary file, fsync, rename, in one directory.

A reader (or a resumed job) therefore sees either the previous checkpoint or the complete
new one, also when the writer is killed or the disk fills mid-write.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional

import torch

PREFIX = "ckpt-step"
SUFFIX = ".pt"


def path_for(directory: str, step: int) -> Path:
    return Path(directory) / f"{PREFIX}{step:09d}{SUFFIX}"


def save(directory: str, step: int, state: dict) -> Path:
    """Write ``state`` as the checkpoint of ``step`` atomically; return its path."""
    target = path_for(directory, step)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    return target


def latest(directory: str) -> Optional[Path]:
    found = sorted(Path(directory).glob(f"{PREFIX}*{SUFFIX}"))
    return found[-1] if found else None
