"""A regular (non-editable) install, used from a directory outside the clone, as a new user would.

The fresh venv gets hvdkit from `pip install <clone>`; its heavy dependencies (torch, the
Horovod built by `make setup`) come from the suite's own environment through a .pth file of
links that leaves hvdkit itself out, so the installed copy is the only hvdkit it can import.
"""

import os
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from conftest import REPO
from hvdkit.checks import selftest

pytestmark = pytest.mark.slow

# What a checkout holds besides its sources: outputs of earlier builds, runs and tools.
NOT_SOURCE = (".git", ".venv", ".make", ".pytest_cache", ".ruff_cache", "__pycache__", "*.egg-info")
OUTPUTS = ("build", "dist", "runs", "logs")  # at the checkout's top only: hvdkit/build is source


def _not_source(directory, names):
    """What shutil.copytree leaves out of the copy: caches anywhere, build outputs at the top."""
    left_out = set(shutil.ignore_patterns(*NOT_SOURCE)(directory, names))
    return left_out | ({name for name in names if name in OUTPUTS} if Path(directory) == REPO else set())


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    root = tmp_path_factory.mktemp("install")
    base = root / "base"  # the suite's site-packages without hvdkit
    base.mkdir()
    for entry in Path(site.getsitepackages()[0]).iterdir():
        if not entry.name.startswith(("hvdkit", "__editable__", "_hvdkit", "__pycache__")):
            (base / entry.name).symlink_to(entry)
    prefix = root / "venv"
    venv.EnvBuilder(with_pip=False).create(prefix)  # pip, setuptools: the suite's, from the .pth
    python = prefix / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "suite-dependencies.pth").write_text(f"{base}\n")
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    environ["PIP_NO_INDEX"] = "1"  # everything it needs is here: nothing may be downloaded
    # pip builds in the source tree: build from a copy of the sources, so a build/ left in the
    # checkout (another build, another filesystem) can neither break this one nor be written to.
    source = root / "source"
    shutil.copytree(REPO, source, ignore=_not_source)
    pip = subprocess.run([str(python), "-m", "pip", "install", "--no-build-isolation", str(source)],
                         capture_output=True, text=True, env=environ, timeout=600)
    assert pip.returncode == 0, pip.stdout[-2000:] + pip.stderr[-2000:]
    work = root / "elsewhere"
    work.mkdir()
    return prefix / "bin", work, selftest.mpi_root_env(environ)


def _run(cmd, cwd, env, timeout=300):
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_installed_copy_is_the_one_imported(installed):
    bin_dir, work, env = installed
    proc = _run([str(bin_dir / "python"), "-c", "import hvdkit; print(hvdkit.__file__)"], work, env)
    assert proc.returncode == 0, proc.stderr
    assert str(bin_dir.parent) in proc.stdout and str(REPO) not in proc.stdout


def test_slurm_render_finds_the_installed_templates(installed):
    bin_dir, work, env = installed
    proc = _run([str(bin_dir / "hvdkit"), "slurm", "render", "--nodes", "2", "--", "hvdkit", "train"], work, env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("#!/bin/bash") and "#SBATCH --nodes=2" in proc.stdout
    requeue = _run([str(bin_dir / "hvdkit"), "slurm", "render", "--requeue", "--", "python", "my.py"], work, env)
    assert requeue.returncode == 0 and "scontrol requeue" in requeue.stdout, requeue.stderr


def test_discover_hosts_is_on_path(installed, tmp_path):
    bin_dir, work, env = installed
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=2\nnode2:1\n")
    proc = _run([str(bin_dir / "hvdkit-discover-hosts")], work, dict(env, HVDKIT_HOSTS_FILE=str(hostfile)))
    assert proc.returncode == 0 and proc.stdout == "node1:2\nnode2:1\n", proc.stderr


def test_doctor_selftest_and_two_rank_training(installed):
    bin_dir, work, env = installed
    env = dict(env, PATH=f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env['PATH']}")
    doctor = _run([str(bin_dir / "hvdkit"), "doctor", "--selftest"], work, env, timeout=600)
    assert doctor.returncode == 0, doctor.stdout[-3000:] + doctor.stderr[-2000:]
    assert "selftest mpi:" in doctor.stdout and "selftest gloo:" in doctor.stdout, doctor.stdout
    assert doctor.stdout.count(" PASS in ") == 2 and "FAIL" not in doctor.stdout, doctor.stdout
    train = _run([str(bin_dir / "hvdkit"), "launch", "-np", "2", "--", str(bin_dir / "hvdkit"), "train",
                  "--model", "mlp", "--epochs", "1", "--log-dir", "logs"], work, env)
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-3000:]
    assert (work / "logs" / "metrics.jsonl").is_file()
    assert not (REPO / "runs" / "logs").exists()
