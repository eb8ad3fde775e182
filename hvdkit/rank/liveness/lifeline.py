"""The lifeline of a rank that `horovodrun --gloo` started over ssh: it ends the rank once its
launcher is gone (hvdkit.rank.liveness.orphan watches launchers on the rank's own host)."""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from hvdkit import job
from hvdkit.job import LOST_SECONDS, PROBE_SECONDS
from hvdkit.system import probes

ADDRESS, PORT = "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT"


def watches(environ) -> bool:
    """Whether a process with this environment was started under horovodrun --gloo, whose
    rendezvous server a rank there probes (a process the rank started has the same variables)."""
    return bool(environ.get(ADDRESS)) and (environ.get(PORT) or "").isdigit()


class Lifeline:
    """A rank started over ssh by `horovodrun --gloo` outlives its launcher: nothing on its
    host ends it when the launcher's host is gone or the launcher was killed (measured: after
    a host was lost, the rank on a third host kept running). The launcher serves Gloo's
    rendezvous for the whole job, so each rank probes that server and ends itself, saying
    why, once it has not been there for ``lost_after`` seconds. Under mpirun and srun, the
    MPI daemons do this already."""

    def __init__(self, address: str, port: int, rank: int, lost_after: float = LOST_SECONDS,
                 every: float = PROBE_SECONDS, on_lost: Optional[Callable[[str], None]] = None) -> None:
        self.address, self.port, self.rank = address, port, rank
        self.lost_after, self.every, self.on_lost = lost_after, every, on_lost or _end_rank
        self._stop = threading.Event()

    def start(self) -> "Lifeline":
        """Its probing thread started (Ending.start); returns itself."""
        threading.Thread(target=self._watch, name="hvdkit-lifeline", daemon=True).start()
        return self

    @classmethod
    def from_environ(cls, environ, rank: int) -> Optional["Lifeline"]:
        if not watches(environ):
            return None  # not started by horovodrun --gloo (nor its elastic driver)
        return cls(environ[ADDRESS], int(environ[PORT]), rank)

    def _watch(self) -> None:
        seen = time.monotonic()
        while not self._stop.wait(self.every):
            if probes.probe(self.address, self.port, timeout=self.every):
                seen = time.monotonic()
            elif time.monotonic() - seen >= self.lost_after:
                self.on_lost(f"rank {self.rank}: its launcher (horovodrun, rendezvous {self.address}:{self.port}) "
                             f"has been gone for {time.monotonic() - seen:.0f} s; ending this rank")
                return

    def stop(self) -> None:
        self._stop.set()


def _end_rank(line: str) -> None:
    job.end_rank(job.LOST, line)
