"""The checks inside a running job: the ranks' copies of the model compared (hvdkit.rank.agree.consistency),
and the rank the others wait for named (hvdkit.rank.agree.stragglers). Real launches of a user's own loop
(tests/programs/checks_script.py) and of `hvdkit train`; the digests and the straggler rule also alone."""

import json
import re
import socket
import sys
from types import SimpleNamespace

import horovod.torch as hvd
import pytest
import torch
from torch import nn

from conftest import REPO, metrics_records, run
from hvdkit import checkpoint, job
from hvdkit.checks import selftest
from hvdkit.rank.agree import consistency, stragglers
from hvdkit.rank.state import RunState

SCRIPT = [sys.executable, str(REPO / "tests" / "programs" / "checks_script.py")]
HVDKIT = [sys.executable, "-m", "hvdkit"]


# --- the digest and what is compared -----------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
                                   torch.uint8, torch.bool, torch.complex64])
def test_a_digest_changes_with_any_one_value_and_only_then(dtype):
    values = (torch.arange(24) % 2 if dtype == torch.bool else torch.randn(24) * 50).to(dtype).reshape(4, 6)
    assert consistency.digest(values).dtype == torch.int64
    assert consistency.digest(values.clone()) == consistency.digest(values)
    assert consistency.digest(values.t().contiguous().t()) == consistency.digest(values), "layout does not count"
    for index in (0, 13, 23):
        changed = values.clone().view(-1)
        changed[index] = (~changed[index]) if dtype == torch.bool else changed[index] + 1
        assert consistency.digest(changed.view(4, 6)) != consistency.digest(values), index


def test_a_weight_nudged_by_one_ulp_changes_the_digest():
    weight = torch.randn(1000)
    nudged = weight.clone()
    nudged[500] = torch.nextafter(nudged[500], torch.tensor(float("inf")))
    assert consistency.digest(nudged) != consistency.digest(weight)


def test_compared_leaves_out_only_the_statistics_each_rank_keeps_itself():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), hvd.SyncBatchNorm(4), nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    names = [name for name, _ in consistency.compared(model, optimizer, replicated_optimizer=True)]
    assert "1.running_mean" not in names and "1.running_var" not in names, "a plain batch norm's are per rank"
    assert {"1.weight", "1.num_batches_tracked", "2.running_mean", "2.running_var", "3.bias"} <= set(names)
    assert "optimizer.3.weight.momentum_buffer" in names
    assert not [n for n, _ in consistency.compared(model, optimizer, replicated_optimizer=False)
                if n.startswith("optimizer.")], "zero's slices and Adasum's own steps are not the same on every rank"


def test_checkpoints_after_the_last_check_that_passed_are_set_aside_not_deleted(tmp_path):
    for step in (4, 8, 12):
        checkpoint.save(str(tmp_path), step, {"step": step}, keep=5)
    (checkpoint.shard_folder(checkpoint.path_for(str(tmp_path), 12))).mkdir()
    # what setting aside reads: the checkpoint_dir; no Horovod, no model
    check = consistency.Consistency(SimpleNamespace(checkpoint_dir=str(tmp_path)), None, None, RunState())
    check.last_good = 8
    check._set_aside_unchecked()
    assert checkpoint.existing(str(tmp_path)) == [checkpoint.path_for(str(tmp_path), s) for s in (4, 8)]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(consistency.SET_ASIDE)) == [
        "ckpt-step000000012.pt.diverged", "ckpt-step000000012.pt.shards.diverged"]


# --- the straggler rule -------------------------------------------------------------------------

def reports(times, tables):
    """Feed ``times`` the tables of reports 5 steps apart, as the report's allreduce sums them: per
    rank mean compute and wait, and the median compute, the mean's where a row leaves it out."""
    hosts = [f"h{r}" for r in range(times.size)]
    for table in tables:
        times.steps = 5
        rows = [row if len(row) == 3 else [*row, row[0]] for row in table]
        times.reported([value for row in rows for value in row], times.total_steps + 5, hosts)
    return times.named


def test_a_rank_is_named_after_three_slow_reports_in_a_row_against_the_others_median(capsys):
    slow = [[0.010, 0.006], [0.016, 0.000], [0.010, 0.005]]  # rank 1: 60% above the others' 10 ms
    fast = [[0.010, 0.001], [0.011, 0.000], [0.010, 0.001]]
    jitter = [[0.0048, 0.0136], [0.0060, 0.0127], [0.0050, 0.0130]]  # 25% more, but 7% of the step
    times = stragglers.StepTimes(rank=0, size=3, threshold=0.15)
    assert reports(times, [slow, slow, fast, slow, slow]) == [], "never three in a row"
    (named,) = reports(times, [slow])
    assert named == {"rank": 1, "host": "h1", "step": 30, "compute_ms": 16.0, "others_median_ms": 10.0,
                     "slower": 0.6}
    assert capsys.readouterr().err == (
        "hvdkit: straggler: rank 1 on h1 computes 60% longer per step than the other ranks' median (a typical "
        "step: 16.0 ms against 10.0 ms) for 3 reports in a row, up to step 30; the others wait for it at every "
        "allreduce: look at h1's load and its data loading, or leave h1 out\n")
    assert len(reports(times, [slow, slow])) == 1, "named once while it stays slow"
    two = stragglers.StepTimes(rank=1, size=2, threshold=0.15)  # the other rank is the median
    assert [n["rank"] for n in reports(two, [[[0.02, 0], [0.01, 0.01]]] * 3)] == [0]
    assert capsys.readouterr().err == "", "only rank 0 prints"
    off = stragglers.StepTimes(rank=0, size=3, threshold=0.0)
    assert reports(off, [slow] * 4) == []
    busy = stragglers.StepTimes(rank=0, size=3, threshold=0.15)
    assert reports(busy, [jitter] * 4) == [], "a busy machine's jitter is not what the job waits for"
    descheduled = [[0.0030, 0.0055, 0.0015], [0.0014, 0.0070, 0.0014]]  # CI's mean; its median is the other's
    assert reports(stragglers.StepTimes(rank=0, size=2, threshold=0.15), [descheduled] * 4) == [], (
        "a few steps descheduled are not a slow rank")


def test_each_rank_measures_its_typical_step_as_the_median_of_its_steps_less_their_wait(monkeypatch):
    clock = iter([0.0, 0.0, 0.001, 0.002, 0.003, 0.0035, 0.004, 0.006, 0.008, 0.036])
    monkeypatch.setattr(stragglers.time, "perf_counter", lambda: next(clock))
    times = stragglers.StepTimes(rank=1, size=2, threshold=0.15)
    times.restart()  # 0.0
    for _ in range(3):  # waits 1 ms of 2, 0.5 of 2, 2 of 32 (30 ms descheduled): computes 1, 1.5, 30 ms
        times.waiting(), times.waited(), times.step_ended()
    assert times.computes == pytest.approx([0.001, 0.0015, 0.030])
    assert times.row().reshape(2, 3)[1].tolist() == pytest.approx([0.0325 / 3, 0.0035 / 3, 0.0015])


# --- real jobs ----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("np_, launcher, checkpoint_steps, detected", [
    (2, ["--launcher", "horovodrun", "--gloo"], 6, 10),  # by the check every 5 steps
    (3, ["--launcher", "mpirun"], 3, 9),  # by the check before step 9's checkpoint (oversubscribed)
])
def test_a_rank_whose_weights_diverge_stops_the_job_and_the_rerun_resumes_from_before(
        tmp_path, np_, launcher, checkpoint_steps, detected):
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    start = [*HVDKIT, "launch", "-np", str(np_), *launcher, "--", *SCRIPT, "--check-every", "5",
             "--checkpoint-steps", str(checkpoint_steps), "--checkpoint-dir", str(ckpt), "--log-dir", str(logs)]
    planted = run([*start, "--plant", "7"], timeout=300)
    assert planted.returncode == job.DIVERGED, planted.stderr[-3000:]
    host = socket.gethostname()
    others = ", ".join(f"{rank} ({host})" for rank in range(np_) if rank != 1)
    assert (f"hvdkit: error: the ranks' copies of the model differ at step {detected}: rank 1 ({host}) differs from "
            f"rank{'s' if np_ > 2 else ''} {others}, first in 'fc.weight'; digests per tensor and rank in "
            f"{logs / f'divergence-step-{detected}.json'}; a rerun resumes from {checkpoint.path_for(str(ckpt), 6)}, "
            "the newest taken before (checked equal at step 6)") in planted.stderr.splitlines(), planted.stderr[-3000:]
    assert planted.stderr.rstrip().splitlines()[-1].startswith("hvdkit launch: the ranks' copies of the model differ")
    report = json.loads((logs / f"divergence-step-{detected}.json").read_text())
    assert report["first"] == "fc.weight" and report["differing_ranks"] == [1] and report["step"] == detected
    assert report["tensors"][0] == "hidden.weight" and "optimizer.fc.weight.momentum_buffer" in report["tensors"]
    weights = report["digests"]["fc.weight"]
    assert len(weights) == np_ and len(set(weights)) == 2 and weights[1] != weights[0]
    assert len(set(report["digests"]["hidden.weight"])) == 1, "only the planted tensor differs"
    assert checkpoint.existing(str(ckpt))[-1] == checkpoint.path_for(str(ckpt), 6), "the newest before step 7"

    rerun = run([*start], timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"hvdkit: resumed from {checkpoint.path_for(str(ckpt), 6)}" in rerun.stderr
    (summary,) = selftest.parse_records(rerun.stdout, "summary")
    assert summary["steps"] == 30


@pytest.mark.slow
@pytest.mark.parametrize("np_, launcher", [(2, ["--launcher", "horovodrun", "--gloo"]), (3, ["--launcher", "mpirun"])])
def test_no_false_alarm_with_bf16_unsynchronized_batch_norm_fp16_allreduce_and_accumulation(tmp_path, np_, launcher):
    """200 steps checked at every step: what is meant to be identical is. A batch norm (each rank's
    own statistics, not compared) and dropout (each rank's own masks), bf16 autocast, fp16
    compression, two micro-batches per allreduce. Horovod's SyncBatchNorm runs on GPUs only. The
    Trainer's loop is the same Session step, checked every 100 steps in every other test."""
    proc = run([*HVDKIT, "launch", "-np", str(np_), *launcher, "--", *SCRIPT, "--norm", "--amp", "--fp16-allreduce",
                "--accumulate", "2", "--check-every", "1", "--checkpoint-steps", "50", "--steps", "200",
                "--checkpoint-dir", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "logs")], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "differ at step" not in proc.stderr
    (summary,) = selftest.parse_records(proc.stdout, "summary")
    assert summary["steps"] == 200 and summary["world_size"] == np_


@pytest.mark.slow
def test_a_rank_with_a_slow_data_loader_is_named_with_its_host_and_slowdown(tmp_path):
    logs, planted_ms = tmp_path / "logs", 40.0
    proc = run([*HVDKIT, "launch", "-np", "3", "--launcher", "mpirun", "--", *SCRIPT, "--slow-rank", "1",
                "--slow-ms", str(planted_ms), "--width", "512", "--steps", "40", "--log-dir", str(logs)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [line for line in proc.stderr.splitlines() if "hvdkit: straggler:" in line]
    assert re.match(r"hvdkit: straggler: rank 1 on \S+ computes \d+% longer per step", line), line
    (summary,) = selftest.parse_records(proc.stdout, "summary")
    (named,) = summary["stragglers"]
    assert named["rank"] == 1 and named["host"] in line and named["step"] <= 40, "within a few reports"
    extra = named["compute_ms"] - named["others_median_ms"]
    assert planted_ms * 0.7 <= extra <= planted_ms * 1.3, named
    table = summary["per_rank"]
    assert [row["rank"] for row in table] == [0, 1, 2] and all(row["host"] == named["host"] for row in table)
    assert table[1]["compute_ms"] > table[0]["compute_ms"] and table[0]["wait_ms"] > table[1]["wait_ms"]
    reports = [r for r in metrics_records(logs / "metrics.jsonl") if r["event"] == "train"]
    assert all(len(r["per_rank"]) == 3 for r in reports[1:]), reports


@pytest.mark.slow
def test_no_rank_is_named_in_a_normal_run(tmp_path):
    proc = run([*HVDKIT, "launch", "-np", "2", "--launcher", "horovodrun", "--gloo", "--", *SCRIPT, "--width", "512",
                "--steps", "60", "--log-dir", str(tmp_path / "logs")], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "straggler" not in proc.stderr
    (summary,) = selftest.parse_records(proc.stdout, "summary")
    assert summary["stragglers"] == [] and len(summary["per_rank"]) == 2
