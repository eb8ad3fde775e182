"""`hvdkit train` as users launch it: real horovodrun and mpirun processes on this machine."""

import json
import math
import sys

import pytest
import torch

from conftest import REPO, final_weights, run
from hvdkit import checkpoint
from hvdkit.checks import selftest
from hvdkit.launch import planner
from test_data import make_imagefolder

pytestmark = pytest.mark.slow

TRAIN = [sys.executable, "-m", "hvdkit", "train"]
LAUNCHERS = {
    "horovodrun --gloo": lambda cmd: planner.local_command("horovodrun --gloo", 2, cmd),
    "mpirun": lambda cmd: planner.local_command("mpirun", 2, cmd),
}
# Plain SGD steps on a model without batch norm or dropout: data parallelism must be exact.
EXACT = ["--model", "mlp", "--warmup-epochs", "0", "--lr-schedule", "none", "--max-steps", "5"]


def train(tmp_path, name, *args, launcher=None, timeout=300):
    """Run hvdkit train (under ``launcher`` when given); return its summary and directories."""
    ckpt, logs = tmp_path / name / "ckpt", tmp_path / name / "logs"
    cmd = [*TRAIN, "--checkpoint-dir", str(ckpt), "--log-dir", str(logs), *args]
    proc = run(LAUNCHERS[launcher](cmd) if launcher else cmd, timeout=timeout)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    summaries = selftest.parse_records(proc.stdout, "summary")
    assert len(summaries) == 1, "exactly one rank prints the summary"
    return summaries[0], ckpt, logs


def test_adasum_checkpoints_in_the_background_however_late_the_copy(tmp_path):
    """Horovod's Adasum optimizer steps each parameter in its gradient hook, so the next backward
    changes the weights and momenta before the optimizer step: a background save copies them at
    once, not while the next step runs (the copy held 0.5 s here, as on a loaded machine)."""
    late = [sys.executable, str(REPO / "tests" / "programs" / "late_copy.py")]
    proc = run(LAUNCHERS["mpirun"]([*late, *EXACT[:-1], "12", "--use-adasum", "--checkpoint-steps", "5",
                                    "--checkpoint-dir", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "logs")]),
               timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [p.name for p in checkpoint.existing(str(tmp_path / "ckpt"))][-2:] == ["ckpt-step000000010.pt",
                                                                                 "ckpt-step000000012.pt"]


@pytest.fixture(scope="module")
def single_process_references(tmp_path_factory):
    """np=1 with batch 2B, and np=1 with batch B and K=2: both must equal np=2 with batch B."""
    tmp = tmp_path_factory.mktemp("np1")
    _, big_batch, _ = train(tmp, "big", *EXACT, "--batch-size", "32", "--base-lr", "0.1")
    _, accumulated, _ = train(tmp, "accum", *EXACT, "--batch-size", "16", "--batches-per-allreduce", "2",
                              "--base-lr", "0.05")
    return final_weights(big_batch), final_weights(accumulated)


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_two_ranks_equal_one_rank_with_twice_the_batch(tmp_path, launcher, single_process_references):
    # base_lr x size x K: 0.05 x 2 = 0.1 x 1 = 0.05 x 1 x 2, so every run steps with lr 0.1.
    summary, ckpt, _ = train(tmp_path, "np2", *EXACT, "--batch-size", "16", "--base-lr", "0.05", launcher=launcher)
    assert summary["world_size"] == 2 and summary["steps"] == 5
    two_ranks = final_weights(ckpt)
    big_batch, accumulated = single_process_references
    for name in two_ranks:
        torch.testing.assert_close(two_ranks[name], big_batch[name], atol=1e-5, rtol=0)
        torch.testing.assert_close(two_ranks[name], accumulated[name], atol=1e-5, rtol=0)


@pytest.mark.parametrize("args", [["--zero", "2"], ["--zero", "1", "--compile"]])
def test_sharded_two_ranks_equal_one_rank_with_twice_the_batch(tmp_path, single_process_references, args):
    """`hvdkit train --zero 1|2`, compiled or not: each rank keeps half the optimizer state."""
    summary, ckpt, _ = train(tmp_path, "zero", *EXACT, "--batch-size", "16", "--base-lr", "0.05", *args,
                             launcher="mpirun")
    two_ranks = final_weights(ckpt)
    big_batch, _ = single_process_references
    for name in two_ranks:
        torch.testing.assert_close(two_ranks[name], big_batch[name], atol=1e-5, rtol=0)
    assert len(summary["memory"]) == 2 and all(m["optimizer_state"] > 0 and m["peak_rss"] > 0
                                               for m in summary["memory"])
    for m in summary["memory"]:  # where each rank's memory peaked (hvdkit.rank.memory), none above its peak
        phases = {k: v for k, v in m["phases"].items() if k != "unit"}
        assert {"setup and resume", "backward", "first optimizer step", "optimizer step"} <= set(phases), m
        assert m["phases"]["unit"] == "rss" and all(0 < v <= m["peak_rss"] for v in phases.values()), m
    assert len(list(ckpt.glob("ckpt-step*.pt.shards/part-*-of-00002.pt"))) == 2


def test_two_ranks_reach_the_accuracy_of_one(tmp_path):
    one, _, _ = train(tmp_path, "np1")
    two, _, logs = train(tmp_path, "np2", launcher="horovodrun --gloo")
    assert one["test_accuracy"] >= 0.97 and two["test_accuracy"] >= 0.97
    assert abs(one["test_accuracy"] - two["test_accuracy"]) <= 0.02
    assert two["test_samples"] == one["test_samples"] == 360
    events = [json.loads(line)["event"] for line in (logs / "metrics.jsonl").read_text().splitlines()]
    assert events[0] == "config" and events[-1] == "summary" and {"train", "test"} <= set(events)
    assert list(logs.glob("events.out.tfevents.*")), "TensorBoard events"


@pytest.mark.parametrize("name, args, steps", [
    ("amp-clip-fp16", ["--amp", "--clip-grad-norm", "1.0", "--fp16-allreduce"], 46),
    ("adasum", ["--use-adasum"], 46),
    ("accumulation-eval-batches", ["--batches-per-allreduce", "2", "--eval-batches", "3"], 24),
    ("zero-1-amp-clip-fp16-accumulation", ["--zero", "1", "--amp", "--clip-grad-norm", "1.0", "--fp16-allreduce",
                                           "--batches-per-allreduce", "2", "--optimizer", "adamw"], 24),
])
def test_options_run_to_completion_on_two_ranks(tmp_path, name, args, steps):
    # 1,437 training digits: not a multiple of 2 ranks x 32, so the last batch is short.
    summary, ckpt, _ = train(tmp_path, name, "--epochs", "2", *args, launcher="mpirun")
    assert summary["steps"] == steps and summary["epochs"] == 2
    # of the 360 test digits, 180 a rank: all, or each rank's first 3 batches of 32
    assert summary["test_samples"] == (2 * 3 * 32 if "--eval-batches" in args else 360)
    assert math.isfinite(summary["train_loss"]) and summary["test_accuracy"] > 0.8, summary
    assert len(list(ckpt.glob("ckpt-step*.pt"))) == 2, "rank 0 writes one checkpoint per epoch"


def test_uneven_validation_shards_count_each_sample_once(tmp_path):
    data_dir = make_imagefolder(tmp_path / "images", val_per_class=(4, 3))  # 7 = 4 + 3 across 2 ranks
    summary, _, _ = train(tmp_path, "imgs", "--dataset", "imagefolder", "--data-dir", str(data_dir),
                          "--image-size", "16", "--batch-size", "2", "--epochs", "1", launcher="horovodrun --gloo")
    assert summary["test_samples"] == 7 and summary["world_size"] == 2


def test_readme_library_example_runs_on_two_ranks(tmp_path):
    """The "Train your own model" code from docs/training.md, as a user would run it."""
    from conftest import REPO

    page = (REPO / "docs" / "training.md").read_text()
    section = page.split("## Train your own model", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "train_mine.py"
    script.write_text(code)
    proc = run(planner.local_command("horovodrun --gloo", 2, [sys.executable, str(script)]), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = selftest.parse_records(proc.stdout, "summary")[0]
    assert summary["world_size"] == 2 and summary["test_samples"] == 512
    assert summary["test_accuracy"] > 0.85, summary
    assert (tmp_path / "runs" / "mine" / "metrics.jsonl").exists()


def test_dataset_smaller_than_one_global_batch(tmp_path):
    proc = run(planner.local_command("mpirun", 2, [*TRAIN, "--batch-size", "1024", "--log-dir", str(tmp_path)]))
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("hvdkit train:")]
    assert lines == ["hvdkit train: data: the training set has 1437 samples, fewer than "
                     "world size x batch_size = 2 x 1024"], proc.stderr[-2000:]


def test_debug_shows_the_traceback(tmp_path):
    quiet = run([*TRAIN, "--model", "nope", "--log-dir", str(tmp_path)])
    loud = run([*TRAIN, "--model", "nope", "--debug", "--log-dir", str(tmp_path)])
    assert quiet.returncode == 2 and "Traceback" not in quiet.stderr
    assert loud.returncode != 0 and "Traceback" in loud.stderr and "UnknownModel" in loud.stderr
