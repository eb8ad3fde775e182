"""Stopping cleanly before Slurm stops the job: a signal, a checkpoint, a requeue.

Submit with `--signal=USR1@<seconds> --requeue`: Slurm sends SIGUSR1 to every task that long
before the time limit, and `scancel --signal=USR1` sends it on demand (preemption). The
handler only sets a flag; the loop reads it at its next metrics report, where one allreduce
makes all ranks agree on the step to stop at, rank 0 writes a checkpoint and requeues the
job, and the restarted job resumes from that checkpoint.
"""

from __future__ import annotations

import signal
import subprocess
from typing import Mapping, Optional

SIGNALS = (signal.SIGUSR1,)


class StopSignal:
    """Remembers that a stop was asked for; installed for the loop's lifetime."""

    def __init__(self) -> None:
        self.received: Optional[int] = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def requeue(environ: Mapping[str, str], max_requeues: int) -> str:
    """Requeue this Slurm job unless it has been requeued max_requeues times; say what happened."""
    job = environ.get("SLURM_JOB_ID")
    if not job:
        return "not a Slurm job: rerun the same command to resume"
    restarts = int(environ.get("SLURM_RESTART_COUNT", "0"))
    if restarts >= max_requeues:
        return f"not requeued: job {job} was restarted {restarts} times already (--max-requeues {max_requeues})"
    result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    if result.returncode != 0:
        return f"requeue of job {job} failed: {result.stderr.strip() or result.stdout.strip()}"
    return f"requeued job {job} (restart {restarts + 1} of at most {max_requeues})"


def exit_code(message: str) -> int:
    """0 when the job goes on after a requeue, else 1 so that the stop is not taken for success."""
    return 0 if message.startswith("requeued") else 1

