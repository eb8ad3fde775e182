"""hvdkit.Trainer and `hvdkit train` with real mpirun and horovodrun processes: any batch shape and
loss, the language model, torch.compile, per-run directories, the warmup schedule."""

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import assert_bitwise_equal, final_weights, kill_tree, run, wait_for_file
from hvdkit import checkpoint
from hvdkit.checks import selftest
from hvdkit.config import TrainConfig
from hvdkit.launch import planner
from hvdkit.trainer import lr_factor

TRAIN = [sys.executable, "-m", "hvdkit", "train"]


def test_warmup_starts_at_base_lr_when_scaled_and_at_zero_when_not():
    cfg = TrainConfig(warmup_epochs=2, lr_schedule="none")
    assert lr_factor(cfg, 0, 10, 4.0) == 1.0 and lr_factor(cfg, 1, 10, 4.0) == 2.5 and lr_factor(cfg, 2, 10, 4.0) == 4
    assert lr_factor(cfg, 0, 10, 1.0) == 0.0 and lr_factor(cfg, 1, 10, 1.0) == 0.5 and lr_factor(cfg, 3, 10, 1.0) == 1
    cosine = TrainConfig(warmup_epochs=0, lr_schedule="cosine")
    assert lr_factor(cosine, 5, 10, 2.0) == pytest.approx(1.0) and lr_factor(cosine, 10, 10, 2.0) == pytest.approx(0)


OWN_TRAINER = '''
import sys, torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
import hvdkit

case = sys.argv[1]
gen = torch.Generator().manual_seed(0)
x = torch.randn(512, 8, generator=gen)
target = x[:, :4].sum(1, keepdim=True)


class Dicts(Dataset):
    def __len__(self):
        return len(x)

    def __getitem__(self, i):
        return {"features": x[i], "mask": (x[i] > -5), "target": target[i]}


class Triples(Dataset):
    def __len__(self):
        return len(x)

    def __getitem__(self, i):
        return x[i], x[i] > -5, int(target[i, 0] > 0)


class Regressor(nn.Module):
    def __init__(self, outputs):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, outputs))

    def forward(self, features, mask):
        return self.net(features * mask)


def mse(model, batch):
    prediction = model(batch["features"], batch["mask"])
    return nn.functional.mse_loss(prediction, batch["target"]), {
        "mae": (prediction - batch["target"]).abs().mean()}


def triples(model, batch):
    features, mask, label = batch
    loss = nn.functional.cross_entropy(model(features, mask), label)
    return loss


config = hvdkit.TrainConfig(epochs=6, batch_size=16, batches_per_allreduce=2, warmup_epochs=0, lr_schedule="none",
                            base_lr=1e-2,
                            lr_scaling="sqrt", log_dir=sys.argv[2])
adamw = lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
if case == "dicts":
    # DataLoaders, as a user's script has them: hvdkit re-shards them, keeping batch size and collate_fn
    trainer = hvdkit.Trainer(config, Regressor(1), DataLoader(Dicts(), batch_size=16),
                             DataLoader(Dicts(), batch_size=16), optimizer=adamw, loss_fn=mse)
elif case == "triples":
    trainer = hvdkit.Trainer(config, Regressor(2), Triples(), Triples(), optimizer=adamw, loss_fn=triples)
else:  # float labels with the default cross-entropy
    trainer = hvdkit.Trainer(config, Regressor(1), torch.utils.data.TensorDataset(x, target),
                             torch.utils.data.TensorDataset(x, target))
trainer.fit()
'''


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dicts", "triples"])
def test_trainer_takes_any_optimizer_loss_and_batch_shape(tmp_path, case):
    script = tmp_path / "own.py"
    script.write_text(OWN_TRAINER)
    own = [sys.executable, str(script), case, str(tmp_path / "logs")]
    proc = run(planner.local_command("horovodrun --gloo", 2, own))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = selftest.parse_records(proc.stdout, "summary")[0]
    # 512 samples, 2 ranks x 16 x K=2: 8 steps an epoch
    assert summary["steps"] == 48 and summary["world_size"] == 2 and summary["test_samples"] == 512
    assert summary["model"] == "Regressor" and summary["dataset"] == ("Dicts" if case == "dicts" else "Triples")
    assert "test_accuracy" not in summary and "train_accuracy" not in summary, "no accuracy the task did not define"
    if case == "dicts":
            assert summary["test_loss"] < 0.5 and 0 < summary["test_mae"] < 0.5, summary  # target variance is 4
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    config_record = records[0]
    assert config_record["event"] == "config" and config_record["lr_scaling"] == "sqrt"
    train = [r for r in records if r["event"] == "train"]
    assert train and all(r["lr"] == pytest.approx(1e-2 * math.sqrt(2 * 2)) for r in train), "sqrt(size x K)"


@pytest.mark.slow
def test_float_labels_with_the_default_loss_are_refused_in_one_line(tmp_path):
    script = tmp_path / "own.py"
    script.write_text(OWN_TRAINER)
    proc = run([sys.executable, str(script), "float-labels", str(tmp_path / "logs")])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert ("hvdkit: error: loss_fn: the default loss is cross-entropy over integer class labels, "
            "and the labels are torch.float32; pass loss_fn=") in proc.stderr


LM = ["--model", "gpt-tiny", "--dataset", "text", "--optimizer", "adamw", "--seq-len", "32", "--lr-scaling", "none",
      "--weight-decay", "0.1", "--clip-grad-norm", "1.0"]


def _corpus(tmp_path):
    """64 KiB of Python source: the embedded corpus's 2.6 MB made each run's final evaluation
    (4110 sequences on two ranks) take longer than its 24 steps."""
    path = tmp_path / "corpus.txt"
    if not path.exists():
        path.write_bytes(Path(argparse.__file__).read_bytes()[:65536])
    return path


def _train(tmp_path, name, args, launcher=None):
    ckpt = tmp_path / name
    cmd = [*TRAIN, *LM, "--data-dir", str(_corpus(tmp_path)), "--checkpoint-dir", str(ckpt),
           "--log-dir", str(tmp_path / f"{name}-logs"), *args]
    proc = run(planner.local_command("mpirun", 2, cmd) if launcher == "mpirun" else cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return selftest.parse_records(proc.stdout, "summary")[0], final_weights(ckpt)


@pytest.mark.slow
def test_language_model_two_ranks_equal_one_rank_with_twice_the_batch(tmp_path):
    """Float32 sums of two ranks' averaged gradients differ from one rank's mean in the last
    bits; AdamW (m / sqrt(v)) keeps that at ~1e-6 after 5 steps, so 1e-5 leaves headroom while
    a wrong average, scale or data order moves weights by ~1e-3. Except attention's key biases:
    softmax ignores them, their exact gradient is 0, and Adam turns the rounding noise left in
    their place into steps of up to lr each, so there the bound is steps x lr."""
    exact = ["--max-steps", "5", "--warmup-epochs", "0", "--lr-schedule", "none", "--base-lr", "1e-3"]
    two, two_weights = _train(tmp_path, "np2", [*exact, "--batch-size", "8"], launcher="mpirun")
    one, one_weights = _train(tmp_path, "np1", [*exact, "--batch-size", "16"])
    assert two["world_size"] == 2 and two["steps"] == one["steps"] == 5
    assert "tokens_per_sec" in two and two["test_bits_per_byte"] == pytest.approx(two["test_loss"] / math.log(2))
    for name in one_weights:
        two_rank, one_rank = two_weights[name].clone(), one_weights[name].clone()
        if name.endswith("attention.k.bias"):  # the key biases
            assert (two_rank - one_rank).abs().max() <= 5 * 1e-3
            continue
        torch.testing.assert_close(two_rank, one_rank, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_language_model_resumes_after_sigkill_bitwise(tmp_path):
    args = ["--max-steps", "24", "--batch-size", "8", "--checkpoint-steps", "4", "--warmup-epochs", "0.1",
            "--amp", "--base-lr", "2e-3"]
    _, uninterrupted = _train(tmp_path, "straight", args, launcher="mpirun")
    ckpt = tmp_path / "killed"
    cmd = planner.local_command("mpirun", 2, [*TRAIN, *LM, "--data-dir", str(_corpus(tmp_path)), "--checkpoint-dir",
                                             str(ckpt), "--log-dir", str(tmp_path / "killed-logs"), *args])
    proc = subprocess.Popen(cmd, env=selftest.mpi_root_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_file(checkpoint.path_for(str(ckpt), 12), proc)
    finally:
        kill_tree(proc)
    assert checkpoint.load(checkpoint.existing(str(ckpt))[-1])["step"] < 24, "killed before the end"
    summary, resumed = _train(tmp_path, "killed", args, launcher="mpirun")
    assert summary["steps"] == 24
    assert_bitwise_equal(resumed, uninterrupted)


@pytest.mark.slow
def test_torch_compile_trains_like_eager(tmp_path):
    args = ["--model", "mlp", "--max-steps", "5", "--warmup-epochs", "0", "--lr-schedule", "none"]
    weights = {}
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        ckpt = tmp_path / name
        proc = run(planner.local_command("mpirun", 2, [*TRAIN, *args, *extra, "--checkpoint-dir", str(ckpt),
                                               "--log-dir", str(tmp_path / f"{name}-logs")]), timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        weights[name] = final_weights(ckpt)
    assert weights["eager"].keys() == weights["compiled"].keys(), "checkpoints hold the uncompiled module's keys"
    for name in weights["eager"]:  # inductor may fuse and reorder float ops
        torch.testing.assert_close(weights["compiled"][name], weights["eager"][name], atol=1e-5, rtol=1e-4)


def test_runs_started_at_once_get_directories_of_their_own(tmp_path):
    """The name is the start second; runs started in one second (a job array) must not share."""
    from concurrent.futures import ThreadPoolExecutor

    from hvdkit.rank.start.startup import new_run_dir

    with ThreadPoolExecutor(8) as pool:
        made = list(pool.map(lambda _: new_run_dir(str(tmp_path / "runs")), range(8)))
    assert len(set(made)) == 8 and all(os.path.isdir(d) for d in made), made


@pytest.mark.slow
def test_each_run_gets_its_own_directory_and_strict_json(tmp_path):
    first = run([*TRAIN, "--model", "mlp", "--max-steps", "3", "--checkpoint-dir", "ckpt"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    again = run([*TRAIN, "--model", "mlp", "--max-steps", "3", "--checkpoint-dir", "ckpt"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2, "two runs, two directories"

    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))

    summary = strict([line for line in again.stdout.splitlines() if '"summary"' in line][0])
    assert summary["train_loss"] is None, "resumed at its end: nothing trained, no NaN"
    for run_dir in runs:
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            strict(line)


@pytest.mark.slow
def test_sync_batch_norm_flag_is_refused_in_one_line_on_cpus(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU: the refusal is for CPU-only hosts")
    proc = run([*TRAIN, "--sync-batch-norm", "--max-steps", "1", "--log-dir", str(tmp_path)])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == ("hvdkit train: sync_batch_norm: Horovod's SyncBatchNorm runs on "
                                                    "GPUs only and this host has none; drop sync_batch_norm "
                                                    "(--sync-batch-norm) on CPUs")


def test_failure_hints_for_oom_and_nccl():
    """Real exception objects as torch and Horovod raise them; a GPU to run out of is not here."""
    from hvdkit.trainer import failure_hint

    gpu = failure_hint(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert gpu.startswith("out of memory: lower --batch-size") and "Tried to allocate 2.00 GiB" in gpu
    cpu = failure_hint(RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"))
    assert cpu.startswith("out of memory")
    nccl = failure_hint(RuntimeError("NCCL error in: nccl_operations.cc:112, unhandled system error"))
    assert "NCCL_DEBUG=INFO" in nccl and "NCCL_SOCKET_IFNAME" in nccl
    assert failure_hint(ValueError("something else")) is None
    peer = failure_hint(RuntimeError("Horovod has been shut down. This was caused by an exception on one of the ranks"))
    assert peer == "stopped because another rank ended first; that rank's own line says why"
