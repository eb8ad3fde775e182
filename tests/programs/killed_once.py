"""`hvdkit train`, except that rank KILL_RANK SIGKILLs itself after step KILL_AT_STEP on the job's
first attempts (HVDKIT_RESTART below KILL_ATTEMPTS, 1 unless set): a rank that dies between
checkpoints, for hvdkit launch --max-restarts."""

import os
import signal
import sys

from hvdkit import cli
from hvdkit import session as session_module

AT, RANK = int(os.environ["KILL_AT_STEP"]), int(os.environ.get("KILL_RANK", "1"))
ATTEMPTS = int(os.environ.get("KILL_ATTEMPTS", "1"))
step = session_module.Session.step


def step_then_die(self) -> None:
    step(self)
    if self.global_step == AT and self.rank == RANK and int(os.environ.get("HVDKIT_RESTART", "0")) < ATTEMPTS:
        print(f"killed_once: rank {RANK} killed at step {AT}, attempt {os.environ.get('HVDKIT_RESTART')} "
              f"(pid {os.getpid()})", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


session_module.Session.step = step_then_die
sys.exit(cli.main(["train", *sys.argv[1:]]))
