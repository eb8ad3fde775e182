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
                str(REPO / "tests" / "checks" / "test_gpu.py")], cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:]
    counts = gpucheck.junit_counts(report.read_text())
    gpu_tests = (REPO / "tests" / "checks" / "test_gpu.py").read_text().count("\ndef test_")
    assert counts == {"passed": 0, "failed": 0, "skipped": gpu_tests} and gpu_tests >= 4
    assert not gpucheck.tests_step(counts).ok
    assert gpucheck.tests_step({"passed": 3, "failed": 0, "skipped": 0}).ok


def test_reads_the_benchmark_ratios_against_their_goals_and_prints_one_verdict():
    def record(rounds):
        return json.dumps({"event": "bench.compare", "np": 1,
                           "total_img_sec": {"hvdkit": 1510.0, "horovod": 1500.0, "ddp": 1400.0},
                           "round_ratios": {"hvdkit/horovod": rounds, "hvdkit/ddp": [1.07, 1.08, 1.09]}})

    step = gpucheck.bench_step("fp32", "== hvdkit: np=1\n" + record([0.99, 1.02, 1.01]) + "\n")
    assert step.ok and step.detail == ("img/s hvdkit 1510.0, horovod 1500.0, ddp 1400.0; fp32 hvdkit/horovod 1.010 "
                                       "(goal >= 1.0), fp32 hvdkit/ddp 1.080"), step.detail
    missed = gpucheck.bench_step("amp", record([0.97, 1.02, 0.98]))
    assert not missed.ok and "amp hvdkit/horovod 0.980 (goal >= 1.0: MISSED)" in missed.detail, missed.detail
    assert not gpucheck.bench_step("fp32", "Traceback ...\n").ok
    lines = gpucheck.summary("H100", [gpucheck.Step("build", True, "Horovod 0.28.1 with NCCL, Gloo"), step])
    assert lines[0] == "gpu-check summary (H100)" and lines[-1] == "gpu-check: PASS"
    assert gpucheck.summary("H100", [gpucheck.Step("build", False, "no NCCL")])[-1] == "gpu-check: FAIL"


def test_the_sharded_bench_passes_only_with_the_cuda_allocators_peaks_and_stage_1_at_its_goals():
    def record(unit, versus_torch=1.05):
        table = {impl: {"peak": mb * 2**20, "samples_per_sec": rate}
                 for impl, mb, rate in (("zero1", 700, 190.0), ("zero2", 650, 180.0), ("horovod", 720, 200.0))}
        ratios = {"zero1/torch-zero": versus_torch, "zero1/horovod": 0.95}
        return "== zero1\n" + json.dumps({"event": "bench.zero.compare", "peak_unit": unit, "table": table,
                                          "ratios": ratios}) + "\n"

    step = gpucheck.zero_step(record("cuda_allocated"))
    assert step.ok and step.detail == ("samples/s zero1 190.0, zero2 180.0, horovod 200.0; zero1/torch-zero 1.050 "
                                       "(goal >= 1.0), zero1/horovod 0.950 (goal >= 0.9); peak (cuda_allocated) "
                                       "zero1 700 MB, zero2 650 MB, horovod 720 MB"), step.detail
    assert not gpucheck.zero_step(record("rss")).ok, "resident memory on a GPU machine: the bench missed the GPU"
    assert not gpucheck.zero_step(record("cuda_allocated", versus_torch=0.8)).ok
    assert not gpucheck.zero_step("Traceback ...\n").ok


def test_the_audit_passes_only_without_reads_or_cuda_syncs():
    def output(reads, syncs):
        steps = [{"reads": reads, "waits": 1, "cuda_syncs": syncs}] * 3
        return "[0]<stdout>:" + json.dumps({"event": "sync.audit", "shape": "session", "steps": steps}) + "\n"

    step = gpucheck.audit_step({"session": output({}, 0), "amp": output({}, 0)})
    assert step.ok and step.detail == ("per steady step: session 0 reads, 0 CUDA syncs, 1 Horovod waits; "
                                       "amp 0 reads, 0 CUDA syncs, 1 Horovod waits")
    assert not gpucheck.audit_step({"session": output({"Tensor.item at x.py:1": 1}, 0)}).ok
    assert not gpucheck.audit_step({"session": output({}, 2)}).ok
    assert not gpucheck.audit_step({"session": "Traceback"}).ok


def test_a_node_without_mpicxx_builds_gloo_only(monkeypatch):
    assert gpucheck.mpi_for_build("auto") == "auto", "this machine has Open MPI's mpicxx (make setup)"
    monkeypatch.setenv("PATH", "/nonexistent")
    assert gpucheck.mpi_for_build("auto") == "none"
    assert gpucheck.mpi_for_build("openmpi") == "openmpi"
