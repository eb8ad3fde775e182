"""`hvdkit doctor`: what this machine offers distributed training, and what is missing.

Every line is read from the real thing (imports, `mpirun --version`, Horovod's build
functions), so a report pasted into an issue says what actually runs. A missing requirement
ends the report with one `doctor: missing ...` line that says how to fix it, and exit code 1.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

from hvdkit import env, job
from hvdkit.checks import selftest
from hvdkit.checks.host_facts import package_version
from hvdkit.launch import planner
from hvdkit.launch.mpi import (
    NAMES,
    built_flavor,
    describe_mpi,
    find_program,
    mpi_flavor,
    mpirun_version,
)

SETUP_HINT = "run `make setup` in the hvdkit checkout, or `python -m hvdkit.build`"


def _mark(flag) -> str:
    return "[X]" if flag else "[ ]"


class Report:
    def __init__(self) -> None:
        self.missing: list[str] = []

    def line(self, key: str, value: str) -> None:
        print(f"{key + ':':<22}{value}", flush=True)

    def require(self, what: str, fix: str) -> None:
        self.missing.append(f"{what}: {fix}")


def report_python_and_torch(report: Report) -> None:
    report.line("Python", f"{platform.python_version()} ({sys.executable})")
    try:
        import torch
    except ImportError:
        report.line("torch", "not installed")
        report.require("torch is not installed", SETUP_HINT)
        return
    cuda = torch.version.cuda or "none (CPU build)"
    extras = [f"CUDA {cuda}"]
    if torch.backends.cudnn.is_available():
        extras.append(f"cuDNN {torch.backends.cudnn.version()}")
    if torch.version.cuda:
        try:
            extras.append("NCCL " + ".".join(map(str, torch.cuda.nccl.version())))
        except Exception:  # noqa: BLE001 - NCCL is optional in a torch build
            pass
    report.line("torch", f"{torch.__version__} ({', '.join(extras)})")
    report.line("torchvision", package_version("torchvision") or "not installed")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = [torch.cuda.get_device_name(i) for i in range(gpus)]
    report.line("GPUs visible", f"{gpus}" + (f" ({', '.join(names)})" if names else ""))


def report_mpi(report: Report) -> None:
    mpirun = find_program("mpirun")
    if mpirun:
        report.line("MPI (mpirun)", f"{describe_mpi(mpirun_version(mpirun))} ({mpirun})")
    else:
        report.line("MPI (mpirun)", "not found on PATH")
    try:
        from mpi4py import MPI
    except ImportError as exc:
        report.line("mpi4py", f"not importable ({exc})")
        report.require("mpi4py is missing", "apt-get install libopenmpi-dev, then pip install mpi4py")
        return
    library = MPI.Get_library_version().strip().splitlines()[0]
    report.line("mpi4py", f"{package_version('mpi4py')} (linked to: {library})")


def report_horovod(report: Report) -> list[str]:
    """Print what `horovodrun --check-build` shows; return the controllers built."""
    version = package_version("horovod")
    if version is None:
        report.line("Horovod", "not installed")
        report.require("Horovod is not installed", SETUP_HINT)
        return []
    try:
        import horovod.torch as hvd
    except Exception as exc:  # noqa: BLE001 - any import failure is the finding
        report.line("Horovod", f"{version}, but horovod.torch does not import: {exc}")
        report.require("horovod.torch does not import (built against another torch?)",
                       "rebuild with `python -m hvdkit.build --force`")
        return []
    controllers = [name for name, built in (("mpi", hvd.mpi_built()), ("gloo", hvd.gloo_built())) if built]
    report.line("Horovod", version)
    report.line("  frameworks", f"{_mark(True)} PyTorch")
    report.line("  controllers", f"{_mark('mpi' in controllers)} MPI {_mark('gloo' in controllers)} Gloo")
    report.line("  tensor operations",
                f"{_mark(hvd.nccl_built())} NCCL {_mark(hvd.ddl_built())} DDL {_mark(hvd.ccl_built())} CCL "
                f"{_mark(hvd.mpi_built())} MPI {_mark(hvd.gloo_built())} Gloo")
    report.line("  GPU builds", f"{_mark(hvd.cuda_built())} CUDA {_mark(hvd.rocm_built())} ROCm")
    if hvd.mpi_built():
        report_built_mpi(report, Path(hvd.__file__).parent)
    if not controllers:
        report.require("Horovod has no controller (neither MPI nor Gloo)", SETUP_HINT)
    if not find_program("horovodrun"):
        report.require("horovodrun is not on PATH", "activate the environment Horovod was installed in")
    if "mpi" in controllers and not find_program("mpirun"):
        report.require("Horovod was built with MPI but mpirun is not on PATH",
                       "apt-get install openmpi-bin, or `module load` your cluster's MPI")
    return controllers


def report_built_mpi(report: Report, package: Path) -> None:
    """Which MPI Horovod was built with, and a warning when mpirun on PATH is another: its ranks
    would each start a job of size 1."""
    libraries = sorted(package.glob("mpi_lib_v2*.so"))
    ldd = subprocess.run(["ldd", str(libraries[0])], capture_output=True, text=True).stdout if libraries else ""
    built = built_flavor(ldd)
    report.line("  built with MPI", NAMES.get(built, "unknown (ldd found no MPI library)"))
    mpirun = find_program("mpirun")
    on_path = mpi_flavor(mpirun_version(mpirun)) if mpirun else None
    if built and on_path and on_path != built:
        report.line("  warning", f"mpirun on PATH ({mpirun}) is {NAMES.get(on_path, on_path)}, but Horovod was "
                                 f"built with {NAMES[built]}: put {NAMES[built]}'s mpirun first on PATH, or "
                                 f"rebuild with python -m hvdkit.build --mpi {on_path} --force")


def report_launch(report: Report) -> None:
    launch = env.detect()
    report.line("launch environment", launch.describe())
    for name, value in launch.variables.items():
        print(f"  {name}={value}")


def run_selftest(report: Report, controllers: list[str]) -> None:
    for controller in controllers:
        how = f"horovodrun --{controller}"
        outcome = selftest.run(how, planner.local_command(how, selftest.NP, selftest.worker_command()))
        verdict = "PASS" if outcome.ok else "FAIL"
        report.line(f"selftest {controller}", f"{verdict} in {outcome.seconds:.1f} s: {outcome.detail}")
        if not outcome.ok:
            report.require(f"the {controller} selftest failed",
                           "see the line above; rerun with HOROVOD_LOG_LEVEL=debug")


def main(selftest_wanted: bool = False) -> int:
    report = Report()
    report_python_and_torch(report)
    report_mpi(report)
    controllers = report_horovod(report)
    report_launch(report)
    if selftest_wanted and controllers:
        run_selftest(report, controllers)
    for problem in report.missing:
        print(f"doctor: missing {problem}", file=sys.stderr)
    return job.FAILED if report.missing else job.OK
