"""A rank whose launcher is gone stops as on SIGTERM: agreed step, checkpoint, exit.

Plain `horovodrun` in MPI mode replaces itself with `sh -c mpirun ...`; SIGTERM, SIGHUP or
SIGKILL to it ends that shell alone, and mpirun with every rank trains on under init, holding
the checkpoint directory's lock (horovod/horovod#2402). hvdkit's own launcher stays the ranks'
parent and ends them (hvdkit.launch.supervise); this is the defence in the ranks themselves, whatever
started them: at start a rank finds its launcher among its ancestors (from its parent up to the
topmost horovodrun, mpirun, orted or Hydra proxy, with the shells and Horovod's middlemen in
between), and a thread checks twice a second that each of them still runs (psutil compares the
process's start time, so a reused PID does not count). The first that is gone asks for a stop.
Ranks started by srun, by ssh without a launcher above them, or by nothing have no chain to
watch: Slurm ends its tasks itself, and hvdkit.rank.liveness.lifeline.Lifeline watches horovodrun --gloo's
rendezvous from other hosts.

A launcher that relayed the ranks' output (horovodrun --gloo reads each rank's pipe) takes the
reading end with it: the rank's next print would raise BrokenPipeError, often before the stop
signal that follows arrives, and the line naming its checkpoint would be lost. Output that has
lost its reader goes to a file in the run directory instead (``keep_output``, ``KeptStream``).
"""

from __future__ import annotations

import os
import select
import sys
import threading
from pathlib import Path
from typing import Callable, Optional

import psutil

from hvdkit.system import launchers

LAUNCHERS = launchers.programs(launcher for launcher in launchers.LAUNCHERS if not launcher.ends_its_ranks)
SHELLS = ("sh", "bash", "dash")
CHECK_SECONDS = 0.5


def _argv(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def _shell_runs(argv: list[str]) -> Optional[str]:
    """The first word of `sh -c 'WORD ...'` (what upstream horovodrun becomes); None for anything else."""
    if argv and Path(argv[0]).name in SHELLS and len(argv) > 2 and argv[1] == "-c" and argv[2].split():
        return argv[2].split()[0]
    return None


def _launcher_name(process: psutil.Process) -> Optional[str]:
    """horovodrun (a Python script: its path is the interpreter's first argument), an MPI
    launcher or daemon, or a shell running one (`sh -c mpirun ...`, what horovodrun becomes):
    its name in LAUNCHERS; None for any other process."""
    argv = _argv(process)
    shell_runs = _shell_runs(argv)
    words = [shell_runs] if shell_runs else argv[:2]
    return next((Path(word).name for word in words if Path(word).name in LAUNCHERS), None)


def is_launcher(process: psutil.Process) -> bool:
    return _launcher_name(process) is not None


def launcher_chain(process: Optional[psutil.Process] = None) -> list[psutil.Process]:
    """``process``'s ancestors from its parent up to the topmost launcher among them; none
    where no launcher is among them."""
    try:
        parents = (process or psutil.Process()).parents()
    except psutil.Error:
        return []
    top = max((i for i, parent in enumerate(parents) if is_launcher(parent)), default=-1)
    return parents[:top + 1]


def started_by_horovodrun_here() -> bool:
    """Whether horovodrun is among this rank's launchers: an elastic worker on the host that
    runs the job's driver, where a stop signal means the job's end (the driver gets it too).
    Workers horovodrun started on other hosts (through ssh) are not."""
    return any(_launcher_name(parent) in launchers.HOROVODRUN.programs for parent in launcher_chain())


def describe(process: psutil.Process) -> str:
    """`horovodrun (pid 123)`, `sh -c mpirun (pid 123)`: what `ps` shows of it, for the stop line."""
    argv = _argv(process)
    shell_runs = _shell_runs(argv)
    if shell_runs:
        name = f"{Path(argv[0]).name} -c {shell_runs}"
    else:
        named = [Path(word).name for word in argv[:2] if Path(word).name in LAUNCHERS]
        name = named[0] if named else Path(argv[0]).name if argv else "?"
    return f"{name} (pid {process.pid})"


def ended(process: psutil.Process) -> bool:
    """Gone, or a zombie that its parent has not collected (a launcher started by a script that
    does not wait for it)."""
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


class LauncherWatch:
    """Calls ``on_gone(line)`` once, from its own thread, when a process of the launcher chain
    ends; the line names the launcher (the chain's top) and the process that ended."""

    def __init__(self, chain: list[psutil.Process], on_gone: Callable[[str], None],
                 every: float = CHECK_SECONDS) -> None:
        self.chain, self.on_gone, self.every = chain, on_gone, every
        self.names = [describe(p) for p in chain]  # now, while they run
        self._stop = threading.Event()
        if chain:
            threading.Thread(target=self._watch, name="hvdkit-launcher-watch", daemon=True).start()

    @classmethod
    def of_this_process(cls, on_gone: Callable[[str], None]) -> "LauncherWatch":
        return cls(launcher_chain(), on_gone)

    def gone(self) -> Optional[str]:
        """What of the chain is gone, as the stop line says it; None while all of it runs."""
        gone = next((i for i, p in enumerate(self.chain) if ended(p)), None)
        if gone is None:
            return None
        launcher = f"its launcher {self.names[-1]}"
        if gone == len(self.chain) - 1:
            return f"{launcher} is gone"
        return f"{self.names[gone]}, which {launcher} started, is gone"

    def _watch(self) -> None:
        while not self._stop.wait(self.every):
            line = self.gone()
            if line:
                self.on_gone(line)
                return

    def stop(self) -> None:
        self._stop.set()


def watch(stop, output_file: Path) -> None:
    """Start watching this rank's launcher chain, if it has one: ``stop`` (a hvdkit.rank.ending.stops.StopSignal)
    is asked to stop once any of it is gone, and keeps the watch; output that loses its reader
    goes to ``output_file``."""
    launcher = LauncherWatch.of_this_process(stop.launcher_gone)
    if launcher.chain:
        stop.launcher, stop.output_file = launcher, output_file
        keep_streams(output_file)


def keep_output(path: Path) -> None:
    """Standard output and error that nothing reads any more (a pipe whose reader is gone, a
    hung-up terminal) are appended to ``path`` from now on, so the rank can still say how it ended."""
    poll = select.poll()
    for fd in (1, 2):
        poll.register(fd, select.POLLOUT)
    broken = [fd for fd, events in poll.poll(0) if events & (select.POLLERR | select.POLLHUP)]
    if not broken:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for fd in broken:
        os.dup2(kept, fd)
    os.close(kept)


class KeptStream:
    """sys.stdout's or sys.stderr's stand-in while a launcher chain is watched: a write or
    flush that finds its reader gone moves the output to ``path`` (keep_output) and tries again."""

    def __init__(self, stream, path: Path) -> None:
        self._stream, self._path = stream, path

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            keep_output(self._path)
            return self._stream.write(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            keep_output(self._path)
            self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def keep_streams(path: Path) -> None:
    """sys.stdout and sys.stderr become KeptStreams (once per process)."""
    if not isinstance(sys.stdout, KeptStream):
        sys.stdout = KeptStream(sys.stdout, path)
    if not isinstance(sys.stderr, KeptStream):
        sys.stderr = KeptStream(sys.stderr, path)
