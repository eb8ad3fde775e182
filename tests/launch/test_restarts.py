"""In-job restarts (hvdkit.launch.restarts, `hvdkit launch --max-restarts N`): what counts as a
failure, then real jobs under horovodrun and mpirun whose rank dies between checkpoints."""

import os
import re
import signal
import subprocess
import sys

import psutil
import pytest

from conftest import REPO, TWO_RANK_TRAIN, assert_bitwise_equal, final_weights, kill_tree, run, wait_for_file
from hvdkit import checkpoint, job
from hvdkit.checks import selftest
from hvdkit.launch import restarts
from hvdkit.launch.hostfile import LaunchError
from hvdkit.launch.supervise import Ended

KILLED_ONCE = str(REPO / "tests" / "programs" / "killed_once.py")


@pytest.mark.parametrize("ended, restarted", [
    (Ended(137), True),  # a rank SIGKILLed: mpirun's 137
    (Ended(205), True),  # no signal's code: mpirun's own, after it lost a host's daemon
    (Ended(job.FAILED), True), (Ended(job.STALLED, recorded=job.STALLED), True), (Ended(job.DIVERGED), True),
    (Ended(job.LOST, lost="host node1 (rank 1) stopped answering"), True),
    (Ended(job.OK), False), (Ended(job.BAD_INPUT, recorded=job.BAD_INPUT), False), (Ended(job.OVER_CAP), False),
    (Ended(143, stopped=True), False),  # hvdkit launch was sent SIGTERM: a stop
    (Ended(143, recorded=143), False),  # a rank recorded a stop (the scheduler's SIGTERM)
])
def test_what_is_restarted(ended, restarted):
    assert (restarts.cause(ended) is not None) == restarted
    assert (restarts.why(ended) in restarts.RESTARTED) == restarted


@pytest.mark.parametrize("ended, why", [
    (Ended(137), restarts.Why.SIGNALLED), (Ended(205), restarts.Why.FAILED), (Ended(job.OK), restarts.Why.FINISHED),
    (Ended(job.LOST, lost="host node1 (rank 1) stopped answering"), restarts.Why.HOST_LOST),
    (Ended(137, cause="rank 1 was killed by SIGKILL"), restarts.Why.RANK_ENDED),
    (Ended(job.BAD_INPUT), restarts.Why.REFUSED), (Ended(143, recorded=143), restarts.Why.STOPPED),
])
def test_an_ending_is_one_kind(ended, why):
    assert restarts.why(ended) is why


def test_the_lines_of_restarts_and_of_the_last_failure(capsys):
    ends = iter([Ended(137), Ended(job.STALLED, recorded=job.STALLED), Ended(job.FAILED)])
    seen, removed = [], []
    assert restarts.run(lambda extra, lost: (seen.append(extra[job.RESTART]), next(ends))[1], 2,
                        lambda lost: "a:1,b:1", lambda place, lost: removed.append(place)) == job.FAILED
    assert seen == ["0", "1", "2"]
    assert len(removed) == 1 and removed[0].startswith(restarts.SHM), "the other hosts' snapshots, after a failure"
    assert capsys.readouterr().err.splitlines() == [
        "hvdkit launch: a rank or its launcher was ended by SIGKILL (exit 137); restart 1 of 2 on a:1,b:1, "
        "from the newest checkpoint",
        "hvdkit launch: exit 75: no progress within --stall-timeout; restart 2 of 2 on a:1,b:1, from the newest "
        "checkpoint",
        "hvdkit launch: exit 1: an error in the script (its traceback), or the launcher's own failure; no restart "
        "left (--max-restarts 2); exit 1"]
    assert restarts.run(lambda extra, lost: Ended(137), 0, lambda lost: "a:1") == 137, "without --max-restarts"
    assert capsys.readouterr().err == ""


def test_a_lost_host_is_left_out_of_the_restarts_after_it_and_spares_take_its_place(capsys):
    """hosts() stands for hvdkit launch's plan without the lost hosts: a:1,b:1 and the spare c:1 for -np 2."""
    def hosts(lost):
        left = [name for name in "abc" if name not in lost]
        if len(left) < 2:
            raise LaunchError(f"-np 2 is more than the {len(left)} slots in {','.join(left)}")
        return ",".join(f"{name}:1" for name in left[:2])

    lost_b = Ended(job.LOST, lost="host b (10.0.0.2, rank 1) does not answer on the network", host="b")
    lost_c = Ended(job.LOST, lost="host c (10.0.0.3, rank 1) does not answer on the network", host="c")
    ends, given = iter([lost_b, Ended(137), lost_c]), []
    assert restarts.run(lambda extra, lost: (given.append(lost), next(ends))[1], 5, hosts) == job.LOST
    assert given == [frozenset(), {"b"}, {"b"}]
    assert capsys.readouterr().err.splitlines() == [
        "hvdkit launch: host b (10.0.0.2, rank 1) does not answer on the network; restart 1 of 5 on a:1,c:1 (without "
        "b), from the newest checkpoint",
        "hvdkit launch: a rank or its launcher was ended by SIGKILL (exit 137); restart 2 of 5 on a:1,c:1 (without "
        "b), from the newest checkpoint",
        f"hvdkit launch: host c (10.0.0.3, rank 1) does not answer on the network; no restart without b, c: -np 2 is "
        f"more than the 1 slots in a; exit {job.LOST}"]


def test_the_ranks_started_ahead_of_need_are_hvdkit_trains_unless_told():
    """A standby attempt's ranks must wait before they train: `hvdkit train` does (the Session's
    start); another program would train at once, beside the job, unless it says it uses the Session."""
    from hvdkit.launch.cli import runs_hvdkit_train

    assert runs_hvdkit_train(["hvdkit", "train", "--model", "mlp"])
    assert runs_hvdkit_train([sys.executable, "-m", "hvdkit", "train"])
    assert not runs_hvdkit_train(["python", "train.py"]) and not runs_hvdkit_train(["hvdkit", "bench", "synthetic"])


def test_a_negative_count_is_one_line_and_exit_2():
    proc = run([sys.executable, "-m", "hvdkit", "launch", "-np", "2", "--max-restarts", "-1", "--", "true"])
    assert proc.returncode == 2 and proc.stderr == "hvdkit launch: --max-restarts must be 0 or more (got -1)\n"
    proc = run([sys.executable, "-m", "hvdkit", "launch", "-np", "2", "--standby", "--", "true"])
    assert proc.returncode == 2 and proc.stderr == ("hvdkit launch: --standby starts the ranks of a restart ahead of "
                                                    "need: it goes with --max-restarts N\n")


def _command(tmp_path, launcher, *extra, train=TWO_RANK_TRAIN):
    return [sys.executable, "-m", "hvdkit", "launch", "-np", "2", "--launcher", launcher, *extra, "--",
            sys.executable, KILLED_ONCE, *train, "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-steps",
            "5", "--log-dir", str(tmp_path / "logs")]


def _launch(tmp_path, launcher, *extra, env=None, train=TWO_RANK_TRAIN):
    return run(_command(tmp_path, launcher, *extra, train=train), env=dict(os.environ, KILL_AT_STEP="12",
                                                                             **(env or {}))), tmp_path / "ckpt"


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["horovodrun", "mpirun"])
def test_a_rank_killed_between_checkpoints_restarts_and_ends_where_an_undisturbed_run_ends(
        tmp_path, launcher, two_ranks_trained):
    """Rank 1 dies of SIGKILL at step 12 (checkpoints every 5): the job restarts by itself, resumes
    from step 10, exits 0 and ends bitwise at the weights of the run that was never killed. Under
    horovodrun the death lands while rank 0 still writes step 10's checkpoint (held until rank 1 is
    gone), and rank 0, told to end, writes it first; under mpirun, which kills every rank's guard at
    once, rank 1 dies once it is written (docs/stops-and-recovery.md#restarts-within-the-job). The
    restart's ranks were started ahead of need (--standby) and waited until then; the standby
    started for a restart after it was not needed, and nothing of it is left."""
    death = ({"HOLD_WRITE": "10", "KILL_MARK": str(tmp_path / "killed")} if launcher == "horovodrun" else
             {"KILL_AFTER_WRITTEN": str(checkpoint.path_for(str(tmp_path / "ckpt"), 10))})
    proc, ckpt = _launch(tmp_path, launcher, "--max-restarts", "2", "--standby", env=death)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "killed_once: rank 1 killed at step 12, attempt 0" in proc.stderr
    [line] = [line for line in proc.stderr.splitlines() if "restart 1 of 2" in line]
    assert line.startswith("hvdkit launch: ") and "on this machine, from the newest checkpoint" in line, line
    assert "restart 2 of 2" not in proc.stderr
    assert f"resumed from {checkpoint.path_for(str(ckpt), 10)}" in proc.stderr, ("2 steps redone, no more",
                                                                                 proc.stderr)
    assert_bitwise_equal(final_weights(ckpt), two_ranks_trained)
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if str(ckpt) in " ".join(p.info["cmdline"] or [])]
    assert left == [], "a standby's processes outlived the job"


@pytest.mark.slow
def test_restarts_exhausted_end_with_one_line_and_the_last_failures_code(tmp_path):
    proc, ckpt = _launch(tmp_path, "mpirun", "--max-restarts", "1", env={"KILL_ATTEMPTS": "9"})
    assert proc.returncode not in (0, 2), proc.stderr[-3000:]
    assert proc.stderr.count("killed_once: rank 1 killed at step 12") == 2
    last = [line for line in proc.stderr.splitlines() if line.startswith("hvdkit launch: ")][-1]
    assert last.endswith(f"no restart left (--max-restarts 1); exit {proc.returncode}"), last
    assert [p.name for p in checkpoint.existing(str(ckpt))][-1] == "ckpt-step000000010.pt"


@pytest.mark.slow
def test_a_stop_signal_is_not_a_failure(tmp_path):
    """SIGTERM to hvdkit launch --max-restarts: the step's checkpoint and exit 143, as without restarts."""
    train = [*TWO_RANK_TRAIN[:2], "--max-steps", "100000", *TWO_RANK_TRAIN[4:]]
    proc = subprocess.Popen(_command(tmp_path, "mpirun", "--max-restarts", "2", train=train), text=True,
                            env=selftest.mpi_root_env(dict(os.environ, KILL_AT_STEP="-1", PYTHONPATH=str(REPO))),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for_file(checkpoint.path_for(str(tmp_path / "ckpt"), 10), proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        kill_tree(proc)
    assert proc.returncode == 143, err[-3000:]
    assert "restart" not in err and "hvdkit: stopped by SIGTERM at step" in err, err[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("zero", ["0", "3"])
def test_with_snapshots_a_killed_rank_redoes_at_most_one_step_and_leaves_none(tmp_path, two_ranks_trained, zero):
    """--snapshot-steps 1: each step's state in host memory besides the checkpoints every 5; rank 1
    killed at step 12 resumes from the snapshot of step 11 or 12, bitwise, and the snapshots are gone
    at the end. At zero 3 each rank's snapshot holds its slices of the weights (its buddy on the same
    host keeps none), and the run ends bitwise at the unsharded run's weights (SGD at np 2: the
    same sums)."""
    proc, ckpt = _launch(tmp_path, "mpirun", "--max-restarts", "1",
                         train=[*TWO_RANK_TRAIN, "--snapshot-steps", "1", "--zero", zero])
    assert proc.returncode == 0, proc.stderr[-3000:]
    [resumed] = [line for line in proc.stderr.splitlines() if "resumed from" in line]
    place = os.path.dirname(resumed.split("resumed from ")[1].split(" (")[0])
    if zero == "3":  # each rank's own folder in the job's
        assert re.search(r"/zero-of-2-holds-[01]$", place), resumed
        place = os.path.dirname(os.path.dirname(place))
    assert place.startswith(restarts.SHM) and "hvdkit-snapshots-" in place, resumed
    assert re.search(r"ckpt-step00000001[12]\.pt \(epoch \d+, step 1[12]\)", resumed), resumed
    assert not os.path.exists(place), "the job's snapshots outlived it"
    assert [p.name for p in checkpoint.existing(str(ckpt))][-1] == "ckpt-step000000020.pt"
    assert_bitwise_equal(final_weights(ckpt), two_ranks_trained)
