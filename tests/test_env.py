"""Launch-environment detection from each launcher's variables (the real runs are in tests/checks/test_selftest.py)."""

import pytest

from hvdkit import env


@pytest.mark.parametrize("environ, launcher, rank, size, local_rank", [
    ({"HOROVOD_RANK": "3", "HOROVOD_SIZE": "8", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "4"},
     "horovodrun", 3, 8, 1),
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "7"}, "mpirun (Open MPI)", 5, 16, 1),
    ({"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "1",
      "PMIX_RANK": "2"}, "srun", 2, 4, 0),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}, "mpirun (MPICH/Hydra or Intel MPI)", 1, 2, 1),
])
def test_detects_each_launcher(environ, launcher, rank, size, local_rank):
    found = env.detect(environ)
    assert (found.launcher, found.rank, found.size, found.local_rank) == (launcher, rank, size, local_rank)
    assert found.variables == {k: environ[k] for k in sorted(environ) if not k.startswith("MPI_")}


def test_batch_script_outside_srun_has_no_rank():
    found = env.detect({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0"})
    assert found.rank is None and "not inside an srun step" in found.launcher


def test_plain_process():
    found = env.detect({"PATH": "/usr/bin"})
    assert found.rank is None and found.launcher.startswith("none") and found.variables == {}
    assert found.describe() == found.launcher


def test_srun_local_size_and_node_from_the_task_layout():
    found = env.detect({"SLURM_PROCID": "5", "SLURM_NTASKS": "7", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
                        "SLURM_NODEID": "3", "SLURM_TASKS_PER_NODE": "2(x3),1"})
    assert (found.node_rank, found.local_size) == (3, 1)
    assert found.describe() == "srun: rank 5 of 7, local rank 1 of 1, node 3"
    horovodrun = env.detect({"HOROVOD_RANK": "2", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "0",
                             "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "1"})
    assert horovodrun.node_rank == 1


@pytest.mark.parametrize("environ, spans", [
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, True),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, False),
    ({"HOROVOD_RANK": "2", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": "2"}, True),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, False),  # no local size: not known to span
    ({"PATH": "/usr/bin"}, False),
])
def test_a_job_spans_hosts_when_it_has_more_ranks_than_this_host(environ, spans):
    assert env.detect(environ).spans_hosts is spans


def test_disagreement_names_the_problem():
    srun = env.detect({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0"})
    assert "srun needs --mpi=pmix" in env.disagreement(srun, 0, 1, 0)
    assert env.disagreement(srun, 1, 2, 1) is None
    assert "local rank 1, Horovod says 0" in env.disagreement(srun, 1, 2, 0)
    assert "says rank 1 of 2, Horovod says rank 0 of 2" in env.disagreement(srun, 0, 2, 1)
    assert env.disagreement(env.detect({}), 0, 1, 0) is None


def test_trainer_warns_when_the_launcher_and_horovod_disagree(tmp_path):
    """srun without --mpi, as Horovod sees it: srun's variables for task 1 of 2, but a plain
    process, so MPI starts a world of one. (Real srun runs come with the Slurm cluster tests.)"""
    import os
    import sys

    from conftest import run

    fake_srun = dict(os.environ, SLURM_JOB_ID="1", SLURM_STEP_ID="0", SLURM_PROCID="1", SLURM_NTASKS="2",
                     SLURM_LOCALID="1")
    proc = run([sys.executable, "-m", "hvdkit", "train", "--max-steps", "1", "--epochs", "1",
                "--log-dir", str(tmp_path)], env=fake_srun)
    assert proc.returncode == 0, proc.stderr[-2000:]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("hvdkit: warning:")]
    assert len(warnings) == 1
    assert "srun started 2 processes, but Horovod sees a world of 1" in warnings[0]
