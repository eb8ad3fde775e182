"""No blocking read and one Horovod wait per steady step (hvdkit.checks.syncaudit), counted on the
CPU in real 2-rank jobs under plain horovodrun: on a GPU each read would block the host until the
GPU is done. The GPU itself is audited by `make gpu-check` (torch.cuda.set_sync_debug_mode)."""

import os
import sys

import pytest

from conftest import REPO, run
from hvdkit.checks import selftest
from hvdkit.launch import planner
from hvdkit.zero.optimizer import IN_FLIGHT_VARIABLE, STAGE2_IN_FLIGHT

SCRIPT = str(REPO / "tests" / "programs" / "sync_audit_script.py")
pytestmark = pytest.mark.slow


def audited(shape: str, layers: int = 2, in_flight: str = "1", hosts: bool = False, **extra: str) -> dict:
    """ZeRO keeps its collectives in flight on GPUs only (docs/zero.md): ``in_flight`` "1" makes
    it do so here too, so that the GPU's policy is what is counted. ``hosts``: each rank in a UTS
    namespace of its own, named host0 and host1, as ranks on two hosts see their names (under
    mpirun: Gloo's rendezvous looks its host's name up)."""
    env = {**os.environ, IN_FLIGHT_VARIABLE: in_flight, **extra}
    named = ["unshare", "--uts", "sh", "-c", 'hostname "host$OMPI_COMM_WORLD_RANK" && exec "$@"', "sh"] if hosts else []
    proc = run(planner.local_command("mpirun" if hosts else "horovodrun --gloo", 2,
                                     [*named, sys.executable, SCRIPT, shape, str(layers)]), env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = selftest.parse_records(proc.stdout, "sync.audit")
    assert len(records) == 1, proc.stdout[-3000:]
    return records[0]


def by_module(counts: dict) -> dict:
    """Counts keyed "Tensor.tolist at /.../hvdkit/rank/x.py:N", summed by module ("rank/x.py")."""
    modules: dict = {}
    for key, n in counts.items():
        module = key.split(" at ")[1].split("/hvdkit/")[-1].split(":")[0]
        modules[module] = modules.get(module, 0) + n
    return modules


def host_reads(step: dict) -> dict:
    """The host tensors read in a step (Tensor.numpy), by module: none, the lockstep meeting's rows
    being read through the numpy view of its tensor made once (hvdkit.rank.agree.lockstep)."""
    return by_module(step["host_reads"])


def settle_reads(step: dict) -> int:
    """Reads of the non-finite flags (hvdkit/rank/step/training.py's settle)."""
    return sum(n for key, n in step["reads"].items() if "hvdkit/rank/step/training.py" in key)


@pytest.mark.parametrize("shape", ["trainer", "session", "amp"])
def test_a_steady_step_of_distributed_optimizer_reads_nothing_and_waits_once(shape):
    result = audited(shape)
    steps = result["steps"]
    assert [(step["reads"], step["cuda_syncs"]) for step in steps] == [({}, 0)] * len(steps), steps
    assert [step["waits"] for step in steps] == [1] * len(steps), steps
    assert [host_reads(step) for step in steps] == [{}] * len(steps), steps
    # The flags of the 14 steps before are read once, at the report (AMP: GradScaler keeps its own).
    assert settle_reads(result["report_step"]) == (0 if shape == "amp" else 1), result["report_step"]
    # The report reads its allreduced metrics and every rank's step times once (rank/reports/report.py);
    # the straggler rule works on that read (rank/agree/stragglers.py reads nothing of its own).
    reads = by_module(result["report_step"]["reads"])
    assert reads.get("rank/reports/report.py") == 1 and "rank/agree/stragglers.py" not in reads, result["report_step"]


def test_a_snapshot_every_step_adds_no_read_and_no_wait_to_the_step(tmp_path):
    """Every rank's RNG state is gathered by a collective the snapshot's writing thread waits for,
    and a rank that writes none takes its gathers once done: the training thread waits only for
    the gradients, as without snapshots."""
    result = audited("snapshot", HVDKIT_SNAPSHOT_DIR=str(tmp_path / "snapshots"))
    steps = result["steps"]
    assert [(step["reads"], step["cuda_syncs"]) for step in steps] == [({}, 0)] * len(steps), steps
    assert [step["waits"] for step in steps] == [1] * len(steps), steps
    assert [host_reads(step) for step in steps] == [{}] * len(steps), steps
    assert not (tmp_path / "snapshots").exists(), "the run's snapshots go at its end"


def test_a_zero_snapshot_sends_its_shard_to_another_host_without_a_read_or_a_wait(tmp_path):
    """ZeRO stage 2 with a snapshot every step on two ranks whose hosts differ: each rank's shard
    goes to the other's snapshot by an alltoall its writing thread waits for, so the step waits as
    often as stage 2's without snapshots (below)."""
    result = audited("zero2-snapshot", hosts=True, HVDKIT_SNAPSHOT_DIR=str(tmp_path / "snapshots"))
    steps = result["steps"]
    assert result["buckets"] == 2
    assert [step["reads"] for step in steps] == [{}] * len(steps), steps
    assert [step["waits"] for step in steps] == [3 + max(0, 2 - STAGE2_IN_FLIGHT)] * len(steps), steps
    assert [host_reads(step) for step in steps] == [{}] * len(steps), steps
    assert not (tmp_path / "snapshots").exists(), "the run's snapshots go at its end"


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
        assert [host_reads(step) for step in result["steps"]] == [{}] * len(result["steps"])
        assert settle_reads(result["report_step"]) == 1, result["report_step"]
    waits = {result["buckets"]: {step["waits"] for step in result["steps"]} for result in (few, many)}
    if stage == 1:
        assert waits == {2: {3}, 7: {3}}, waits
        one_at_a_time = audited("zero1", 12, in_flight="")["steps"]
        assert {step["waits"] for step in one_at_a_time} == {2 * 7 + 1}, one_at_a_time
    else:
        assert waits == {n: {3 + max(0, n - STAGE2_IN_FLIGHT)} for n in (2, 7)}, waits


def test_a_steady_stage_3_step_reads_nothing_and_waits_for_each_gather_by_design():
    """Stage 3 waits for each unit's gather before the unit's forward and again before its
    backward: a unit's weights are needed whole there, so each gather is one wait point (the next
    one is in flight meanwhile). At U units: U for the forward, U - 1 for the backward (the first
    layer's backward does not read its weight: its input needs no gradient), U - 2 for the
    reduce-scatters beyond the two in flight (as stage 2's), one at the step for the rest, one
    for the norm's allreduce: 3U - 1, by design, and no read."""
    for layers in (2, 5):
        result = audited("zero3", layers)
        units = layers + 2  # each Linear of the Sequential a group, one unit each
        assert result["buckets"] == units
        steps = result["steps"]
        assert [step["reads"] for step in steps] == [{}] * len(steps), steps
        assert [host_reads(step) for step in steps] == [{}] * len(steps), steps
        assert [step["waits"] for step in steps] == [3 * units - 1] * len(steps), steps
        assert settle_reads(result["report_step"]) == 1, result["report_step"]


@pytest.mark.parametrize("shape", ["tp", "tp-sequence-parallel"])
def test_a_steady_tensor_parallel_step_reads_nothing(shape):
    """Session(tp=2): every collective of the split layers, the norms and the checks stays a tensor
    on the device; its waits are Horovod's handles (on a GPU they return once queued), as many in
    every step."""
    steps = audited(shape)["steps"]
    assert [(step["reads"], step["cuda_syncs"]) for step in steps] == [({}, 0)] * len(steps), steps
    assert [host_reads(step) for step in steps] == [{}] * len(steps), steps
    assert len({step["waits"] for step in steps}) == 1, steps


def test_a_steady_pipeline_step_reads_nothing_and_waits_where_the_schedule_needs_a_gradient():
    """1F1B over 4 micro-batches at pp 2 (rank 0, the first stage: F0 F1 B0 F2 B1 F3 B2 B3), every
    receive started at the step's start: the stage starts waiting at B0, B1 and B2, each after a
    forward's send; B3's gradient and the sends are waited for without a submission between, at
    the same wait point. The shapes, read on the host once, are not read again."""
    steps = audited("pp")["steps"]
    assert [(step["reads"], step["cuda_syncs"]) for step in steps] == [({}, 0)] * len(steps), steps
    assert [host_reads(step) for step in steps] == [{}] * len(steps), steps
    assert [step["waits"] for step in steps] == [3] * len(steps), steps


def test_a_steady_session_pipeline_step_reads_nothing():
    """Session(pp=2, micro_batches=4): the Session's pipeline step (1F1B), its optimizer step clipped by
    nothing but checked for finiteness over both stages, and should_stop(): no read on the host, and as
    many waits in every step."""
    steps = audited("pp-session")["steps"]
    assert [(step["reads"], step["cuda_syncs"]) for step in steps] == [({}, 0)] * len(steps), steps
    assert [host_reads(step) for step in steps] == [{}] * len(steps), steps
    assert len({step["waits"] for step in steps}) == 1, steps
