"""The ranks' copies of the model compared (hvdkit.rank.agree.consistency): the digests and what is
compared alone; real launches of a user's own loop (tests/programs/checks_script.py) and of `hvdkit train`."""

import json
import socket
import sys
from types import SimpleNamespace

import horovod.torch as hvd
import pytest
import torch
from torch import nn

from conftest import REPO, run
from hvdkit import checkpoint, job
from hvdkit.checks import selftest
from hvdkit.rank.agree import consistency
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


def test_under_zero_3_the_sharded_weights_are_not_compared_and_the_scope_says_so():
    """Stage 3's optimizer names its sharded weights (hvdkit.zero.stage3.sharded_names): each rank
    holds its slices alone, so the check compares the buffers and the weights kept whole."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model[0].requires_grad_(False)

    class Stage3Names:  # what consistency reads of stage 3's optimizer
        state: dict = {}

        def sharded_names(self):
            return {"1.weight", "1.bias", "2.weight", "2.bias"}

    names = [name for name, _ in consistency.compared(model, Stage3Names(), replicated_optimizer=False)]
    assert names == ["0.weight", "0.bias", "1.num_batches_tracked"]
    assert consistency.scope(3, False).startswith("the buffers and the weights kept whole; not the sharded weights")
    assert "not the optimizer's state, whose slices" in consistency.scope(2, False)
    assert consistency.scope(0, False) == "the weights, the buffers and the optimizer's state"


def test_checkpoints_after_the_last_check_that_passed_are_set_aside_not_deleted(tmp_path):
    for step in (4, 8, 12):
        checkpoint.save(str(tmp_path), step, {"step": step}, keep=5)
    (checkpoint.shard_folder(checkpoint.path_for(str(tmp_path), 12))).mkdir()
    # what setting aside reads: the checkpoint_dir; no Horovod, no model
    check = consistency.Consistency(SimpleNamespace(checkpoint_dir=str(tmp_path)), None, None, RunState(), None)
    check.last_good = 8
    check._set_aside_unchecked()
    assert checkpoint.existing(str(tmp_path)) == [checkpoint.path_for(str(tmp_path), s) for s in (4, 8)]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(consistency.SET_ASIDE)) == [
        "ckpt-step000000012.pt.diverged", "ckpt-step000000012.pt.shards.diverged"]


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
def test_under_tensor_parallelism_a_block_is_compared_within_its_data_parallel_group(tmp_path):
    """tp 2 x dp 2: rank 3 changes its block of fc.weight, which only rank 1 holds too; the blocks of
    one tensor-parallel group differ by design and raise nothing, nor does fc.bias, whole everywhere."""
    logs = tmp_path / "logs"
    proc = run([*HVDKIT, "launch", "-np", "4", "--launcher", "mpirun", "--", *SCRIPT, "--tp", "2", "--plant", "3",
                "--plant-rank", "3", "--check-every", "2", "--steps", "8", "--log-dir", str(logs)], timeout=300)
    assert proc.returncode == job.DIVERGED, proc.stderr[-3000:]
    host = socket.gethostname()
    assert (f"hvdkit: error: the ranks' copies of the model differ at step 4: rank 3 ({host}) differs from ranks "
            f"0 ({host}), 1 ({host}), 2 ({host}), first in 'fc.weight'") in proc.stderr, proc.stderr[-3000:]
    report = json.loads((logs / "divergence-step-4.json").read_text())
    assert report["differing_ranks"] == [3] and report["compared"] == consistency.scope(0, False, 2)
    assert report["tensors"][0] == "fc.bias", "what is whole first, then the blocks"
    weights = report["digests"]["fc.weight"]
    assert weights[0] != weights[1] and weights[1] != weights[3] and weights[0] == weights[2], weights


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
