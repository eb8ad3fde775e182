"""The lifeline (hvdkit.rank.liveness.lifeline): the watch a rank that horovodrun --gloo started keeps
on horovodrun's server, which ends it when the launcher is gone. The ranks it ends in a job:
tests/rehearse/test_multihost.py; its probe against a host watch's: tests/launch/test_network.py."""

import os
import queue
import socket
import subprocess
import sys

from conftest import REPO
from hvdkit.rank.liveness.lifeline import Lifeline


def test_a_lifeline_says_its_launcher_is_gone_once_its_server_stopped_answering_and_not_before():
    server = socket.create_server(("127.0.0.1", 0))
    port, said = server.getsockname()[1], queue.Queue()
    line = Lifeline("127.0.0.1", port, 3, lost_after=0.6, every=0.1, on_lost=said.put).start()
    try:
        assert said.empty() and not _said_within(said, 1.0), "the server answers: nothing said"
        server.close()
        assert _said_within(said, 10.0).startswith(
            f"rank 3: its launcher (horovodrun, rendezvous 127.0.0.1:{port}) has been gone for ")
        assert said.empty(), "said once"
    finally:
        line.stop()
        server.close()


def _said_within(said: queue.Queue, seconds: float) -> str:
    try:
        return said.get(timeout=seconds)
    except queue.Empty:
        return ""


def test_only_a_rank_horovodrun_gloo_started_has_a_lifeline():
    """hvdkit rehearse --chaos waits out a lifeline (15 s and more) only for what horovodrun
    --gloo started: the variables as the real launchers set them."""
    from hvdkit.checks import selftest

    script = "import os; from hvdkit.rank.liveness import lifeline; print('watches', lifeline.watches(os.environ))"
    env = selftest.mpi_root_env(dict(os.environ, PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"))
    for launcher, watched in ((["horovodrun", "--gloo", "-np", "1", "-H", "localhost:1"], True),
                              (["mpirun", "-np", "1", "--allow-run-as-root"], False)):
        out = subprocess.run([*launcher, sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert f"watches {watched}" in out.stdout, (launcher, out.stdout)
