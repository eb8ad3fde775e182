"""hvdkit's image, built and run for real with podman (docs/containers.md).

One image for the module, built by `hvdkit image build --base local` from a Debian base made
here with mmdebstrap (no registry is reachable): the build ends with `hvdkit doctor --selftest`
inside, so a built image has passed it once; it is run again here, as users run it. Then the
MPIJob shape on this machine (`hvdkit mpijob --run`): a launcher and two worker containers on one
network, mpirun over ssh as the non-root user. The layers are cached between runs on a machine;
what changed in the checkout rebuilds only the last ones (hvdkit and a cached Horovod wheel).
Every container, network and key a test makes is removed, also when it fails.
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch

from conftest import TWO_RANK_TRAIN, build_image, final_weights
from hvdkit.container.engine import find_engine

pytestmark = pytest.mark.slow
HVDKIT = [sys.executable, "-m", "hvdkit"]


@pytest.fixture(scope="module")
def image(hvdkit_image):
    return hvdkit_image


@pytest.fixture
def job():
    """The test's own job name: the suite runs tests side by side, and a test removes and counts
    only the containers and networks its jobs made (their names start with it)."""
    name = f"ctest-{uuid.uuid4().hex[:6]}"
    yield name
    for leftover in ours(name):  # a job killed when the test failed cannot clean up
        subprocess.run(["podman", "rm", "-f", leftover], capture_output=True)
        subprocess.run(["podman", "network", "rm", "-f", leftover], capture_output=True)


@pytest.fixture
def workspace(tmp_path):
    """The volume: a folder the image's user (uid 1000) owns, as a claim mounted with fsGroup is."""
    folder = tmp_path / "workspace"
    folder.mkdir()
    os.chown(folder, 1000, 1000)
    return folder


def engine_run(image, command, workspace, **kwargs):
    engine = find_engine("podman")
    from hvdkit.container.engine import Mount
    cmd = engine.run(image, command, mounts=[Mount(str(workspace), "/workspace")], **kwargs)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def summary(text):
    return json.loads(next(line[line.index("{"):] for line in text.splitlines() if '"event": "summary"' in line))


def ours(job):
    """Containers and networks the job ``job`` made (their names start with the job's name)."""
    listed = subprocess.run(["podman", "ps", "-a", "--filter", "label=hvdkit.mpijob", "--format", "{{.Names}}"],
                            capture_output=True, text=True).stdout.split()
    networks = subprocess.run(["podman", "network", "ls", "--format", "{{.Name}}"], capture_output=True,
                              text=True).stdout.split()
    return [name for name in listed + networks if name.startswith(f"{job}-")]


def test_the_image_runs_as_a_user_passes_the_selftest_and_trains_to_make_trains_accuracy(image, workspace):
    who = engine_run(image, ["id", "-u", "-n"], workspace)
    assert who.stdout.strip() == "hvdkit", who.stderr
    doctor = engine_run(image, ["hvdkit", "doctor", "--selftest"], workspace)
    assert doctor.returncode == 0, doctor.stdout[-2000:] + doctor.stderr[-2000:]
    assert "selftest mpi:         PASS" in doctor.stdout and "selftest gloo:        PASS" in doctor.stdout
    trained = engine_run(image, ["hvdkit", "launch", "-np", "2", "--", "hvdkit", "train"], workspace)
    assert trained.returncode == 0, trained.stderr[-3000:]
    result = summary(trained.stdout)
    assert result["world_size"] == 2 and result["test_accuracy"] >= 0.98, result  # make train: about 99%
    assert list((workspace / "runs").iterdir()), "the run went to the mounted volume"


def test_a_folder_the_user_cannot_write_is_one_line(image, tmp_path):
    root_only = tmp_path / "root-only"
    root_only.mkdir(mode=0o755)
    os.chmod(root_only, 0o755)  # whatever the umask: owned by root, not writable by uid 1000
    done = engine_run(image, ["hvdkit", "launch", "-np", "2", "--", "hvdkit", "train", "--epochs", "1"], root_only)
    assert done.returncode != 0, done.stderr[-3000:]  # mpirun's code: the first rank to end (rank 1, 1)
    said = [line for line in done.stderr.splitlines() if "cannot make the run directory" in line]
    assert len(said) == 1 and "Permission denied" in said[0], done.stderr[-3000:]


def mpijob(image, workspace, name, *command, workers=2, grace=30):
    return [*HVDKIT, "mpijob", "--run", "--name", name, "--workers", str(workers), "--image", image,
            "--workspace", str(workspace), "--grace", str(grace), "--", *command]


def test_launcher_and_two_workers_train_as_two_ranks_on_one_host(image, workspace, job, two_ranks_trained):
    done = subprocess.run(mpijob(image, workspace, job, "hvdkit", "train", *TWO_RANK_TRAIN), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = summary(done.stdout)
    hosts = [rank["host"] for rank in result["per_rank"]]
    assert all(host.startswith(f"{job}-") for host in hosts), hosts
    assert [host.rsplit("-", 2)[1:] for host in hosts] == [["worker", "0"], ["worker", "1"]], hosts
    # Close, not bitwise: each worker's rank has the container's two cores to itself, and torch's
    # kernels sum in another order with two threads than with the one each of two ranks on one host has.
    trained = final_weights(workspace / "runs" / job / "checkpoints")
    assert trained.keys() == two_ranks_trained.keys()
    for name, value in two_ranks_trained.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert ours(job) == []


def _wait_for_steps(proc, metrics, steps, seconds=240):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the job ended before it trained: {proc.stderr.read()[-3000:]}"
        if metrics.exists() and any('"step"' in line for line in metrics.read_text().splitlines()):
            records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
            if max((r.get("step", 0) for r in records), default=0) >= steps:
                return
        time.sleep(0.5)
    pytest.fail(f"no step {steps} within {seconds} s")


def _container(job, suffix_end):
    names = subprocess.run(["podman", "ps", "--filter", "label=hvdkit.mpijob", "--format", "{{.Names}}"],
                           capture_output=True, text=True).stdout.split()
    [name] = [n for n in names if n.startswith(f"{job}-") and n.endswith(suffix_end)]
    return name


def _interrupted(image, workspace, job, command, after_steps, interrupt):
    """Run the job, call ``interrupt()`` once it has trained ``after_steps`` steps, and wait for
    its end: (exit code, stderr, what interrupt returned). The job is killed if the test fails."""
    proc = subprocess.Popen(mpijob(image, workspace, job, *command), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        _wait_for_steps(proc, workspace / "runs" / job / "metrics.jsonl", after_steps)
        done = interrupt()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # the test failed: a stop first, which removes the containers
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return proc.returncode, err, done


def test_podman_stop_of_the_launcher_saves_on_the_volume_leaves_nothing_and_the_rerun_resumes(image, workspace, job):
    command = ["hvdkit", "train", "--model", "mlp", "--max-steps", "120", "--log-interval", "5"]
    code, err, stopped = _interrupted(image, workspace, job, command, 20, lambda: subprocess.run(
        ["podman", "stop", "-t", "30", _container(job, "-launcher")], capture_output=True, text=True, timeout=120))
    assert stopped.returncode == 0, stopped.stderr
    assert code == 143, err[-3000:]
    saved = [line for line in err.splitlines() if "hvdkit: stopped by SIGTERM at step" in line]
    assert saved and f"saved in /workspace/runs/{job}/checkpoints" in saved[0], err[-3000:]
    assert list((workspace / "runs" / job / "checkpoints").iterdir()), err[-3000:]
    assert ours(job) == []
    rerun = subprocess.run(mpijob(image, workspace, job, *command), capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "resum" in rerun.stderr.lower(), rerun.stderr[-3000:]
    assert summary(rerun.stdout)["steps"] == 120
    assert ours(job) == []


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_killed_or_stopped_worker_ends_the_job_naming_its_rank(image, workspace, job, how):
    """A pod deleted (stop: SIGTERM to its sshd, which ends its container and the rank in it) or
    lost (kill) ends the job the same way."""
    def end_worker_1():
        worker = _container(job, "-worker-1")
        subprocess.run(["podman", how, worker], capture_output=True, timeout=60)
        return worker

    command = ["hvdkit", "train", "--model", "mlp", "--max-steps", "5000", "--log-interval", "5"]
    code, err, worker = _interrupted(image, workspace, job, command, 10, end_worker_1)
    assert code == 76, err[-3000:]  # hvdkit.job.LOST
    assert f"hvdkit launch: host {worker} (" in err and ", rank 1) does not answer" in err, err[-3000:]
    assert ours(job) == []


def _tags():
    return subprocess.run(["podman", "images", "--format", "{{.Repository}}:{{.Tag}}"], capture_output=True,
                          text=True).stdout.split()


def test_a_base_image_that_does_not_exist_is_one_line_and_tags_nothing(image):
    tag = "localhost/hvdkit:test-no-base"
    done = build_image("--base", "localhost/no-such-base:1", "--tag", tag, timeout=300)
    assert done.returncode == 1 and done.stdout == "", done.stderr
    assert done.stderr.startswith("hvdkit image: the base image localhost/no-such-base:1 does not exist here and "
                                  "could not be pulled: ") and len(done.stderr.splitlines()) == 1, done.stderr
    assert tag not in _tags()


def test_a_gpu_image_on_a_base_without_cuda_stops_with_the_builders_reason_and_tags_nothing(image):
    """The local Debian base has no CUDA toolkit (a CUDA base without NCCL fails the same way, at
    the same check): --gpu stops the build instead of making a CPU image under a GPU tag."""
    tag = "localhost/hvdkit:test-gpu-no-cuda"
    done = build_image("--base", "local", "--gpu", "--tag", tag, timeout=900)
    assert done.returncode == 1, done.stderr[-2000:]
    said = done.stderr.strip().splitlines()[-1]
    assert said.startswith("hvdkit image: the image build failed (hvdkit.build: error: --gpu: Horovod cannot be "
                           "built with NCCL here: no CUDA toolkit"), said
    assert tag not in _tags()
