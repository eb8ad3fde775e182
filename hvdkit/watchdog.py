"""A per-rank watchdog that ends a job which has stopped making progress.

Horovod's stall inspector names the tensor a missing rank never submitted and shuts the job
down, but only under the MPI controller: measured here with Horovod 0.28.1, a rank that
stops calling collectives under `horovodrun --gloo` hangs the job with no message at all.
The watchdog works under any controller: the loop beats at each step, and a rank that has
not beaten for ``timeout`` seconds says where it was and exits, which makes every launcher
end the whole job.
"""

from __future__ import annotations

import os
import sys
import threading
import time

EXIT_CODE = 75  # distinct from a Python error (1), for job scripts that want to tell stalls apart


class Watchdog:
    def __init__(self, timeout: float, rank: int) -> None:
        self.timeout, self.rank = timeout, rank
        self.where = "start-up"
        self.last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hvdkit-watchdog", daemon=True)
        if timeout > 0:
            self._thread.start()

    @classmethod
    def after_stall_inspector(cls, stall_timeout: float, rank: int) -> "Watchdog":
        """A watchdog that fires after Horovod's inspector (MPI) had its chance to name the tensor."""
        return cls(stall_timeout * 1.5 + 5 if stall_timeout > 0 else 0, rank)

    def beat(self, where: str) -> None:
        self.where, self.last = where, time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout / 10)):
            idle = time.monotonic() - self.last
            if idle > self.timeout:
                print(f"hvdkit: rank {self.rank} made no progress for {idle:.0f} s in {self.where}; ending the "
                      f"job (a rank is stalled or gone; --stall-timeout sets the limit)", file=sys.stderr, flush=True)
                os._exit(EXIT_CODE)
