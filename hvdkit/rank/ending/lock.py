"""One run per directory: a second run on a checkpoint or log directory in use is refused.

Two runs sharing a checkpoint_dir overwrite each other's checkpoints and interleave their
metrics, and both exit 0. Rank 0 of a run therefore holds an advisory lock (flock) on a file
in each directory it writes for as long as it runs. The kernel releases the lock when the
process ends, however it ends, so a lock left by a killed or requeued run never blocks the
resume: only a live holder does. The file names the holder, for the refusal's one line, and
is removed when the run ends.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import IO

from hvdkit.config import ConfigError, TrainConfig

NAME = ".hvdkit-run.lock"


class DirectoryInUse(ConfigError):
    """Another live run holds the directory."""


class DirectoryLock:
    def __init__(self, directory: str, what: str) -> None:
        self.path = Path(directory) / NAME
        self.what = what
        self._file: IO | None = None

    def acquire(self) -> None:
        """Take the lock or raise DirectoryInUse naming its holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            handle = open(self.path, "a+")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _describe(handle)
                handle.close()
                raise DirectoryInUse(f"{self.what} {self.path.parent} is in use by another run ({holder}); wait for "
                                     f"it to end, or use another directory") from None
            except OSError as exc:  # Lustre mounted without -o flock, some FUSE filesystems
                handle.close()
                print(f"hvdkit: warning: cannot lock {self.what} {self.path.parent} ({exc.strerror}): a second run "
                      f"on it would not be refused", file=sys.stderr, flush=True)
                return
            # The holder may have removed the file between our open and our lock: lock the new one.
            if self.path.exists() and os.fstat(handle.fileno()).st_ino == os.stat(self.path).st_ino:
                break
            handle.close()
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "slurm_job": os.environ.get("SLURM_JOB_ID"),
                                 "since": time.strftime("%Y-%m-%d %H:%M:%S")}))
        handle.flush()
        self._file = handle
        atexit.register(self.release)

    def release(self) -> None:
        if self._file is None:
            return
        self.path.unlink(missing_ok=True)
        self._file.close()  # closing releases the lock
        self._file = None


def _describe(handle: IO) -> str:
    handle.seek(0)
    try:
        holder = json.loads(handle.read() or "{}")
    except ValueError:
        holder = {}
    if not holder:
        return "its holder is starting"
    job = f", Slurm job {holder['slurm_job']}" if holder.get("slurm_job") else ""
    return f"pid {holder.get('pid')} on {holder.get('host')}{job}, since {holder.get('since')}"


def lock_directories(cfg: TrainConfig, hvd, log_dir: str) -> list[DirectoryLock]:
    """Rank 0 locks the checkpoint and log directories for this run (DirectoryLock);
    every rank stops with the same line when another run holds one."""
    if cfg.elastic:  # rank 0 may leave and another process take its place
        return []
    locks, problem = [], None
    if hvd.rank() == 0:
        places = {os.path.realpath(d): what for d, what in ((cfg.checkpoint_dir, "checkpoint_dir"),
                                                             (log_dir, "log_dir")) if d}
        try:
            for directory, what in places.items():
                locks.append(DirectoryLock(directory, what))
                locks[-1].acquire()
        except DirectoryInUse as exc:
            locks.pop()
            for held in locks:
                held.release()
            problem = exc
    problem = hvd.broadcast_object(problem, root_rank=0, name="hvdkit.lock")
    if problem is not None:
        raise problem
    return locks
