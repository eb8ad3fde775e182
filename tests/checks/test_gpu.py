"""What only a GPU exercises: NCCL collectives, gradient bucket views, fp16 autocast with GradScaler, pinned memory and
the end-of-epoch lockstep, each in real ranks started by horovodrun (Gloo controller: no MPI needed on a
GPU node). One rank per GPU of this machine.

Marked ``gpu``: on a machine without CUDA they skip with the reason (conftest), and
`make gpu-check` runs them where there is one.
"""

import os
import sys

import pytest
import torch

from conftest import REPO, run
from hvdkit import checkpoint
from hvdkit.checks import selftest
from hvdkit.launch import planner

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

WORKER = [sys.executable, str(REPO / "tests" / "programs" / "gpu_worker.py")]


def ranks() -> int:
    return torch.cuda.device_count()


def records(proc, event):
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    found = selftest.parse_records(proc.stdout, event)
    assert len(found) == ranks(), f"expected one {event} record per rank: {proc.stdout[-3000:]}"
    return found


def test_nccl_allreduce_and_broadcast_on_the_gpu():
    env = {**os.environ, "NCCL_DEBUG": "INFO"}
    proc = run(planner.local_command("horovodrun --gloo", ranks(), [*WORKER, "collectives"]), env=env)
    for record in records(proc, "gpu.collectives"):
        assert record["nccl_built"], "this Horovod was built without NCCL: rebuild with `make gpu-check`"
        assert record["result_device"] == "cuda" and record["half_dtype"] == "torch.float16"
        assert record["allreduce_exact"] and record["half_exact"] and record["broadcast_exact"], record
    # NCCL's own log: the collectives went through NCCL, not a copy to the CPU and Gloo.
    assert "NCCL INFO" in proc.stdout + proc.stderr, proc.stderr[-3000:]


def test_bucket_views_average_as_horovods_own_optimizer_on_the_gpu():
    """hvdkit's buckets as views of one CUDA tensor each, through NCCL, against Horovod's
    DistributedOptimizer (tests/rank/test_buckets.py runs the same worker on CPUs)."""
    worker = [sys.executable, str(REPO / "tests" / "programs" / "buckets_worker.py")]
    proc = run(planner.local_command("horovodrun --gloo", ranks(), worker), timeout=300)
    assert proc.returncode == 0 and "buckets: ok on cuda" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_own_loop_pins_batches_scales_fp16_and_joins_on_the_device(tmp_path):
    env = {**os.environ, "HVDKIT_LOG_DIR": str(tmp_path / "logs")}
    proc = run(planner.local_command("horovodrun --gloo", ranks(), [*WORKER, "loop"]), env=env, timeout=600)
    for record in records(proc, "gpu.loop"):
        assert record["device"] == f"cuda:{record['rank'] % ranks()}"
        assert record["pin_memory"] and record["every_batch_pinned"]
        assert record["autocast_dtypes"] == ["torch.float16"], "fp16 autocast on the GPU (bf16 is the CPU's)"
        assert record["scaler"] == "GradScaler" and record["scale"] > 0
        assert record["weights_dtype"] == "torch.float32", "autocast keeps fp32 master weights"
        assert record["steps"] > 0 and record["last_loss"] < record["first_loss"], record


def test_trainer_with_amp_trains_in_fp16_and_checkpoints_the_scaler(tmp_path):
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "hvdkit", "train", "--amp", "--epochs", "2", "--checkpoint-dir", str(ckpt),
           "--log-dir", str(tmp_path / "logs")]
    proc = run(planner.local_command("horovodrun --gloo", ranks(), cmd), timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    (summary,) = selftest.parse_records(proc.stdout, "summary")
    assert summary["world_size"] == ranks() and summary["skipped_steps"] == 0
    assert summary["test_accuracy"] > 0.8, summary
    saved = checkpoint.load(checkpoint.existing(str(ckpt))[-1])
    assert saved["scaler"] is not None and saved["scaler"]["scale"] > 0, "fp16 on a GPU needs the GradScaler's state"
