"""Launch-environment detection from each launcher's variables (the real runs are in test_multiprocess)."""

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
