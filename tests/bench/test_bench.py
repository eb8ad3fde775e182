"""The benchmarks compute their figures right; real launches on tiny sizes, no timing asserted.

The figure functions are checked on hand-made inputs; the commands are run for real
(mpirun, horovodrun, torch.distributed over Gloo) at sizes that take seconds, and their
records checked for consistency with those functions: totals summed across ranks,
busbw from algbw, efficiency from the totals, and every file they promise written.
"""

import csv
import json
import math
import os
import re
import socket
import sys
from pathlib import Path

import pytest

from conftest import run
from hvdkit.bench import estimate, figures
from hvdkit.checks.selftest import parse_records
from hvdkit.launch.planner import local_command
from hvdkit.launch.rank_output import TAG

HVDKIT = [sys.executable, "-m", "hvdkit.cli", "bench"]
TINY = ["--model", "cnn", "--batch-size", "4", "--image-size", "32", "--num-classes", "10",
        "--num-warmup-batches", "1", "--num-batches-per-iter", "2", "--num-iters", "3"]


# ---------------------------------------------------------------------------
# Figures.
# ---------------------------------------------------------------------------

def test_sizes():
    assert figures.parse_size("4K") == 4096 and figures.parse_size("256M") == 256 << 20
    assert figures.parse_size("1G") == 1 << 30 and figures.parse_size("4096") == 4096
    assert figures.parse_size("8KiB") == 8192
    assert figures.size_range("4K..64K") == [4096, 8192, 16384, 32768, 65536]
    assert len(figures.size_range("4K..256M")) == 17
    assert figures.size_range("4K,1M") == [4096, 1 << 20]
    assert [figures.format_size(s) for s in (4096, 1 << 20, 1 << 30, 100)] == ["4K", "1M", "1G", "100"]


@pytest.mark.parametrize("bad", ["4X", "", "2", "6", "1.5M", "-4K"])
def test_bad_size(bad):
    with pytest.raises(figures.BenchError, match="size"):
        figures.parse_size(bad)


def test_bad_range():
    with pytest.raises(figures.BenchError, match="smaller than the first"):
        figures.size_range("1M..4K")


def test_bandwidths():
    assert figures.algbw(10**9, 1.0) == 1.0
    assert figures.algbw(64 << 20, 0.01) == pytest.approx((64 << 20) / 0.01 / 1e9)
    # busbw = algbw x 2(n-1)/n: equal at 2 ranks, 1.5x at 4, 1.75x at 8, nothing moves at 1
    assert figures.busbw(2.0, 2) == 2.0
    assert figures.busbw(2.0, 4) == 3.0
    assert figures.busbw(2.0, 8) == 3.5
    assert figures.busbw(2.0, 1) == 0.0


def test_rate_stats_match_horovods():
    rates = [10.0, 12.0, 14.0]
    mean, conf = figures.rate_stats(rates)
    assert mean == 12.0
    assert conf == pytest.approx(1.96 * math.sqrt(8 / 3))  # numpy's std: population
    assert figures.rate_stats([5.0]) == (5.0, 0.0)


def test_total_is_summed_across_ranks():
    result = figures.cross_rank_total([[10.0, 1.0], [30.0, 3.0]])
    assert result["total_img_sec"] == 40.0  # rank 0's 10 x 2 would say 20
    assert result["img_sec_per_device"] == 20.0
    assert result["total_img_sec_conf"] == 4.0
    assert result["rank_img_sec"] == [10.0, 30.0]


def test_scaling_table():
    rows = figures.scaling_table({2: 150.0, 1: 100.0, 4: 200.0})
    assert [r["np"] for r in rows] == [1, 2, 4]
    assert [r["speedup"] for r in rows] == [1.0, 1.5, 2.0]
    assert [r["efficiency"] for r in rows] == [1.0, 0.75, 0.5]
    # without np=1, the smallest size run is the base
    rows = figures.scaling_table({2: 100.0, 4: 150.0})
    assert rows[1]["efficiency"] == pytest.approx(0.75)


def test_ratio_summary():
    def cell(busbw):
        return {"time_us": 1.0, "algbw": busbw, "busbw": busbw}
    record = {"implementations": list(figures.ALLREDUCE_IMPLS), "rows": [
        {"bytes": 4096, **{n: cell(b) for n, b in zip(figures.ALLREDUCE_IMPLS, (8.0, 0.5, 1.0, 0.9), strict=True)}},
        {"bytes": 16 << 20, **{n: cell(b) for n, b in zip(figures.ALLREDUCE_IMPLS, (2.0, 1.0, 1.8, 0.9), strict=True)}},
        {"bytes": 64 << 20, **{n: cell(b) for n, b in zip(figures.ALLREDUCE_IMPLS, (2.0, 1.0, 1.6, 0.9), strict=True)}},
    ]}
    summary = figures.ratio_summary(record)
    # the 4K row is below 16 MiB: it counts against torch.distributed only
    assert summary["ratios"] == {"in-place/mpi4py min >=16M": 0.8, "in-place/torch min": 1.6}


def test_ring_allreduce_cost_model():
    """By hand: 2 ranks move 2(2-1)/2 x 125 MB = 125 MB = 1e9 bits at 1 Gbit/s in 1 s, plus
    2(2-1) hops of 25 us; 4 ranks move 1.5 x 125 MB; one rank moves nothing."""
    assert estimate.ring_allreduce_seconds(125e6, 2, 1.0, 25e-6) == pytest.approx(1.0 + 50e-6)
    assert estimate.ring_allreduce_seconds(125e6, 4, 1.0, 0.0) == pytest.approx(1.5)
    assert estimate.ring_allreduce_seconds(125e6, 1, 1.0, 25e-6) == 0.0
    row = estimate.estimate(compute_ms=500.0, gradient_bytes=125e6, batch_size=10, ranks=2, gbit=1.0, latency_us=0)
    assert row.allreduce_ms == pytest.approx(1000.0)
    assert (row.step_ms_no_overlap, row.step_ms_overlap) == pytest.approx((1500.0, 1000.0))
    assert (row.img_sec_no_overlap, row.img_sec_overlap) == pytest.approx((20 / 1.5, 20.0))
    assert (row.efficiency_no_overlap, row.efficiency_overlap) == pytest.approx((1 / 3, 0.5))


def test_estimate_prints_each_link_and_world_size():
    proc = run(HVDKIT + ["estimate", "--compute-ms", "500", "--gradient-bytes", "250000000", "--batch-size", "10",
                         "--fp16-allreduce", "--gbit", "1,10", "-np", "2,4", "--latency-us", "0"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "ring allreduce of 119.2 MiB per step" in proc.stdout  # fp16: half of 250 MB
    [record] = parse_records(proc.stdout, "bench.estimate")
    assert [(r["gbit"], r["np"]) for r in record["rows"]] == [(1, 2), (1, 4), (10, 2), (10, 4)]
    assert record["rows"][0]["allreduce_ms"] == pytest.approx(1000.0)
    assert re.search(r"^\s+2\s+1000\.0\s+1500\.0 \.\. 1000\.0\s+13 \.\. 20\s+33% \.\. 50%", proc.stdout, re.M)


@pytest.mark.parametrize("argv, message", [
    (["estimate", "--compute-ms", "x", "--gradient-bytes", "1", "--batch-size", "1"], "expected a number >= 0"),
    (["estimate", "--compute-ms", "1", "--gradient-bytes", "1", "--batch-size", "1", "--gbit", "0"],
     "link speeds must be > 0"),
    (["estimate", "--compute-ms", "1", "--batch-size", "1"], "--gradient-bytes"),
    (["allreduce", "--sizes", "4X"], "size '4X'"),
    (["allreduce", "--sizes", "1M..4K"], "smaller than the first"),
    (["scaling", "--np", "0"], "world sizes must be >= 1"),
    (["scaling", "--np", "one"], "expected a list like 1,2,4"),
    (["synthetic", "--compare", "torchrun"], "unknown implementation 'torchrun'"),
    (["synthetic", "--batch-size", "0"], "expected a whole number >= 1"),
    (["synthetic", "--knob", "HOROVOD_CYCLE_TIME"], "expected NAME=VALUE"),
    (["tp-ops", "-np", "2", "--seq-len", "7"], "tp-ops: --seq-len 7 and --width 512 must each split over the 2 ranks"),
    (["pp-transport", "--seq-lens", "128,0"], "expected whole numbers >= 1, got '128,0'"),
    (["pp", "--schedules", "gpipe,zb"], "unknown schedule 'zb'; choose from gpipe, 1f1b"),
    (["zero", "--impls", "tp", "--model", "cnn"], "zero: tensor parallelism (tp, tp-sp, torch-tp) splits the GPT"),
    (["zero", "--max-model"], "needs --memory-cap SIZE"),
    (["zero", "--memory-cap", "2G"], "--memory-cap goes with --max-model"),
    (["zero", "--max-model", "--memory-cap", "2G", "--model", "resnet50"], "grows a GPT"),
    (["zero", "--max-model", "--memory-cap", "2X"], "size '2X'"),
    (["zero", "--impls", "zero3,fsdp"],
     "expected some of zero1,zero2,zero3,horovod,torch-zero,fsdp2,tp,tp-sp,torch-tp, got 'zero3,fsdp'"),
    (["checkpoint", "--params", "0"], "expected a count like 175M"),
    (["checkpoint", "--params", "1.5T"], "expected a count like 175M"),
    (["checkpoint", "--arms", "async,disk"], "unknown arm 'disk'; choose from sync, async, sharded, snapshot"),
    (["goodput", "--arms", "ddp"], "unknown arm 'ddp'; choose from restarts, disk, torchrun"),
])
def test_bad_input_is_one_line(argv, message):
    proc = run(HVDKIT + argv, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert message in proc.stderr


@pytest.mark.parametrize("threshold", [-1, 0, 5, 17, 39])
@pytest.mark.parametrize("first", [-3, 0, 9, 25, 39, 60])
def test_the_max_model_search_finds_the_last_size_that_fits_wherever_it_starts(threshold, first):
    probed = []

    def fits(index):
        probed.append(index)
        return index <= threshold

    assert figures.largest(fits, 40, first) == threshold
    assert len(probed) == len(set(probed)) <= 12 and all(0 <= i < 40 for i in probed)


def test_the_max_model_ladder_grows_by_steps_up_to_what_stage_3_could_fit():
    rungs = figures.ladder(3 * 2**30, 3, 32)
    counts = [count for count, _, _ in rungs]
    assert all(b >= a * figures.LADDER_STEP for a, b in zip(counts, counts[1:], strict=False))
    assert counts[-1] <= 3 * 2**30 / (16 / 3) and counts[-1] > 0.9 * 3 * 2**30 / (16 / 3)  # stage 3's 16/N
    assert {width for _, width, _ in rungs} == set(figures.LADDER_WIDTHS)


@pytest.mark.slow
def test_max_model_under_a_cap_no_model_fits_ends_the_run_at_once_in_one_line(tmp_path, hvd_built):
    """The rank that passes the cap ends its launch (its watch thread), so the search moves on
    without training the model; here not even the smallest GPT fits in 300 MB."""
    proc = run(HVDKIT + ["zero", "--max-model", "--memory-cap", "300M", "--out", str(tmp_path)], timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "zero1: 3.4M parameters (width 512 x 1 layers): over the cap" in proc.stdout
    assert proc.stderr.strip().splitlines() == [
        "hvdkit bench: zero1: not even the smallest GPT (3.4M parameters) trains under 300 MB per rank"]
    assert not list(tmp_path.iterdir())


def test_drivers_refuse_to_run_under_a_launcher():
    """Open MPI's rank variables set on a plain process stand in for a launch here: the
    refusal happens before anything would use them."""
    for argv in (["allreduce", "-np", "2"], ["scaling", "--np", "1,2"], ["synthetic", "--compare", "ddp"],
                 ["checkpoint"]):
        proc = run(HVDKIT + argv, timeout=60, env={**__import__("os").environ, "OMPI_COMM_WORLD_RANK": "0",
                                                   "OMPI_COMM_WORLD_SIZE": "2"})
        assert proc.returncode == 2 and "without a launcher" in proc.stderr, proc.stderr


@pytest.mark.parametrize("hosts, environ, expected", [
    (None, {}, "127.0.0.1"),
    ("h1:1,h2:1", {}, "h1"),
    (None, {"HVDKIT_HOSTS": "node0:1,node1:1"}, "node0"),  # inside `hvdkit rehearse`
    (None, {"SLURM_JOB_NODELIST": "cn[07-08]", "SLURM_TASKS_PER_NODE": "1(x2)"}, "cn07"),
    (None, {"SLURM_JOB_NODELIST": "cn[07-08]", "SLURM_TASKS_PER_NODE": "1(x2)", "HVDKIT_HOSTS": "node0:1"}, "cn07"),
])
def test_torch_distributed_meets_on_rank_0s_host_wherever_the_hosts_are_listed(monkeypatch, hosts, environ,
                                                                                 expected):
    """The DDP leg's MASTER_ADDR is the first host of the launch; 127.0.0.1 on a host of a
    rehearsal left rank 1 waiting on its own loopback until --timeout."""
    from hvdkit.bench import drivers

    for name in ("HVDKIT_HOSTS", "SLURM_JOB_NODELIST", "SLURM_TASKS_PER_NODE", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    args = drivers.argparse.Namespace(hosts=hosts, launcher="auto", controller=None)
    command = drivers.launch_command(args, 2, ["synthetic"])
    assert f"MASTER_ADDR={expected}" in command


def test_a_bad_host_list_is_one_line():
    proc = run(HVDKIT + ["synthetic", "-np", "2", "-H", "h1:x", "--compare", "ddp"], timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "slot count 'x'" in proc.stderr, proc.stderr
    assert proc.stdout == "", "nothing started"


# ---------------------------------------------------------------------------
# Real launches.
# ---------------------------------------------------------------------------

@pytest.mark.slow
def test_synthetic_under_horovodrun_prints_horovods_output(hvd_built):
    """`horovodrun -np 2 hvdkit bench synthetic`, as users run Horovod's benchmark script."""
    proc = run(local_command("horovodrun --gloo", 2, HVDKIT + ["synthetic", *TINY]), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert re.search(r"Number of CPUs: 2", proc.stdout)
    assert len(re.findall(r"Iter #\d: [\d.]+ img/sec per CPU", proc.stdout)) == 3  # rank 0 only
    per = re.search(r"Img/sec per CPU: ([\d.]+) \+-([\d.]+)", proc.stdout)
    total = re.search(r"Total img/sec on 2 CPU\(s\): ([\d.]+) \+-([\d.]+)", proc.stdout)
    assert per and total, proc.stdout[-2000:]
    [record] = parse_records(proc.stdout, "bench.synthetic")
    assert record["impl"] == "hvdkit" and record["world_size"] == 2
    assert record["environment"]["controller"] == "gloo"
    rates = record["rank_img_sec"]
    assert len(rates) == 2 and all(r > 0 for r in rates)
    assert record["total_img_sec"] == pytest.approx(sum(rates))
    assert float(total.group(1)) == pytest.approx(sum(rates), abs=0.05)
    assert float(per.group(1)) == pytest.approx(sum(rates) / 2, abs=0.05)
    # each rank's compute and wait per step (hvdkit.rank.agree.stragglers), printed and in the record
    host = socket.gethostname()
    assert [(row["rank"], row["host"]) for row in record["per_rank"]] == [(0, host), (1, host)]
    assert all(row["compute_ms"] > 0 and row["wait_ms"] >= 0 for row in record["per_rank"])
    assert len(re.findall(rf"^Rank [01] on {host}: compute [\d.]+ ms, waiting for the gradients [\d.]+ ms per step$",
                          proc.stdout, re.M)) == 2


@pytest.mark.slow
def test_compare_runs_each_implementation_and_reports_ratios(hvd_built, tmp_path):
    proc = run(HVDKIT + ["synthetic", "-np", "2", "--compare", "own-loop,horovod,ddp", "--knob", "HOROVOD_CYCLE_TIME=1",
                         "--counters", "--out", str(tmp_path), *TINY], timeout=600, raw=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert not TAG.search(proc.stdout.encode()), "rank 0's lines are echoed as one process's, untagged"
    labels = ("hvdkit", "own-loop", "horovod", "ddp", "hvdkit HOROVOD_CYCLE_TIME=1")
    for label in labels:
        assert f"== {label}: np=2" in proc.stdout
    assert proc.stdout.count("Total img/sec on 2 CPU(s)") == 5
    assert "# environment" in proc.stdout and "torch_threads: 1" in proc.stdout
    [record] = parse_records(proc.stdout, "bench.compare")
    totals = record["total_img_sec"]
    assert set(totals) == set(labels) and all(v > 0 for v in totals.values())
    for label in labels[1:]:
        assert record["ratios"][f"hvdkit/{label}"] == pytest.approx(totals["hvdkit"] / totals[label])
        # one round (no --repeats): the round's ratio is the ratio of the means
        assert record["round_ratios"][f"hvdkit/{label}"] == pytest.approx([totals["hvdkit"] / totals[label]])
    spread = re.search(r"^ddp +[\d.]+ +[\d.]+ +[\d.]+ +([\d.]+)-\1 ", proc.stdout, re.M)
    assert spread, "the table gives the per-round spread, here of one round"
    # CPU per step and rank, all threads and all but the training thread: each within what a step can use
    for label in labels:
        cpu, others = record["cpu_ms_per_step"][label], record["other_threads_cpu_ms_per_step"][label]
        assert 0 < others < cpu, (label, cpu, others)
    # the Trainer's settings are in force and reported; a --knob overrides one of them in its run only
    assert record["knobs"]["hvdkit"]["OMPI_MCA_mpi_yield_when_idle"] == "1"
    assert record["knobs"]["hvdkit"]["HOROVOD_CYCLE_TIME"] == "0.1"
    assert record["knobs"]["own-loop"]["HOROVOD_CYCLE_TIME"] == "0.1", "the Session applies the same settings"
    assert record["knobs"]["hvdkit HOROVOD_CYCLE_TIME=1"]["HOROVOD_CYCLE_TIME"] == "1"
    # what the scaling estimate needs: compute alone (timed, so only > 0) and the cnn's gradients at 32x32, 10 classes
    assert record["compute_ms"] > 0 and record["gradient_bytes"] == 4 * 2_117_962
    assert (f"hvdkit bench estimate --compute-ms {record['compute_ms']:.1f} --gradient-bytes 8471848 "
            "--batch-size 4") in proc.stdout
    # --counters: each duty of the step, timed where it is called, as many steps as were timed (6)
    counted = {arm: json.loads((tmp_path / f"counters-{arm}.json").read_text()) for arm in ("hvdkit", "horovod")}
    assert not (tmp_path / "counters-ddp.json").exists(), "DDP's step is not counted"
    duties = {arm: {row["duty"]: row for row in summary["duties"]} for arm, summary in counted.items()}
    assert counted["hvdkit"]["steps"] == 6 and all(row["us_per_step"] >= 0 for row in duties["hvdkit"].values())
    assert duties["hvdkit"]["lockstep.submit (the meeting's allreduce started)"]["calls_per_step"] == 1.0
    assert duties["hvdkit"]["lockstep.collect (the meeting read)"]["calls_per_step"] == 1.0
    assert duties["hvdkit"]["model.forward()"]["calls_per_step"] == 1.0
    assert duties["hvdkit"]["memory phase (entry and exit)"]["calls_per_step"] == 0.0, "steps 5 to 10: none measured"
    # the cnn's 8 MB of gradients go in buckets, each stepped as it lands: no synchronize of them all
    assert duties["hvdkit"]["a bucket's allreduce started (the 1/size division, enqueue)"]["calls_per_step"] > 1
    assert duties["hvdkit"]["optimizer.synchronize() (wait for the averaged gradients)"]["calls_per_step"] == 0.0
    assert duties["horovod"]["a gradient's allreduce started (enqueue)"]["calls_per_step"] >= 8
    assert "timer_ns" in counted["horovod"] and "µs a step" in (tmp_path / "counters-horovod.txt").read_text()


def _read_allreduce(out):
    rows = list(csv.DictReader((out / "allreduce.csv").open()))
    record = json.loads((out / "allreduce.json").read_text())
    assert (out / "allreduce.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return rows, record


@pytest.mark.slow
def test_allreduce_under_mpirun(tmp_path, hvd_built):
    """Every implementation's result is checked by the worker before it is timed; here, that
    the reported figures follow from the times and the files hold them."""
    out = tmp_path / "ar"
    proc = run(HVDKIT + ["allreduce", "-np", "2", "--sizes", "4K..16K", "--iters", "5", "--out", str(out)],
               timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    rows, record = _read_allreduce(out)
    assert record["implementations"] == list(figures.ALLREDUCE_IMPLS)
    assert record["environment"]["controller"] == "mpi"
    assert len(rows) == 3 * 4
    for row in record["rows"]:
        for name in figures.ALLREDUCE_IMPLS:
            cell = row[name]
            assert cell["algbw"] == pytest.approx(row["bytes"] / (cell["time_us"] * 1e-6) / 1e9)
            assert cell["busbw"] == pytest.approx(cell["algbw"])  # 2(n-1)/n = 1 at n = 2
    assert {r["implementation"] for r in rows} == set(figures.ALLREDUCE_IMPLS)
    assert "horovod in-place / mpi4py" not in proc.stdout  # no size reached 16M
    assert "horovod in-place / torch.distributed busbw, every size: min" in proc.stdout


@pytest.mark.slow
def test_tp_ops_times_each_operator_beside_torchs_functional_collectives(tmp_path, hvd_built):
    """Each operator's result is checked equal to torch's on the same tensors by the worker before
    it is timed; here, that every operator is reported with a ratio per round, and the file holds it."""
    out = tmp_path / "tp"
    proc = run(HVDKIT + ["tp-ops", "-np", "2", "--width", "32", "--seq-len", "8", "--repeats", "2", "--iters", "2",
                         "--out", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    [record] = parse_records(proc.stdout, "bench.tp_ops")
    assert record == json.loads((out / "tp-ops.json").read_text())
    assert [row["op"] for row in record["rows"]] == ["reduce_from_tp", "gather_from_tp", "gather_from_sp",
                                                     "reduce_scatter_to_sp"]
    for row in record["rows"]:
        assert len(row["rounds"]) == 2 and row["ratio"] == pytest.approx(sorted(row["rounds"])[0] / 2
                                                                         + sorted(row["rounds"])[1] / 2)
        assert re.search(rf"^{row['op']}\s+\S+\s+{row['hvdkit_us']:.1f}\s+{row['torch_us']:.1f}", proc.stdout, re.M)


@pytest.mark.slow
def test_pp_transport_times_each_way_beside_torchs_isend_irecv(tmp_path, hvd_built):
    """Each way brings back what it sent, checked by the worker before it is timed; here, that
    every shape is reported with each way's time and a ratio per round, and the file holds it."""
    out = tmp_path / "pp"
    proc = run(HVDKIT + ["pp-transport", "--width", "16", "--seq-lens", "1,8", "--repeats", "2", "--iters", "2",
                         "--out", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    [record] = parse_records(proc.stdout, "bench.pp_transport")
    assert record == json.loads((out / "pp-transport.json").read_text())
    assert [row["shape"] for row in record["rows"]] == [[4, 1, 16], [4, 8, 16]]
    assert record["controller"] == "mpi" and record["skipped"] == {}, record  # mpi4py's needs MPI's world
    for row in record["rows"]:
        assert set(row["us"]) == {"hvdkit", "alltoall", "mpi4py", "torch"} and len(row["rounds"]["mpi4py"]) == 2
        assert re.search(rf"^{'x'.join(map(str, row['shape']))}\s+\d+\s+{row['us']['hvdkit']:.1f}\s+"
                         rf"{row['us']['alltoall']:.1f}\s+{row['us']['mpi4py']:.1f}\s+{row['us']['torch']:.1f}",
                         proc.stdout, re.M)


@pytest.mark.slow
def test_pp_times_hvdkits_pipeline_beside_torchs_pipelining(tmp_path, hvd_built):
    """The worker checks hvdkit's first losses, over MPI's point-to-point (the transport under mpirun)
    and over Horovod's broadcasts, equal to torch's (the same stages, the same weights) before it
    times them; here, every schedule and micro-batch count is reported with both ratios per round
    and each stage's bubble, and each stage holds about half the model's bytes."""
    out = tmp_path / "pp"
    proc = run(HVDKIT + ["pp", "--width", "32", "--layers", "2", "--seq-len", "8", "--batch-size", "8",
                         "--micro-batches", "2,4", "--repeats", "2", "--steps", "1", "--out", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    [record] = parse_records(proc.stdout, "bench.pp")
    assert record == json.loads((out / "pp.json").read_text())
    assert [(row["schedule"], row["micro_batches"]) for row in record["rows"]] == [
        ("gpipe", 2), ("gpipe", 4), ("1f1b", 2), ("1f1b", 4)]
    for row in record["rows"]:
        assert row["transport"] == "mpi" and set(row["seconds"]) == {"hvdkit", "hvdkit-horovod", "torch"}, row
        assert len(row["rounds"]) == 2 and len(row["broadcast_rounds"]) == 2
        assert all(0 < bubble < 1 for bubble in row["bubble"])
        assert row["ideal_bubble"] == pytest.approx(1 / (row["micro_batches"] + 1))
        assert re.search(rf"^{row['schedule']}\s+{row['micro_batches']}\s+{row['seconds']['hvdkit']:.3f}\s+",
                         proc.stdout, re.M)
    assert sum(held["bytes"] for held in record["memory"]) == pytest.approx(record["whole_bytes"], rel=0.01)


@pytest.mark.slow
def test_allreduce_under_gloo_says_why_mpi_is_missing(tmp_path, hvd_built):
    out = tmp_path / "ar"
    proc = run(HVDKIT + ["allreduce", "-np", "2", "--gloo", "--sizes", "4K", "--iters", "3", "--out", str(out)],
               timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "# skipped mpi4py: a Gloo launch (horovodrun --gloo) has no MPI" in proc.stdout
    rows, record = _read_allreduce(out)
    assert record["implementations"] == ["torch.distributed", "horovod in-place", "horovod out-of-place"]
    assert record["environment"]["controller"] == "gloo"


@pytest.mark.slow
def test_scaling_table_and_plot(tmp_path, hvd_built):
    out = tmp_path / "scaling"
    proc = run(HVDKIT + ["scaling", "--np", "1,2", *TINY, "--out", str(out)], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    record = json.loads((out / "scaling.json").read_text())
    one, two = record["rows"]
    assert (one["np"], two["np"]) == (1, 2) and one["efficiency"] == 1.0
    assert two["efficiency"] == pytest.approx(two["total_img_sec"] / (2 * one["total_img_sec"]))
    assert (out / "scaling.png").read_bytes()[:4] == b"\x89PNG"
    assert two["torch_threads"] == 1  # one per core on this 2-core machine; np=1 gets both
    assert re.search(r"^\s+2\s+1\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+%$", proc.stdout, re.M), proc.stdout[-1500:]


@pytest.mark.slow
@pytest.mark.parametrize("model", [["--width", "64", "--layers", "2"], ["--model", "cnn", "--optimizer", "adamw"]],
                         ids=["gpt-adam", "cnn-adamw"])
def test_zero_runs_each_loop_and_reports_the_bytes_each_rank_holds(tmp_path, hvd_built, model):
    out = tmp_path / "zero"
    proc = run(HVDKIT + ["zero", *model, "--steps", "2", "--warmup", "1", "--repeats", "1", "--out", str(out)],
               timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    record = json.loads((out / "zero.json").read_text())
    table = record["table"]
    assert list(table) == ["zero1", "zero2", "zero3", "horovod", "torch-zero", "fsdp2"]
    whole = table["horovod"]
    assert whole["params"] == 4 * record["parameters"] and record["peak_unit"] == "rss"
    # Each rank holds half the optimizer state; torch's partitions whole parameters, so the
    # cnn's one large layer (all but 1% of it) puts nearly all the state on one rank.
    halved = ("zero1", "zero2", "zero3", "torch-zero", "fsdp2") if "--width" in model else ("zero1", "zero2", "zero3")
    for impl in halved:
        assert table[impl]["optimizer_state"] == pytest.approx(whole["optimizer_state"] / 2, rel=0.05)
    for impl in ("zero2", "zero3"):
        assert table[impl]["grads"] == pytest.approx(whole["grads"] / 2, rel=0.05)
    assert table["zero3"]["params"] == pytest.approx(whole["params"] / 2, rel=0.05), "stage 3 halves the weights"
    assert all(row["cpu_ms_per_step"] > 0 and 0 < row["baseline"] < row["peak"] for row in table.values())
    assert table["zero1"]["grads"] <= whole["grads"] * 1.01  # its reduced slices live in its own gradients
    assert all(row["peak"] > row["params"] > 0 and row["samples_per_sec"] > 0 for row in table.values())
    phases = ["first step: forward and backward", "first step: optimizer step", "steady: forward and backward",
              "steady: optimizer step"]
    for row in table.values():  # each phase's peak, none above the process's
        assert list(row["phases"]) == phases and all(0 < row["phases"][p] <= row["peak"] for p in phases)
    assert set(record["ratios"]) == {"zero1/horovod", "zero1/torch-zero", "zero2/horovod", "zero2/torch-zero",
                                     "zero3/fsdp2", "zero3/zero2", "zero3/horovod"}
    for name, ratio in record["ratios"].items():
        a, b = name.split("/")
        assert ratio == pytest.approx(record["runs"][a][0] / record["runs"][b][0])
        assert f"  {name} by round: {ratio:.3f}" in proc.stdout
    for impl, per_parameter in (("zero1", 4), ("zero2", 6), ("zero3", 8)):  # 8, 12 and 16 (1 - 1/N) bytes at N=2
        saving = record["peak_saving"][impl]
        assert saving["formula"] == pytest.approx(per_parameter * record["parameters"])
        assert saving["measured"] == whole["peak"] - table[impl]["peak"]
        assert f"{impl} {saving['measured'] / 2**20:.0f} MB of {saving['formula'] / 2**20:.0f} MB" in proc.stdout
    assert (out / "zero.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_zero_runs_tensor_parallelism_beside_torchs_and_reports_each_ranks_half(tmp_path, hvd_built):
    """--impls tp,tp-sp,torch-tp: hvdkit's Session(tp=2) with the GPT's plan (and with sequence
    parallelism) and torch's parallelize_module with the same plan, each rank stepping the whole
    global batch: each holds about half the weights and the state (the norms and positions are
    replicated), the group's rate is one rank's, and the Session's exposed communication is a part
    of its step."""
    out = tmp_path / "tp"
    proc = run(HVDKIT + ["zero", "--impls", "tp,tp-sp,torch-tp,horovod", "--width", "64", "--layers", "2", "--steps",
                         "2", "--warmup", "1", "--repeats", "1", "--out", str(out)], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    record = json.loads((out / "zero.json").read_text())
    table = record["table"]
    assert list(table) == ["tp", "tp-sp", "torch-tp", "horovod"]
    for impl in ("tp", "tp-sp", "torch-tp"):
        for held in ("params", "optimizer_state"):
            assert table[impl][held] == pytest.approx(table["horovod"][held] / 2, rel=0.05), (impl, held)
    assert set(record["ratios"]) == {"tp/torch-tp", "tp/horovod", "tp-sp/tp"}
    assert "  tp/torch-tp by round: " in proc.stdout
    assert 0 < table["tp"]["exposed_ms_per_step"] < 1000 * 4 * 2 / table["tp"]["samples_per_sec"], table["tp"]
    assert "tp: exposed communication " in proc.stdout


@pytest.mark.slow
def test_checkpoint_times_the_saves_in_the_training_thread_and_in_the_background(tmp_path, hvd_built):
    out = tmp_path / "checkpoint"
    snapshots_before = set(Path("/dev/shm").glob("hvdkit-snapshots-*"))
    proc = run(HVDKIT + ["checkpoint", "--params", "3M", "--width", "1024", "--steps", "4", "--warmup", "1",
                         "--checkpoint-every", "2", "--dir", str(tmp_path), "--out", str(out)], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    record = json.loads((out / "checkpoint.json").read_text())
    table, runs = record["table"], record["runs"]
    assert list(table) == ["none", "sync", "async", "sharded", "snapshot"]
    assert record["parameters"] == 3 * (1024 * 1024 + 1024)
    assert [runs[impl][0]["checkpoints"]["saves"] for impl in table] == [0, 2, 2, 2, 2]
    assert [runs[impl][0]["checkpoints"]["background"] for impl in table] == [False, False, True, True, True]
    assert set(Path("/dev/shm").glob("hvdkit-snapshots-*")) == snapshots_before, "the snapshots outlived the run"
    for impl in list(table)[1:]:  # against the run without saves of the same round
        ratio = runs[impl][0]["steps_per_sec"] / runs["none"][0]["steps_per_sec"]
        assert table[impl]["round_ratios"] == [round(ratio, 4)]
        assert table[impl]["throughput_lost"] == pytest.approx(1 - ratio)
    sync, background = runs["sync"][0]["checkpoints"], runs["async"][0]["checkpoints"]
    assert sync["stall_seconds"] == pytest.approx(sync["write_seconds"], rel=0.05)  # the write is the stall
    assert record["stall_ratio"] == pytest.approx(table["async"]["stall_per_save"] / table["sync"]["stall_per_save"])
    assert table["none"]["stall_per_save"] is None and background["write_seconds"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint"], "the runs' checkpoints removed"
    assert "stall per save, background / training thread" in proc.stdout


@pytest.mark.parametrize("flag", ["-np", "--np"])
def test_world_size_is_spelled_either_way_everywhere(flag):
    from hvdkit.bench.cli import parser

    assert parser().parse_args(["synthetic", flag, "2"]).np == 2
    assert parser().parse_args(["allreduce", flag, "2"]).np == 2
    assert parser().parse_args(["scaling", flag, "1,2"]).np_list == [1, 2]
    assert parser().parse_args(["checkpoint", flag, "3"]).np == 3


def test_the_goodput_arms_run_one_job_differing_only_in_how_it_comes_back(tmp_path):
    """Commands as data: each arm's rehearsal, built once (hvdkit.bench.goodput), golden here."""
    from hvdkit.bench import ddp_job, goodput
    from hvdkit.bench.cli import parser

    args = parser().parse_args(["goodput", "--count", "4", "--seed", "7", "--steps", "60"])
    train = ["hvdkit", "train", "--model", "mlp", "--dataset", "synthetic", "--image-size", "32", "--epochs", "1000",
             "--max-steps", "60",
             "--checkpoint-steps", "20", "--warmup-epochs", "0", "--lr-schedule", "none", "--log-interval", "1",
             "--checkpoint-dir", f"{tmp_path}/ckpt", "--log-dir", f"{tmp_path}/logs"]
    assert goodput.arm_command("restarts", args, tmp_path / "ckpt", tmp_path / "logs") == [
        "hvdkit", "launch", "-np", "3", "-x", "OMP_NUM_THREADS=1", "--max-restarts", "100", "--", *train,
        "--snapshot-steps", "1"]
    assert goodput.arm_command("disk", args, tmp_path / "ckpt", tmp_path / "logs") == [
        "hvdkit", "launch", "-np", "3", "-x", "OMP_NUM_THREADS=1", "--", *train]
    assert goodput.arm_command("torchrun", args, tmp_path / "ckpt", tmp_path / "logs") == [
        sys.executable, "-m", "hvdkit.bench.ddp_job", "launch", "--nodes", "3", "--max-restarts", "100", "--",
        "--model", "mlp", "--image-size", "32", "--max-steps", "60", "--checkpoint-steps", "20", "--checkpoint-dir",
        f"{tmp_path}/ckpt", "--log-dir", f"{tmp_path}/logs"]
    assert ddp_job.agent_command("node1", 3, 100, "node0", ["--max-steps", "60"]) == [
        "ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "node1",
        f"env OMP_NUM_THREADS=1 PATH={os.environ['PATH']} TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 {sys.executable} -m "
        f"torch.distributed.run --nnodes 3 --nproc-per-node 1 --max-restarts 100 --rdzv-backend c10d --rdzv-endpoint "
        f"node0:29400 --rdzv-id hvdkit-goodput -m hvdkit.bench.ddp_job train --max-steps 60"]
    assert goodput.rehearse_command("disk", args, tmp_path)[1:] == [
        "-m", "hvdkit", "rehearse", "--hosts", "3", "--chaos", "4", "--chaos-seed", "7", "--faults", "kill", "--out",
        f"{tmp_path}/rehearsal", "--", "hvdkit", "launch", "-np", "3", "-x", "OMP_NUM_THREADS=1", "--", *train]
