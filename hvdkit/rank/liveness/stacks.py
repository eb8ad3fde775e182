"""Where every rank is when a job stalls: each rank keeps a file of its threads' stacks in the
run's log directory, ``stacks-rank-N.txt``. Python's faulthandler writes it from a C thread of its
own, on a timer armed once per run that repeats at a fraction of the stall limit: a rank stuck in
C code that holds the GIL, which no Python thread of it can interrupt, is written too. The step
pays nothing: the watchdog's thread (hvdkit.rank.liveness.watchdog) empties the file after progress.

The rank whose watchdog ends the job reads every rank's file and names the stalled rank's
innermost frame in the user's code (not in hvdkit, torch, Horovod or Python's own library), and the
Horovod call the others wait in."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import site
import sysconfig
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import hvdkit

PREFIX = "stacks-rank-"
_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)", re.IGNORECASE)
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
_HEADER = re.compile(r"^# rank (\d+), pid (\d+), main thread (0x[0-9a-f]+)")
_NOW = "# written as the rank ended"
_DUMP = re.compile(rf"^(?:Timeout \(.*\)!|{_NOW})$", re.MULTILINE)  # before each dump: the timer's, or ours


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{_shown(self.file)}:{self.line} in {self.function}"


def path(directory: Path, rank: int) -> Path:
    return Path(directory) / f"{PREFIX}{rank}.txt"


class Stacks:
    """This rank's file of stacks, open from setup() to the run's end. faulthandler's C thread
    appends the stacks every ``period`` seconds for the whole run; the watchdog's thread empties the
    file after each progress, so what it holds was written since the rank last made progress. Armed
    once: re-arming lets the GIL go while the old timer is cancelled, and a rank that takes it then
    and stays in C would be left with no timer."""

    def __init__(self, directory: Path, rank: int, period: float) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = path(directory, rank)
        header = f"# rank {rank}, pid {os.getpid()}, main thread {threading.main_thread().ident:#x}\n"
        self._header = header.encode()
        self._fd: Optional[int] = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        self._lock = threading.Lock()  # the watchdog's thread empties, the run's end closes
        os.write(self._fd, self._header)
        faulthandler.dump_traceback_later(max(period, 0.01), repeat=True, file=self._fd)

    def progress(self) -> None:
        """The rank made progress: what the timer wrote before is of a slow moment that passed."""
        with self._lock:
            if self._fd is not None and os.fstat(self._fd).st_size > len(self._header):
                os.ftruncate(self._fd, len(self._header))

    def write_now(self) -> None:
        """This rank's stacks, now (the calling thread's among them); the run is ending."""
        with self._lock:
            if self._fd is None:
                return
            faulthandler.cancel_dump_traceback_later()
            os.ftruncate(self._fd, len(self._header))
            os.write(self._fd, f"{_NOW}\n".encode())
            faulthandler.dump_traceback(self._fd, all_threads=True)

    def close(self, remove: bool = True) -> None:
        """At the run's end: the timer off, the file closed and removed unless not to be (a rank
        ended by a stall or a stop's count exits without closing it, and the file stays)."""
        with self._lock:
            if self._fd is None:
                return
            faulthandler.cancel_dump_traceback_later()
            os.close(self._fd)
            self._fd = None
        if remove:
            self.path.unlink(missing_ok=True)


def last_dump(text: str) -> str:
    """The last of the dumps in a stacks file ('' if none is whole: one cut by an emptying)."""
    marks = list(_DUMP.finditer(text))
    return text[marks[-1].end():] if marks else ""


def main_thread(text: str) -> list[Frame]:
    """The main thread's frames in a stacks file, innermost first (faulthandler's order)."""
    header = _HEADER.match(text)
    wanted = int(header.group(3), 16) if header else None
    frames: dict[int, list[Frame]] = {}
    current: Optional[list[Frame]] = None
    for line in last_dump(text).splitlines():
        thread = _THREAD.match(line)
        if thread:
            current = frames.setdefault(int(thread.group(1), 16), [])
            continue
        frame = _FRAME.match(line)
        if frame and current is not None:
            current.append(Frame(frame.group(1), int(frame.group(2)), frame.group(3)))
    return frames.get(wanted, []) if wanted is not None else next(iter(frames.values()), [])


def _libraries() -> tuple[str, ...]:
    places = {sysconfig.get_paths()[name] for name in ("stdlib", "platstdlib", "purelib", "platlib")}
    with contextlib.suppress(AttributeError):  # a virtual environment's site module may lack it
        places.update(site.getsitepackages())
    places.add(str(Path(hvdkit.__file__).parent))
    return tuple(os.path.join(os.path.realpath(place), "") for place in places)


def users(frames: list[Frame]) -> Optional[Frame]:
    """The innermost frame in the user's code."""
    libraries = _libraries()
    for frame in frames:
        if not frame.file.startswith("<") and not os.path.realpath(frame.file).startswith(libraries):
            return frame
    return None


def horovod_call(frames: list[Frame]) -> Optional[str]:
    """'synchronize() from hvdkit/rank/step/training.py:140' where the innermost frames are Horovod's."""
    inside = [i for i, frame in enumerate(frames) if f"{os.sep}horovod{os.sep}" in frame.file]
    if not inside or inside[0] > 2:  # waiting in Horovod, not merely called from it further out
        return None
    last = inside[0]
    while last + 1 < len(frames) and f"{os.sep}horovod{os.sep}" in frames[last + 1].file:
        last += 1
    caller = frames[last + 1] if last + 1 < len(frames) else None
    return f"{frames[last].function}()" + (f" from {_shown(caller.file)}:{caller.line}" if caller else "")


def read(directory: Path, rank: int) -> list[Frame]:
    try:
        return main_thread(path(directory, rank).read_text(errors="replace"))
    except OSError:
        return []


def _shown(file: str) -> str:
    with contextlib.suppress(ValueError):
        return os.path.relpath(file) if not os.path.relpath(file).startswith("..") else file
    return file
