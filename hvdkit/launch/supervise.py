"""Running a launcher so that a signal reaches every rank and no rank outlives it.

`exec horovodrun` is not enough: in MPI mode horovodrun becomes `/bin/sh -c mpirun ...`, so
a SIGTERM ends the shell and leaves mpirun and every rank training with no launcher. hvdkit
therefore starts the launcher as a child in its own session and stays as its parent:

* it is the "child subreaper" of everything the launcher starts on this host (Linux
  prctl), so a process orphaned by the launcher becomes its child, not init's;
* SIGTERM, SIGINT, SIGUSR1 and SIGHUP go to whatever delivers them to the ranks: mpirun and srun
  forward signals to their ranks on other hosts, and the ranks on this host are signalled
  directly. srun takes a single Ctrl-C as "show status", so SIGINT reaches srun
  as SIGTERM, as Open MPI's mpirun passes it to its ranks;
* a stop always ends: the ranks end themselves ``stop_grace()`` seconds after the signal where
  no step boundary comes (hvdkit.rank.ending.stops), and whatever still runs a few seconds later (a
  frozen rank, a launcher that does not exit) is killed, with one line;
* when the launcher exits, every process still left below it is ended (SIGTERM, then
  SIGKILL), by PID, and the launcher's exit code is returned, or the documented code a rank
  left in the job directory (HVDKIT_JOB_DIR) when a launcher replaced it with its own;
* with --max-restarts, a rank that dies (no word on its line, hvdkit.launch.links) has the
  other ranks ended at once, for the restart; and the restart's launcher and ranks are started
  ahead of need (a standby attempt, once every rank of the running one is on its line), so that
  a restart does not wait for them to start and import torch;
* across hosts, it watches them (hvdkit.launch.network.HostWatch): when one stops answering, the
  other ranks are blocked in a collective that cannot complete, so the launcher and every
  process below it are killed at once, with one line naming the host, and it exits with
  hvdkit.job.LOST.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Sequence

from hvdkit.env import RANK_VARIABLES
from hvdkit.job import (
    FAILED,
    JOB_DIR,
    KILL_AFTER_GRACE,
    LINK,
    LOST,
    STANDBY,
    rank_cause,
    rank_exit,
    restarting,
    shell_code,
    stop_grace,
    stopped_by,
)
from hvdkit.launch import guard, network, rank_output
from hvdkit.launch.links import Links
from hvdkit.system import launchers
from hvdkit.system.proctree import (
    become_subreaper,
    die_with_parent,
    end_processes,
    wait_child,
)
from hvdkit.system.sighandlers import Handlers

if TYPE_CHECKING:  # imported where used: `hvdkit doctor` runs without psutil
    import psutil

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)
FORWARDERS = launchers.programs((launcher for launcher in launchers.LAUNCHERS if launcher.forwards_signals),
                               daemons=False)


def end_with_parent() -> None:
    """In the launcher's process: a SIGKILLed hvdkit still takes its launcher with it."""
    die_with_parent(signal.SIGTERM)


def signal_targets(launcher: "psutil.Process") -> list[tuple["psutil.Process", bool]]:
    """(process, is a forwarder) for each process a stop signal must reach: the launchers
    below us that forward signals to other hosts (mpirun, srun), and the ranks on this host
    directly: Open MPI's mpirun sends SIGCONT, waits odls_base_sigkill_timeout (1 s), sends
    SIGTERM, waits again and SIGKILLs, so a rank told only by mpirun has about 1 s to save."""
    below = [launcher, *launcher.children(recursive=True)]
    return [(p, True) for p in below if _name(p) in FORWARDERS] + [(p, False) for p in below if _is_rank(p)]


def pass_on(signum: int, launcher: "psutil.Process", lines: Optional[Links] = None) -> None:
    """Send a stop signal to what delivers it to the ranks; where every rank is on ``lines``
    (--max-restarts), on them to the other hosts' and not through the launchers. A launcher that
    has just exited (a signal arriving while its exit is handled) leaves nothing to tell: seen as
    a traceback from the signal handler, which ended `hvdkit launch` with 1 instead of its own code."""
    import psutil

    try:
        targets = signal_targets(launcher)
    except psutil.Error:
        return
    if lines is not None and lines.stop(signum):
        targets = [(process, forwarder) for process, forwarder in targets if not forwarder]
    for process, forwarder in targets:
        try:
            process.send_signal(translate(signum, _name(process)) if forwarder else signum)
        except psutil.Error:
            pass


def _name(process: "psutil.Process") -> str:
    import psutil

    try:
        return process.name()
    except psutil.Error:
        return ""


def _is_rank(process: "psutil.Process") -> bool:
    """A rank on this host: not its guard, which passes on what it is sent (hvdkit.launch.guard)."""
    import psutil

    try:
        return any(name in process.environ() for name in RANK_VARIABLES) and not guard.is_guard(process.cmdline())
    except psutil.Error:
        return False


def translate(signum: int, forwarder: str) -> int:
    """What to send the launcher ``forwarder`` (a process name) for ``signum``: its own word for a SIGINT."""
    launcher = launchers.running_as(forwarder)
    return launcher.interrupt if launcher and signum == signal.SIGINT else signum


@dataclass
class Ended:
    """How a job ended: its exit code (what run() returns), whether hvdkit launch itself was
    stopped by a signal, the code a rank recorded with its line (job.record_exit), and the line
    and name of a host that stopped answering; ``cause``: what a rank's guard said ended it (a
    signal, the out-of-memory killer) where no rank recorded a code, else the recorded code's line."""
    code: int
    stopped: bool = False
    recorded: Optional[int] = None
    lost: str = ""
    host: str = ""
    cause: str = ""


def run(command: Sequence[str], env: Mapping[str, str], join_lines: bool = False,
        watch: Optional[Mapping[str, str]] = None, ranks: Optional[Mapping[str, list]] = None) -> int:
    """Run ``command`` (a launcher) to its end as described above; its exit code. With
    ``join_lines``, its output (tagged by rank) is passed on as whole lines (hvdkit.launch.rank_output);
    ``watch``: {host: address} of the other hosts of the job; ``ranks``: {host: the ranks it runs}."""
    return attempt(command, env, join_lines, watch, ranks).code


class Launched:
    """One attempt's launcher, started: its job directory, its line to the ranks (under
    --max-restarts), the child and the pumps of its output. A ``standby`` one (the next attempt,
    started ahead of need) has its ranks wait on the line until go(); its output is held in its
    pipes until then."""

    def __init__(self, command: Sequence[str], env: Mapping[str, str], join_lines: bool = False,
                 watch: Optional[Mapping[str, str]] = None, standby: bool = False) -> None:
        self.job_dir = tempfile.mkdtemp(prefix="hvdkit-job-")
        self.lines: Optional[Links] = None
        if restarting(env):  # where the ranks on other hosts reach this one
            self.lines = Links(network.source_address(next(iter(watch.values()))) if watch else "127.0.0.1")
        self.env = {JOB_DIR: self.job_dir, **env, LINK: self.lines.address if self.lines else "",
                    STANDBY: "1" if standby else ""}
        self.standby = standby
        pipe = subprocess.PIPE if join_lines or standby else None
        self.child = subprocess.Popen(list(command), env=self.env, start_new_session=True,
                                      preexec_fn=end_with_parent, stdout=pipe, stderr=pipe)
        self.pumps: list = []

    def go(self) -> None:
        """Its output passed on from now, and (a standby's) its ranks told to go on."""
        if self.child.stdout:
            self.pumps = [rank_output.pump(os.dup(stream.fileno()), target.fileno())
                          for stream, target in ((self.child.stdout, sys.stdout), (self.child.stderr, sys.stderr))]
            for stream in (self.child.stdout, self.child.stderr):
                stream.close()  # the pumps hold their own copies
        if self.standby and self.lines:
            self.lines.go()

    def close(self) -> None:
        for pump in self.pumps:
            pump.join(timeout=5)
        if self.lines:
            self.lines.close()
        remove_job_dir(self.job_dir)

    def discard(self) -> None:
        """A standby that is not needed: its launcher and whatever it started here ended (the
        launcher ends its ranks on other hosts), unheard."""
        import psutil

        with contextlib.suppress(psutil.Error):
            launcher = psutil.Process(self.child.pid)
            end_processes([launcher, *launcher.children(recursive=True)], grace=KILL_AFTER_GRACE)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.child.wait(timeout=KILL_AFTER_GRACE)
        for stream in (self.child.stdout, self.child.stderr):
            if stream:
                stream.close()
        self.close()


def attempt(command: Sequence[str], env: Mapping[str, str], join_lines: bool = False,
            watch: Optional[Mapping[str, str]] = None, ranks: Optional[Mapping[str, list]] = None,
            standby: Optional[Launched] = None, ahead: Optional[Callable[[], Launched]] = None) -> Ended:
    """run(), saying how the job ended (hvdkit.launch.restarts decides on a restart from it).
    ``standby``: this attempt, started ahead of need (its ranks told to go now); ``ahead``: starts
    the next attempt as a standby, called once every rank of this one is on its line."""
    import psutil  # here: `hvdkit doctor` imports this module where psutil may be missing

    become_subreaper()
    launched = standby or Launched(command, env, join_lines, watch)
    spare: list[Optional[Launched]] = []  # the next attempt's, once started (None: it could not be)
    try:
        launched.go()
        child, lines = launched.child, launched.lines
        launcher = psutil.Process(child.pid)
        stopped: list[int] = []  # the first stop signal, which starts the grace period

        def forward(signum, frame) -> None:
            if not stopped:
                stopped.append(signum)
                stopped.append(time.monotonic() + stop_grace() + KILL_AFTER_GRACE)
            pass_on(signum, launcher, lines)

        def start_the_next() -> None:
            if ahead and not spare and not stopped and lines and lines.complete():
                try:
                    spare.append(ahead())
                except OSError as exc:  # no standby: a restart starts its ranks then, as without
                    spare.append(None)
                    print(f"hvdkit launch: warning: cannot start the next attempt ahead of need: {exc}",
                          file=sys.stderr, flush=True)

        handlers = Handlers(FORWARDED, forward).install()
        hosts = network.HostWatch(dict(watch or {}), ranks=dict(ranks or {}))
        try:
            code = _wait(child, hosts, stopped, start_the_next)
            if code != 0 and not stopped and not hosts.lost and hosts.confirm():
                print(f"hvdkit launch: {hosts.lost}", file=sys.stderr, flush=True)
        finally:
            hosts.stop()
            handlers.restore()
            left = max(0.0, stopped[1] - time.monotonic()) if stopped else stop_grace()  # of a stop's grace period
            end_leftovers(grace=0 if hosts.lost else left, keep=[s.child.pid for s in spare if s])
            for pump in launched.pumps:
                pump.join(timeout=5)
        if hosts.lost:
            return Ended(LOST, bool(stopped), lost=hosts.lost, host=hosts.lost_host)
        recorded, said = rank_exit(Path(launched.job_dir)) or (None, "")
        if recorded is None and stopped and code > 0:  # it exited by itself, not killed after the grace
            # No rank said where it stopped: stopped while starting (importing torch, before the
            # Session's handlers), or ranks on hosts that do not share this job directory
            # (containers, machines without a shared /tmp). A stopped job still exits as the signal says.
            print(f"hvdkit launch: stopped by {signal.Signals(stopped[0]).name} before any rank here said at which "
                  f"step (while starting, or on another host); exit {stopped_by(stopped[0])}",
                  file=sys.stderr, flush=True)
            return Ended(stopped_by(stopped[0]), True)
        # A guard's cause over a rank's plain error (FAILED): another rank's death is what ended that one's wait.
        cause = rank_cause(Path(launched.job_dir)) if code != 0 and recorded in (None, FAILED) and not stopped else None
        if cause and not lines:  # the guard's line, said again after the launcher's own text (a restart's says it)
            print(f"hvdkit launch: {cause}", file=sys.stderr, flush=True)
        if not cause and lines and lines.died and code != 0 and not stopped:
            cause = lines.died.described()
        return Ended(recorded or shell_code(code), bool(stopped), recorded, cause=cause or said)
    finally:
        launched.close()


def _wait(child: subprocess.Popen, hosts: network.HostWatch, stopped: list,
          meanwhile: Callable[[], None] = lambda: None) -> int:
    """The launcher's exit code; if a host is lost first, or the job outlives a stop's grace
    period (``stopped``: [signal, deadline]), the launcher is killed (its process group) after
    saying why; what it leaves is killed after. ``meanwhile`` is called every half second."""
    while True:
        code = wait_child(child, timeout=0.5)
        if code is not None:
            return code
        meanwhile()
        why = hosts.lost or (stopped and time.monotonic() > stopped[1] and
                             f"the job did not end within {stop_grace() + KILL_AFTER_GRACE:g} s of "
                             f"{signal.Signals(stopped[0]).name}; killing what is left")
        if why:
            print(f"hvdkit launch: {why}", file=sys.stderr, flush=True)
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return wait_child(child)


def remove_job_dir(directory: str) -> None:
    """Remove the job directory. Ranks on other hosts that share this /tmp (a shared filesystem,
    namespace hosts) may still write heartbeats into it after the job ended here, so that a removal
    finds it not empty: it is renamed first, which no later write by its old name can enter, and
    then removed, again if a write in flight landed."""
    ended = f"{directory}.ended"
    with contextlib.suppress(OSError):
        os.rename(directory, ended)
    for path in (directory, ended):
        for _ in range(20):
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.exists(path):
                break
            time.sleep(0.05)


def end_leftovers(grace: float, keep: Sequence[int] = ()) -> list[int]:
    """End every process still below this one (orphans re-parented to it included), except
    ``keep`` and what is below them (a standby attempt's): SIGTERM, then SIGKILL after ``grace``
    seconds. Their PIDs, which are also printed."""
    import psutil

    kept = set(keep)
    for pid in keep:
        with contextlib.suppress(psutil.Error):
            kept.update(p.pid for p in psutil.Process(pid).children(recursive=True))
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in kept]
    _, left = psutil.wait_procs(left, timeout=3)  # ranks still exiting after their launcher did
    if left:
        print(f"hvdkit launch: the launcher exited and left {len(left)} processes running; ending them "
              f"(pids {' '.join(str(p.pid) for p in left)})", file=sys.stderr, flush=True)
        end_processes(left, grace)
    _reap()
    return [p.pid for p in left]


def _reap() -> None:
    """Collect the exit status of orphans that died as our children (we are their subreaper)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
