"""``python -m hvdkit.launch.guard -- COMMAND``: what `hvdkit launch` starts in place of each rank,
on every host. It runs the rank as its child and, where the rank ends by a signal it was not told
to stop by, or the kernel's out-of-memory killer ended it or one of its processes (a DataLoader
worker), says so in one line: only a rank's parent learns the signal, and a launcher says it in its
own terms (Open MPI's mpirun: "process rank 0 with PID 0 ... exited on signal 9", with the wrong
PID). The line is the rank's last output, before the launcher's own text.

The rank writes what the line needs on a page of memory the guard gives it (job.GUARD;
hvdkit.rank.liveness.watchdog): the step it finished, at each step (a store, no call into the kernel), and
once a second its rank, where its checkpoints are and its peak memory. The guard passes the stop
signals on to the rank, dies with a SIGKILL to it (the rank's PR_SET_PDEATHSIG), ends what the
rank left running (it is their subreaper), and ends as the rank did: the same exit code, or the
same signal."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional, Sequence

from hvdkit import env, job
from hvdkit.system import cgroups
from hvdkit.system.proctree import become_subreaper, die_with_parent, end_processes, wait_child
from hvdkit.system.sighandlers import Handlers

PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP, signal.SIGCONT)
LEFT_GRACE = 1.0  # SIGTERM to SIGKILL for what the rank left (DataLoader workers ignore SIGTERM)
NOTE_SECONDS = 1.0  # how often the rank's memory cgroup is looked up (a rehearsal's `oom` moves it)
MODULE = "hvdkit.launch.guard"


def command(python: str, rank_command: Sequence[str]) -> list[str]:
    """The launcher's command for one rank: ``rank_command`` under the guard."""
    return [python, "-m", MODULE, "--", *rank_command]


def is_guard(cmdline: Sequence[str]) -> bool:
    """Whether a process's command line is a guard's (a rank's variables are in its environment too)."""
    return list(cmdline[1:3]) == ["-m", MODULE]


def _die_with_guard() -> None:
    die_with_parent(signal.SIGKILL)


def _end_what_it_left() -> None:
    """The processes the rank left (orphans come to the guard, their subreaper): a DataLoader's
    forkserver and workers outlived a rank that ended on an error, held the launcher's output pipes
    open, and horovodrun waited for them for good."""
    import psutil

    left = psutil.Process().children(recursive=True)
    if left:
        end_processes(left, grace=LEFT_GRACE)


class Reports:
    """What the rank wrote on its page (job.GUARD: the step it finished at each step, a record of
    facts once a second), read once it has ended; and the out-of-memory kills counted in each memory
    cgroup it was seen in since it started, looked at once a second (a cgroup it was moved to
    counts from there)."""

    def __init__(self, pid: int, page: int) -> None:
        self.pid, self.page = pid, page
        self.counted: dict[Path, int] = {}  # out-of-memory kills in each cgroup when first seen
        self.seen_in: dict[Path, set] = {}  # which of the rank's processes were seen in it
        self.cgroup_of: dict[int, Path] = {}  # where each was seen last
        self._done = threading.Event()
        self._note_cgroup()
        threading.Thread(target=self._watch, name="hvdkit-guard-cgroups", daemon=True).start()

    def _note_cgroup(self) -> None:
        for pid in (self.pid, *cgroups.descendants(self.pid)):  # a DataLoader worker may be in one of its own
            where = cgroups.memory_cgroup(pid)
            if where is not None and where not in self.counted:
                self.counted[where] = cgroups.oom_kills(where) or 0
            if where is not None:
                self.seen_in.setdefault(where, set()).add(pid)
                self.cgroup_of[pid] = where

    def _watch(self) -> None:
        while not self._done.wait(NOTE_SECONDS):
            self._note_cgroup()

    def read(self) -> dict:
        """The rank's last record, with its step ({} where it wrote none, or a torn one)."""
        self._done.set()
        data = os.pread(self.page, job.GUARD_PAGE, 0)
        record: dict = {}
        with contextlib.suppress(ValueError):
            record = json.loads(data[8:].split(b"\0", 1)[0] or b"{}")
        step = struct.unpack_from("<q", data)[0] if len(data) >= 8 else -1
        return {**record, "step": step} if step >= 0 else record

    def out_of_memory(self) -> tuple[bool, list, Optional[Path]]:
        """(the rank was killed by the kernel's out-of-memory killer, the PIDs of its processes that
        were, the cgroup it happened in). From the kernel's log where it can be read; else from the
        counts of the cgroups (a rank's count is shared with the other ranks in its cgroup, and a
        rank whose own cgroup counted one is taken for the one killed only when SIGKILL ended it)."""
        victims = cgroups.oom_victims()
        processes = set().union(*self.seen_in.values()) - {self.pid}
        if victims is not None:
            killed = sorted(processes & victims)
            return self.pid in victims, killed, self.cgroup_of.get(self.pid if self.pid in victims else
                                                                   next(iter(killed), self.pid))
        rank, killed, where = False, [], None
        for cgroup, before in self.counted.items():
            if (cgroups.oom_kills(cgroup) or 0) > before:
                if self.pid in self.seen_in[cgroup]:
                    rank, where = True, cgroup
                elif not killed:
                    killed, where = sorted(self.seen_in[cgroup]), where or cgroup
        return rank, killed, where


def ending(code: int, reports: Reports, stopped: bool, rank: Optional[int]) -> Optional[str]:
    """The line for a rank that ended with ``code`` (Popen's: -N for signal N), or None where the
    rank said its own (it exited by itself) or was told to stop (``stopped``)."""
    report = reports.read()
    number = report.get("rank", rank if rank is not None else "?")
    who = f"rank {number} (host {socket.gethostname()}, pid {reports.pid})"
    step = f" after step {report['step']}" if "step" in report else ""
    resume = _resumed_from(report.get("checkpoints"))
    rank_killed, killed, cgroup = reports.out_of_memory()
    peak, cap = report.get("peak"), cgroups.limit(cgroup) if cgroup else None
    held = f"; its peak {_gib(peak)}" if peak else ""
    held += f", its cgroup's limit {_gib(cap)}" if cap else ""
    if rank_killed and code == -signal.SIGKILL:
        return (f"{who} was killed by the kernel's out-of-memory killer (SIGKILL){step}{held}: lower the batch "
                f"size or the model's memory, or give the rank more memory{resume}")
    if killed and code != 0:
        return (f"{who} ended ({_how(code)}){step} after the kernel's out-of-memory killer killed its process "
                f"{', '.join(map(str, killed))} (a DataLoader worker){held}: lower num_workers, prefetch_factor or "
                f"what each worker holds, or give the rank more memory{resume}")
    if code < 0 and not stopped and -code not in PASSED_ON:  # a stop signal is a stop: hvdkit launch says it
        name = _signal_name(-code)
        why = " (not the kernel's out-of-memory killer)" if code == -signal.SIGKILL else ""
        return f"{who} was killed by {name}{step}{why}{resume}"
    return None


def _resumed_from(checkpoints: Optional[list]) -> str:
    """'; a rerun resumes from' the newest checkpoint (the rank said where and what to look for)."""
    if not checkpoints:
        return ""
    directory, pattern = checkpoints
    try:
        newest = sorted(Path(directory).glob(pattern))
    except OSError:
        return ""
    if not newest:
        return f"; no checkpoint in {directory} yet: a rerun starts anew"
    return f"; a rerun resumes from {newest[-1]}"


def _how(code: int) -> str:
    return f"exit {code}" if code >= 0 else _signal_name(-code)


def _signal_name(number: int) -> str:
    return signal.Signals(number).name if number in signal.Signals._value2member_map_ else f"signal {number}"


def _gib(size: int) -> str:
    return f"{size / 2 ** 30:.2f} GiB" if size >= 2 ** 30 / 10 else f"{size / 2 ** 20:.0f} MiB"


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        print(f"usage: python -m {MODULE} -- COMMAND [ARGS...]", file=sys.stderr)
        return job.BAD_INPUT
    rank_command = argv[argv.index("--") + 1:]
    become_subreaper()
    page = os.memfd_create("hvdkit-guard")
    os.ftruncate(page, job.GUARD_PAGE)
    os.pwrite(page, struct.pack("<q", -1), 0)
    os.set_inheritable(page, True)
    try:
        # Every descriptor the launcher gave stays the rank's: Hydra's and srun's PMI_FD among them.
        child = subprocess.Popen(rank_command, env={**os.environ, job.GUARD: str(page)}, close_fds=False,
                                 preexec_fn=_die_with_guard)
    except OSError as exc:
        print(f"hvdkit: cannot start {rank_command[0]}: {exc.strerror}", file=sys.stderr)
        return 127
    stopped: list[int] = []

    def pass_on(signum, frame) -> None:
        if signum != signal.SIGCONT:
            stopped.append(signum)
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    reports = Reports(child.pid, page)
    with Handlers(PASSED_ON, pass_on):
        code = wait_child(child)
        line = ending(code, reports, bool(stopped), env.detect(os.environ).rank)
        if line:
            with contextlib.suppress(OSError, ValueError):
                print(f"hvdkit: {line}", file=sys.stderr, flush=True)
            job.record_cause(line)
        _end_what_it_left()
    if code < 0:  # ended by the same signal: the launcher reports it as it would the rank's (no core of ours)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        Handlers([] if -code == signal.SIGKILL else [-code], signal.SIG_DFL).install()
        signal.raise_signal(-code)
    return code if code >= 0 else job.stopped_by(-code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
