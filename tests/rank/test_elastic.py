"""Elastic runs (hvdkit.rank.resume.elastic) under horovodrun: a worker removed from discovery and added
back, a job killed whole resumed from its checkpoint, checkpoints only with the sampler's position."""

import subprocess
import sys

import pytest

from conftest import (
    assert_bitwise_equal,
    elastic_on_this_host,
    final_weights,
    kill_tree,
    metrics_records,
    run,
    wait_for,
)
from hvdkit import checkpoint
from hvdkit.checks import selftest

pytestmark = pytest.mark.slow

TRAIN = [sys.executable, "-m", "hvdkit", "train"]


def test_elastic_training_scales_down_and_back_up(tmp_path):
    hosts, logs = tmp_path / "hosts", tmp_path / "logs"
    cmd, env = elastic_on_this_host(hosts, [*TRAIN, "--elastic", "--dataset", "synthetic", "--epochs", "6",
                                            "--log-interval", "5", "--commit-steps", "5", "--log-dir", str(logs)])
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    jsonl = logs / "metrics.jsonl"

    def sizes():
        return [r["world_size"] for r in metrics_records(jsonl) if r["event"] == "train"]

    wait_for(lambda: sizes().count(2) >= 2, proc, "training on 2 ranks")
    hosts.write_text("localhost:1\n")  # a worker leaves
    wait_for(lambda: 1 in sizes(), proc, "training on 1 rank after the worker left")
    hosts.write_text("localhost:2\n")  # and comes back
    wait_for(lambda: 2 in sizes()[sizes().index(1):], proc, "training on 2 ranks again")
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output[-3000:]
    summary = selftest.parse_records(output, "summary")[0]
    assert summary["epochs"] == 6 and summary["world_size"] == 2 and summary["test_samples"] == 512
    resets = [r for r in metrics_records(jsonl) if r["event"] == "reset"]
    assert [r["world_size"] for r in resets][:2] == [1, 2], resets
    assert [(c["from"], c["to"]) for c in summary["world_size_changes"]][:2] == [(2, 1), (1, 2)], summary


def test_an_elastic_job_killed_whole_resumes_from_its_checkpoint(tmp_path):
    """A requeued or restarted elastic job goes on from its last checkpoint on disk and ends
    with the weights of a job that was never stopped (Horovod's state lives in memory only)."""
    def job(name):
        return elastic_on_this_host(tmp_path / f"{name}-hosts", [
            *TRAIN, "--elastic", "--dataset", "synthetic", "--model", "mlp", "--epochs", "100", "--max-steps", "150",
            "--checkpoint-steps", "20", "--checkpoint-dir", str(tmp_path / name / "ckpt"),
            "--log-dir", str(tmp_path / name / "logs")])

    cmd, env = job("whole")
    whole = run(cmd, env=env, timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    cmd, env = job("stopped")
    ckpt = tmp_path / "stopped" / "ckpt"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: checkpoint.existing(str(ckpt)), proc, "the first checkpoint")
    kill_tree(proc)  # every process of the job, at once: a node failure, scancel, a requeue
    newest = checkpoint.existing(str(ckpt))[-1]
    saved = checkpoint.load(newest)
    epoch, step = saved["epoch"] + 1, saved["step"]
    assert 0 < step < 150
    again = run(cmd, env=env, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"hvdkit: resumed from {newest} (epoch {epoch}, step {step}, written by 2 ranks, now 2)" in again.stderr
    (summary,) = selftest.parse_records(again.stdout, "summary")
    assert summary["steps"] == 150 and summary["elastic"]
    assert_bitwise_equal(final_weights(ckpt), final_weights(tmp_path / "whole" / "ckpt"))
    refused = run([*TRAIN, "--dataset", "synthetic", "--model", "mlp", "--checkpoint-dir", str(ckpt),
                   "--log-dir", str(tmp_path / "fixed")])
    assert refused.returncode == 2
    assert refused.stderr.strip().endswith("was written by an elastic run (--elastic): resume it the same way, or "
                                           "start afresh in another --checkpoint-dir"), refused.stderr


ELASTIC_STEPS = '''
import sys, torch
import horovod.torch as hvd
import hvdkit
from hvdkit import checkpoint

session = hvdkit.Session(elastic=True, checkpoint_dir=sys.argv[1], checkpoint_steps=1, log_dir=sys.argv[2])
model = torch.nn.Linear(2, 1)
model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
for _ in range(2):
    optimizer.zero_grad()
    session.backward(model(torch.ones(4, 2)).pow(2).mean())
    session.step()
print("after steps", len(checkpoint.existing(sys.argv[1])))
for call in (session.save, session.should_stop):
    try:
        call()
    except RuntimeError as exc:
        print(exc)
session.save_elastic(hvd.elastic.ElasticSampler(list(range(8))))
print("saved", sorted(checkpoint.load(checkpoint.existing(sys.argv[1])[-1])))
'''


def test_an_elastic_run_writes_checkpoints_only_with_the_sampler_position(tmp_path):
    """step() wrote a fixed-size checkpoint (no sampler position) at --checkpoint-steps in
    elastic runs, just before save_elastic replaced it: a job killed between the two could
    not be resumed (KeyError: 'sampler', seen in CI). should_stop() before load_elastic(sampler)
    says what is missing: its checkpoint needs the sampler. One process, no launcher."""
    script = tmp_path / "elastic_steps.py"
    script.write_text(ELASTIC_STEPS)
    proc = run([sys.executable, str(script), str(tmp_path / "ckpt"), str(tmp_path / "logs")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "after steps 0" in proc.stdout
    assert "hvdkit: an elastic run writes its checkpoints with save_elastic(sampler)" in proc.stdout
    assert "hvdkit: an elastic loop calls session.load_elastic(sampler) before its first step" in proc.stdout
    saved = proc.stdout.split("saved ", 1)[1]
    assert "'sampler'" in saved and "'rng'" not in saved, proc.stdout
