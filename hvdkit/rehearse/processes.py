"""The job's processes on the rehearsal hosts, and what an ending leaves there: its ranks (to
strike), whatever still runs after it, the temporary files of cut saves, snapshots in host
memory (hvdkit.rehearse.chaos)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

from hvdkit import checkpoint, job
from hvdkit.env import RANK_VARIABLES
from hvdkit.launch import guard, restarts
from hvdkit.rank.liveness import lifeline
from hvdkit.rehearse.namespaces import Hosts
from hvdkit.system import launchers, wholefiles

TORCHRUN_WORKER = "TORCHELASTIC_RUN_ID"  # what torchrun's agent sets in the workers it starts, beside RANK
NOT_RANKS = {"sh", "bash", "dash", "ssh", "sshd", "env", "timeout",
             *launchers.programs(launcher for launcher in launchers.LAUNCHERS if not launcher.ends_its_ranks)}


def ranks(hosts: Hosts) -> dict[int, tuple]:
    """The job's ranks on the hosts: {rank: (psutil.Process, host)}. A rank is the process that
    carries a launcher's rank variable and whose parent does not, or is its guard (its data workers
    carry it too; the guard hvdkit launch starts it under does, and is not the rank); of two
    with one rank, the running attempt's (the other is the next one's, started ahead of need: its
    HVDKIT_RESTART is higher)."""
    import psutil

    found: dict[int, tuple] = {}
    attempts: dict[int, int] = {}
    for name in hosts.names:
        for pid in hosts.pids(name):
            try:
                process = psutil.Process(pid)
                if (process.name() in NOT_RANKS or process.status() == psutil.STATUS_ZOMBIE
                        or guard.is_guard(process.cmdline())):
                    continue
                rank = _rank_of(process)
                parent = process.parent()
                if rank is None or (parent and parent.name() not in NOT_RANKS and not guard.is_guard(parent.cmdline())
                                    and _rank_of(parent) == rank):
                    continue
                attempt = int(process.environ().get(job.RESTART) or 0)
                if rank in found and attempts[rank] <= attempt:
                    continue
                found[rank], attempts[rank] = (process, name), attempt
            except psutil.Error:
                continue
    return found


def loader_workers(rank) -> list:
    """A rank's DataLoader workers (psutil.Process): the children of its fork server, or the
    children it forked itself running its own command (the fork start method)."""
    import psutil

    workers = []
    try:
        command = rank.cmdline()
        for child in rank.children():
            below = child.cmdline()
            if any("multiprocessing.forkserver" in word for word in below):
                workers += child.children()
            elif below == command:
                workers.append(child)
    except psutil.Error:
        pass
    return sorted(workers, key=lambda process: process.pid)


def _rank_of(process) -> Optional[int]:
    environ = process.environ()
    for variable in RANK_VARIABLES:
        if variable in environ:
            return int(environ[variable])
    if TORCHRUN_WORKER in environ and "RANK" in environ:  # torchrun's worker (hvdkit bench goodput's peer arm)
        return int(environ["RANK"])
    return None


def left_running(hosts: Hosts) -> list[tuple[str, bool]]:
    """What runs on the hosts besides their sshd (and its sessions): ('name (pid N, ...) on host',
    whether a rank's lifeline will end it)."""
    kept = {proc.pid for proc in hosts.sshd.values()}
    return [found for name in hosts.names for found in left_among(hosts.pids(name), name, kept)]


def left_among(pids, host: str, kept=frozenset()) -> list[tuple[str, bool]]:
    """Of ``pids`` on ``host``, those still running, but ``kept`` and any sshd: as left_running says them."""
    import psutil

    found = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            if pid in kept or process.name() == "sshd" or process.status() == psutil.STATUS_ZOMBIE:
                continue
            found.append((f"{' '.join(process.cmdline()[:3]) or process.name()} ({how_it_is(process)}) on {host}",
                          lifeline.watches(process.environ())))
        except psutil.Error:
            continue
    return found


def settled(look: Callable[[], list[tuple[str, bool]]], lifeline_seconds: float, plain_seconds: float,
            every: float = 0.2) -> tuple[list[str], Optional[float]]:
    """After a job's ending (the chaos run's ``_after``): ``look()`` (left_running's list) until
    it finds nothing, for ``plain_seconds``, or ``lifeline_seconds`` once any look has found a
    process that a rank's lifeline ends. Returns what is still there and the seconds it took to
    go (None where something stayed). The longer wait, once earned, is kept: a rank's lifeline ends
    it, and the processes waiting on it (horovodrun's remote ``sh -c``, which lacks the rank's
    variables) end a moment after; judged by the look after the rank's end alone, they were left."""
    began = time.monotonic()
    until = began + plain_seconds
    while True:
        left = look()
        if any(ends for _, ends in left):
            until = max(until, began + lifeline_seconds)
        if not left:
            return [], round(time.monotonic() - began, 1)
        if time.monotonic() >= until:
            return [what for what, _ in left], None
        time.sleep(every)


def how_it_is(process) -> str:
    """'pid N, sleeping in pipe_write, parent sshd (pid M), 4 children, 31.2 s old': what a process
    left running waits for, and who holds it, for the line that names it."""
    try:
        wait = Path(f"/proc/{process.pid}/wchan").read_text().strip()
    except OSError:
        wait = ""
    import psutil

    try:  # a parent gone meanwhile must not drop the process from the list
        parent = process.parent()
        held_by = f"parent {parent.name()} (pid {parent.pid})" if parent else "no parent"
    except psutil.Error:
        held_by = "its parent gone"
    children = len(process.children())
    return ", ".join(part for part in (
        f"pid {process.pid}", process.status() + (f" in {wait}" if wait and wait != "0" else ""), held_by,
        f"{children} child{'ren' if children != 1 else ''}" if children else "",
        f"{time.time() - process.create_time():.1f} s old") if part)


def partials(directory: Path) -> list[Path]:
    """The temporary files of saves under way (or cut) in a checkpoint directory and its shard folders."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.rglob(f"*{wholefiles.PARTIAL}"))


def step_of_partial(path: Path) -> Optional[int]:
    """The step a temporary file belongs to: its own name's, or its shard folder's."""
    step = checkpoint.step_in(path.name)
    return step if step is not None else checkpoint.step_in(path.parent.name)


def snapshots(tag: str) -> set[Path]:
    """The snapshot folders in host memory now of the jobs given ``tag`` (restarts.SNAPSHOT_TAG:
    the rehearsal's hosts share this machine's memory with other rehearsals' jobs)."""
    return set(Path(restarts.SHM).glob(f"{restarts.SNAPSHOT_PREFIX}{tag}-*"))
