"""`hvdkit rehearse`: real jobs on the hosts it makes (hvdkit.rehearse.namespaces), then nothing of them left.

Each run is `python -m hvdkit rehearse ...` as a user types it; the hosts' names carry its PID
(hvdk<pid>x...), which is how the test finds what it made: namespaces, sshd, slurmd and ranks.
"""

import os
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest
import torch

from conftest import (
    REPO,
    TWO_RANK_TRAIN,
    final_weights,
    metrics_records,
    require_namespaces,
    require_slurm_on_namespaces,
    untagged,
    wait_for,
)
from hvdkit import checkpoint
from hvdkit.checks import selftest
from hvdkit.rehearse import cli as rehearse

REHEARSE = [sys.executable, "-m", "hvdkit", "rehearse"]
VENV_BIN = os.path.dirname(sys.executable)


def environment(mark):
    """The user's shell: the virtual environment active, and a mark in everything started from it."""
    return selftest.mpi_root_env(dict(os.environ, PATH=f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
                                      HVDKIT_TEST_MARK=mark))


def leftovers(rehearse_pid, mark, tmp_path):
    """Namespaces and processes that a rehearsal made and left: by its hosts' prefix, the mark in
    the environment (what it started here), or the test's directory (ranks started over ssh)."""
    prefix = f"hvdk{rehearse_pid}x"
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found = [line.split()[0] for line in listed.splitlines() if line.startswith(prefix)]
    for process in psutil.process_iter():
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
            command = " ".join(process.cmdline())
            if prefix in command or str(tmp_path) in command or process.environ().get("HVDKIT_TEST_MARK") == mark:
                found.append(f"{process.pid} {command}")
        except psutil.Error:
            pass
    return found


def wait_for_none_left(rehearse_pid, mark, tmp_path, seconds=10):
    """Ranks killed with the hosts may take a moment to be reaped; then nothing may be left."""
    deadline = time.monotonic() + seconds
    while leftovers(rehearse_pid, mark, tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftovers(rehearse_pid, mark, tmp_path) == []


def test_bad_input_is_one_line_and_exit_2(capsys):
    cases = {
        ("--hosts", "2"): "give the command after '--'",
        ("--hosts", "300", "--", "true"): "--hosts 300: at most 244 hosts fit the rehearsal's network (10.231.0.11 to",
        ("--kill-host", "0", "--after", "5s", "--", "true"): "--kill-host 0: pick a host from 1 to 1 (node0 runs",
        ("--kill-host", "1", "--", "true"): "--kill-host and --after go together",
        ("--hosts", "1", "--kill-host", "1", "--after", "5", "--", "true"): "--kill-host needs --hosts 2 or more",
        ("--bandwidth", "1gb", "--", "true"): "argument --bandwidth: rate '1gb': expected a number and gbit",
        ("--delay", "5", "--", "true"): "argument --delay: delay '5': expected a number and us, ms or s",
        ("--slurm", "--kill-host", "1", "--after", "1", "--", "sbatch", "x"): "--kill-host is for launches",
        ("--kill-host", "1", "--after", "soon", "--", "true"): "argument --after: 'soon': expected a duration like",
    }
    for argv, expected in cases.items():
        try:
            code = rehearse.main(list(argv))
        except SystemExit as exc:  # argparse's own checks
            code = exc.code
        err = capsys.readouterr().err
        assert code == 2 and err.startswith(f"hvdkit rehearse: {expected}") and err.count("\n") == 1, err


def test_not_root_is_one_line():
    proc = subprocess.run(["setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups",
                           *REHEARSE, "--", "true"], capture_output=True, text=True, cwd="/")
    assert (proc.returncode, proc.stderr) == (2, "hvdkit rehearse: namespace hosts need root (ip netns add)\n")


@pytest.mark.slow
def test_two_hosts_train_to_the_weights_of_two_ranks_on_one(tmp_path, two_ranks_trained):
    require_namespaces()
    mark, ckpt = uuid.uuid4().hex, tmp_path / "ckpt"
    proc = subprocess.Popen([*REHEARSE, "--hosts", "2", "--", "hvdkit", "launch", "--launcher", "horovodrun", "-np",
                             "2", "--", "hvdkit", "train", *TWO_RANK_TRAIN, "--checkpoint-dir", str(ckpt),
                             "--log-dir", str(tmp_path / "logs")],
                            env=environment(mark), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert err.startswith("hvdkit rehearse: 2 hosts: node0 (10.231.0.11), node1 (10.231.0.12), 1 slot(s) each;")
    (summary,) = selftest.parse_records(untagged(out), "summary")
    assert summary["world_size"] == 2
    weights = final_weights(ckpt)
    assert weights.keys() == two_ranks_trained.keys()
    for name, value in weights.items():  # not bitwise: a rank alone on its host computes with more threads
        torch.testing.assert_close(value, two_ranks_trained[name], atol=1e-5, rtol=0)
    wait_for_none_left(proc.pid, mark, tmp_path)


@pytest.mark.slow
def test_an_elastic_job_finishes_on_the_host_left_when_the_other_is_lost(tmp_path):
    """node1 fails on SIGUSR1 once the job has trained on both hosts (a time limit raced the ranks' start: under
    load they were still importing torch at 20 s); links shaped to 30 Mbit/s keep the job on two hosts until then."""
    require_namespaces()
    mark, logs = uuid.uuid4().hex, tmp_path / "logs"
    proc = subprocess.Popen([*REHEARSE, "--hosts", "2", "--bandwidth", "30mbit", "--kill-host", "1",
                             "--after", "SIGUSR1", "--", "hvdkit", "launch", "-np", "2", "--min-np", "1",
                             "--max-np", "2",
                             "--host-discovery-script", "hvdkit-discover-hosts", "--",
                             "hvdkit", "train", "--elastic", "--model", "mlp", "--dataset", "synthetic", "--epochs",
                             "100", "--max-steps", "200", "--warmup-epochs", "0", "--lr-schedule", "none",
                             "--log-interval", "5", "--commit-steps", "5", "--checkpoint-dir", str(tmp_path / "ckpt"),
                             "--log-dir", str(logs)],
                            env=environment(mark), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    wait_for(lambda: any(r.get("world_size") == 2 for r in metrics_records(logs / "metrics.jsonl")
                         if r["event"] == "train"), proc, "a train report from two ranks", seconds=240)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert f"hvdkit rehearse: node1 fails on SIGUSR1: kill -USR1 {proc.pid}" in err
    assert "hvdkit rehearse: node1 lost on SIGUSR1, " in err
    (summary,) = selftest.parse_records(untagged(out), "summary")
    assert summary["steps"] == 200 and summary["world_size"] == 1, summary
    assert [(c["from"], c["to"]) for c in summary["world_size_changes"]] == [(2, 1)], summary
    assert {r["world_size"] for r in metrics_records(logs / "metrics.jsonl") if r["event"] == "train"} == {1, 2}
    wait_for_none_left(proc.pid, mark, tmp_path)


@pytest.mark.slow
def test_slurm_runs_a_template_to_completed_across_the_two_hosts(tmp_path):
    require_slurm_on_namespaces()
    mark = uuid.uuid4().hex
    env = dict(environment(mark), HVDKIT_ARGS="--model mlp --max-steps 5", HVDKIT_RUN_DIR=str(tmp_path / "run"))
    proc = subprocess.Popen([*REHEARSE, "--hosts", "2", "--slurm", "--", "sbatch", "--output",
                             str(tmp_path / "job-%j.out"), str(REPO / "slurm" / "multi-node-srun.sbatch")],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    (ended,) = [line for line in err.splitlines() if line.startswith("hvdkit rehearse: job ")]
    assert ended.startswith("hvdkit rehearse: job 1 (hvdkit) COMPLETED, exit 0:0, on node[0-1]; output"), ended
    (summary,) = selftest.parse_records((tmp_path / "run" / "rank-0.log").read_text(), "summary")
    assert summary["world_size"] == 2 and summary["steps"] == 5
    wait_for_none_left(proc.pid, mark, tmp_path)


@pytest.mark.slow
def test_sigterm_mid_run_stops_the_job_with_its_checkpoint_and_removes_everything(tmp_path):
    require_namespaces()
    mark, ckpt, logs = uuid.uuid4().hex, tmp_path / "ckpt", tmp_path / "logs"
    proc = subprocess.Popen([*REHEARSE, "--hosts", "2", "--", "hvdkit", "launch", "--launcher", "mpirun", "-np", "2",
                             "--", "hvdkit", "train", "--model", "mlp", "--dataset", "synthetic", "--epochs", "1000",
                             "--log-interval", "5", "--checkpoint-dir", str(ckpt), "--log-dir", str(logs)],
                            env=environment(mark), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        wait_for(lambda: any(r["event"] == "train" for r in metrics_records(logs / "metrics.jsonl")), proc,
                 "training on two hosts", seconds=120)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = untagged(err)
    assert proc.returncode == 143, err[-3000:]
    (stopped,) = [line for line in err.splitlines() if line.startswith("hvdkit launch: stopped by SIGTERM at step ")]
    step = int(stopped.split(" at step ")[1].split(";")[0])
    assert checkpoint.existing(str(ckpt))[-1] == checkpoint.path_for(str(ckpt), step)
    wait_for_none_left(proc.pid, mark, tmp_path)


@pytest.mark.slow
def test_hvdkit_run_inside_a_rehearsal_spans_its_hosts(tmp_path):
    """A script calling hvdkit.run on node0: `hvdkit launch` finds the hosts in HVDKIT_HOSTS."""
    require_namespaces()
    mark = uuid.uuid4().hex
    script = ("import socket, hvdkit; print(hvdkit.run(lambda: socket.gethostname(), np=2, launcher='mpirun'))")
    proc = subprocess.Popen([*REHEARSE, "--hosts", "2", "--", sys.executable, "-c", script], env=environment(mark),
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert out.splitlines()[-1] == "['node0', 'node1']"
    assert list(tmp_path.iterdir()) == [], "the call's directory is removed"
    wait_for_none_left(proc.pid, mark, tmp_path)


@pytest.mark.slow
def test_plain_mpirun_leaves_ranks_unbound_on_hosts_that_share_the_cores(tmp_path):
    """Open MPI binds each host's first rank to core 0: on hosts sharing this machine's cores,
    every rank would compute on the same one (the chaos test under plain mpirun ran at half
    speed). With --cpus each host has its own cores, and Open MPI's binding stays; so does a
    binding the user chose."""
    require_namespaces()
    mark = uuid.uuid4().hex
    line = "mpirun -np 2 --hostfile $HVDKIT_HOSTFILE --allow-run-as-root --report-bindings true"
    chosen = {rehearse.BINDING: "core"}
    for given, env, bound in (([], {}, 0), (["--cpus"], {}, 2), ([], chosen, 2)):
        proc = subprocess.Popen([*REHEARSE, "--hosts", "2", *given, "--", "sh", "-c", line], cwd=tmp_path,
                                env={**environment(mark), **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        assert (out + err).count(" bound to ") == bound, (given, env, out + err)
        wait_for_none_left(proc.pid, mark, tmp_path)
