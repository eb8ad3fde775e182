"""MPICH for real: Horovod built against Debian's MPICH from a local source distribution with
the network unreachable (`unshare --net`; built once, then taken from the cache by its own key,
as the Open MPI build is), then the 2-rank launch, the self-test worker and a short training
under MPICH's Hydra mpiexec, through `hvdkit launch`.

The MPICH build is installed beside the suite's Open MPI one, not over it: into a folder put
first on PYTHONPATH, with Hydra's mpirun first on PATH, as a second MPI on a cluster would be.
A frozen rank ends the job at the stall limit under Hydra too.
"""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import REPO, kill_tree, run, wait_for
from hvdkit.build import builder as build
from hvdkit.checks import selftest
from hvdkit.launch import mpi

pytestmark = pytest.mark.slow
HYDRA = "/usr/bin/mpiexec.mpich"


@pytest.fixture(scope="module")
def mpich(tmp_path_factory):
    missing = [tool for tool in ("mpicxx.mpich", "mpiexec.mpich", "unshare") if shutil.which(tool) is None]
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"MPICH is required in CI but {', '.join(missing)} is missing (make setup installs it)")
        pytest.skip(f"MPICH is not installed here ({', '.join(missing)} missing): run `make setup`")
    root = tmp_path_factory.mktemp("mpich")
    cached = build.cache_dir() / "sdist" / f"horovod-{build.HOROVOD_VERSION}.tar.gz"
    assert cached.is_file(), "make setup caches Horovod's source distribution"
    sdist = root / "offline" / cached.name  # what a user brings to a machine without internet
    sdist.parent.mkdir()
    shutil.copy(cached, sdist)
    # The suite's cache, where the MPICH build has a key of its own: built once, as `make setup`
    # builds the Open MPI one, then exported from the cache by the same offline command.
    # CPU-only: no test here uses NCCL, and where a CUDA toolkit is installed its kernels for every
    # architecture would take most of the build. One worker runs this module (conftest groups it).
    built = run(["unshare", "--net", sys.executable, "-m", "hvdkit.build", "--mpi", "mpich", "--cpu-only",
                 "--sdist", str(sdist), "--no-install", "--wheel-dir", str(root / "wheels")], cwd=root, timeout=1800)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    wheels = list((root / "wheels").glob("horovod-*.whl"))
    assert len(wheels) == 1, built.stdout
    site = root / "site"
    pip = run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site),
               str(wheels[0])], cwd=root)
    assert pip.returncode == 0, pip.stderr
    bin_dir = root / "bin"
    bin_dir.mkdir()
    for name in ("mpirun", "mpiexec"):
        (bin_dir / name).symlink_to(HYDRA)
    (bin_dir / "hydra_pmi_proxy").symlink_to(Path(HYDRA).with_name("hydra_pmi_proxy"))  # Hydra looks beside itself
    environ = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}"
                                    f"{os.environ['PATH']}", PYTHONPATH=f"{site}{os.pathsep}{REPO}")
    return {"build": built.stdout, "wheel": wheels[0], "site": site, "env": environ, "root": root}


def _run(mpich, cmd, **kwargs):
    """With the MPICH Horovod and Hydra first; conftest's run would put the repository first."""
    return subprocess.run(cmd, env=selftest.mpi_root_env(mpich["env"]), capture_output=True, text=True,
                          timeout=300, **kwargs)


def test_the_offline_build_is_mpich_and_cached_apart(mpich):
    assert "controllers: MPI (MPICH), Gloo" in mpich["build"]
    openmpi = build.plan_build(build.detect_toolchain(mpi="openmpi"))
    assert openmpi.local_version not in mpich["wheel"].name  # its own cache key and version
    extension = next((mpich["site"] / "horovod" / "torch").glob("mpi_lib_v2*.so"))
    ldd = subprocess.run(["ldd", str(extension)], capture_output=True, text=True).stdout
    assert mpi.built_flavor(ldd) == "mpich", ldd


def test_hydra_runs_the_selftest_worker(mpich):
    proc = _run(mpich, [sys.executable, "-m", "hvdkit", "launch", "-np", "2", "--launcher", "mpirun", "--verbose",
                        "--", *selftest.worker_command()])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.startswith("# launcher: mpirun") and "; mpich)" in proc.stdout.splitlines()[0]
    results = selftest.parse_results(proc.stdout)
    assert selftest.check(results) == [], proc.stdout[-2000:]
    assert {r["launcher"] for r in results} == {"mpirun (MPICH/Hydra or Intel MPI)"}
    assert {r["controller"] for r in results} == {"mpi"}


def test_hydra_runs_a_short_training(mpich, tmp_path):
    proc = _run(mpich, [sys.executable, "-m", "hvdkit", "launch", "-np", "2", "--launcher", "mpirun", "--",
                        sys.executable, "-m", "hvdkit", "train", "--model", "mlp", "--epochs", "1", "--max-steps", "6",
                        "--log-dir", str(tmp_path / "logs")])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = selftest.parse_records(proc.stdout, "summary")
    assert len(summary) == 1 and summary[0]["world_size"] == 2 and summary[0]["steps"] == 6, proc.stdout[-2000:]


def test_doctor_names_the_mpi_built_with_and_warns_of_another_mpirun(mpich):
    proc = _run(mpich, [sys.executable, "-m", "hvdkit", "doctor"])
    assert "built with MPI:     MPICH" in proc.stdout and "warning" not in proc.stdout, proc.stdout
    other = dict(mpich, env=dict(mpich["env"], PATH=f"/usr/bin{os.pathsep}{mpich['env']['PATH']}"))
    proc = _run(other, [sys.executable, "-m", "hvdkit", "doctor"])
    assert "mpirun on PATH (/usr/bin/mpirun) is Open MPI, but Horovod was built with MPICH" in proc.stdout, proc.stdout


def test_a_frozen_rank_ends_the_job_at_the_stall_limit(mpich, tmp_path):
    """SIGSTOP to rank 1 under Hydra: ended within --stall-timeout + 5 s, rank 1 named, exit 75."""
    stall, logs = 30, tmp_path / "logs"  # not below 30: a limit of its own at 30 s would end the job first
    proc = subprocess.Popen([sys.executable, "-m", "hvdkit", "launch", "-np", "2", "--launcher", "mpirun", "--",
                             sys.executable, "-m", "hvdkit", "train", "--model", "mlp", "--epochs", "60",
                             "--stall-timeout", str(stall), "--log-dir", str(logs)],
                            env=selftest.mpi_root_env(mpich["env"]), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        wait_for(lambda: (logs / "metrics.jsonl").exists() and '"train"' in (logs / "metrics.jsonl").read_text(),
                 proc, "training to report")
        (frozen,) = [p for p in psutil.Process(proc.pid).children(recursive=True)
                     if p.cmdline()[1:4] == ["-m", "hvdkit", "train"] and p.environ().get("PMI_RANK") == "1"]
        frozen.suspend()  # SIGSTOP
        began = time.monotonic()
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - began
    finally:
        kill_tree(proc)
    assert proc.returncode == 75, err[-3000:]
    assert took <= stall + 5, (took, err[-3000:])
    assert f"rank 1 (host {os.uname().nodename}, pid {frozen.pid}) stopped responding" in err, err[-3000:]
