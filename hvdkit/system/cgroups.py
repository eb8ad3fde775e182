"""A process's memory cgroup, and what the kernel counts there: how many processes its
out-of-memory killer ended (cgroup v2's ``memory.events``, v1's ``memory.oom_control``), the
limit and the peak. A Slurm job's, a container's, a systemd unit's: where a rank's memory is
capped, a kill by that cap shows here, and nowhere in the exit status (a SIGKILL like any other)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from pathlib import Path
from typing import Optional

PROC = Path("/proc")


def _mounts() -> tuple[Optional[tuple[Path, str]], Optional[tuple[Path, str]]]:
    """((mount point, root) of cgroup v2, of cgroup v1's memory controller), from mountinfo."""
    unified = memory = None
    with contextlib.suppress(OSError):
        for line in (PROC / "self" / "mountinfo").read_text().splitlines():
            fields, _, tail = line.partition(" - ")
            parts, kind = fields.split(), tail.split()
            if len(parts) < 5 or len(kind) < 3:
                continue
            if kind[0] == "cgroup2" and unified is None:
                unified = (Path(parts[4]), parts[3])
            elif kind[0] == "cgroup" and "memory" in kind[2].split(",") and memory is None:
                memory = (Path(parts[4]), parts[3])
    return unified, memory


def _under(mount: tuple[Path, str], path: str) -> Path:
    point, root = mount
    relative = path[len(root):] if root != "/" and path.startswith(root) else path
    return point / relative.lstrip("/")


def memory_cgroup(pid: int) -> Optional[Path]:
    """The directory of ``pid``'s memory cgroup; None where there is none to read."""
    unified, memory = _mounts()
    try:
        lines = (PROC / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        number, controllers, path = line.split(":", 2)
        if memory and "memory" in controllers.split(","):
            return _under(memory, path)
        if number == "0" and unified and (_under(unified, path) / "memory.events").exists():
            return _under(unified, path)
    return None


def _read_number(path: Path) -> Optional[int]:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def oom_kills(directory: Path) -> Optional[int]:
    """How many processes the out-of-memory killer ended in this cgroup (None: not counted here): its
    own where the kernel tells them apart (v2's memory.events.local), else with its descendants'."""
    for name in ("memory.events.local", "memory.events", "memory.oom_control"):
        with contextlib.suppress(OSError):
            for line in (directory / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill" and value.strip().isdigit():
                    return int(value)
    return None


def limit(directory: Path) -> Optional[int]:
    """The cgroup's memory limit in bytes; None where there is none ("max", or v1's huge number)."""
    for name in ("memory.max", "memory.limit_in_bytes"):
        value = _read_number(directory / name)
        if value is not None:
            return value if value < 2 ** 60 else None
    return None


def peak(directory: Path) -> Optional[int]:
    """The most memory the cgroup held, in bytes (v2 from Linux 5.19; v1 always)."""
    for name in ("memory.peak", "memory.max_usage_in_bytes"):
        value = _read_number(directory / name)
        if value is not None:
            return value
    return None


def confine(pid: int, limit_bytes: int, name: str) -> Path:
    """Move ``pid`` into a new memory cgroup ``name`` under its own, limited to ``limit_bytes``; its
    directory. What it holds already stays charged where it was: what it allocates from now on
    counts against the limit (the chaos rehearsal's ``oom`` fault). OSError where cgroups cannot be
    written (not root, no memory controller)."""
    parent = memory_cgroup(pid)
    if parent is None:
        raise OSError(f"no memory cgroup to confine pid {pid} in")
    child = parent / name
    child.mkdir()
    try:
        (child / ("memory.max" if (child / "memory.max").exists() else "memory.limit_in_bytes")).write_text(
            str(limit_bytes))
        (child / "cgroup.procs").write_text(str(pid))
    except OSError:
        release(child)
        raise
    return child


def exceed(directory: Path, nbytes: int) -> int:
    """Take cgroup ``directory`` past its limit: a process started in it holds ``nbytes`` (dd's
    buffer), and the kernel's out-of-memory killer ends the cgroup's largest process first, the one
    confine() put there. A confined rank whose memory is reused from step to step would otherwise ride
    its limit out (the chaos rehearsal's ``oom`` fault). dd's exit code: -9 where it was ended too."""
    script = 'echo $$ > "$1" && exec dd if=/dev/zero of=/dev/null bs="$2" count=1 2>/dev/null'
    return subprocess.run(["sh", "-c", script, "sh", str(directory / "cgroup.procs"), str(nbytes)],
                          timeout=60).returncode


def release(directory: Path) -> None:
    """Remove a cgroup confine() made, once its processes have ended (those left go to its parent first)."""
    with contextlib.suppress(OSError):
        for pid in (directory / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (directory.parent / "cgroup.procs").write_text(pid)
    with contextlib.suppress(OSError):
        directory.rmdir()


def descendants(pid: int) -> list[int]:
    """``pid``'s processes, its children's and theirs (Linux's /proc/PID/task/TID/children): a
    DataLoader's workers are the children of its forkserver."""
    found, below = [], [pid]
    while below:
        parent = below.pop()
        with contextlib.suppress(OSError):
            for task in (PROC / str(parent) / "task").iterdir():
                with contextlib.suppress(OSError):
                    children = [int(child) for child in (task / "children").read_text().split()]
                    found += children
                    below += children
    return found


_KILLED = re.compile(r"[Oo]ut of memory.*: Killed process (\d+) ")


def oom_victims() -> Optional[set]:
    """The PIDs the kernel's out-of-memory killer ended, from its log (/dev/kmsg); None where the log
    cannot be read (kernel.dmesg_restrict, not root): then only a cgroup's count says it."""
    try:
        descriptor = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    victims = set()
    try:
        while True:
            try:
                record = os.read(descriptor, 8192)
            except BrokenPipeError:  # records overwritten while read: go on with the next
                continue
            except BlockingIOError:
                return victims
            if not record:
                return victims
            found = _KILLED.search(record.decode(errors="replace"))
            if found:
                victims.add(int(found.group(1)))
    except OSError:
        return None
    finally:
        os.close(descriptor)
