"""hvdkit.parallel.ops in real jobs against the one-process arithmetic in fp64
(tests/programs/parallel_ops_worker.py): under mpirun at 2 and 3 ranks, at 4 in two process sets
made at hvd.init as well as in the whole job, and under horovodrun --gloo."""

import sys

import pytest

from conftest import REPO, run
from hvdkit.checks import selftest

WORKER = [sys.executable, str(REPO / "tests" / "programs" / "parallel_ops_worker.py")]


@pytest.mark.slow
@pytest.mark.parametrize("launch, said", [
    (["mpirun", "--oversubscribe", "-np", "2"], "parallel ops: ok in the job"),
    (["mpirun", "--oversubscribe", "-np", "3"], "parallel ops: ok in the job"),
    (["mpirun", "--oversubscribe", "-np", "4"], "parallel ops: ok in the job and two sets"),
    (["horovodrun", "--gloo", "-np", "2"], "parallel ops: ok in the job"),
], ids=["mpirun-2", "mpirun-3", "mpirun-4-sets", "gloo-2"])
def test_gathered_shards_and_their_gradients_are_the_one_process_arithmetic(launch, said):
    proc = run([*launch, *WORKER], env=selftest.mpi_root_env(), timeout=240)
    assert proc.returncode == 0 and said in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
