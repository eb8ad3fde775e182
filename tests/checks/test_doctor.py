"""`hvdkit doctor` on this machine's real installation."""

import os
import re
import subprocess
import sys

import pytest

from conftest import run
from hvdkit.launch import mpi


def test_report_names_every_part():
    proc = run([sys.executable, "-m", "hvdkit", "doctor"], env=dict(os.environ, SLURM_JOB_ID="42"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for key in ("Python:", "torch:", "torchvision:", "GPUs visible:", "MPI (mpirun):", "mpi4py:",
                "Horovod:", "controllers:", "tensor operations:", "launch environment:"):
        assert key in proc.stdout, key
    assert re.search(r"MPI \(mpirun\):\s+Open MPI 4\.", proc.stdout)
    assert re.search(r"controllers:\s+\[X\] MPI \[X\] Gloo", proc.stdout)
    assert "Slurm allocation, not inside an srun step" in proc.stdout
    assert "SLURM_JOB_ID=42" in proc.stdout


@pytest.mark.slow
def test_selftest_passes_over_each_controller():
    proc = run([sys.executable, "-m", "hvdkit", "doctor", "--selftest"], timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"selftest mpi:\s+PASS", proc.stdout), proc.stdout
    assert re.search(r"selftest gloo:\s+PASS", proc.stdout), proc.stdout


def test_missing_horovod_is_one_line_and_exit_1(tmp_path):
    """A real environment without Horovod: a fresh venv that sees hvdkit and nothing else."""
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    proc = run([str(venv / "bin" / "python"), "-m", "hvdkit", "doctor"], env={"PATH": os.environ["PATH"]})
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert "doctor: missing torch is not installed: run `make setup`" in lines[0]
    assert any(line.startswith("doctor: missing Horovod is not installed") for line in lines)
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("text, name", [
    ("mpirun (Open MPI) 4.1.4\n\nReport bugs to http://www.open-mpi.org/community/help/\n", "Open MPI 4.1.4"),
    ("HYDRA build details:\n    Version:                                 4.0.2\n", "MPICH 4.0.2"),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619\n",
     "Intel MPI: Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619"),
])
def test_mpi_implementation_from_version_text(text, name):
    assert mpi.describe_mpi(text) == name
