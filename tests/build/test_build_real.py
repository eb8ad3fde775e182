"""The real, cached build: what `make setup` installed is what the builder plans today."""

import hashlib
import re
import shutil
import sys
import tarfile

import pytest

from conftest import REPO, run
from hvdkit.build import builder as build
from hvdkit.build import patches
from hvdkit.launch import mpi

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
    proc = run([mpi.find_program("horovodrun"), "--check-build"])
    assert proc.returncode == 0, proc.stderr
    marked = set(re.findall(r"\[X\] (\w+)", proc.stdout))
    assert {"PyTorch", "MPI", "Gloo"} <= marked, proc.stdout
    assert ("NCCL" in marked) == (plan.gpu_operations == "NCCL"), proc.stdout
    assert hvd_built["nccl"] == (plan.gpu_operations == "NCCL")


@pytest.mark.parametrize("standard", [17, 20])  # torch 2.1-2.13 (the GPU machine's 2.11), and >= 2.14
def test_patches_apply_to_the_real_source_and_give_the_tree_of_record(tmp_path, standard):
    """hvdkit/build/patches/ on Horovod's real sdist, with GNU patch: every file they change, and only
    those, as tests/golden records it. For 0001-0003 that tree is the one the Python-held edits
    they replaced produced, checked with diff -r, but for one comment that named them; 0004 and
    later were written as patches."""
    sdist = build.cache_dir() / "sdist" / f"horovod-{build.HOROVOD_VERSION}.tar.gz"
    assert sdist.exists(), "make setup caches the source distribution"
    trees = {}
    for name in ("pristine", "patched"):
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp_path / name)
        trees[name] = tmp_path / name / f"horovod-{build.HOROVOD_VERSION}"
    patches.apply(trees["patched"], patches.for_standard(standard))
    diff = run(["diff", "-rq", str(trees["pristine"]), str(trees["patched"])])
    changed = sorted(line.split()[1][len(str(trees["pristine"])) + 1:] for line in diff.stdout.splitlines())
    golden = REPO / "tests" / "golden" / f"horovod-{build.HOROVOD_VERSION}-patched-cxx{standard}.sha256"
    expected = dict(reversed(line.split()) for line in golden.read_text().splitlines())
    assert changed == sorted(expected), diff.stdout
    for path, digest in expected.items():
        assert hashlib.sha256((trees["patched"] / path).read_bytes()).hexdigest() == digest, path
    standards = re.findall(r"set\(CMAKE_CXX_STANDARD (\d+)\)", (trees["patched"] / "CMakeLists.txt").read_text())
    assert set(standards) == {str(standard)}


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


# --- machines without internet: `unshare --net` runs the builder with no network at all ------------

def _offline(*args, cwd):
    return run(["unshare", "--net", sys.executable, "-m", "hvdkit.build", *args], cwd=cwd, timeout=300)


@pytest.fixture(scope="module")
def no_network():
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is missing: cannot take the network away from the build")
    probe = run(["unshare", "--net", "true"])
    if probe.returncode != 0:
        pytest.skip(f"cannot create a network namespace here ({probe.stderr.strip()}); run as root")


def test_offline_without_a_source_says_what_it_needs_in_one_line(tmp_path, no_network):
    proc = _offline("--force", "--no-install", "--cache-dir", str(tmp_path / "cache"), cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1, proc.stderr
    # Where another test is reinstalling a build requirement at that moment, the builder finds it
    # missing and cannot fetch it offline either: that says so in its one line, with the same remedy.
    assert proc.stderr.startswith(("hvdkit.build: error: cannot download the Horovod",
                                   "hvdkit.build: error: pip could not install")), proc.stderr
    assert "--sdist horovod-0.28.1.tar.gz or --find-links DIR" in proc.stderr


def test_a_wheelhouse_serves_the_build_offline_without_building(tmp_path, plan, no_network):
    """One machine exports its wheel (--wheel-dir); another, offline, takes it from --find-links."""
    house = tmp_path / "house"
    exported = _offline("--no-install", "--wheel-dir", str(house), cwd=tmp_path)  # from the suite's cache
    assert exported.returncode == 0, exported.stderr
    wheels = list(house.glob(f"horovod-{plan.local_version}-*.whl"))
    assert len(wheels) == 1, list(house.iterdir())
    proc = _offline("--no-install", "--find-links", str(house), "--wheel-dir", str(tmp_path / "out"),
                    "--cache-dir", str(tmp_path / "empty-cache"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"found {wheels[0]}" in proc.stdout and "building" not in proc.stdout
    assert (tmp_path / "out" / wheels[0].name).is_file()


@pytest.mark.parametrize("args, message", [
    (["--sdist", "nowhere.tar.gz"], "--sdist nowhere.tar.gz: no such file"),
    (["--find-links", "nowhere"], "--find-links nowhere: no such folder"),
])
def test_bad_sources_are_one_line(tmp_path, args, message):
    proc = run([sys.executable, "-m", "hvdkit.build", "--force", "--no-install", "--cache-dir", str(tmp_path), *args],
               cwd=tmp_path)
    assert proc.returncode == 1 and proc.stderr.strip().endswith(message) and proc.stderr.count("\n") == 1, proc.stderr
