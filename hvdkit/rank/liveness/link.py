"""A rank's line to `hvdkit launch --max-restarts` (hvdkit.launch.links): the launcher learns at
once that a rank died, its connection closed without the word that it is leaving, and tells the
other ranks to end. They would otherwise wait in a collective for the rank that is gone until
mpirun's kill sequence (SIGCONT, SIGTERM, SIGKILL, a second or more apart on each host) ends
them, and the restart waits with them. A stop signal to the launcher reaches the ranks on other
hosts on this line too, not through mpirun, whose kill sequence is then left no delay.

A rank that leaves by itself says so first: at the interpreter's exit (a finished run, a stop, a
traceback) and before the Session's own errors end it (hvdkit.rank.ending.stops.exit_on_own_errors).
The processes it forks (a DataLoader's workers) close their copy of the line at once.
One killed by a signal, or ended by its own thread (job.end_rank: a stall, a stop's countdown),
has no word: the others are ended with it, as the job is ending anyway; each first finishes the
checkpoint it is writing (before_end), which a restart would otherwise lose. (Under Open MPI's
mpirun, which kills every rank's guard as soon as one has ended, with no pause under --max-restarts,
a rank dies with its guard before that: docs/stops-and-recovery.md#restarts-within-the-job.)"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import sys
import threading
from typing import Callable, Mapping, Optional

from hvdkit import job

CONNECT_SECONDS = 5.0

_line: Optional[socket.socket] = None
_before_end: list[Callable[[], None]] = []  # run by the line's thread before this rank ends on END


def before_end(hook: Callable[[], None]) -> Callable[[], None]:
    """Have ``hook`` run before this rank ends because another rank died (END from the launcher),
    in the line's thread while the rank's own threads go on (a checkpoint's write in flight is
    finished: the restart resumes from it); the undo, which removes it. Called on every rank."""
    _before_end.append(hook)
    return lambda: _before_end.remove(hook) if hook in _before_end else None


def connect(environ: Mapping[str, str], rank: int, size: int) -> bool:
    """Open this rank's line where the launcher gave one (job.LINK); whether it did. A launcher
    that cannot be reached leaves the rank as without a line: it ends as before, only later."""
    global _line
    address, _, port = environ.get(job.LINK, "").rpartition(":")
    if _line is not None or not address or not port.isdigit():
        return False
    try:
        line = socket.create_connection((address, int(port)), timeout=CONNECT_SECONDS)
    except OSError:
        return False
    try:
        line.sendall(f"{job.HELLO} {rank} {size} {os.getpid()} {socket.gethostname()}\n".encode())
        said = line.makefile("rb")
        welcomed = said.readline().decode(errors="replace").strip() == job.WELCOME
        line.settimeout(None)
    except OSError:
        welcomed = False
    if not welcomed:  # a welcome too late to be read: the launcher may know this rank, which leaves the line
        with contextlib.suppress(OSError):
            line.sendall(f"{job.LEAVING}\n".encode())
        line.close()
        return False
    _line = line
    atexit.register(leaving)
    os.register_at_fork(after_in_child=_forget)
    threading.Thread(target=_listen, args=(said,), name="hvdkit-launcher-link", daemon=True).start()
    return True


def wait_for_go(environ: Mapping[str, str]) -> None:
    """In a rank of a standby attempt (job.STANDBY), which `hvdkit launch --max-restarts` starts
    while the job runs, before it is needed: what the rank imports is paid for now (torch.optim
    imports torch._dynamo at the first step), then it waits on its line, before hvd.init, until
    the attempt before fails and the launcher says go. Told nothing (the standby was not needed,
    its launcher is gone, or it cannot be reached), it ends with 1, so that the standby's
    launcher ends its other ranks and the standby is seen to be gone (one ended with 0 before
    MPI's init is no failure to mpirun: the others would wait for it in their init)."""
    if environ.get(job.STANDBY) != "1":
        return
    import torch._dynamo  # noqa: F401

    address, _, port = environ.get(job.LINK, "").rpartition(":")
    told = ""
    try:
        with socket.create_connection((address, int(port)), timeout=CONNECT_SECONDS) as line:
            line.settimeout(None)
            line.sendall(f"{job.READY}\n".encode())
            told = line.makefile("rb").readline().decode(errors="replace").strip()
    except (OSError, ValueError):
        pass
    if told != job.GO:
        os._exit(job.FAILED)


def leaving() -> None:
    """Say that this rank leaves by itself (once; nothing where there is no line)."""
    global _line
    line, _line = _line, None
    if line is not None:
        with contextlib.suppress(OSError):
            line.sendall(f"{job.LEAVING}\n".encode())


def _forget() -> None:
    """In a process forked from the rank (a DataLoader's worker): its copy of the line closed, so
    that the line closes when the rank dies, not when its last worker does; nothing said on it.
    The socket's descriptor alone: the reading end's lock was held by the listening thread, which
    the fork did not copy, so closing the reading end would wait for it forever."""
    global _line
    line, _line = _line, None
    if line is not None:
        with contextlib.suppress(OSError):
            os.close(line.detach())


def _listen(said) -> None:
    """END from the launcher: another rank died, and this one goes at once (the launcher has said
    which and why); STOP N: signal N, as if it came to this process. The launcher gone closes the
    line: its own watches end the rank then."""
    with contextlib.suppress(OSError):
        for words in (raw.decode(errors="replace").split() for raw in said):
            if words == [job.END]:
                for hook in list(_before_end):
                    with contextlib.suppress(Exception):  # the rank ends as told, whatever the hook met
                        hook()
                with contextlib.suppress(OSError, ValueError):
                    sys.stderr.flush()
                os._exit(job.FAILED)
            if words[:1] == [job.STOP] and len(words) == 2 and words[1].isdigit():
                signal.raise_signal(int(words[1]))
