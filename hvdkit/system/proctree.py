"""Processes: a child's exit awaited, and the one way
hvdkit ends processes, by PID, only what it started."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:  # imported where used: a rank and `hvdkit doctor` may run without psutil
    import subprocess

    import psutil

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36  # Linux's prctl options


def wait_child(proc: "subprocess.Popen", timeout: Optional[float] = None) -> Optional[int]:
    """``proc``'s exit code (None after ``timeout`` seconds), once a reaper thread has it. A
    signal handler that raises interrupts this sleep, never Popen.wait: raised inside it, it can
    leave its lock held (between its acquire and its try), and the next wait then blocks for
    good."""
    if getattr(proc, "_hvdkit_reaper", None) is None:
        proc._hvdkit_reaper = threading.Thread(target=proc.wait, name="hvdkit-reaper", daemon=True)
        proc._hvdkit_reaper.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    while proc.returncode is None:
        if deadline is not None and time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    return proc.returncode


def tree(pid: int) -> list["psutil.Process"]:
    """The process ``pid`` and every process below it; none once it has ended and been reaped."""
    import psutil

    try:
        top = psutil.Process(pid)
        return [*top.children(recursive=True), top]
    except psutil.NoSuchProcess:
        return []


def processes(pids: Sequence[int]) -> list["psutil.Process"]:
    """The processes of ``pids`` still running (for end_processes)."""
    import psutil

    found = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            found.append(psutil.Process(pid))
    return found


def end_processes(processes: Sequence["psutil.Process"], grace: float) -> None:
    """The one way hvdkit ends processes (a launcher's leftovers, a rehearsal's hosts, a test
    cluster's daemons). End ``processes``, by PID, those already gone passed over: SIGTERM, then
    SIGKILL to what is left after ``grace`` seconds (SIGKILL at once where ``grace`` is 0); waits
    until they are gone. A child of ours is left for its owner to collect (a Popen's wait gets its
    real code; psutil's wait_procs would reap it and leave the Popen 0)."""
    import psutil

    alive = list(processes)
    if grace > 0:
        for process in alive:
            with contextlib.suppress(psutil.Error):
                process.terminate()
        alive = _wait_gone(alive, grace)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    _wait_gone(alive, max(grace, 5.0))


def _wait_gone(processes: Sequence["psutil.Process"], timeout: float) -> list:
    """Those of ``processes`` still running after ``timeout`` seconds; an exited child (a zombie)
    counts as gone, not collected."""
    import psutil

    def running(process) -> bool:
        try:
            return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    deadline = time.monotonic() + timeout
    alive = [p for p in processes if running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.02)
        alive = [p for p in alive if running(p)]
    return alive


def die_with_parent(signum: int) -> None:
    """In a child, before it execs: ``signum`` to it when its parent dies (PR_SET_PDEATHSIG)."""
    _prctl(PR_SET_PDEATHSIG, signum)


def become_subreaper() -> None:
    """Orphans below this process come to it, not to init (PR_SET_CHILD_SUBREAPER): it can end them."""
    _prctl(PR_SET_CHILD_SUBREAPER, 1)


def _prctl(option: int, value: int) -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
