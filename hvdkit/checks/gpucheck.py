"""`make gpu-check`: what the CPU-only suite cannot show, on any CUDA machine, in one command.

It builds (or finds) Horovod with NCCL for this torch, runs the tests marked ``gpu`` (NCCL
collectives, fp16 autocast with GradScaler, pinned memory, the end-of-epoch lockstep), audits a
steady step for host syncs, runs the synthetic benchmark beside Horovod's own loop (fp32 with DDP
and the profile, AMP, then each GPU default turned off) and the sharded optimizer's bench, then
prints one summary, with the ratios against their goals, whose last line is PASS or FAIL.
Offline nodes pass ``--sdist`` or ``--find-links`` on to the builder.

    python -m hvdkit.checks.gpucheck [--sdist horovod-0.28.1.tar.gz] [--no-build]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Optional, Sequence

from hvdkit import job
from hvdkit.build.builder import MPI_CHOICES
from hvdkit.checks import selftest

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
ITERS = ["--num-iters", "5"]  # 50 timed steps a run: resnet50 takes ~20 ms a step on an H100
FP32 = ["synthetic", "-np", "1", "--compare", "horovod,ddp", "--repeats", "3", "--profile", *ITERS]
AMP = ["synthetic", "-np", "1", "--amp", "--compare", "horovod", "--repeats", "3", *ITERS]
# What each GPU default adds: hvdkit with one of them turned off (TF32: turned on), one round.
DEFAULTS = ["synthetic", "-np", "1", *ITERS,
            "--knob", "HOROVOD_ENABLE_ASYNC_COMPLETION=0", "--knob", "HVDKIT_FUSED_OPTIMIZER=false",
            "--knob", "HVDKIT_CHANNELS_LAST=false", "--knob", "HVDKIT_CUDNN_BENCHMARK=false",
            "--knob", "HVDKIT_TF32=true"]
ZERO = ["zero", "-np", "1", "--repeats", "1"]  # one GPU: the CUDA allocator's peaks, nothing to shard
AUDITED = ("session", "amp", "zero1")  # tests/programs/sync_audit_script.py's shapes
# The goals (issue 49): hvdkit / Horovod's loop, median of the rounds' ratios, fp32 and AMP; ZeRO stage 1's throughput.
GOALS = {"fp32 hvdkit/horovod": 1.0, "amp hvdkit/horovod": 1.0, "zero1/torch-zero": 1.0, "zero1/horovod": 0.9}


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


def round_ratio(record: dict, peer: str) -> float:
    """hvdkit / ``peer``: the median of the rounds' ratios (each round ran both, minutes apart at most)."""
    return statistics.median(record["round_ratios"][f"hvdkit/{peer}"])


def goal_text(name: str, value: float) -> tuple[bool, str]:
    goal = GOALS.get(name)
    met = goal is None or value >= goal
    return met, f"{name} {value:.3f}" + ("" if goal is None else f" (goal >= {goal}{'' if met else ': MISSED'})")


def bench_step(name: str, output: str) -> Step:
    """The img/s and the ratios of a bench.compare record, against their goals."""
    records = selftest.parse_records(output, "bench.compare")
    if not records:
        return Step(name, False, "no bench.compare record in its output")
    record = records[-1]
    totals = ", ".join(f"{label} {value:.1f}" for label, value in record["total_img_sec"].items())
    parts, ok = [], True
    for label in record["total_img_sec"]:
        if label == "hvdkit":
            continue
        met, text = goal_text(f"{name} hvdkit/{label}", round_ratio(record, label))
        ok, _ = ok and met, parts.append(text)
    return Step(name, ok, f"img/s {totals}; " + ", ".join(parts))


def audit_step(outputs: dict) -> Step:
    """Blocking reads (hvdkit.checks.syncaudit) and CUDA's synchronizing calls per steady step."""
    found, ok = [], True
    for shape, output in outputs.items():
        records = selftest.parse_records(output, "sync.audit")
        if not records:
            return Step("audit", False, f"{shape}: no result")
        steps = records[-1]["steps"]
        reads = sum(sum(step["reads"].values()) for step in steps) / len(steps)
        syncs = sum(step["cuda_syncs"] for step in steps) / len(steps)
        waits = statistics.median(step["waits"] for step in steps)
        ok = ok and reads == 0 and syncs == 0
        found.append(f"{shape} {reads:g} reads, {syncs:g} CUDA syncs, {waits:g} Horovod waits")
    return Step("audit", ok, "per steady step: " + "; ".join(found))


def zero_step(output: str) -> Step:
    """The sharded optimizer's bench on the GPU: its peaks must be the CUDA allocator's."""
    records = selftest.parse_records(output, "bench.zero.compare")
    if not records:
        return Step("zero", False, "no bench.zero.compare record in its output")
    table = records[-1]["table"]
    peaks = ", ".join(f"{impl} {row['peak'] / 2**20:.0f} MB" for impl, row in table.items())
    rates = ", ".join(f"{impl} {row['samples_per_sec']:.1f}" for impl, row in table.items())
    unit = records[-1]["peak_unit"]
    goals = [goal_text(name, records[-1]["ratios"][name]) for name in ("zero1/torch-zero", "zero1/horovod")]
    ok = unit == "cuda_allocated" and all(met for met, _ in goals)
    return Step("zero", ok, f"samples/s {rates}; {', '.join(text for _, text in goals)}; peak ({unit}) {peaks}")


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
    parser.add_argument("--skip", default="", help="comma-separated steps not to run: audit, fp32, amp, zero, defaults "
                                                   "(a machine lent for minutes)")
    parser.add_argument("--out", default="runs/gpu-check", help="where the benchmarks' profiles and figures go "
                                                                "(default runs/gpu-check)")
    args = parser.parse_args(argv)
    args.skip = set(filter(None, args.skip.split(",")))
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
            modules = [str(path) for path in sorted(TESTS.rglob("test_*.py")) if "mark.gpu" in path.read_text()]
            _run([sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-rA",
                  f"--junitxml={report}", *modules])
            steps.append(tests_step(junit_counts(report.read_text())) if report.exists()
                         else Step("tests", False, "pytest wrote no report"))
        audits = {}
        for shape in AUDITED if "audit" not in args.skip else ():
            code, audits[shape] = _run([sys.executable, "-m", "hvdkit", "launch", "-np", "1", "--launcher",
                                        "horovodrun", "--gloo", "--", sys.executable,
                                        str(TESTS / "programs" / "sync_audit_script.py"), shape, "2"])
        if audits:
            steps.append(audit_step(audits))
        out = Path(args.out)
        for name, bench, read in (("fp32", [*FP32, "--out", str(out / "fp32")], partial(bench_step, "fp32")),
                                  ("amp", AMP, partial(bench_step, "amp")),
                                  ("zero", [*ZERO, "--out", str(out / "zero")], zero_step),
                                  ("defaults", DEFAULTS, partial(bench_step, "defaults"))):
            if name in args.skip:
                continue
            code, output = _run([sys.executable, "-m", "hvdkit", "bench", *bench])
            if code != 0:
                steps.append(Step(name, False, f"exit {code}: " + (output.strip().splitlines() or ["?"])[-1]))
            else:
                steps.append(read(output))
            print(f"gpu-check: {summary(device, steps[-1:])[1].strip()}", flush=True)  # as it comes, if cut short
    print("\n".join(summary(device, steps)), flush=True)
    return job.OK if all(step.ok for step in steps) else job.FAILED


if __name__ == "__main__":
    sys.exit(main())
