"""The rank the others wait for named (hvdkit.rank.agree.stragglers): the rule alone, and real launches of a
user's own loop (tests/programs/checks_script.py)."""

import re
import sys

import pytest

from conftest import REPO, metrics_records, run
from hvdkit.checks import selftest
from hvdkit.rank.agree import stragglers

SCRIPT = [sys.executable, str(REPO / "tests" / "programs" / "checks_script.py")]
HVDKIT = [sys.executable, "-m", "hvdkit"]


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
