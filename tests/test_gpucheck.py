"""`make gpu-check` where there is no GPU, and how it reads what it runs.

The GPU half (the build with NCCL, the tests marked gpu, the benchmark) needs a CUDA device and
runs only there; here: its refusal, and its readers fed by real pytest output.
"""

import json
import sys

import pytest

from conftest import REPO, run
from hvdkit.checks import gpucheck


def test_without_a_gpu_it_says_why_in_one_line_and_fails():
    proc = run([sys.executable, "-m", "hvdkit.checks.gpucheck"], cwd=REPO)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("gpu-check: torch ") and ("sees no CUDA device" in proc.stderr
                                                            or "CPU-only build" in proc.stderr)


@pytest.mark.slow
def test_make_gpu_check_is_the_same_command():
    proc = run(["make", "--no-print-directory", "gpu-check"], cwd=REPO, timeout=600)
    assert proc.returncode != 0
    assert "-m hvdkit.checks.gpucheck" in proc.stdout and "gpu-check: torch " in proc.stderr, proc.stderr[-2000:]
    assert "is up to date" not in proc.stdout + proc.stderr, "the package check's sub-make runs silent"


def test_reads_pytest_report_and_counts_skips_on_a_gpu_machine_as_failures(tmp_path):
    """The report of a real pytest run of the gpu tests: on this machine, all skipped."""
    report = tmp_path / "junit.xml"
    proc = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                str(REPO / "tests" / "test_gpu.py")], cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:]
    counts = gpucheck.junit_counts(report.read_text())
    assert counts == {"passed": 0, "failed": 0, "skipped": 3}
    assert not gpucheck.tests_step(counts).ok
    assert gpucheck.tests_step({"passed": 3, "failed": 0, "skipped": 0}).ok


def test_reads_the_benchmark_ratios_and_prints_one_verdict():
    record = {"event": "bench.compare", "np": 1, "total_img_sec": {"hvdkit": 1510.0, "horovod": 1500.0, "ddp": 1400.0},
              "ratios": {"hvdkit/horovod": 1.0067, "hvdkit/ddp": 1.0786}}
    step = gpucheck.bench_step("== hvdkit: np=1\n" + json.dumps(record) + "\n")
    assert step.ok and step.detail == "hvdkit 1510.0 img/s at np=1; hvdkit/ddp 1.079, hvdkit/horovod 1.007"
    assert not gpucheck.bench_step("Traceback ...\n").ok
    lines = gpucheck.summary("H100", [gpucheck.Step("build", True, "Horovod 0.28.1 with NCCL, Gloo"), step])
    assert lines[0] == "gpu-check summary (H100)" and lines[-1] == "gpu-check: PASS"
    assert gpucheck.summary("H100", [gpucheck.Step("build", False, "no NCCL")])[-1] == "gpu-check: FAIL"


def test_the_sharded_bench_passes_only_with_the_cuda_allocators_peaks():
    def record(unit):
        table = {impl: {"peak": mb * 2**20} for impl, mb in (("zero1", 700), ("zero2", 650), ("horovod", 720))}
        return "== zero1\n" + json.dumps({"event": "bench.zero.compare", "peak_unit": unit, "table": table}) + "\n"

    step = gpucheck.zero_step(record("cuda_allocated"))
    assert step.ok and step.detail == "peak (cuda_allocated) zero1 700 MB, zero2 650 MB, horovod 720 MB"
    assert not gpucheck.zero_step(record("rss")).ok, "resident memory on a GPU machine: the bench missed the GPU"
    assert not gpucheck.zero_step("Traceback ...\n").ok


def test_a_node_without_mpicxx_builds_gloo_only(monkeypatch):
    assert gpucheck.mpi_for_build("auto") == "auto", "this machine has Open MPI's mpicxx (make setup)"
    monkeypatch.setenv("PATH", "/nonexistent")
    assert gpucheck.mpi_for_build("auto") == "none"
    assert gpucheck.mpi_for_build("openmpi") == "openmpi"
