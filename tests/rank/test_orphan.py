"""The watch on the launcher (hvdkit.rank.liveness.orphan) with real processes: a rank finds its launcher among
its ancestors, notices when it is gone, and keeps its output where nothing reads it any more."""

import os
import signal
import subprocess
import sys
import time

import psutil

from conftest import REPO

PROBE = """
import sys, time
from pathlib import Path
from hvdkit.rank.liveness import orphan
from hvdkit.system.wholefiles import write_whole

lines = []
watch = orphan.LauncherWatch(orphan.launcher_chain(), lines.append, every=0.1)
print("chain", " | ".join(watch.names), flush=True)  # named at start, while they run
deadline = time.monotonic() + 20
while not lines and time.monotonic() < deadline:
    time.sleep(0.05)
write_whole(Path(sys.argv[1]), lines[0] if lines else "not noticed")  # whole: the test reads it once it is there
"""


def _fake_launcher(tmp_path, name):
    """An executable called ``name`` that runs the probe as its child (a shell script, so that
    the process is `/bin/sh .../mpirun`, as a real launcher's name shows in its arguments)."""
    (tmp_path / "probe.py").write_text(PROBE)
    launcher = tmp_path / name
    launcher.write_text(f'#!/bin/sh\n"{sys.executable}" "{tmp_path / "probe.py"}" "{tmp_path / "noticed"}"\n')
    launcher.chmod(0o755)
    return launcher


def _wait_for_line(proc, prefix):
    line = proc.stdout.readline()
    assert line.startswith(prefix), line + proc.stderr.read()
    return line


def test_a_rank_notices_within_seconds_that_horovodruns_shell_is_gone(tmp_path):
    """What plain horovodrun becomes in MPI mode: `sh -c mpirun ...`; killing it leaves mpirun
    (here, a script named mpirun) and the rank running; the rank notices and names the shell."""
    launcher = _fake_launcher(tmp_path, "mpirun")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    shell = subprocess.Popen(["/bin/sh", "-c", f"{launcher} && true"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        chain = _wait_for_line(shell, "chain ")
        assert chain.strip() == f"chain mpirun (pid {psutil.Process(shell.pid).children()[0].pid}) | " \
                                f"sh -c {launcher} (pid {shell.pid})", chain
        killed = time.monotonic()
        shell.send_signal(signal.SIGKILL)
        shell.wait()
        deadline = killed + 10
        while not (tmp_path / "noticed").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        noticed = time.monotonic() - killed
        assert (tmp_path / "noticed").read_text() == f"its launcher sh -c {launcher} (pid {shell.pid}) is gone"
        assert noticed < 5, noticed  # "within a few seconds" (issue 27); it checks every 0.1 s here
    finally:
        os.killpg(shell.pid, signal.SIGKILL)


def test_a_rank_without_a_launcher_above_it_watches_nothing(tmp_path):
    """Started by srun, by ssh, or by hand: no chain, no thread."""
    probe = subprocess.run([sys.executable, "-c",
                            "from hvdkit.rank.liveness import orphan; print(orphan.launcher_chain())"],
                           env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "[]", probe.stdout + probe.stderr


KEPT = """
import sys
from pathlib import Path
from hvdkit.rank.liveness import orphan

orphan.keep_streams(Path(sys.argv[1]))
sys.stdin.readline()  # the reader of our output is gone when this returns
print("hvdkit: stopped at step 7; checkpoint of step 7 saved in ckpt", flush=True)
print("to stderr", file=sys.stderr, flush=True)
"""


def test_output_whose_reader_is_gone_is_kept_in_a_file(tmp_path):
    """horovodrun --gloo relays each rank's output through a pipe it reads; killed, it takes the
    reading end with it, and a plain print would raise BrokenPipeError."""
    kept = tmp_path / "ranks" / "rank-0-after-launcher.log"
    proc = subprocess.Popen([sys.executable, "-c", KEPT, str(kept)], env=dict(os.environ, PYTHONPATH=str(REPO)),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    proc.stderr.close()
    proc.stdin.write("go\n")
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0
    assert kept.read_text() == "hvdkit: stopped at step 7; checkpoint of step 7 saved in ckpt\nto stderr\n"
