"""The Session's parts tested on their own, each handed what it uses (no Session, fake or real):
tests/programs/parts_worker.py runs each in a real Horovod process of world size 1."""

import sys

import pytest

from conftest import REPO, run
from hvdkit.checks import selftest


@pytest.mark.slow
@pytest.mark.parametrize("part", ["loaders", "step", "checkpoints", "reports", "start_nothing"])
def test_a_part_works_with_what_it_is_handed(part, tmp_path):
    proc = run([sys.executable, str(REPO / "tests" / "programs" / "parts_worker.py"), part, str(tmp_path)],
               env=selftest.mpi_root_env(), timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith(f"{part}: ok"), proc.stdout + proc.stderr[-3000:]
