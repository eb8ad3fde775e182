"""The sbatch templates, submitted to a real Slurm cluster that this module starts."""

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import (
    REPO,
    assert_bitwise_equal,
    final_weights,
    require_slurm_on_namespaces,
    run,
)
from hvdkit import checkpoint
from hvdkit.checks import selftest
from hvdkit.container.engine import Limits
from hvdkit.launch import planner
from hvdkit.rehearse import namespaces as namespace_hosts
from hvdkit.rehearse import slurm_cluster

pytestmark = pytest.mark.slow
VENV_BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def cluster():
    require_slurm_on_namespaces()
    with namespace_hosts.Hosts(2, own_tmp=True) as hosts:
        cluster = slurm_cluster.SlurmCluster(hosts)
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.stop()


@pytest.fixture
def tmp_path(cluster, request):
    """A directory in the cluster's shared home (the nodes' /tmp is their own, as on a cluster)."""
    path = cluster.home / re.sub(r"[^\w.-]", "_", request.node.name)[:80]
    path.mkdir()
    return path


def submit(cluster, tmp_path, template, *sbatch_args, args="--epochs 1 --max-steps 8", extra_env=None,
           first_on_path=()):
    path = os.pathsep.join([*map(str, first_on_path), str(VENV_BIN), cluster.env["PATH"]])
    env = dict(cluster.env, PATH=path, PYTHONPATH=str(REPO),
               HVDKIT=str(VENV_BIN / "hvdkit"), HVDKIT_COMMAND=f"{VENV_BIN / 'hvdkit'} train",
               HVDKIT_ARGS=args, HVDKIT_RUN_DIR=str(tmp_path / "run"))
    env = selftest.mpi_root_env({**env, **(extra_env or {})})
    job = cluster.sbatch("--chdir", str(tmp_path), "--output", str(tmp_path / "job-%j.out"), *sbatch_args,
                         str(REPO / "slurm" / template), env=env)
    return job


def job_log(tmp_path, job):
    return (tmp_path / f"job-{job}.out").read_text()


def what_ran(tmp_path, log):
    """A failed job's message: the end of its log, then of each rank's (a rank's crash is told only there)."""
    ranks = sorted((tmp_path / "run").glob("rank-*.log"))
    return log[-3000:] + "".join(f"\n--- {path.name}\n{path.read_text()[-3000:]}" for path in ranks)


@pytest.mark.parametrize("template, nodes, tasks, flags", [
    pytest.param("single-node.sbatch", 1, 2, "", marks=pytest.mark.fast),  # make test-fast's srun run
    ("multi-node-srun.sbatch", 2, 2, "--zero 2 --checkpoint-dir ckpt"),  # each node writes its shard
    ("multi-node-mpirun.sbatch", 2, 2, ""),
    ("multi-node-horovodrun.sbatch", 2, 2, ""),
])
def test_template_runs_to_completion(cluster, tmp_path, template, nodes, tasks, flags):
    job = submit(cluster, tmp_path, template, args=f"--epochs 1 --max-steps 8 {flags}")
    info = cluster.wait(job)
    log = job_log(tmp_path, job)
    assert info["JobState"] == "COMPLETED", what_ran(tmp_path, log)
    assert info["NumNodes"] == str(nodes) and info["NumTasks"] == str(tasks)
    head = log.splitlines()[:10]  # before training: the multi-node templates' doctor table, then the command
    assert any(f"{VENV_BIN / 'hvdkit'} train --epochs 1" in line for line in head), f"no resolved command in {head}"
    if nodes > 1:
        assert f"doctor: {nodes} hosts checked in " in log and ": all hosts agree" in log, log[:3000]
    summary = selftest.parse_records(log, "summary")
    assert len(summary) == 1 and summary[0]["world_size"] == tasks and summary[0]["steps"] == 8, log[-3000:]
    assert (tmp_path / "run" / "metrics.jsonl").exists()
    assert sorted(p.name for p in (tmp_path / "run").glob("rank-*.log")) == [f"rank-{r}.log" for r in range(tasks)]
    if "--zero" in flags:
        shards = tmp_path / "ckpt" / "ckpt-step000000008.pt.shards"
        assert sorted(p.name for p in shards.iterdir()) == ["part-00000-of-00002.pt", "part-00001-of-00002.pt"]


def test_a_template_restarts_a_killed_rank_within_the_allocation(cluster, tmp_path, time_limited_job):
    """Rank 1, on the second node, dies of SIGKILL at step 12 (checkpoints every 5): the template's
    hvdkit launch --max-restarts starts the job again in the same allocation, from step 10, and the
    job completes, each rank's log keeping both attempts. (It starts the time-limit test's job.)"""
    killed_once = f"env KILL_AT_STEP=12 {sys.executable} {REPO / 'tests' / 'programs' / 'killed_once.py'}"
    job = submit(cluster, tmp_path, "multi-node-mpirun.sbatch", extra_env={"HVDKIT_COMMAND": killed_once},
                 args="--model mlp --max-steps 20 --warmup-epochs 0 --lr-schedule none --checkpoint-dir ckpt "
                      "--checkpoint-steps 5")
    info = cluster.wait(job)
    log = job_log(tmp_path, job)
    assert info["JobState"] == "COMPLETED", what_ran(tmp_path, log)
    [line] = [line for line in log.splitlines() if "restart 1 of 2" in line]
    assert line.startswith("hvdkit launch: ") and "from the newest checkpoint" in line, line
    rank1 = (tmp_path / "run" / "rank-1.log").read_text()
    assert "killed_once: rank 1 killed at step 12, attempt 0" in rank1, rank1[-3000:]
    rank0 = (tmp_path / "run" / "rank-0.log").read_text()
    assert f"resumed from {checkpoint.path_for('ckpt', 10)}" in rank0, rank0[-3000:]
    assert selftest.parse_records(log, "summary")[0]["steps"] == 20


def test_a_run_directory_the_nodes_do_not_share_ends_the_job_before_any_rank_starts(cluster, tmp_path):
    """HVDKIT_RUN_DIR on /tmp, which is each node's own here as on a cluster: the template's
    `hvdkit doctor` names the node that does not see it, and the job ends before training, where
    each node would otherwise have kept checkpoints the other cannot resume from."""
    local = f"/tmp/hvdkit-{tmp_path.name}"
    job = submit(cluster, tmp_path, "multi-node-mpirun.sbatch", extra_env={"HVDKIT_RUN_DIR": local})
    info = cluster.wait(job)
    log = job_log(tmp_path, job)
    assert info["JobState"] == "FAILED", log[-3000:]
    batch_node = info["BatchHost"]
    said = [line for line in log.splitlines() if line.startswith("doctor: ") and "checked in" not in line]
    assert len(said) == 1 and said[0].endswith(f": {local} is not shared: a file written there on this host is not "
                                                "there; ranks there would save and resume from another directory: put "
                                                "the run and checkpoint directory on a filesystem every host mounts "
                                                "(HVDKIT_LOG_DIR, HVDKIT_CHECKPOINT_DIR)"), log[-3000:]
    assert said[0].split(":")[1].strip() != batch_node and "[train]" not in log, log[-3000:]


def test_array_runs_one_training_per_index(cluster, tmp_path):
    job = submit(cluster, tmp_path, "array.sbatch", "--array=0-1", "--output", str(tmp_path / "job-%A_%a.out"),
                 extra_env={"HVDKIT_SWEEP": "--seed 1|--seed 2"})
    for index in (0, 1):
        info = cluster.wait(f"{job}_{index}")
        log = (tmp_path / f"job-{job}_{index}.out").read_text()
        assert info["JobState"] == "COMPLETED", what_ran(tmp_path, log)
        assert f"--seed {index + 1}" in log
        assert selftest.parse_records(log, "summary")[0]["steps"] == 8
        assert (tmp_path / "run" / str(index) / "checkpoints").is_dir()


STRICT_TEMPLATES = [("single-node.sbatch", 2), ("multi-node-srun.sbatch", 2), ("multi-node-mpirun.sbatch", 2),
                    ("multi-node-horovodrun.sbatch", 2), ("preemptible.sbatch", 2), ("array.sbatch", 1)]


@pytest.mark.parametrize("template, tasks", STRICT_TEMPLATES)
def test_every_template_runs_a_strict_argparse_script_unchanged(cluster, tmp_path, template, tasks):
    """A plain Horovod script that refuses unknown flags gets exactly its own arguments; the
    run directory reaches it as HVDKIT_LOG_DIR (and HVDKIT_CHECKPOINT_DIR where checkpointing)."""
    script = f"{sys.executable} {REPO / 'tests' / 'programs' / 'strict_script.py'}"
    env = {"HVDKIT_COMMAND": script}
    array = ("--array=0-1", "--output", str(tmp_path / "job-%A_%a.out")) if template == "array.sbatch" else ()
    job = submit(cluster, tmp_path, template, *array, args="--lr 0.05 --steps 4", extra_env=env)
    runs = [(f"{job}_{i}", tmp_path / "run" / str(i), i) for i in (0, 1)] if array else [(job, tmp_path / "run", None)]
    for job_id, run_dir, index in runs:
        info = cluster.wait(job_id)
        log = (tmp_path / f"job-{job_id}.out").read_text()
        ranks = sorted(run_dir.glob("rank-*.log"))
        assert info["JobState"] == "COMPLETED", log[-2000:] + "".join(p.read_text()[-1500:] for p in ranks)
        results = [json.loads((run_dir / f"strict-rank-{r}.json").read_text()) for r in range(tasks)]
        checkpoints = str(run_dir / "checkpoints") if template in ("preemptible.sbatch", "array.sbatch") else None
        for rank, result in enumerate(results):
            assert (result["rank"], result["size"], result["lr"], result["steps"]) == (rank, tasks, 0.05, 4)
            assert result["ranks_agree"] and result["checkpoint_dir"] == checkpoints
            assert result["seed"] == (None if index is None else str(index))


PREEMPT_ARGS = "--dataset synthetic --epochs 2 --log-interval 4"


def reference_run(tmp_path, command):
    """The final checkpoint of ``command`` run uninterrupted on 2 ranks by mpirun."""
    proc = run(planner.local_command("mpirun", 2, [*command, "--checkpoint-dir", str(tmp_path / "reference"),
                                           "--log-dir", str(tmp_path / "reference-logs")]),
               env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return final_weights(tmp_path / "reference")


@pytest.fixture(scope="module")
def preempt_reference(tmp_path_factory):
    return reference_run(tmp_path_factory.mktemp("preempt"), [str(VENV_BIN / "hvdkit"), "train",
                                                               *PREEMPT_ARGS.split()])


def wait_for_training(cluster, job, tmp_path):
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and '"event": "train"' in metrics.read_text()):
        assert time.monotonic() < deadline, f"job {job} did not start training: {cluster.job(job).get('JobState')}"
        time.sleep(0.2)


def assert_nothing_left(tmp_path):
    """No process of the job outlives it: every one of them names the test's directory."""
    def leftovers():
        found = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            if any(str(tmp_path) in part for part in proc.info["cmdline"] or []):
                found.append(proc)
        return found

    deadline = time.monotonic() + 15  # slurmstepd reaps the step's processes after the job's state changed
    while leftovers() and time.monotonic() < deadline:
        time.sleep(0.2)
    left = leftovers()
    for proc in left:
        proc.kill()
    assert not left, f"processes outlived the job: {[(p.pid, p.info['cmdline']) for p in left]}"


def stopped_step(log):
    """The step of the one 'stopped by SIGTERM' line in a rank-0 log."""
    [line] = [line for line in log.splitlines() if "hvdkit: stopped by SIGTERM at step" in line]
    return int(line.split(" at step ")[1].split(";")[0])


def slow_scontrol(tmp_path):
    """A directory whose scontrol is the real one answering 2 s late, as a loaded controller can:
    the requeue has happened, so Slurm's SIGTERM to every task arrives before the answer does."""
    wrapper = tmp_path / "slow-bin" / "scontrol"
    wrapper.parent.mkdir()
    wrapper.write_text(f"#!/bin/bash\ntrap '' TERM\n{shutil.which('scontrol')} \"$@\"\nrc=$?\nsleep 2\nexit $rc\n")
    wrapper.chmod(0o755)
    return wrapper.parent


def test_preempted_job_requeues_resumes_and_matches_an_uninterrupted_run(cluster, tmp_path, preempt_reference):
    """The requeue's own SIGTERM must not cut rank 0's report short (its line and its summary)."""
    job = submit(cluster, tmp_path, "preemptible.sbatch", args=PREEMPT_ARGS,
                 first_on_path=[slow_scontrol(tmp_path)])
    wait_for_training(cluster, job, tmp_path)
    assert cluster.run(["scancel", "--signal=USR1", job]).returncode == 0
    cluster.release_requeued(job)
    info = cluster.wait(job, timeout=300)
    log = job_log(tmp_path, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", what_ran(tmp_path, log)
    assert "restart 0" in log and "restart 1" in log
    rank0 = (tmp_path / "run" / "rank-0.log").read_text()
    assert "requeued job" in rank0 or "requeued job" in log
    summaries = selftest.parse_records(log, "summary")
    assert summaries[-1]["epochs"] == 2 and not summaries[-1].get("stopped"), summaries
    assert any(s.get("stopped") for s in summaries), "the stopped run reported its summary too"
    assert_bitwise_equal(final_weights(tmp_path / "run" / "checkpoints"), preempt_reference)
    assert_nothing_left(tmp_path)


def test_the_container_template_with_podman_completes_and_requeues_on_usr1(cluster, tmp_path, preempt_reference,
                                                                          hvdkit_image):
    """slurm/container.sbatch as Apptainer runs it (srun --mpi=pmix, a container per rank), with
    podman as the runtime: the ranks join Slurm's PMIx from their containers, SIGUSR1 stops them
    with a checkpoint on the mounted run directory, the script outside requeues (the container
    has no scontrol), and the restart resumes to an uninterrupted run's weights."""
    limits = " ".join(Limits.of_this_process().args())
    job = submit(cluster, tmp_path, "container.sbatch", args=PREEMPT_ARGS,
                 extra_env={"HVDKIT_IMAGE": hvdkit_image, "HVDKIT_RUNTIME": "podman",
                            "HVDKIT_COMMAND": "hvdkit train", "HVDKIT_CONTAINER_ARGS": limits})
    wait_for_training(cluster, job, tmp_path)
    first_node = cluster.job(job)["NodeList"]
    assert cluster.run(["scancel", "--signal=USR1", job]).returncode == 0
    cluster.release_requeued(job, exclude=first_node)  # the restart on the other node, as preempted jobs often go
    info = cluster.wait(job, timeout=300)
    log = job_log(tmp_path, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, what_ran(tmp_path, log))
    assert info["NodeList"] != first_node, info
    assert f"requeueing job {job} (restart 1)" in log, log[-3000:]
    rank0 = (tmp_path / "run" / "rank-0.log").read_text()
    assert "not requeued from here: no scontrol on PATH (a container?)" in rank0, rank0[-3000:]
    summaries = selftest.parse_records(log, "summary")
    assert summaries[-1]["epochs"] == 2 and not summaries[-1].get("stopped"), log[-3000:]
    assert_bitwise_equal(final_weights(tmp_path / "run" / "checkpoints"), preempt_reference)
    assert_nothing_left(tmp_path)
    containers = run(["podman", "ps", "-a", "--filter", f"label=hvdkit.slurm-job={job}", "--format", "{{.Names}}"])
    assert containers.stdout.split() == [], "every rank's container was removed"


def test_plain_scancel_saves_the_step_it_stopped_at_and_a_resubmitted_job_finishes(cluster, tmp_path,
                                                                                      preempt_reference):
    """scancel sends SIGTERM (then SIGKILL after KillWait, 5 s here): no requeue, a checkpoint."""
    # Loader workers get Slurm's SIGTERM too; they must not take the rank down before it saves.
    job = submit(cluster, tmp_path, "preemptible.sbatch", args=f"{PREEMPT_ARGS} --num-workers 1")
    wait_for_training(cluster, job, tmp_path)
    assert cluster.run(["scancel", job]).returncode == 0
    info = cluster.wait(job)
    rank0 = (tmp_path / "run" / "rank-0.log").read_text()
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", rank0[-3000:]
    step = stopped_step(rank0)
    ckpt = str(tmp_path / "run" / "checkpoints")
    assert f"checkpoint of step {step} saved in {ckpt}" in rank0
    assert checkpoint.existing(ckpt)[-1] == checkpoint.path_for(ckpt, step)
    assert_nothing_left(tmp_path)

    again = submit(cluster, tmp_path, "preemptible.sbatch", args=PREEMPT_ARGS)
    info = cluster.wait(again)
    assert info["JobState"] == "COMPLETED", job_log(tmp_path, again)[-3000:]
    assert f"resumed from {checkpoint.path_for(ckpt, step)}" in (tmp_path / "run" / "rank-0.log").read_text()
    assert_bitwise_equal(final_weights(tmp_path / "run" / "checkpoints"), preempt_reference)
    assert_nothing_left(tmp_path)


SLOW_LOOP = [sys.executable, str(REPO / "tests" / "programs" / "slow_loop.py")]


@pytest.fixture(scope="module")
def time_limited_job(cluster):
    """The time-limit test's job, submitted by an earlier test of the module: its minute runs out
    while the tests between run their own jobs beside it (the partition shares its nodes)."""
    tmp_path = cluster.home / "time-limit"
    tmp_path.mkdir()
    ckpt = tmp_path / "run" / "checkpoints"
    job = submit(cluster, tmp_path, "single-node.sbatch", "--time=1",
                 args=f"--checkpoint-dir {ckpt} --step-seconds 0.1", extra_env={"HVDKIT_COMMAND": " ".join(SLOW_LOOP)})
    return tmp_path, ckpt, job


def test_a_time_limit_saves_the_step_it_stopped_at_and_a_resubmitted_job_finishes(cluster, time_limited_job):
    """At --time=1 Slurm sends SIGTERM (no --signal in single-node.sbatch) between 60 and 90 s
    in; slow_loop's 0.1 s steps would take 160 s. The resubmitted job runs them at full speed."""
    tmp_path, ckpt, job = time_limited_job
    reference = reference_run(tmp_path, SLOW_LOOP)
    slow = {"HVDKIT_COMMAND": " ".join(SLOW_LOOP)}
    info = cluster.wait(job, timeout=240)
    rank0 = (tmp_path / "run" / "rank-0.log").read_text()
    assert info["JobState"] == "TIMEOUT", rank0[-3000:]
    step = stopped_step(rank0)
    assert 0 < step < 1600 and f"checkpoint of step {step} saved in {ckpt}" in rank0, rank0[-3000:]
    assert checkpoint.existing(str(ckpt))[-1] == checkpoint.path_for(str(ckpt), step)
    assert_nothing_left(tmp_path)

    again = submit(cluster, tmp_path, "single-node.sbatch", args=f"--checkpoint-dir {ckpt}", extra_env=slow)
    info = cluster.wait(again)
    rank0 = (tmp_path / "run" / "rank-0.log").read_text()
    assert info["JobState"] == "COMPLETED", rank0[-3000:]
    assert f"resumed from {checkpoint.path_for(str(ckpt), step)}" in rank0
    assert_bitwise_equal(final_weights(ckpt), reference)
    assert_nothing_left(tmp_path)


def test_rendered_scripts_pass_sbatch_test_only(cluster, tmp_path):
    """The golden requests, fitted to the test cluster (its one partition, 2 nodes of 2 CPUs, no GPUs)."""
    import dataclasses

    from hvdkit import slurm
    from test_slurm_render import CASES

    for name, request in CASES.items():
        fitted = dataclasses.replace(request, partition="debug", account=None, gpus_per_node=0,
                                     nodes=min(request.nodes, 2), tasks_per_node=1, cpus_per_task=1)
        result = cluster.run(["sbatch", "--test-only"], input=slurm.render(fitted), cwd=tmp_path)
        assert result.returncode == 0 and "to start at" in result.stderr, f"{name}: {result.stderr}"


def test_hvdkit_slurm_submit_runs_the_job(cluster, tmp_path):
    from conftest import run

    env = selftest.mpi_root_env(dict(cluster.env, PATH=f"{VENV_BIN}{os.pathsep}{cluster.env['PATH']}",
                                     PYTHONPATH=str(REPO)))
    proc = run(cluster.on([sys.executable, "-m", "hvdkit", "slurm", "submit", "--nodes", "2", "--time", "10:00",
                           "--", "hvdkit", "train", "--max-steps", "4"]), env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip()
    assert job.isdigit()
    info = cluster.wait(job)
    log = (tmp_path / f"hvdkit-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED", what_ran(tmp_path, log)
    assert selftest.parse_records(log, "summary")[0]["steps"] == 4


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_failing_rank_ends_an_srun_job_within_60s(cluster, tmp_path, how):
    """Issue 5's failure semantics under srun, started as users do: hvdkit launch in salloc."""
    from rank.test_watchdog import FAILING_RANK

    script = tmp_path / "fail.py"
    script.write_text(FAILING_RANK)
    env = selftest.mpi_root_env(dict(cluster.env, PATH=f"{VENV_BIN}{os.pathsep}{cluster.env['PATH']}",
                                     PYTHONPATH=str(REPO)))
    start = time.monotonic()
    proc = cluster.run(["salloc", "-N", "2", "-n", "2", str(VENV_BIN / "hvdkit"), "launch", "-np", "2",
                        "--launcher", "srun", "--", sys.executable, str(script), how],
                       env=env, timeout=90, cwd=tmp_path)
    assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert time.monotonic() - start < 60, f"took {time.monotonic() - start:.0f} s"
