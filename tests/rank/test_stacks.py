"""A stalled job says where (hvdkit.rank.liveness.stacks, written by the watchdog): a rank stuck in its data
loading, in Python's time.sleep or in a C call that holds the GIL (tests/programs/stuck_loader.py), under
hvdkit launch (mpirun, horovodrun --gloo) and as users type them (mpirun, horovodrun --gloo). Every rank's
stacks land in the run's log directory and the job's line names the stuck frame, file:line of the program,
and the Horovod call the other rank waits in. The four jobs run at once: each idles through its stall limit."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import REPO, kill_tree, untagged
from hvdkit.checks import selftest
from hvdkit.launch import planner

pytestmark = pytest.mark.slow

PROGRAM = REPO / "tests" / "programs" / "stuck_loader.py"
LAUNCH = [sys.executable, "-m", "hvdkit", "launch", "-np", "2"]
LAUNCHERS = {
    "hvdkit launch mpirun": lambda command: [*LAUNCH, "--launcher", "mpirun", "--", *command],
    "hvdkit launch horovodrun --gloo": lambda command: [*LAUNCH, "--launcher", "horovodrun", "--gloo", "--",
                                                        *command],
    "mpirun": lambda command: planner.local_command("mpirun", 2, command),
    "horovodrun --gloo": lambda command: planner.local_command("horovodrun --gloo", 2, command),
}
# Each launcher once, each way of being stuck under two of them: ranks start at a cost of seconds
# of CPU each, and the suite's time is mostly theirs (docs/development.md).
JOBS = [("sleep", "hvdkit launch mpirun"), ("gil", "hvdkit launch horovodrun --gloo"), ("gil", "mpirun"),
        ("sleep", "horovodrun --gloo")]
STALL = 12  # seconds: four jobs start at once beside the suite's other worker
SECONDS = 240  # four jobs of two ranks starting at once on two cores


def marked_line(mark):
    """The line of the program that gets stuck, found by its comment."""
    lines = PROGRAM.read_text().splitlines()
    return next(number for number, text in enumerate(lines, 1) if mark in text)


def ours(log_dir):
    """The processes of one job still running: those whose command line names its log directory."""
    left = []
    for process in psutil.process_iter(["cmdline"]):
        if str(log_dir) in " ".join(process.info["cmdline"] or []):
            left.append(process)
    return left


def test_a_stalled_rank_leaves_every_ranks_stacks_and_its_stuck_line(tmp_path):
    jobs = {}
    try:
        for how, launcher in JOBS:
            directory = tmp_path / f"{how}-{launcher.replace(' ', '-')}"
            directory.mkdir()
            with open(directory / "output", "w") as output:
                jobs[how, launcher] = (directory, subprocess.Popen(
                    LAUNCHERS[launcher]([sys.executable, str(PROGRAM), "--how", how, "--at", "3", "--stall-timeout",
                                         str(STALL), "--log-dir", str(directory / "logs")]),
                    env=dict(selftest.mpi_root_env(), PYTHONPATH=str(REPO)), stdout=output,
                    stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + SECONDS
        for (how, launcher), (directory, proc) in jobs.items():
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{how}, {launcher}: still running {SECONDS} s after the start: "
                            f"{(directory / 'output').read_text()[-3000:]}")
        left = {job: [p.pid for p in psutil.wait_procs(ours(directory), timeout=10)[1]]
                for job, (directory, _) in jobs.items()}
    finally:
        for _, proc in jobs.values():
            kill_tree(proc)
    for (how, launcher), (directory, proc) in jobs.items():
        output = untagged((directory / "output").read_text())
        where = f"{(how, launcher)}: {output[-3000:]}"
        assert proc.returncode in ((75,) if launcher.startswith("hvdkit") else (75, 137, 1)), where
        stuck = f"stuck at {PROGRAM.relative_to(REPO)}:{marked_line('STUCK-' + how.upper())} in __getitem__"
        lines = [line for line in output.splitlines() if line.startswith("hvdkit") and stuck in line]
        assert lines, where
        assert re.search(r"waiting in Horovod's \w+\(\)", lines[-1]) or "rank 1 waited" in lines[-1], where
        assert f"every rank's stacks: {directory / 'logs'}/stacks-rank-*.txt" in lines[-1], where
        for rank in (0, 1):
            stacks = (directory / "logs" / f"stacks-rank-{rank}.txt").read_text()
            assert stacks.startswith(f"# rank {rank}, pid "), (where, stacks)
            assert 'File "' in stacks, (where, stacks)
        assert str(PROGRAM) in (directory / "logs" / "stacks-rank-1.txt").read_text(), where
        assert left[how, launcher] == [], f"{where}: processes of the job outlived it: {left[how, launcher]}"


def test_stacks_are_read_as_faulthandler_writes_them(tmp_path):
    """The parsing, on a file faulthandler wrote here (no launcher): the main thread's frames,
    the innermost in the user's code (this file, not threading's or hvdkit's)."""
    import threading

    from hvdkit.rank.liveness import stacks

    written = stacks.Stacks(tmp_path, 3, period=3600)

    def inner():
        written.write_now()

    inner()
    text = written.path.read_text()
    written.close()
    assert not written.path.exists()
    frames = stacks.main_thread(text)
    assert text.startswith(f"# rank 3, pid {os.getpid()}, main thread {threading.main_thread().ident:#x}")
    assert frames[0].file.endswith(os.path.join("hvdkit", "rank", "liveness", "stacks.py"))
    user = stacks.users(frames)
    assert user is not None and Path(user.file) == Path(__file__) and user.function == "inner", frames
    assert stacks.horovod_call(frames) is None


def test_the_timer_writes_until_progress_and_the_last_dump_is_read(tmp_path):
    """Armed once, the timer appends a dump each period; progress empties the file to its header;
    the reader takes the main thread's frames of the last dump only."""
    from hvdkit.rank.liveness import stacks

    written = stacks.Stacks(tmp_path, 0, period=0.2)
    try:
        deadline = time.monotonic() + 60
        while written.path.read_text().count("Timeout (") < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        text = written.path.read_text()
        assert text.count("Timeout (") >= 5, text
        frames = stacks.main_thread(text)
        assert Path(frames[0].file) == Path(__file__), frames  # in time.sleep, below this test's frame
        assert 5 * len(frames) <= sum(line.lstrip().startswith("File ") for line in text.splitlines()), text
        written.progress()
        emptied = written.path.read_text()
        assert emptied.startswith("# rank 0, pid ") and emptied.count("Timeout (") < 5, emptied
    finally:
        written.close()
    assert not written.path.exists()


HELD_IN_C = """
import ctypes, os, sys, time
from pathlib import Path
from hvdkit.rank.ending import stops
from hvdkit.rank.liveness import stacks
from hvdkit.rank.liveness.watchdog import Watchdog

directory, seconds = Path(sys.argv[1]), float(sys.argv[2])
watchdog = Watchdog(timeout=2, rank=0).start()
stops.StopSignal(rank=0, watchdog=watchdog).install()
watchdog.share(str(directory / "heartbeats"), stacks=str(directory / "logs"))
watchdog.beat("training step 1")
print("holding", flush=True)
ctypes.PyDLL(None).sleep(int(seconds))  # HELD: the GIL held; a signal with a handler ends it early
watchdog.beat("training step 2")
time.sleep(1)  # the watchdog's thread looks 5 times (every 0.2 s)
sys.stdout.write(stacks.path(directory / "logs", 0).read_text())
os._exit(0)
"""


def held_in_c(tmp_path, seconds):
    """The program above, holding the GIL in a C call for ``seconds`` once its first beat is made."""
    program = tmp_path / "held_in_c.py"
    program.write_text(HELD_IN_C)
    proc = subprocess.Popen([sys.executable, str(program), str(tmp_path), str(seconds)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.stdout.readline() == "holding\n"
    return program, proc


def held_frame(program, text):
    """Whether a dump in a stacks file has the main thread in the program's held call."""
    line = next(number for number, code in enumerate(HELD_IN_C.splitlines(), 1) if "# HELD" in code)
    return f'File "{program}", line {line} in <module>' in text


def test_a_rank_frozen_in_a_call_holding_the_gil_ends_with_the_stacks_written_while_it_was(tmp_path):
    """The watchdog's thread runs again after 6 s held out: it ends the rank as frozen before a
    beat since would empty the stacks faulthandler wrote meanwhile, the only word of where it was."""
    program, proc = held_in_c(tmp_path, 6)
    try:
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 75, stderr
    assert re.search(r"hvdkit: rank 0 was frozen for \d+ s \(stopped, or its host paused\) in training step",
                     stderr), stderr
    from hvdkit.rank.liveness import stacks

    text = stacks.path(tmp_path / "logs", 0).read_text()
    assert held_frame(program, text), text


def test_a_stop_keeps_the_stacks_written_during_a_stall_it_ends(tmp_path):
    """SIGTERM ends a call that held the GIL (as a launcher's, once another rank ended the job on
    this one's stall): the rank's beats after it no longer empty the stacks its stall left."""
    from hvdkit.rank.liveness import stacks

    program, proc = held_in_c(tmp_path, 600)
    try:
        written, deadline = stacks.path(tmp_path / "logs", 0), time.monotonic() + 30
        while not held_frame(program, written.read_text()) or written.read_text().count("Timeout (") < 2:
            assert time.monotonic() < deadline, written.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert held_frame(program, stdout), stdout
