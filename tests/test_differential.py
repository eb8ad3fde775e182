"""The differential harness (tests/programs/differential.py): hvdkit's step against Horovod's
DistributedOptimizer over the models, optimizers and loops users train (tensor parallelism's
rows against the one-process step), one real job per world size and launcher, every cell run in
it; bitwise at 2 ranks, within each cell's tolerance at 3 and 4. The whole matrix under plain
mpirun at 2, 3 and 4 ranks, a smoke subset under horovodrun --gloo."""

import sys

import pytest

from conftest import REPO, run
from hvdkit.checks import selftest

sys.path.insert(0, str(REPO / "tests" / "programs"))
import differential  # noqa: E402  -- the cells' names, for the lines every launch must print

PROGRAM = [sys.executable, str(REPO / "tests" / "programs" / "differential.py")]
# The reference reproduces itself only unfused (the harness's docstring).
UNFUSED = ["-x", "HOROVOD_FUSION_THRESHOLD=0"]


def expected_lines(np: int, smoke: bool = False) -> list[str]:
    return [f"differential: {cell.name} {arm}: ok" for cell in differential.CELLS
            if np in cell.at and (not smoke or cell.name in differential.SMOKE) for arm in cell.arms
            if not (arm.endswith("zero-1") and np == (cell.tp or 1) * (cell.pp or 1))]  # no data-parallel set


@pytest.mark.slow
@pytest.mark.parametrize("np", [2, 3, 4])
def test_every_cell_steps_as_horovods_distributed_optimizer_under_mpirun(np):
    proc = run(["mpirun", "--oversubscribe", "-np", str(np), *UNFUSED, *PROGRAM], timeout=480,
               env=selftest.mpi_root_env())
    said = [line for line in proc.stdout.splitlines() if line.startswith("differential: ")]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert said[:-1] == expected_lines(np), "\n".join(line for line in said if not line.endswith(": ok"))
    assert said[-1].endswith(" 0 failed"), said[-1]


@pytest.mark.slow
def test_the_smoke_cells_step_as_horovods_under_horovodrun_gloo():
    proc = run(["horovodrun", "--gloo", "-np", "2", "env", "HOROVOD_FUSION_THRESHOLD=0", *PROGRAM, "--smoke"],
               timeout=300)
    said = [line for line in proc.stdout.splitlines() if "differential: " in line]
    said = [line[line.index("differential: "):] for line in said]  # horovodrun tags each line with its rank
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert said[:-1] == expected_lines(2, smoke=True), "\n".join(said)
    assert said[-1].endswith(" 0 failed"), said[-1]

