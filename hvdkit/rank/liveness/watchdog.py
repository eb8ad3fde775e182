"""A per-rank watchdog that ends a job which has stopped making progress.

Horovod's stall inspector names the tensor a missing rank never submitted (before the
timeout, hvdkit.rank.start.startup.stall_settings), but its shutdown works only under the MPI controller,
and not even there when a rank is frozen (SIGSTOP: measured here with Horovod 0.28.1, the
job ran on past the limit). The watchdog works under any controller and is what ends a
stalled job at ``--stall-timeout``: the loop beats at each step and at each of hvdkit's calls,
and a rank that has not beaten for ``timeout`` seconds says where it was and exits, which
makes every launcher end the whole job.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import socket
import threading
import time
from pathlib import Path
from typing import Optional

from hvdkit import job
from hvdkit.rank.liveness import stacks as stack_files
from hvdkit.rank.memory import peak_rss
from hvdkit.system import cgroups, probes, wholefiles

HEARTBEAT_SECONDS = 1.0
FROZEN_SECONDS = 5.0  # a rank whose watchdog thread has not written for this long is frozen or gone
# How a rank gone is said where its heartbeat or a probe tells more than that it is gone.
OOM_KILLED = "was killed by the kernel's out-of-memory killer"
FROZEN = "stopped responding (its process is there: stopped, or stuck holding the GIL)"
PRESENCE_SECONDS = 0.5  # a probe of a rank's port: refused at once where its process is gone, its host up
# A launcher's SIGTERM can come while the rank it follows is still dying: mpirun's, once a lost host's
# daemon is gone, a few ms before that host's rank. Looked for again this long (mpirun's SIGKILL: 1 s).
DYING_SECONDS = 0.5
STACKS_EVERY = 0.4  # of the stall limit: each rank's stacks are written at least once before the first one ends the job


class Watchdog:
    """Also names the rank that stopped: each rank's watchdog thread writes a small heartbeat
    file (its last beat, and that it is alive) to a directory all ranks share, the job
    directory of `hvdkit launch` or the run's log directory. When it fires, the ranks blocked
    in a collective are all alive but idle; the culprit is the rank whose thread went silent
    (SIGSTOP, a dead host) or, if all are alive, the one whose last progress is oldest."""

    def __init__(self, timeout: float, rank: int) -> None:
        self.timeout, self.rank = timeout, rank
        self.where = "start-up"
        self.last: Optional[float] = None  # no limit before the first beat: start-up is not a stall
        self.last_wall = self.started = time.time()  # started: older heartbeats are another run's
        self.shared: Optional[Path] = None
        self.stacks: Optional[stack_files.Stacks] = None
        self._emptied: Optional[float] = None  # the beat the stacks' file was last emptied after
        self._own = False
        self._presence: Optional[probes.Presence] = None
        self._stopping = False  # told to stop by a signal, as its heartbeat tells the others (gone_at_a_stop)
        self._stacks_kept = False  # from a stop signal on: the stacks' file is no longer emptied
        self._found_gone: set = set()  # the ranks gone at the last look after Horovod's shutdown
        self._writing = threading.Lock()
        self._guard = _guard_page()
        self._steps = self._guard[:8].cast("q") if self._guard is not None else None
        self._facts: dict = {}
        self._written = 0.0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "Watchdog":
        """Its thread started (once; the Session's start, every rank): the stall limit, and the
        heartbeats and the port's draining without a limit too (a rank whose heartbeat went stale
        would be taken for gone). Returns itself."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="hvdkit-watchdog", daemon=True)
            self._thread.start()
        return self

    def share(self, directory: str, own: bool = True, stacks: Optional[str] = None,
              facts: Optional[dict] = None) -> None:
        """Write heartbeats to ``directory`` (every rank must pass the same one); ``own``: the
        directory is only for them, and the last rank to stop removes it. ``stacks``: where each
        rank's stacks are written when it stalls (hvdkit.rank.liveness.stacks), the run's log directory.
        ``facts``: what the rank's guard is told besides (hvdkit.launch.guard: where its checkpoints are);
        data, not a callable: this watchdog outlives the Session (the stop signal's handler holds it)."""
        self.shared, self._own, self._facts = Path(directory), own, dict(facts or {})
        with contextlib.suppress(OSError):  # without it, a rank gone is known from its heartbeat alone
            self._presence = self._presence or probes.Presence()
        if stacks and self.timeout > 0:
            with contextlib.suppress(OSError):  # without them, the line says less
                self.stacks = stack_files.Stacks(Path(stacks), self.rank, STACKS_EVERY * self.timeout)
        self._write_heartbeat()  # now: a rank that freezes within its first second is named too

    def beat(self, where: str) -> None:
        self.where, self.last, self.last_wall = where, time.monotonic(), time.time()

    def step_done(self, step: int) -> None:
        """The steps finished, on the guard's page (a store in memory: the step makes no system call)."""
        if self._steps is not None:
            self._steps[0] = step

    def stop(self, keep_stacks: bool = False) -> None:
        """At the run's end; ``keep_stacks`` where it ends on an error (Horovod shut down by a stalled
        peer's end: this rank's stacks, written before, are part of the story)."""
        self._stop.set()
        if self.stacks is not None:
            self.stacks.close(remove=not keep_stacks)
        if self.shared is not None:
            self._path(self.rank).unlink(missing_ok=True)
        if self._presence is not None:  # after the heartbeat: a rank whose heartbeat is there is probed
            self._presence.close()
        if self.shared is not None and self._own:
            with contextlib.suppress(OSError):  # other ranks' heartbeats are still there
                self.shared.rmdir()

    def _path(self, rank: int) -> Path:
        return self.shared / f"heartbeat-rank-{rank}.json"

    def _watch(self) -> None:
        interval = min(HEARTBEAT_SECONDS, self.timeout / 10) if self.timeout > 0 else HEARTBEAT_SECONDS
        woke = time.monotonic()
        while not self._stop.wait(interval):
            slept, woke = time.monotonic() - woke, time.monotonic()
            # This whole process was stopped for longer than the others wait for it. Not merely
            # FROZEN_SECONDS: a long call holding the GIL (pickling a large checkpoint) also
            # delays this thread, and must not end the run. Before the stacks are emptied: those
            # faulthandler wrote while this thread could not run say where the rank was held.
            if self.timeout > 0 and slept > max(FROZEN_SECONDS, self.timeout):
                line = (f"rank {self.rank} was frozen for {slept:.0f} s (stopped, or its host paused) in "
                        f"{self.where}; ending")
                job.end_rank(job.STALLED, line)
            self._write_heartbeat()
            # Held out past a dump (a call held the GIL): that dump stays a look longer, for a stop
            # signal that ended the hold to be heard first (the main thread's handler).
            if slept < STACKS_EVERY * self.timeout:
                self._progress_to_stacks()
            if self._presence is not None:
                self._presence.drain()
            if self.timeout <= 0:  # --stall-timeout 0: no limit
                continue
            idle = woke - self.last if self.last is not None else 0.0
            if idle > self.timeout:
                self.write_stacks()
                culprit, stalled = self._culprit()
                self._kill_frozen_here()
                line = (f"{culprit}; rank {self.rank} waited {idle:.0f} s in {self.where}{self._waiting(stalled)}; "
                        f"ending the job (--stall-timeout sets the limit){self._stacks_said()}" if culprit else
                        f"rank {self.rank} made no progress for {idle:.0f} s in {self.where}"
                        f"{self._stuck_at(self.rank)}; ending the job (a rank is stalled or gone; "
                        f"--stall-timeout sets the limit){self._stacks_said()}")
                job.end_rank(job.STALLED, line)

    def told_to_stop(self) -> None:
        """A stop signal arrived (StopSignal's handler, in the main thread): the stacks' file is no
        longer emptied, for what it holds may be of the stall that ended the job, which its line
        points to (a launcher's SIGTERM ends a call that held the GIL, and the rank beats again)."""
        self._stacks_kept = True

    def _progress_to_stacks(self) -> None:
        """After a new beat the stacks' file holds only what is written from now on, until a stop."""
        if self.stacks is not None and self.last != self._emptied and not self._stacks_kept:
            self._emptied = self.last
            self.stacks.progress()

    def write_stacks(self) -> str:
        """This rank's stacks into its file now (the job is ending on a stall or a stop); ', stuck at
        train.py:42 in f' where its main thread is in the user's code."""
        if self.stacks is None:
            return ""
        self.stacks.write_now()
        return self._stuck_at(self.rank)

    def _stuck_at(self, rank: int) -> str:
        """', stuck at train.py:42 in __getitem__': a stalled rank's innermost frame in the user's code,
        from its stacks (none from a rank stopped by SIGSTOP: its faulthandler thread is stopped too)."""
        if self.stacks is None:
            return ""
        frame = stack_files.users(stack_files.read(self.stacks.path.parent, rank))
        return f", stuck at {frame}" if frame else ""

    def _waiting(self, stalled: set) -> str:
        """'; ranks 0, 2 waiting in Horovod's synchronize() from step.py:140' (the ranks whose stacks are written)."""
        if self.stacks is None:
            return ""
        calls: dict[str, list[int]] = {}
        for record in sorted(self._records(), key=lambda r: r["rank"]):
            if record["rank"] in stalled:
                continue
            call = stack_files.horovod_call(stack_files.read(self.stacks.path.parent, record["rank"]))
            if call:
                calls.setdefault(call, []).append(record["rank"])
        return "".join(f"; rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} waiting in Horovod's "
                       f"{call}" for call, ranks in calls.items())

    def _stacks_said(self) -> str:
        return f"; every rank's stacks: {self.stacks.path.parent / stack_files.PREFIX}*.txt" if self.stacks else ""

    def _write_heartbeat(self, now: bool = False) -> None:
        """Once a second at most, unless ``now``."""
        written = time.time()
        if self.shared is None or not now and written - self._written < HEARTBEAT_SECONDS:
            return
        self._report()
        record = {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(), "where": self.where,
                  "beat": self.last_wall, "alive": written, "port": self._presence.port if self._presence else None,
                  "stopping": self._stopping}
        try:
            if self._own:  # a launcher's job directory is the launcher's: gone with it, not made again
                self.shared.mkdir(parents=True, exist_ok=True)
            with self._writing:  # the watchdog's thread and a stop signal's: one temporary file
                wholefiles.write_whole(self._path(self.rank), json.dumps(record))
            self._written = written
        except OSError:
            pass  # heartbeats only improve the message; never fail training for them

    def gone(self, size: int = 0) -> str:
        """Who is gone, from the heartbeats, for a rank that Horovod's shutdown (a peer's connection
        closed) finds waiting: one the kernel's out-of-memory killer ended (its log, where it can be
        read), one on this host whose process is gone, one whose port refuses a probe, or one whose
        watchdog has not written for FROZEN_SECONDS, waited for that long at most; '' at once where a
        rank of the ``size`` has no heartbeat (it ended on an error, said so itself and removed it)."""
        return _described(*self._gone(size))

    def _gone(self, size: int) -> tuple[list, dict]:
        deadline = time.monotonic() + FROZEN_SECONDS + HEARTBEAT_SECONDS
        while True:
            records, gone, how = self._missing()
            if gone or len(records) < size - 1 or time.monotonic() > deadline:
                self._found_gone = {r["rank"] for r in gone}
                return gone, how
            time.sleep(HEARTBEAT_SECONDS / 4)

    def lowest_rank_left(self) -> bool:
        """Whether every rank below this one was gone at the last look after Horovod's shutdown: rank
        0 says the job's errors, and where it is gone, this rank (hvdkit.rank.ending.stops.exit_on_own_errors)."""
        return set(range(self.rank)) <= self._found_gone

    def after_shutdown(self, exc: BaseException, size: int) -> str:
        """' (rank 1 (host h, pid p) is gone, ...)' for Horovod's shutdown met outside hvdkit's calls:
        Gloo's 'Read error [10.0.0.2]:41369: Connection reset by peer' names an address, not a rank."""
        if type(exc).__name__ != "HorovodInternalError":
            return ""
        gone = self.gone(size)
        return f" ({gone})" if gone else ""

    def gone_at_a_stop(self) -> str:
        """At a stop signal, who is gone already (a launcher ending the job after a rank died: mpirun's
        SIGTERM, then its SIGKILL a second later), said by the lowest rank still running alone. Its
        heartbeat says at once that it was told to stop: a rank that ends on the same signal is not
        taken for one gone before it."""
        self._stopping = True
        self._write_heartbeat(now=True)
        deadline = time.monotonic() + DYING_SECONDS
        while True:
            records, gone, how = self._missing()
            if gone or all(r.get("stopping") for r in records) or time.monotonic() > deadline:
                break  # every other rank told to stop too: a preemption, nobody to look for
            time.sleep(DYING_SECONDS / 10)
        living = [r["rank"] for r in records if r not in gone] + [self.rank]
        return _described(gone, how) if gone and self.rank == min(living) else ""

    def _missing(self) -> tuple[list, list, dict]:
        """(the other ranks' heartbeats of this run, those of ranks gone, how each of those is said
        where not 'is gone'): a rank is gone whose heartbeat is stale, whose process on this host is
        not there, or whose port refuses a probe (its host answers; mpirun ends the others a second
        after a host's loss, before a heartbeat goes stale). Of those, one the kernel's out-of-memory
        killer ended was killed by it; one whose heartbeat is stale and whose port still answers is
        frozen."""
        now, here, victims = time.time(), socket.gethostname(), cgroups.oom_victims() or set()
        records = [r for r in self._records() if r["rank"] != self.rank and r["alive"] > self.started]
        gone = [r for r in records if r["pid"] in victims or not r.get("stopping") and r["host"] == here
                and not Path(f"/proc/{r['pid']}").exists()]
        how = {r["pid"]: OOM_KILLED for r in gone if r["pid"] in victims}
        ports = [(r["host"], r["port"]) for r in records if r not in gone and r.get("port") and not r.get("stopping")]
        answers = probes.probe_all(ports, PRESENCE_SECONDS)
        for r in records:
            answer = answers.get((r["host"], r.get("port")))
            if r in gone or r.get("stopping") or answer is not False and now - r["alive"] <= FROZEN_SECONDS:
                continue
            if answer is True:
                how[r["pid"]] = FROZEN
            gone.append(r)
        return records, gone, how

    def _report(self) -> None:
        """The record the guard `hvdkit launch` started this rank under reads, if any: a rank killed
        by a signal says nothing, and the guard says for it who it was and how far it got."""
        if self._guard is None:
            return
        record = json.dumps({"rank": self.rank, "peak": peak_rss(), **self._facts}).encode()[:job.GUARD_PAGE - 9]
        self._guard[8:8 + len(record) + 1] = record + b"\0"

    def _records(self) -> list[dict]:
        records = []
        for path in self.shared.glob("heartbeat-rank-*.json") if self.shared else []:
            try:
                records.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
        return records

    def _frozen(self, records: list[dict]) -> list[dict]:
        now = time.time()
        return [r for r in records if now - r["alive"] > FROZEN_SECONDS]

    def _kill_frozen_here(self) -> None:
        """A frozen rank on this host, stopped and running this same program, is killed now: a
        stopped process keeps a SIGTERM pending, and launchers that send one first wait seconds
        more before SIGKILL (horovodrun --gloo: 10 s, measured), past the stall limit. Not under
        Open MPI, whose daemon sends SIGCONT before its SIGTERM: there, a frozen rank killed here
        ended first and mpirun reported its SIGKILL (137) instead of this rank's 75."""
        import psutil

        if "OMPI_COMM_WORLD_RANK" in os.environ:
            return
        for record in self._frozen(self._records()):
            if record["host"] != socket.gethostname() or record["pid"] == os.getpid():
                continue
            try:
                process = psutil.Process(record["pid"])
                if process.status() == psutil.STATUS_STOPPED and process.cmdline() == psutil.Process().cmdline():
                    process.kill()
            except psutil.Error:
                pass

    def _culprit(self) -> tuple[Optional[str], set]:
        """Who stopped the job, from the other ranks' heartbeats: ('rank 1 (host h, pid p) ...', their
        ranks). One whose watchdog thread went silent is frozen (SIGSTOP, a host gone, a call into C
        holding the GIL); else it is the one whose last progress is oldest."""
        records = self._records()
        if len(records) < 2:
            return None, set()
        now = time.time()
        frozen = self._frozen(records)
        if frozen:
            return "; ".join(f"rank {r['rank']} (host {r['host']}, pid {r['pid']}) stopped responding "
                             f"{now - r['alive']:.0f} s ago, last seen in {r['where']}{self._stuck_at(r['rank'])}"
                             for r in frozen), {r["rank"] for r in frozen}
        oldest = min(records, key=lambda r: r["beat"])
        return (f"rank {oldest['rank']} (host {oldest['host']}, pid {oldest['pid']}) made no progress since "
                f"{oldest['where']} ({now - oldest['beat']:.0f} s ago){self._stuck_at(oldest['rank'])}"), \
            {oldest["rank"]}


def _described(gone: list[dict], how: dict) -> str:
    """'rank 1 (host h, pid p) is gone, last seen in training step 4; ...' of the heartbeats of ranks
    gone, each said as ``how`` says it where it does (hvdkit.rank.liveness.watchdog.Watchdog._missing)."""
    return "; ".join(f"rank {r['rank']} (host {r['host']}, pid {r['pid']}) {how.get(r['pid'], 'is gone')}, "
                     f"last seen in {r['where']}" for r in sorted(gone, key=lambda r: r["rank"]))


def _guard_page() -> Optional[memoryview]:
    """The page this rank's guard reads once the rank has ended (job.GUARD); None without a guard.
    Its descriptor is closed: the programs the rank starts do not hold it."""
    text = os.environ.get(job.GUARD, "")
    if not text.isdigit():
        return None
    try:
        with open(int(text), "r+b") as page:
            return memoryview(mmap.mmap(page.fileno(), job.GUARD_PAGE))
    except (OSError, ValueError):
        return None
