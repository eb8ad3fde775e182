"""hvdkit.launch.supervise on real processes, with shell scripts standing in for a launcher and
its ranks. supervise.run makes its caller the subreaper of what it starts and ends every process
below it, so it runs in a small Python process of its own here, never in the pytest worker."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from conftest import REPO, run
from hvdkit import job
from hvdkit.launch import supervise
from hvdkit.system import proctree, sighandlers

SUPERVISE = ("import json, os, sys\n"
             "from hvdkit.launch import supervise\n"
             "sys.exit(supervise.run(json.loads(sys.argv[1]), dict(os.environ)))\n")


def supervised(script, **kwargs):
    """`supervise.run(["sh", "-c", script])` in a process of its own, to its end."""
    return run([sys.executable, "-c", SUPERVISE, json.dumps(["sh", "-c", script])], timeout=60, **kwargs)


def gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_the_launchers_exit_code_is_the_jobs_and_a_signal_is_128_plus_it():
    assert supervised("exit 3").returncode == 3
    assert supervised("kill -KILL $$").returncode == job.stopped_by(signal.SIGKILL)


def test_a_code_a_rank_recorded_replaces_the_launchers_own():
    """mpirun and horovodrun exit 1 whatever a rank exited with; the rank's record says 75."""
    proc = supervised('echo "75 rank 1 made no progress for 30 s" > "$HVDKIT_JOB_DIR/exit-123"; exit 1')
    assert proc.returncode == job.STALLED
    assert proc.stderr == "hvdkit launch: rank 1 made no progress for 30 s\n"


def test_what_the_launcher_leaves_running_is_ended_by_pid(tmp_path):
    """One child left in the launcher's process group, one orphaned into a session of its own:
    both are ended, named, when the launcher exits."""
    pids = tmp_path / "pids"
    proc = supervised(f"sleep 300 & echo $! >> {pids}; (setsid sleep 301 & echo $! >> {pids}); exit 0")
    left = [int(pid) for pid in pids.read_text().split()]
    assert proc.returncode == 0
    assert proc.stderr.startswith("hvdkit launch: the launcher exited and left 2 processes running; ending them")
    assert all(str(pid) in proc.stderr for pid in left) and all(gone(pid) for pid in left)


def test_a_stop_reaches_the_ranks_and_a_rank_that_does_not_end_is_killed_after_the_grace(tmp_path):
    """The rank (it has HOROVOD_RANK) is signalled directly, not through its launcher; it notes the
    SIGTERM and goes on, so the job is killed stop_grace() + KILL_AFTER_GRACE seconds later."""
    got, pid = tmp_path / "got-sigterm", tmp_path / "rank-pid"
    rank = tmp_path / "rank.sh"
    rank.write_text(f"echo $$ > {pid}; trap 'touch {got}' TERM; while :; do sleep 0.05; done\n")
    env = dict(os.environ, HVDKIT_STOP_GRACE="0.2")
    caller = subprocess.Popen([sys.executable, "-c", SUPERVISE, json.dumps(["sh", "-c", f"HOROVOD_RANK=0 sh {rank}"])],
                              cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not pid.exists() or not pid.read_text().strip():
            assert caller.poll() is None and time.monotonic() < deadline, "the rank did not start"
            time.sleep(0.02)
        caller.send_signal(signal.SIGTERM)
        _, stderr = caller.communicate(timeout=30)
    finally:
        proctree.end_processes(proctree.tree(caller.pid), grace=0)
    assert got.exists(), "the rank got the stop signal itself"
    assert caller.returncode == job.stopped_by(signal.SIGKILL)
    assert stderr.splitlines()[-1] == (f"hvdkit launch: the job did not end within {0.2 + job.KILL_AFTER_GRACE:g} s "
                                       "of SIGTERM; killing what is left")
    assert gone(int(pid.read_text()))


def test_srun_gets_sigint_as_sigterm_and_the_others_as_sent():
    """A single Ctrl-C makes srun print its tasks' status instead of passing it on."""
    assert supervise.translate(signal.SIGINT, "srun") == signal.SIGTERM
    assert supervise.translate(signal.SIGINT, "mpirun") == signal.SIGINT
    assert supervise.translate(signal.SIGUSR1, "srun") == signal.SIGUSR1


def test_end_processes_kills_what_ignores_sigterm_after_the_grace():
    proc = subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 300 & wait"])
    try:
        deadline = time.monotonic() + 10
        while len(proctree.tree(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        processes = proctree.tree(proc.pid)
        assert [p.pid for p in processes][-1] == proc.pid and len(processes) == 2, "the child, then the top"
        started = time.monotonic()
        proctree.end_processes(processes, grace=0.3)
        assert time.monotonic() - started >= 0.3, "SIGTERM is ignored: they are killed once the grace is over"
        proc.wait(timeout=5)
        assert all(gone(p.pid) for p in processes)
    finally:
        proctree.end_processes(proctree.tree(proc.pid), grace=0)
    assert proctree.tree(proc.pid) == []


def test_a_stop_arriving_as_the_launcher_exits_is_no_traceback():
    """The launcher gone (and reaped) when the signal handler runs: nothing to pass on, no error."""
    child = subprocess.Popen(["true"])
    gone = psutil.Process(child.pid)
    child.wait()
    supervise.pass_on(signal.SIGTERM, gone)


WRITER = ("import os, sys, time\n"
          "path = sys.argv[1]\n"
          "while not os.path.exists(path): time.sleep(0.01)\n"
          "directory = open(path).read().strip()\n"
          "end = time.monotonic() + 4\n"
          "while time.monotonic() < end:\n"
          "    try:\n"
          "        tmp = os.path.join(directory, f'heartbeat.{time.monotonic_ns()}.tmp')\n"
          "        open(tmp, 'w').write('{}')\n"
          "        os.replace(tmp, os.path.join(directory, 'heartbeat-rank-1.json'))\n"
          "    except OSError:\n"
          "        pass\n"
          "    time.sleep(0.002)\n")


def test_the_job_directory_is_removed_while_a_rank_elsewhere_still_writes_into_it(tmp_path):
    """A rank on another host that shares /tmp is not below the launcher and goes on writing
    heartbeats after the job ended here (CI: a link-down job exited with a traceback, 'Directory
    not empty', instead of its code). The writer here is started beside the job, not below it."""
    for round in range(2):
        named = tmp_path / f"job-dir-{round}"
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(named)])
        try:
            proc = supervised(f'echo "$HVDKIT_JOB_DIR" > {named}.tmp; mv {named}.tmp {named}; '
                              'until [ -e "$HVDKIT_JOB_DIR/heartbeat-rank-1.json" ]; do sleep 0.01; done; exit 3')
        finally:
            writer.kill()
            writer.wait()
        assert (proc.returncode, proc.stderr) == (3, "")
        directory = named.read_text().strip()
        assert not os.path.exists(directory) and not os.path.exists(f"{directory}.ended")


def test_handlers_keep_nohups_sighup_ignored_and_restore_the_others():
    """`nohup hvdkit launch ...` ignores SIGHUP so that the job outlives the terminal: no handler
    of hvdkit's takes it back (sighandlers.Handlers: the one way signals are handled)."""
    def mine(signum, frame):
        pass

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN), signal.getsignal(signal.SIGUSR2)
    try:
        with sighandlers.Handlers((signal.SIGHUP, signal.SIGUSR2), mine) as handlers:
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN and signal.getsignal(signal.SIGUSR2) is mine
            assert list(handlers.previous) == [signal.SIGUSR2]
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN and signal.getsignal(signal.SIGUSR2) == before[1]
    finally:
        signal.signal(signal.SIGHUP, before[0])


def test_a_handler_that_raises_during_a_wait_leaves_the_next_wait_working():
    """The hang spawn.py met: a raise inside Popen.wait can leave its lock held. proctree.wait_child
    sleeps instead, so the caller's handler raises there and the next wait returns the code."""
    class Raised(Exception):
        pass

    def raising(signum, frame):
        raise Raised

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.0); raise SystemExit(3)"])
    with sighandlers.Handlers((signal.SIGUSR2,), raising):
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR2)).start()
        with pytest.raises(Raised):
            proctree.wait_child(child)
        assert proctree.wait_child(child, timeout=30) == 3
