"""A per-rank watchdog that ends a job which has stopped making progress.

Horovod's stall inspector names the tensor a missing rank never submitted (before the
timeout, hvdkit.rank.startup.stall_settings), but its shutdown works only under the MPI controller,
and not even there when a rank is frozen (SIGSTOP: measured here with Horovod 0.28.1, the
job ran on past the limit). The watchdog works under any controller and is what ends a
stalled job at ``--stall-timeout``: the loop beats at each step and at each of hvdkit's calls,
and a rank that has not beaten for ``timeout`` seconds says where it was and exits, which
makes every launcher end the whole job.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Optional

from hvdkit import job
from hvdkit.system import wholefiles

HEARTBEAT_SECONDS = 1.0
FROZEN_SECONDS = 5.0  # a rank whose watchdog thread has not written for this long is frozen or gone


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
        self.last_wall = time.time()
        self.shared: Optional[Path] = None
        self._own = False
        self._written = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hvdkit-watchdog", daemon=True)
        if timeout > 0:
            self._thread.start()

    def share(self, directory: str, own: bool = True) -> None:
        """Write heartbeats to ``directory`` (every rank must pass the same one); ``own``: the
        directory is only for them, and the last rank to stop removes it."""
        self.shared, self._own = Path(directory), own
        self._write_heartbeat()  # now: a rank that freezes within its first second is named too

    def beat(self, where: str) -> None:
        self.where, self.last, self.last_wall = where, time.monotonic(), time.time()

    def stop(self) -> None:
        self._stop.set()
        if self.shared is not None:
            self._path(self.rank).unlink(missing_ok=True)
            if self._own:
                with contextlib.suppress(OSError):  # other ranks' heartbeats are still there
                    self.shared.rmdir()

    def _path(self, rank: int) -> Path:
        return self.shared / f"heartbeat-rank-{rank}.json"

    def _watch(self) -> None:
        interval = min(HEARTBEAT_SECONDS, self.timeout / 10)
        woke = time.monotonic()
        while not self._stop.wait(interval):
            slept, woke = time.monotonic() - woke, time.monotonic()
            self._write_heartbeat()
            idle = woke - self.last if self.last is not None else 0.0
            # This whole process was stopped for longer than the others wait for it. Not merely
            # FROZEN_SECONDS: a long call holding the GIL (pickling a large checkpoint) also
            # delays this thread, and must not end the run.
            if slept > max(FROZEN_SECONDS, self.timeout):
                line = (f"rank {self.rank} was frozen for {slept:.0f} s (stopped, or its host paused) in "
                        f"{self.where}; ending")
                job.end_rank(job.STALLED, line)
            if idle > self.timeout:
                culprit = self._culprit()
                self._kill_frozen_here()
                line = (f"{culprit}; rank {self.rank} waited {idle:.0f} s in {self.where}; ending the job "
                        f"(--stall-timeout sets the limit)" if culprit else
                        f"rank {self.rank} made no progress for {idle:.0f} s in {self.where}; ending the job (a rank "
                        f"is stalled or gone; --stall-timeout sets the limit)")
                job.end_rank(job.STALLED, line)

    def _write_heartbeat(self) -> None:
        now = time.time()
        if self.shared is None or now - self._written < HEARTBEAT_SECONDS:
            return
        record = {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(), "where": self.where,
                  "beat": self.last_wall, "alive": now}
        try:
            if self._own:  # a launcher's job directory is the launcher's: gone with it, not made again
                self.shared.mkdir(parents=True, exist_ok=True)
            wholefiles.write_whole(self._path(self.rank), json.dumps(record))
            self._written = now
        except OSError:
            pass  # heartbeats only improve the message; never fail training for them

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

    def _culprit(self) -> Optional[str]:
        """Who stopped the job, from the other ranks' heartbeats: 'rank 1 (host h, pid p) ...'."""
        records = self._records()
        if len(records) < 2:
            return None
        now = time.time()
        frozen = self._frozen(records)
        if frozen:
            return "; ".join(f"rank {r['rank']} (host {r['host']}, pid {r['pid']}) stopped responding "
                             f"{now - r['alive']:.0f} s ago, last seen in {r['where']}" for r in frozen)
        oldest = min(records, key=lambda r: r["beat"])
        return (f"rank {oldest['rank']} (host {oldest['host']}, pid {oldest['pid']}) made no progress since "
                f"{oldest['where']} ({now - oldest['beat']:.0f} s ago)")
