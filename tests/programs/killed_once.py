"""`hvdkit train`, except that rank KILL_RANK SIGKILLs itself after step KILL_AT_STEP on the job's
first attempts (HVDKIT_RESTART below KILL_ATTEMPTS, 1 unless set): a rank that dies between
checkpoints, for hvdkit launch --max-restarts. With HOLD_WRITE=N, rank 0's write of checkpoint N is
held until the killed rank and its guard are gone (their pids in KILL_MARK): the death lands while
that write is in flight. With KILL_AFTER_WRITTEN=PATH, the rank dies only once PATH (a checkpoint) exists."""

import os
import signal
import sys
import time
from pathlib import Path

import psutil

from hvdkit import cli
from hvdkit import session as session_module
from hvdkit.checkpoint import writer

AT, RANK = int(os.environ["KILL_AT_STEP"]), int(os.environ.get("KILL_RANK", "1"))
ATTEMPTS = int(os.environ.get("KILL_ATTEMPTS", "1"))
HOLD, MARK = int(os.environ.get("HOLD_WRITE", "-1")), os.environ.get("KILL_MARK", "")
WRITTEN = os.environ.get("KILL_AFTER_WRITTEN", "")
FIRST = int(os.environ.get("HVDKIT_RESTART", "0")) < ATTEMPTS
step, commit = session_module.Session.step, writer._commit


def held_commit(directory, at, *rest) -> None:
    deadline = time.monotonic() + 60  # the test fails on its assertions, not by hanging here
    while FIRST and at == HOLD and time.monotonic() < deadline:
        said = Path(MARK).read_text().split() if Path(MARK).exists() else []
        if said and not any(psutil.pid_exists(int(pid)) for pid in said):  # the rank and its guard gone
            break
        time.sleep(0.01)
    commit(directory, at, *rest)


def step_then_die(self) -> None:
    step(self)
    if self.global_step == AT and self.rank == RANK and FIRST:
        deadline = time.monotonic() + 60
        while WRITTEN and not Path(WRITTEN).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        if MARK:
            Path(MARK + ".new").write_text(f"{os.getpid()} {os.getppid()}")
            os.replace(MARK + ".new", MARK)  # read whole or not at all
        print(f"killed_once: rank {RANK} killed at step {AT}, attempt {os.environ.get('HVDKIT_RESTART')} "
              f"(pid {os.getpid()})", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


session_module.Session.step = step_then_die
writer._commit = held_commit
sys.exit(cli.main(["train", *sys.argv[1:]]))
