"""No blocking read and one Horovod wait per steady step (hvdkit.checks.syncaudit), counted on the
CPU in real 2-rank jobs under plain horovodrun: on a GPU each read would block the host until the
GPU is done. The GPU itself is audited by `make gpu-check` (torch.cuda.set_sync_debug_mode)."""

import json
import os
import sys

import pytest

from conftest import REPO, run
from hvdkit.launch import cli as launch
from hvdkit.zero.optimizer import IN_FLIGHT_VARIABLE, STAGE2_IN_FLIGHT

SCRIPT = str(REPO / "tests" / "sync_audit_script.py")
pytestmark = pytest.mark.slow


def audited(shape: str, layers: int = 2, in_flight: str = "1") -> dict:
    """ZeRO keeps its collectives in flight on GPUs only (docs/zero.md): ``in_flight`` "1" makes
    it do so here too, so that the GPU's policy is what is counted."""
    env = {**os.environ, IN_FLIGHT_VARIABLE: in_flight}
    proc = run(launch.local_command("horovodrun --gloo", 2, [sys.executable, SCRIPT, shape, str(layers)]), env=env,
               timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line[line.index("{"):] for line in proc.stdout.splitlines() if "\"shape\"" in line]
    assert len(lines) == 1, proc.stdout[-3000:]
    return json.loads(lines[0])


@pytest.mark.parametrize("shape", ["trainer", "session", "amp"])
def test_a_steady_step_of_distributed_optimizer_reads_nothing_and_waits_once(shape):
    steps = audited(shape)["steps"]
    assert [(step["reads"], step["cuda_syncs"]) for step in steps] == [({}, 0)] * len(steps), steps
    assert [step["waits"] for step in steps] == [1] * len(steps), steps


@pytest.mark.parametrize("stage", [1, 2])
def test_a_steady_zero_step_reads_nothing_and_its_waits_do_not_grow_with_the_buckets(stage):
    """With its GPU policy, stage 1 waits for its reduce-scatters once, its allgathers once and the
    gradient norm's allreduce: three, at 2 buckets and at 7. Stage 2 waits for its oldest
    reduce-scatter whenever STAGE2_IN_FLIGHT are in flight, so that it never holds the whole
    gradient: one more wait per bucket beyond those, by design. On CPUs, one collective at a time
    (the peak's policy there) waits for each bucket (docs/zero.md)."""
    few, many = audited(f"zero{stage}", 2), audited(f"zero{stage}", 12)
    assert (few["buckets"], many["buckets"]) == (2, 7)
    for result in (few, many):
        assert [step["reads"] for step in result["steps"]] == [{}] * len(result["steps"]), result
    waits = {result["buckets"]: {step["waits"] for step in result["steps"]} for result in (few, many)}
    if stage == 1:
        assert waits == {2: {3}, 7: {3}}, waits
        one_at_a_time = audited("zero1", 12, in_flight="")["steps"]
        assert {step["waits"] for step in one_at_a_time} == {2 * 7 + 1}, one_at_a_time
    else:
        assert waits == {n: {3 + max(0, n - STAGE2_IN_FLIGHT)} for n in (2, 7)}, waits
