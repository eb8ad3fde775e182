"""The real, cached build: what `make setup` installed is what the builder plans today."""

import re
import shutil
import sys
import tarfile

import pytest

from hvdkit import build, launch
from conftest import run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def plan():
    return build.plan_build(build.detect_toolchain())


def test_second_run_installs_nothing(plan):
    proc = run([sys.executable, "-m", "hvdkit.build"])
    assert proc.returncode == 0, proc.stderr
    assert f"Horovod {plan.local_version} already installed" in proc.stdout
    assert "HOROVOD_WITH_MPI=1" in proc.stdout and f"C++{plan.cxx_standard}" in proc.stdout
    assert (build.cache_dir() / "wheels" / plan.key).is_dir()


def test_check_build_lists_what_was_planned(plan, hvd_built):
    proc = run([launch.find_program("horovodrun"), "--check-build"])
    assert proc.returncode == 0, proc.stderr
    marked = set(re.findall(r"\[X\] (\w+)", proc.stdout))
    assert {"PyTorch", "MPI", "Gloo"} <= marked, proc.stdout
    assert ("NCCL" in marked) == (plan.gpu_operations == "NCCL"), proc.stdout
    assert hvd_built["nccl"] == (plan.gpu_operations == "NCCL")


def test_patch_applies_to_the_real_source(tmp_path, plan):
    sdist = build.cache_dir() / "sdist" / f"horovod-{build.HOROVOD_VERSION}.tar.gz"
    assert sdist.exists(), "make setup caches the source distribution"
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path)
    src = tmp_path / f"horovod-{build.HOROVOD_VERSION}"
    build.patch_cxx_standard(src, plan.cxx_standard)
    for name in build.CXX_STANDARD_FILES:
        standards = re.findall(r"set\(CMAKE_CXX_STANDARD (\d+)\)", (src / name).read_text())
        assert standards and set(standards) == {str(plan.cxx_standard)}, name


def test_failed_build_shows_first_errors_and_log(tmp_path, plan, monkeypatch):
    """A real CMake failure (no such compiler) ends in a short report, and the installed Horovod stays."""
    cache = tmp_path / "cache"
    (cache / "sdist").mkdir(parents=True)
    shutil.copy(build.cache_dir() / "sdist" / f"horovod-{build.HOROVOD_VERSION}.tar.gz", cache / "sdist")
    env = dict(__import__("os").environ, CXX="/nonexistent/g++", HVDKIT_CACHE_DIR=str(cache))
    proc = run([sys.executable, "-m", "hvdkit.build", "--force"], env=env, timeout=600)
    assert proc.returncode == 1
    assert "Horovod build failed; first errors:" in proc.stderr
    assert "CMAKE_CXX_COMPILER" in proc.stderr
    log = re.search(r"full log: (\S+)", proc.stderr).group(1)
    assert log.startswith(str(cache)) and "CMAKE_CXX_COMPILER" in open(log).read()
    assert len(proc.stderr.splitlines()) <= 16, proc.stderr
    assert not list((cache / "wheels").glob("**/*.whl"))
    after = run([sys.executable, "-c", "import importlib.metadata as m; print(m.version('horovod'))"])
    assert after.stdout.strip() == plan.local_version
