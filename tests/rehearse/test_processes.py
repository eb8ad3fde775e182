"""hvdkit.rehearse.processes: what a job's ending leaves on the rehearsal hosts, judged with real
processes on this machine."""

import os
import subprocess
import sys

from hvdkit.rank.liveness import lifeline
from hvdkit.rehearse import processes
from hvdkit.system import proctree

# A rank under horovodrun --gloo as its remote host runs it: a shell that waits for it (patch 0014's
# `sh -c '... { env HOROVOD_GLOO_RENDEZVOUS_... python ...; } ...; exit $?'`), the lifeline's variables
# in the rank's environment only. Here the rank outlives the short wait, and its shell outlives it by
# a second: the interleaving a rank ended by its lifeline makes, each time.
WRAPPED_RANK = (f"env {lifeline.ADDRESS}=127.0.0.1 {lifeline.PORT}=9 {sys.executable} -c 'import time; time.sleep(2)';"
                " sleep 1; exit 0")


def _tree_of(root: subprocess.Popen):
    """A look over ``root`` and whatever it started, as left_running looks over a host."""
    return lambda: processes.left_among([process.pid for process in proctree.tree(root.pid)], "this host")


def test_the_shell_that_waits_on_a_rank_ended_by_its_lifeline_is_given_the_lifelines_wait():
    """The soak's leftover `sh -c` (docs/rehearse.md): the rank earns the longer wait while it runs;
    once it has ended, its shell, a moment from its own end, must not be judged by the short one."""
    shell = subprocess.Popen(["sh", "-c", WRAPPED_RANK], start_new_session=True)
    try:
        look = _tree_of(shell)
        left, seconds = processes.settled(look, lifeline_seconds=20.0, plain_seconds=0.5)
        assert left == [], f"judged left while still ending: {left}"
        assert seconds is not None and shell.wait(timeout=5) == 0
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, 9)
            shell.wait()


def test_a_process_no_lifeline_ends_is_left_after_the_short_wait_and_said_with_its_state():
    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        left, seconds = processes.settled(_tree_of(sleeper), lifeline_seconds=20.0, plain_seconds=0.5)
        assert seconds is None and len(left) == 1
        assert left[0].startswith(f"sleep 60 (pid {sleeper.pid}, sleeping") and left[0].endswith(" on this host"), left
    finally:
        sleeper.kill()
        sleeper.wait()
