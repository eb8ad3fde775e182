"""hvdkit launch's line to its ranks under --max-restarts (hvdkit.launch.links, hvdkit.rank.liveness.link),
with real processes on it: a rank that dies has the others ended at once, one that leaves by
itself does not, and a stop reaches a rank on another host (its own UTS namespace) as a signal."""

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import REPO
from hvdkit import job
from hvdkit.launch.links import Links
from hvdkit.system import proctree

RANK = str(REPO / "tests" / "programs" / "link_rank.py")
SECONDS = 30  # for an event that comes within a second: a loaded machine, never a sleep


@pytest.fixture
def lines():
    links = Links("127.0.0.1")
    ranks: list[subprocess.Popen] = []
    children: list[int] = []  # what the ranks forked

    def start(rank: int, size: int, host: str = "", *extra: str) -> subprocess.Popen:
        argv = [sys.executable, RANK, str(rank), str(size), *extra]
        if host:  # another host's name, as a rank there says it
            argv = ["unshare", "--uts", "sh", "-c", f'hostname {host} && exec "$@"', "sh", *argv]
        # Unbuffered: a line read ahead into a buffer would be one select() no longer sees.
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, bufsize=0, env=dict(
            os.environ, PYTHONPATH=str(REPO), **{job.LINK: links.address}))
        ranks.append(proc)
        assert said(proc) == "on the line"
        return proc

    try:
        yield links, start, children
    finally:
        alive = [process for proc in ranks if proc.poll() is None for process in proctree.tree(proc.pid)]
        proctree.end_processes(alive + proctree.processes(children), grace=0)
        for proc in ranks:
            proc.wait()
            proc.stdout.close()
        links.close()


def said(proc: subprocess.Popen, seconds: float = SECONDS) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], seconds)
    assert ready, "no word from the rank"
    return proc.stdout.readline().decode().strip()


def test_a_rank_that_dies_has_the_others_ended_at_once_with_one_line(lines, capfd):
    """Its forked child (a DataLoader's worker) outlives it and holds no copy of the line open."""
    links, start, children = lines
    ranks = [start(rank, 3, "", *(["fork"] if rank == 1 else [])) for rank in range(3)]
    children.append(int(said(ranks[1]).removeprefix("child ")))
    ranks[1].kill()
    assert [ranks[0].wait(SECONDS), ranks[2].wait(SECONDS)] == [job.FAILED, job.FAILED]
    assert links.died.rank == "1" and links.died.pid == str(ranks[1].pid)
    [line] = [line for line in capfd.readouterr().err.splitlines() if line.startswith("hvdkit launch:")]
    assert line == (f"hvdkit launch: rank 1 (pid {ranks[1].pid} on {os.uname().nodename}) ended without a word "
                    f"(a signal or a crash); ending the other ranks now")


def test_a_connection_that_never_said_who_it_is_ends_no_rank(lines):
    links, start, _ = lines
    rank = start(0, 2)
    host, port = links.address.rsplit(":", 1)
    socket.create_connection((host, int(port))).close()  # a stray connection, as a port scan's
    start(1, 2)  # welcomed after the stray connection's end was read
    assert links.died is None
    rank.send_signal(signal.SIGUSR1)  # still there, and still hears
    assert said(rank) == "got SIGUSR1"


def test_a_rank_that_leaves_by_itself_ends_no_other(lines):
    links, start, _ = lines
    ranks = [start(rank, 2) for rank in range(2)]
    ranks[1].send_signal(signal.SIGUSR2)
    assert said(ranks[1]) == "got SIGUSR2" and ranks[1].wait(SECONDS) == 0
    ranks[0].send_signal(signal.SIGUSR1)  # still there, and still hears
    assert said(ranks[0]) == "got SIGUSR1"
    assert links.died is None


@pytest.mark.skipif(not shutil.which("unshare"), reason="unshare (util-linux) is needed for another host's name")
def test_a_stop_goes_on_the_line_to_the_ranks_on_other_hosts_only(lines):
    """The ranks on this host are signalled directly by hvdkit launch (supervise.pass_on): the line
    passes the signal only to the others, and says whether every rank is on it."""
    links, start, _ = lines
    here = start(0, 3)
    there = start(1, 3, host="elsewhere")
    assert not links.stop(signal.SIGUSR1), "rank 2 is not on the line yet"
    assert said(there) == "got SIGUSR1"
    start(2, 3, host="elsewhere")
    assert links.stop(signal.SIGTERM)
    assert said(there) == "got SIGTERM"
    here.send_signal(signal.SIGUSR2)  # its first word since it started: no signal came to it on the line
    assert said(here) == "got SIGUSR2"


def test_a_standby_rank_waits_until_told_to_go_and_one_not_needed_ends_unheard():
    """The ranks of a standby attempt (started ahead of need) import what they need, say they are
    ready and wait; go() lets them on, onto the line as any rank. Those of a standby whose line
    closes without it (it was not needed) end with 1, saying nothing: their launcher then ends
    the standby's other ranks (one ended with 0 before MPI's init is no failure to mpirun)."""
    needed, unneeded = Links("127.0.0.1"), Links("127.0.0.1")
    open_ones, procs = [needed, unneeded], []
    try:
        for links in (needed, needed, unneeded):
            procs.append(subprocess.Popen([sys.executable, RANK, str(len(procs) % 2), "2"], stdout=subprocess.PIPE,
                                          bufsize=0, env=dict(os.environ, PYTHONPATH=str(REPO),
                                                              **{job.LINK: links.address, job.STANDBY: "1"})))
        for links, count in ((needed, 2), (unneeded, 1)):
            _await(lambda: links.waiting() == count)  # noqa: B023 -- awaited here, in this iteration
        assert not select.select([p.stdout for p in procs], [], [], 0)[0], "a standby's rank said something"
        needed.go()
        assert [said(procs[0]), said(procs[1])] == ["on the line", "on the line"]
        assert needed.complete() and needed.waiting() == 0
        open_ones.remove(unneeded)
        unneeded.close()
        assert procs[2].wait(SECONDS) == job.FAILED and procs[2].stdout.read() == b""
    finally:
        proctree.end_processes([p for proc in procs if proc.poll() is None for p in proctree.tree(proc.pid)], grace=0)
        for proc in procs:
            proc.wait()
            proc.stdout.close()
        for links in open_ones:
            links.close()


def _await(condition) -> None:
    """Until ``condition()`` holds (the standby's ranks import torch first: seconds on a loaded machine)."""
    deadline = time.monotonic() + SECONDS
    while not condition():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.05)
