"""`make gpu-check`: what the CPU-only suite cannot show, on any CUDA machine, in one command.

It builds (or finds) Horovod with NCCL for this torch, runs the tests marked ``gpu`` (NCCL
collectives, fp16 autocast with GradScaler, pinned memory, the end-of-epoch lockstep), the synthetic
benchmark beside Horovod's own loop and DDP, and the sharded optimizer's bench (the CUDA
allocator's peak per phase), then prints one summary whose last line is PASS or
FAIL. Offline nodes pass ``--sdist`` or ``--find-links`` on to the builder.

    python -m hvdkit.checks.gpucheck [--sdist horovod-0.28.1.tar.gz] [--no-build]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from hvdkit import job
from hvdkit.build.builder import MPI_CHOICES
from hvdkit.checks import selftest

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
BENCH = ["synthetic", "-np", "1", "--compare", "horovod,ddp"]
ZERO = ["zero", "-np", "1", "--repeats", "1"]  # one GPU: the CUDA allocator's peaks, nothing to shard


@dataclass
class Step:
    name: str
    ok: bool
    detail: str


def no_gpu_problem() -> Optional[str]:
    """Why this machine cannot run the check, or None when torch sees a CUDA device."""
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build: install a CUDA build of torch"
    if not torch.cuda.is_available():
        return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device: "
                "run it on a GPU machine (nvidia-smi lists none, or CUDA_VISIBLE_DEVICES hides them)")
    return None


def mpi_for_build(requested: str) -> str:
    """The builder's --mpi: as asked, except that a node without an MPI compiler builds Gloo only."""
    if requested == "auto" and not shutil.which("mpicxx"):
        return "none"
    return requested


def junit_counts(xml_text: str) -> dict:
    """passed/failed/skipped from pytest's --junitxml report."""
    root = ElementTree.fromstring(xml_text)
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    return {"passed": total["tests"] - total["failures"] - total["errors"] - total["skipped"],
            "failed": total["failures"] + total["errors"], "skipped": total["skipped"]}


def tests_step(counts: dict) -> Step:
    """On a GPU machine a skipped gpu test is a failure: nothing else runs it."""
    detail = f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
    return Step("tests", counts["failed"] == 0 and counts["skipped"] == 0 and counts["passed"] > 0, detail)


def bench_step(output: str) -> Step:
    """The ratios of the benchmark's bench.compare record."""
    records = selftest.parse_records(output, "bench.compare")
    if not records:
        return Step("bench", False, "no bench.compare record in its output")
    record = records[-1]
    ratios = ", ".join(f"{name} {value:.3f}" for name, value in sorted(record["ratios"].items()))
    return Step("bench", True, f"hvdkit {record['total_img_sec']['hvdkit']:.1f} img/s at np={record['np']}; {ratios}")


def zero_step(output: str) -> Step:
    """The sharded optimizer's bench on the GPU: its peaks must be the CUDA allocator's."""
    records = selftest.parse_records(output, "bench.zero.compare")
    if not records:
        return Step("zero", False, "no bench.zero.compare record in its output")
    table = records[-1]["table"]
    peaks = ", ".join(f"{impl} {row['peak'] / 2**20:.0f} MB" for impl, row in table.items())
    unit = records[-1]["peak_unit"]
    return Step("zero", unit == "cuda_allocated", f"peak ({unit}) {peaks}")


def summary(device: str, steps: Sequence[Step]) -> list[str]:
    lines = [f"gpu-check summary ({device})"]
    lines += [f"  {step.name:<6} {'ok' if step.ok else 'FAILED':<6} {step.detail}" for step in steps]
    lines.append("gpu-check: " + ("PASS" if steps and all(step.ok for step in steps) else "FAIL"))
    return lines


def _run(cmd: Sequence[str]) -> tuple[int, str]:
    """Run ``cmd`` in the clone with its output shown as it comes, and kept for reading."""
    print(f"gpu-check: $ {' '.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, cwd=REPO)
    kept = []
    for line in proc.stdout:
        sys.stdout.write(line)
        kept.append(line)
    return proc.wait(), "".join(kept)


def build_step(args: argparse.Namespace) -> Step:
    cmd = [sys.executable, "-m", "hvdkit.build", "--mpi", mpi_for_build(args.mpi)]
    if args.sdist:
        cmd += ["--sdist", str(args.sdist)]
    if args.find_links:
        cmd += ["--find-links", str(args.find_links)]
    code, output = _run(cmd) if args.build else (0, "")
    probe = subprocess.run([sys.executable, "-c", "import horovod, horovod.torch as h; print(horovod.__version__, "
                            "int(bool(h.nccl_built())), int(h.gloo_built()), int(h.mpi_built()))"],
                           capture_output=True, text=True)
    if code != 0:
        return Step("build", False, "hvdkit.build failed: " + (output.strip().splitlines() or ["?"])[-1])
    if probe.returncode != 0:
        tail = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return Step("build", False, f"horovod.torch does not import: {tail}")
    version, nccl, gloo, mpi = probe.stdout.split()
    gpu_line = next((line for line in output.splitlines() if "GPU operations:" in line), "")
    controllers = "+".join(name for name, on in (("MPI", mpi), ("Gloo", gloo)) if on == "1")
    if nccl != "1":
        return Step("build", False, f"Horovod {version} has no NCCL ({gpu_line.strip() or 'see the build output'})")
    return Step("build", True, f"Horovod {version} with NCCL, {controllers}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hvdkit.checks.gpucheck", description=__doc__.splitlines()[0])
    parser.add_argument("--sdist", type=Path, help="build Horovod from this local source distribution (offline)")
    parser.add_argument("--find-links", type=Path, metavar="DIR", help="take Horovod's wheel or sdist from DIR")
    parser.add_argument("--mpi", choices=MPI_CHOICES, default="auto",
                        help="passed to the builder; auto on a node without mpicxx builds Gloo only (none)")
    parser.add_argument("--no-build", dest="build", action="store_false", help="check the installed Horovod as it is")
    args = parser.parse_args(argv)
    problem = no_gpu_problem()
    if problem:
        print(f"gpu-check: {problem}", file=sys.stderr)
        return job.BAD_INPUT
    if not TESTS.is_dir():
        print(f"gpu-check: the tests are not installed ({TESTS} is missing): run it from a clone of hvdkit",
              file=sys.stderr)
        return job.BAD_INPUT
    import torch

    device = (f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, torch {torch.__version__}, "
              f"CUDA {torch.version.cuda}")
    steps = [build_step(args)]
    if steps[0].ok:
        with tempfile.TemporaryDirectory(prefix="hvdkit-gpucheck-") as tmp:
            report = Path(tmp) / "junit.xml"
            # Only the modules with gpu tests: the others may import what a GPU node lacks (jsonschema).
            modules = [str(path) for path in sorted(TESTS.glob("test_*.py")) if "mark.gpu" in path.read_text()]
            _run([sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-rA",
                  f"--junitxml={report}", *modules])
            steps.append(tests_step(junit_counts(report.read_text())) if report.exists()
                         else Step("tests", False, "pytest wrote no report"))
        for name, args, read in (("bench", BENCH, bench_step), ("zero", ZERO, zero_step)):
            code, output = _run([sys.executable, "-m", "hvdkit", "bench", *args])
            steps.append(read(output) if code == 0 else Step(name, False, f"exit {code}: "
                                                             + (output.strip().splitlines() or ["?"])[-1]))
    print("\n".join(summary(device, steps)), flush=True)
    return 0 if all(step.ok for step in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
