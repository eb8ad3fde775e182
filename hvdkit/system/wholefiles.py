"""Files written whole: the one atomic write every part of hvdkit uses (checkpoints, records,
heartbeats, reports)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

PARTIAL = ".partial"  # write_whole's temporary: ``.NAME.PID.partial`` beside the file


def write_whole(path: Path, data, durable: bool = False) -> None:
    """Write ``data`` (bytes, text, a tuple of bytes-like parts: no copy joins them, or a function
    that writes into the open file: a checkpoint streamed) to ``path`` through a temporary beside
    it, replaced in one step: a reader (another rank, the launcher, a
    resume) sees the old file or the new, never half. The temporary is this process's own, so
    ranks writing one path do not collide. ``durable`` (checkpoints) also syncs the data and the
    directory entry, so that a machine's crash keeps the file, and then lets the page cache drop
    it: a checkpoint of gigabytes would push the training data out, and slow each next write
    while the cache is full of them (docs/performance-notes.md#figures-behind-the-code). A
    heartbeat or a record that the next write replaces needs neither."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}{PARTIAL}")
    try:
        with open(partial, "wb") as file:
            if callable(data):
                data(file)
            else:
                for part in data if isinstance(data, tuple) else (data,):
                    file.write(part.encode() if isinstance(part, str) else part)
            if durable:
                file.flush()
                os.fsync(file.fileno())
                with contextlib.suppress(OSError):  # advice: a filesystem may not take it
                    os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    if durable:
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
