"""Shared helpers: run real commands from the environment the suite runs in."""

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from hvdkit.checks import selftest
from hvdkit.launch.rank_output import untagged
from hvdkit.system import proctree

REPO = Path(__file__).resolve().parent.parent


def run(cmd, timeout=300, env=None, raw=False, **kwargs):
    """Run a real command; Open MPI's run-as-root consent is added as mpirun needs it. Unless
    ``raw``, output tagged by rank ([1,0]<stderr>:, as planner.local_command's mpirun and
    horovodrun print it) is joined into whole lines and untagged, as a user reads one rank."""
    full_env = selftest.mpi_root_env(env if env is not None else os.environ)
    full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                          **kwargs) as started:
        try:
            stdout, stderr = started.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(started)  # subprocess.run killed the launcher alone, and its ranks ran on as orphans
            raise
    proc = subprocess.CompletedProcess(started.args, started.returncode, stdout, stderr)
    if not raw:
        proc.stdout, proc.stderr = untagged(proc.stdout), untagged(proc.stderr)
    return proc


def part_checked(part: str, tmp_path) -> None:
    """tests/programs/parts_worker.py's check of the Session part ``part``, in a Horovod process of its
    own (the test process never holds MPI); fails with its output."""
    proc = run([sys.executable, str(REPO / "tests" / "programs" / "parts_worker.py"), part, str(tmp_path)],
               env=selftest.mpi_root_env(), timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith(f"{part}: ok"), proc.stdout + proc.stderr[-3000:]


def leaves(value):
    """The values in nested dicts, lists and tuples (a state_dict's tensors among them)."""
    from hvdkit import nested  # torch: only in the tests that use it

    return (leaf for _, leaf in nested.leaves(value))


def final_weights(ckpt_dir):
    """The model weights in the newest checkpoint of ``ckpt_dir``, whole (a stage-3 one's joined)."""
    from hvdkit import checkpoint
    from hvdkit.zero import shards

    newest = checkpoint.existing(str(ckpt_dir))[-1]
    return shards.plain_state(newest, checkpoint.load_whole(newest))["model"]


# The notebook's settings (examples/hvdkit_run.ipynb) as `hvdkit train` flags: plain SGD on a model
# without batch norm or dropout, so that every way of running two ranks gives the same weights.
TWO_RANK_TRAIN = ["--model", "mlp", "--max-steps", "20", "--warmup-epochs", "0", "--lr-schedule", "none"]


@pytest.fixture(scope="session")
def two_ranks_trained(tmp_path_factory):
    """The final weights of `hvdkit train` with TWO_RANK_TRAIN on two ranks of this host (horovodrun)."""
    ckpt = tmp_path_factory.mktemp("two-ranks") / "ckpt"
    proc = run([sys.executable, "-m", "hvdkit", "launch", "-np", "2", "--launcher", "horovodrun", "--",
                sys.executable, "-m", "hvdkit", "train", *TWO_RANK_TRAIN, "--checkpoint-dir", str(ckpt),
                "--log-dir", str(ckpt.parent / "logs")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return final_weights(ckpt)


def assert_bitwise_equal(a, b):
    import torch

    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def require_namespaces():
    """Skip, saying why, where namespace hosts (hvdkit.rehearse.namespaces) cannot be made; in CI that is a failure."""
    from hvdkit.rehearse import namespaces as hosts

    problem = hosts.unavailable()
    if problem:
        _missing(f"CI must run the multi-host tests, but: {problem}", f"cannot make namespace hosts here: {problem}")


def require_slurm_on_namespaces():
    """Skip, saying why, where Slurm or namespace hosts are missing; in CI that is a failure."""
    from hvdkit.rehearse import slurm_cluster

    missing = ", ".join(slurm_cluster.missing_binaries())
    if missing:
        _missing(f"Slurm is required in CI but {missing} is missing (make test-setup installs it)",
                 f"Slurm is not installed here ({missing} missing): run `make test-setup`")
    require_namespaces()


def _missing(in_ci, elsewhere):
    """CI must run every test: there a missing part fails the test; elsewhere it skips, saying why."""
    if os.environ.get("CI"):
        pytest.fail(in_ci)
    pytest.skip(elsewhere)


def require_podman():
    """Skip, saying why, where podman or mmdebstrap is missing; in CI that is a failure."""
    import shutil

    missing = [tool for tool in ("podman", "mmdebstrap") if shutil.which(tool) is None]
    if missing:
        _missing(f"CI must run the container tests, but {', '.join(missing)} is missing (make test-setup installs it)",
                 f"{', '.join(missing)} not installed here: run `make test-setup`")


def build_image(*args, timeout=1800):
    """`hvdkit image build ARGS`, one at a time on this machine: two builds of one context at once
    broke podman's storage here ("Stale file handle" in a RUN step)."""
    import fcntl

    require_podman()
    with open(Path(tempfile.gettempdir()) / "hvdkit-image-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return subprocess.run([sys.executable, "-m", "hvdkit", "image", "build", *args], capture_output=True,
                              text=True, cwd=REPO, timeout=timeout)


@pytest.fixture(scope="session")
def hvdkit_image():
    """hvdkit's image, built by `hvdkit image build --base local`: podman caches the layers, so a
    second build of the same checkout (another worker's, the next run's) takes seconds."""
    import time

    began = time.monotonic()
    done = build_image("--base", "local")
    assert done.returncode == 0, done.stderr[-3000:]
    tag = done.stdout.strip().splitlines()[-1]
    print(f"image {tag} built in {time.monotonic() - began:.0f} s", file=sys.stderr)
    return tag


def elastic_on_this_host(hostfile, command, launcher="horovodrun"):
    """(argv, env) of an elastic job with two slots of this host, from the hostfile ``hostfile``
    read by launchers/discover_hosts.sh; ``launcher``: horovodrun itself or `hvdkit launch`."""
    from hvdkit.launch.mpi import find_program

    hostfile.write_text("localhost:2\n")
    # One host: Horovod's elastic driver needs the interface named, or it waits for a second host.
    flags = ["-np", "2", "--min-np", "1", "--max-np", "2", "--network-interface", "lo",
             "--host-discovery-script", str(REPO / "launchers" / "discover_hosts.sh")]
    start = {"horovodrun": [find_program("horovodrun")], "hvdkit launch": [sys.executable, "-m", "hvdkit", "launch"]}
    argv = [*start[launcher], *flags, *(["--"] if launcher == "hvdkit launch" else []), *command]
    return argv, dict(selftest.mpi_root_env(), HVDKIT_HOSTS_FILE=str(hostfile), PYTHONPATH=str(REPO))


def metrics_records(path):
    """The records of a metrics.jsonl written so far (none before it exists)."""
    import json

    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


HVDKIT_TRAIN = [sys.executable, "-m", "hvdkit", "train"]


def gpt_train_flags(batch_size: int) -> list:
    """The built-in GPT on the text set for 8 steps of AdamW at a constant rate, a checkpoint at step 4,
    a report every step, the consistency check every 2 and an evaluation of 4 batches a replica (the
    whole test text took most of a run): what the tp and pp runs and resumes train."""
    return ["--dataset", "text", "--model", "gpt-tiny", "--seq-len", "32", "--batch-size", str(batch_size),
            "--optimizer", "adamw", "--base-lr", "0.002", "--warmup-epochs", "0", "--lr-schedule", "none",
            "--max-steps", "8", "--checkpoint-steps", "4", "--log-interval", "1", "--check-consistency-steps", "2",
            "--logger", "none", "--eval-batches", "4"]


def trained_run(flags, directory, launcher, np, *args, env=None):
    """``hvdkit train`` with ``flags`` and ``args`` on ``np`` ranks under ``launcher`` (None: one process,
    no launcher; a name: planner.local_command's; a list: a command line that takes hvdkit train's
    flags), its checkpoints and logs under ``directory``: its losses by step, its final weights and the
    process (a failure fails the test with its output)."""
    from hvdkit.launch import planner

    command = [*HVDKIT_TRAIN, *flags, "--checkpoint-dir", str(directory / "ckpt"), "--log-dir",
               str(directory / "logs"), *args]
    if isinstance(launcher, list):
        command = [*launcher, *command[len(HVDKIT_TRAIN):]]
    elif launcher:
        command = planner.local_command(launcher, np, command)
    proc = run(command, timeout=300, env=env)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    records = metrics_records(directory / "logs" / "metrics.jsonl")
    return {r["step"]: r["loss"] for r in records if r.get("event") == "train"}, final_weights(directory / "ckpt"), proc


def resumed_run(flags, middle, directory, launcher, np, *args, said=None):
    """``trained_run`` in ``directory`` from a copy of the checkpoint ``middle`` (of step 4 of 8): checked
    resumed from it (and saying ``said``), its steps 5 to 8 reported; its losses by step and final weights."""
    (directory / "ckpt").mkdir(parents=True)
    shutil.copy(middle, directory / "ckpt")
    losses, weights, proc = trained_run(flags, directory, launcher, np, *args)
    assert f"resumed from {directory / 'ckpt'}" in proc.stderr, proc.stderr[-2000:]
    assert said is None or said in proc.stderr, proc.stderr[-2000:]
    assert sorted(losses) == [5, 6, 7, 8], losses
    return losses, weights


def trained_through_a_kill(flags, directory, *args):
    """``trained_run`` of 4 ranks under `hvdkit launch --launcher mpirun --max-restarts 1` whose rank 3
    SIGKILLs itself at step 6 once the checkpoint of step 4 is written (tests/programs/killed_once.py):
    checked killed and restarted once; its final weights and the process."""
    from hvdkit import checkpoint

    killed = [sys.executable, "-m", "hvdkit", "launch", "-np", "4", "--launcher", "mpirun", "--max-restarts", "1",
              "--", sys.executable, str(REPO / "tests" / "programs" / "killed_once.py")]
    death = {"KILL_AT_STEP": "6", "KILL_RANK": "3",
             "KILL_AFTER_WRITTEN": checkpoint.path_for(str(directory / "ckpt"), 4)}
    _, weights, proc = trained_run(flags, directory, killed, 4, *args, env=dict(os.environ, **death))
    assert "killed_once: rank 3 killed at step 6, attempt 0" in proc.stderr, proc.stderr[-3000:]
    assert "restart 1 of 1" in proc.stderr, proc.stderr[-3000:]
    return weights, proc


def assert_refused_before_anything_starts(flags, tmp_path, np, args, said) -> None:
    """``hvdkit train`` with ``flags`` and ``args`` on ``np`` ranks under mpirun: exit 2, one line from
    hvdkit train that starts with ``said``, and no checkpoint written."""
    from hvdkit import checkpoint
    from hvdkit.launch import planner

    proc = run(planner.local_command("mpirun", np, [*HVDKIT_TRAIN, *flags, "--log-dir", str(tmp_path / "logs"),
                                                    "--checkpoint-dir", str(tmp_path / "ckpt"), *args]), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("hvdkit train:")]
    assert len(lines) == 1 and lines[0].startswith(said), proc.stderr[-2000:]
    assert not (tmp_path / "ckpt").exists() or not checkpoint.existing(str(tmp_path / "ckpt"))


def relative_difference(a, b) -> float:
    """The norm of ``a - b`` over the norm of ``b`` (fp64)."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-12)).item()


def wait_for_file(path, proc, timeout=120):
    """Wait for the job ``proc`` to write ``path``, polling every 2 ms: a test that kills the job
    there must catch it before the job's next step."""
    import time

    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, f"the run ended before writing {path.name}"
        time.sleep(0.002)


def wait_for(predicate, proc, what, seconds=120):
    """Poll ``predicate`` while the job ``proc`` runs; fail naming ``what`` if it ends or time runs out."""
    import time

    deadline = time.monotonic() + seconds
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"the job ended (exit {proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            kill_tree(proc)
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


def kill_tree(proc):
    """SIGKILL a launcher and every process it started (by PID, ours only), as hvdkit.run does,
    and remove the job directory its ranks were given: a launcher killed cannot."""
    import psutil

    from hvdkit import job
    from hvdkit.launch import supervise

    processes = proctree.tree(proc.pid)
    job_dirs = set()
    for process in processes:
        with contextlib.suppress(psutil.Error):
            job_dirs.add(process.environ().get(job.JOB_DIR))
    proctree.end_processes(processes, grace=0)
    proc.wait(timeout=30)
    for job_dir in job_dirs - {None}:
        supervise.remove_job_dir(job_dir)


def pytest_configure(config):
    """munged runs from the start of the session, as systemd runs it where the munge package is
    installed. Installed for the test Slurm cluster but stopped (a container has no systemd), it
    costs every Open MPI start: PMIx's munge module retries its socket for 2.3 s in mpirun and
    again in each rank (`mpirun -np 2` of an mpi4py barrier: 4.95 s, 0.40 s with munged running).
    Started here, the tests before the cluster do not wait; the session ends it (pytest_unconfigure).
    Once, by the controller, before pytest-xdist starts its workers."""
    import shutil

    if hasattr(config, "workerinput") or not (shutil.which("munged") or Path("/usr/sbin/munged").exists()):
        return
    from hvdkit.rehearse import slurm_cluster

    config.hvdkit_munged = slurm_cluster.ensure_munge()


def pytest_unconfigure(config):
    """The munged pytest_configure started ends with the session (by the controller, by PID)."""
    from hvdkit.rehearse import slurm_cluster

    slurm_cluster.end_munge(getattr(config, "hvdkit_munged", None))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip, saying why, where torch sees no CUDA device. Under
    pytest-xdist (`make test` runs two workers), the tests of a module that use a fixture it
    makes once for all of them (a Slurm cluster, namespace hosts, a reference run) are one
    group, run by one worker, so that the fixture is made once; the rest go where a worker is free.
    The slow tests go first (pytest-xdist hands them out in this order): quick tests left for
    the end fill the gaps, where a minute-long test started last kept one worker busy while the
    other sat idle."""
    import torch

    for item in items:
        if any(_made_once_for_the_module(item, name) for name in item.fixturenames):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    items.sort(key=lambda item: "slow" not in item.keywords)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="marked gpu and torch.cuda.is_available() is False here: "
                                   "`make gpu-check` runs it on a CUDA machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _made_once_for_the_module(item, fixture):
    """``fixture`` is one of the module-scoped fixtures that ``item``'s own module defines."""
    return any(d.scope == "module" and d.func.__module__ == item.module.__name__
               for d in item._fixtureinfo.name2fixturedefs.get(fixture, ()))


@pytest.fixture(scope="session")
def hvd_built():
    """What the installed Horovod was built with; the multi-process tests need it installed."""
    probe = run([sys.executable, "-c",
                 "import horovod.torch as h; print(int(h.mpi_built()), int(h.gloo_built()), int(h.nccl_built()))"])
    assert probe.returncode == 0, f"Horovod is not importable (run `make setup`): {probe.stderr[-500:]}"
    mpi, gloo, nccl = (bool(int(x)) for x in probe.stdout.split())
    return {"mpi": mpi, "gloo": gloo, "nccl": nccl}


# `mpirun --version` of each MPI implementation, for plans made without one installed.
OPENMPI = "mpirun (Open MPI) 4.1.4\n\nReport bugs to http://www.open-mpi.org/community/help/\n"
MPICH = "HYDRA build details:\n    Version:                                 4.0.2\n"
INTEL = "Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619\n"
