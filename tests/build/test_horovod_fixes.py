"""hvdkit's fixes to Horovod's source (hvdkit/build/patches/), on the installed build, under real
launchers: float16 sums stay exact, a rank waiting on a collective sleeps instead of spinning, and
so does its background thread in the MPI negotiation, an idle rank's background thread sleeps
instead of negotiating every cycle, a failed collective still raises, horovodrun knows what was
built without importing torch, and horovodrun forwards stop signals to its ranks and ends what it
started."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import REPO, kill_tree, run
from hvdkit.checks import selftest
from hvdkit.launch import mpi, planner

pytestmark = pytest.mark.slow

WORKER = [sys.executable, str(REPO / "tests" / "programs" / "horovod_fixes_worker.py")]


@pytest.mark.parametrize("how", ["horovodrun --gloo", "mpirun"])
def test_fixed_horovod_sums_float16_exactly_and_waits_and_idles_without_spinning(how, hvd_built):
    proc = run(planner.local_command(how, 2, WORKER), timeout=240)
    assert proc.returncode == 0, f"{how} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    results = sorted(selftest.parse_records(proc.stdout, "horovod_fixes"), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1], proc.stdout[-2000:]
    for r in results:
        assert r["controller"] == ("gloo" if "gloo" in how else "mpi")
        assert r["fp16_mismatches"] == 0, r
        assert "Mismatched ALLREDUCE tensor shapes" in (r["mismatch_error"] or ""), r
    waiting = results[0]  # rank 1 joined the collective 2 s late
    assert waiting["wait_wall_s"] > 1.5, waiting
    # Spinning costs the whole wait in CPU time: 1.96-1.98 s of 2.0 with Horovod's own wait.
    assert waiting["wait_cpu_s"] < 0.2 * waiting["wait_wall_s"], waiting
    # Waiting for a late rank in the negotiation of a cached allreduce: Open MPI's blocking
    # allreduce spun the background thread for the whole wait (2.0 s of CPU in 2.0 s, before 0013).
    assert waiting["cached_wait_wall_s"] > 1.5 and waiting["cached_wait_cpu_s"] < 0.3 * waiting["cached_wait_wall_s"], \
        waiting
    for r in results:
        # Cycling with nothing to do: 0.5-0.65 s of CPU a second under Gloo (0.1 ms cycle), before.
        assert r["idle_cpu_s"] < 0.15 * r["idle_wall_s"], r


def test_gloo_moves_the_data_under_the_mpi_controller(tmp_path, hvd_built):
    """HOROVOD_CPU_OPERATIONS=gloo under mpirun, as hvdkit's ranks set it across hosts on CPUs:
    every rank segfaulted in its first allreduce before 0011. The timeline says Gloo moved the
    tensors; a process set added later, which has no Gloo context, is served by MPI."""
    timeline = tmp_path / "timeline.json"
    program = [sys.executable, str(REPO / "tests" / "programs" / "gloo_data_worker.py")]
    env = {**os.environ, "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_DYNAMIC_PROCESS_SETS": "1",
           "HOROVOD_TIMELINE": str(timeline), "OMP_NUM_THREADS": "1"}
    proc = run([*planner.local_command("mpirun", 3, program)[:-len(program)], "-x", "HOROVOD_CPU_OPERATIONS",
                "-x", "HOROVOD_DYNAMIC_PROCESS_SETS", "-x", "HOROVOD_TIMELINE", "-x", "OMP_NUM_THREADS", *program],
               env=env, timeout=240)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    results = sorted(selftest.parse_records(proc.stdout, "gloo_data"), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1, 2], proc.stdout[-2000:]
    for r in results:
        assert r["controller"] == "mpi" and r["sums_right"] and r["average_right"], r
        assert r["allgather"] == [0, 1, 2] and r["broadcast"] == 10, r
    assert [r.get("pair_sum") for r in results] == [2.0, 2.0, None]
    activities = timeline.read_text()
    assert "GLOO_ALLREDUCE" in activities and "MPI_ALLREDUCE" in activities, "Gloo for the global set, MPI for the pair"


@pytest.mark.parametrize("mode", [[], ["--gloo"]], ids=["horovodrun", "horovodrun --gloo"])
def test_horovodrun_knows_what_was_built_without_importing_torch(tmp_path, mode, hvd_built):
    """0004: horovodrun reads the controllers the build recorded in Horovod's metadata.json.
    With a torch that cannot be imported first on the path, Horovod's own check (horovod.torch
    imported in a child) finds neither MPI nor Gloo and refuses to launch; the record launches."""
    import horovod

    recorded = json.loads((Path(horovod.__file__).parent / "metadata.json").read_text())
    assert (recorded["mpi_built"], recorded["gloo_built"]) == (hvd_built["mpi"], hvd_built["gloo"])
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('torch is not importable in this test')\n")
    proc = run([mpi.find_program("horovodrun"), "-np", "2", *mode, "echo", "launched"],
               env=dict(os.environ, PYTHONPATH=str(tmp_path)), timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("launched") == 2, proc.stdout


SIGNALLED_RANK = """
import os, signal, sys, time
from pathlib import Path

rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("HOROVOD_RANK"))
log = Path(sys.argv[1]) / f"rank-{rank}"


def record(signum, frame):
    with log.open("a") as f:
        f.write(signal.Signals(signum).name + "\\n")
    if signum != signal.SIGCONT:
        sys.exit(0)


for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCONT):
    signal.signal(signum, record)
log.write_text("")
time.sleep(120)
"""


def _still_there(processes):
    found = []
    for process in processes:
        try:
            found.append((process.pid, process.name(), process.status()))
        except psutil.Error:
            pass
    return found


def _signal_state(pid):
    """Blocked, ignored and caught signals (hex masks, /proc/PID/status): a mask or an ignored
    disposition is inherited by every child, so a polluted test process would show here."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return "status (gone)"
    return " ".join(line.replace("\t", "") for line in lines if line.startswith(("SigBlk", "SigIgn", "SigCgt")))


@pytest.mark.parametrize("mode, sig, code, ranks_got", [
    ("--mpi", signal.SIGTERM, 143, "SIGTERM"),  # to the ranks directly: mpirun would send SIGCONT first
    ("--mpi", signal.SIGINT, 130, "SIGINT"),
    ("--mpi", signal.SIGHUP, 129, "SIGHUP"),
    ("--mpi", "nohup", 143, "SIGTERM"),  # SIGHUP ignored at start stays ignored; then SIGTERM
    ("--mpi", signal.SIGKILL, -9, None),  # mpirun gets SIGTERM from the kernel and ends the job
    ("--gloo", signal.SIGHUP, 129, "SIGTERM"),  # Horovod's middlemen end Gloo ranks with SIGTERM
    ("--gloo", signal.SIGTERM, 143, "SIGTERM"),
], ids=["mpi-TERM", "mpi-INT", "mpi-HUP", "mpi-nohup", "mpi-KILL", "gloo-HUP", "gloo-TERM"])
def test_horovodrun_forwards_stop_signals_and_ends_what_it_started(tmp_path, mode, sig, code, ranks_got):
    """0005, on a plain script without hvdkit: horovodrun stays mpirun's parent, passes SIGTERM,
    SIGINT and SIGHUP to the ranks once, waits for them, and exits with 128 + the signal; killed,
    it takes mpirun and the ranks with it. Nothing of the job is left within 15 s."""
    script = tmp_path / "rank.py"
    script.write_text(SIGNALLED_RANK)
    nohup = sig == "nohup"

    def as_a_shell_starts_it():
        """The dispositions a shell gives a command it starts: the stop signals at their defaults
        (nohup: SIGHUP ignored). This process's may not be: one full-suite run had SIGINT and
        SIGQUIT ignored here (as system(3) does while it waits), so horovodrun kept them ignored
        and the SIGINT case waited out its 15 s."""
        for signum in (signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        if nohup:
            signal.signal(signal.SIGHUP, signal.SIG_IGN)

    proc = subprocess.Popen([mpi.find_program("horovodrun"), "-np", "2", mode, sys.executable, str(script),
                             str(tmp_path)], env=selftest.mpi_root_env(), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=as_a_shell_starts_it)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"rank-{r}").exists() for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
            time.sleep(0.05)
        below = psutil.Process(proc.pid).children(recursive=True)
        if nohup:
            proc.send_signal(signal.SIGHUP)  # discarded by the kernel: ignored, as nohup asks
        proc.send_signal(signal.SIGTERM if nohup else sig)
        try:
            ended = proc.wait(timeout=15)
        except subprocess.TimeoutExpired:  # seen once in a full suite run: say what was still there
            pytest.fail(f"horovodrun still running 15 s after the signal; the ranks logged "
                        f"{[(log.name, log.read_text()) for log in sorted(tmp_path.glob('rank-*'))]}; "
                        f"below it: {_still_there(below)}; horovodrun's {_signal_state(proc.pid)}, this "
                        f"process's {_signal_state(os.getpid())}")
        assert ended == code, proc.stderr.read()[-3000:]
        _, alive = psutil.wait_procs(below, timeout=15)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], [(p.pid, p.name()) for p in alive]
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    if ranks_got:
        assert [(tmp_path / f"rank-{r}").read_text() for r in (0, 1)] == [f"{ranks_got}\n"] * 2
