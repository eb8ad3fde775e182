"""A rank's ending in hvdkit's own line (hvdkit.launch.guard), under hvdkit launch over mpirun and
horovodrun --gloo: a SIGKILLed rank named with its host, its own PID, the signal and the last step
it finished; the kernel's out-of-memory killer named where it ended a rank or its DataLoader worker,
each confined to a memory cgroup of its own for real (as the chaos rehearsal's ``oom`` fault does),
with the rank's peak. The jobs of a test run at once; after them no process of theirs is left."""

import os
import re
import socket
import subprocess
import sys
import time

import psutil
import pytest

from conftest import REPO, kill_tree, untagged
from hvdkit.checks import selftest
from hvdkit.launch import guard, planner
from hvdkit.system import cgroups

pytestmark = pytest.mark.slow

LAUNCH = [sys.executable, "-m", "hvdkit", "launch", "-np", "2"]
LAUNCHERS = {"mpirun": ["--launcher", "mpirun"], "horovodrun --gloo": ["--launcher", "horovodrun", "--gloo"]}
SECONDS = 180
KILLED = "tests/programs/killed_once.py"


def start(directory, launcher, program, *args, **env):
    directory.mkdir()
    with open(directory / "output", "w") as output:
        return subprocess.Popen([*LAUNCH, *LAUNCHERS[launcher], "--", sys.executable, str(REPO / program), *args],
                                env=dict(selftest.mpi_root_env(), PYTHONPATH=str(REPO), **env), stdout=output,
                                stderr=subprocess.STDOUT, start_new_session=True)


def wait_all(jobs):
    """Each job's end, within SECONDS of the first's start."""
    deadline = time.monotonic() + SECONDS
    for name, (directory, proc) in jobs.items():
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name}: still running after {SECONDS} s: {(directory / 'output').read_text()[-3000:]}")


def left(directory):
    """Processes still running whose command line names the job's directory: none may be."""
    return [p.pid for p in psutil.process_iter(["cmdline"]) if str(directory) in " ".join(p.info["cmdline"] or [])]


def rank_process(proc, rank):
    """The rank's own process below hvdkit launch (not its guard), once it runs."""
    for process in psutil.Process(proc.pid).children(recursive=True):
        try:
            environ = process.environ()
            if (environ.get("OMPI_COMM_WORLD_RANK", environ.get("HOROVOD_RANK")) == str(rank)
                    and not guard.is_guard(process.cmdline()) and process.parent().pid != proc.pid
                    and guard.is_guard(process.parent().cmdline())):
                return process
        except psutil.Error:
            continue
    return None


def worker(rank):
    """The rank's DataLoader worker: below it (its child, or its forkserver's), with no process below it."""
    for process in rank.children(recursive=True):
        try:
            if not process.children() and "resource_tracker" not in " ".join(process.cmdline()):
                return process
        except psutil.Error:
            continue
    return None


def test_a_sigkilled_rank_is_named_with_its_host_pid_signal_and_last_step(tmp_path):
    """Under hvdkit launch, the guard's line; under Gloo, the surviving rank's names it too (Horovod
    shut down when its connection closed), as it does under plain horovodrun, where no guard is:
    rank 0's, or where rank 0 is the one killed, rank 1's."""
    jobs = {}
    args = ["--model", "mlp", "--epochs", "3", "--checkpoint-steps", "10"]
    try:
        for launcher, victim in ((*((name, 1) for name in LAUNCHERS), ("plain horovodrun --gloo", 1),
                                  ("plain horovodrun --gloo", 0))):
            directory = tmp_path / f"{launcher.replace(' ', '-')}-{victim}"
            own = [*args, "--checkpoint-dir", str(directory / "ckpt"), "--log-dir", str(directory / "logs")]
            if launcher.startswith("plain"):
                directory.mkdir()
                with open(directory / "output", "w") as output:
                    proc = subprocess.Popen(
                        planner.local_command("horovodrun --gloo", 2, [sys.executable, str(REPO / KILLED), *own]),
                        env=dict(selftest.mpi_root_env(), PYTHONPATH=str(REPO), KILL_AT_STEP="15",
                                 KILL_RANK=str(victim)),
                        stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
            else:
                proc = start(directory, launcher, KILLED, *own, KILL_AT_STEP="15")
            jobs[launcher, victim] = (directory, proc)
        wait_all(jobs)
        gone = {job: psutil.wait_procs([psutil.Process(p) for p in left(directory)], timeout=10)[1]
                for job, (directory, _) in jobs.items()}
    finally:
        for _, proc in jobs.values():
            kill_tree(proc)
    for (launcher, victim), (directory, proc) in jobs.items():
        output = untagged((directory / "output").read_text())
        where = (launcher, victim, output[-3000:])
        pid = re.search(rf"killed_once: rank {victim} killed at step 15, attempt \w+ \(pid (\d+)\)", output)
        assert pid and proc.returncode != 0, where
        who = f"rank {victim} (host {socket.gethostname()}, pid {pid.group(1)})"
        if not launcher.startswith("plain"):
            line = (f"hvdkit: {who} was killed by SIGKILL after step 15 (not the kernel's out-of-memory killer); a "
                    f"rerun resumes from {directory / 'ckpt' / 'ckpt-step000000010.pt'}")
            assert line in output.splitlines(), where
        if "gloo" in launcher:
            assert re.search(rf"Horovod shut down while rank {1 - victim} waited in [^:]+: {re.escape(who)} is gone, "
                             rf"last seen in ", output), where
        assert gone[launcher, victim] == [], (where, gone[launcher, victim])


@pytest.fixture
def memory_cgroups():
    """Skips, saying why, where this machine's memory cgroups cannot be written (not root, none
    mounted); the ones a test made are removed after it."""
    made = []
    if os.geteuid() != 0 or cgroups.memory_cgroup(os.getpid()) is None:
        pytest.skip("a memory cgroup of its own needs root and a mounted memory controller")
    yield made
    for directory in made:
        cgroups.release(directory)


def test_the_out_of_memory_killer_is_named_for_a_rank_and_for_a_dataloader_worker(tmp_path, memory_cgroups):
    jobs, flags = {}, {}
    try:
        for leak, launcher in (("rank", "mpirun"), ("worker", "horovodrun --gloo"), ("worker", "mpirun"),
                               ("rank", "horovodrun --gloo")):
            directory = tmp_path / f"{leak}-{launcher.replace(' ', '-')}"
            flags[leak, launcher] = tmp_path / f"flag-{leak}-{launcher.replace(' ', '-')}"
            jobs[leak, launcher] = (directory, start(directory, launcher, "tests/programs/leaky.py", "--leak", leak,
                                                     "--flag", str(flags[leak, launcher]),
                                                     "--log-dir", str(directory / "logs")))
        victims = {}
        for (leak, launcher), (directory, proc) in jobs.items():
            deadline = time.monotonic() + SECONDS
            while (leak, launcher) not in victims:
                assert proc.poll() is None and time.monotonic() < deadline, (directory / "output").read_text()[-3000:]
                rank = rank_process(proc, 1)
                training = "step 3" in (directory / "output").read_text()
                victim = rank if leak == "rank" else worker(rank) if rank else None
                if training and victim is not None:
                    victims[leak, launcher] = victim.pid
                    memory_cgroups.append(cgroups.confine(victim.pid, 96 * 2 ** 20, f"hvdkit-test-{victim.pid}"))
                    flags[leak, launcher].touch()
                time.sleep(0.2)
        wait_all(jobs)
        gone = {job: psutil.wait_procs([psutil.Process(p) for p in left(directory)], timeout=10)[1]
                for job, (directory, _) in jobs.items()}
    finally:
        for _, proc in jobs.values():
            kill_tree(proc)
    for (leak, launcher), (directory, proc) in jobs.items():
        output = untagged((directory / "output").read_text())
        where = (leak, launcher, output[-3000:])
        assert proc.returncode != 0, where
        said = [line for line in output.splitlines() if line.startswith("hvdkit: rank 1 (host ")]
        assert said, where
        if leak == "rank":
            assert re.match(rf"hvdkit: rank 1 \(host {socket.gethostname()}, pid {victims[leak, launcher]}\) was "
                            r"killed by the kernel's out-of-memory killer \(SIGKILL\) after step \d+; its peak "
                            r"\d+\.\d\d GiB(, its cgroup's limit 96 MiB)?: lower the batch size", said[-1]), where
        else:
            assert re.match(rf"hvdkit: rank 1 \(host {socket.gethostname()}, pid \d+\) ended \(exit 1\) after step "
                            rf"\d+ after the kernel's out-of-memory killer killed its process "
                            rf"{victims[leak, launcher]} "
                            r"\(a DataLoader worker\); its peak \d+\.\d\d GiB(, its cgroup's limit 96 MiB)?: "
                            r"lower num_workers", said[-1]), where
        assert gone[leak, launcher] == [], where
