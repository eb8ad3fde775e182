"""The own-loop API (hvdkit.Session) and the Trainer over it, with real mpirun and horovodrun
processes: the ported Horovod example, exact resume, preemption, any batch shape and loss,
the language model, torch.compile, per-run directories."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections import namedtuple

import psutil
import pytest
import torch

from conftest import REPO, assert_bitwise_equal, final_weights, kill_tree, run
from hvdkit import checkpoint, config
from hvdkit.checks import selftest
from hvdkit.config import ConfigError, TrainConfig
from hvdkit.launch import cli as launch
from hvdkit.models import sync_batch_norm
from hvdkit.rank.metrics import finite_or_none
from hvdkit.rank.startup import ALLREDUCE_RULES, performance_settings
from hvdkit.rank.step import batch_len, lr_multiplier, split_batch
from hvdkit.trainer import lr_factor

PORTED = [sys.executable, str(REPO / "examples" / "hvdkit_digits.py")]
SLOW_LOOP = [sys.executable, str(REPO / "tests" / "slow_loop.py")]
TRAIN = [sys.executable, "-m", "hvdkit", "train"]


# -- pieces, in one process ----------------------------------------------------------------

def test_split_batch_splits_every_nesting():
    Pair = namedtuple("Pair", "x y")
    batch = {"ids": torch.arange(10), "pair": Pair(torch.zeros(10, 3), [torch.ones(10), torch.arange(10) * 2])}
    chunks = split_batch(batch, 4)
    assert [batch_len(c) for c in chunks] == [4, 4, 2]
    assert torch.equal(chunks[2]["ids"], torch.tensor([8, 9]))
    assert isinstance(chunks[1]["pair"], Pair) and torch.equal(chunks[1]["pair"].y[1], torch.tensor([8, 10, 12, 14]))
    x_mask_y = split_batch((torch.zeros(5, 2), torch.ones(5, 2, dtype=torch.bool), torch.arange(5)), 3)
    assert [len(part) for part in x_mask_y] == [3, 3] and torch.equal(x_mask_y[1][2], torch.tensor([3, 4]))
    with pytest.raises(ValueError, match="different numbers of samples"):
        split_batch((torch.zeros(4), torch.zeros(6)), 2)
    with pytest.raises(TypeError, match="cannot split a str"):
        split_batch(("text", torch.zeros(4)), 2)


@pytest.mark.parametrize("scaling, adasum, expected", [
    ("linear", False, 16.0), ("sqrt", False, 4.0), ("none", False, 1.0),
    ("linear", True, 2.0),  # Adasum on CPUs: only K counts
])
def test_lr_multiplier(scaling, adasum, expected):
    cfg = TrainConfig(lr_scaling=scaling, use_adasum=adasum, batches_per_allreduce=2)
    assert lr_multiplier(cfg, size=8, local_size=4, on_gpu_with_nccl=False) == expected


def test_adasum_on_gpus_sums_within_a_node():
    cfg = TrainConfig(use_adasum=True, batches_per_allreduce=2)
    assert lr_multiplier(cfg, size=8, local_size=4, on_gpu_with_nccl=True) == 8.0


def test_warmup_starts_at_base_lr_when_scaled_and_at_zero_when_not():
    cfg = TrainConfig(warmup_epochs=2, lr_schedule="none")
    assert lr_factor(cfg, 0, 10, 4.0) == 1.0 and lr_factor(cfg, 1, 10, 4.0) == 2.5 and lr_factor(cfg, 2, 10, 4.0) == 4
    assert lr_factor(cfg, 0, 10, 1.0) == 0.0 and lr_factor(cfg, 1, 10, 1.0) == 0.5 and lr_factor(cfg, 3, 10, 1.0) == 1
    cosine = TrainConfig(warmup_epochs=0, lr_schedule="cosine")
    assert lr_factor(cosine, 5, 10, 2.0) == pytest.approx(1.0) and lr_factor(cosine, 10, 10, 2.0) == pytest.approx(0)


def test_new_config_keys_are_checked():
    cfg = config.parse(["--optimizer", "adamw", "--lr-scaling", "sqrt", "--compile", "--seq-len", "16"])
    assert (cfg.optimizer, cfg.lr_scaling, cfg.compile, cfg.seq_len) == ("adamw", "sqrt", True, 16)
    for argv, message in ((["--optimizer", "lamb"], "optimizer must be one of sgd, adamw, adam (got 'lamb')"),
                          (["--lr-scaling", "log"], "lr_scaling must be one of linear, sqrt, none"),
                          (["--base-lr", "nan"], "base_lr must be a finite number (got nan)"),
                          (["--clip-grad-norm", "inf"], "clip_grad_norm must be a finite number (got inf)")):
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            config.parse(argv)


def test_environment_variables_set_keys_for_own_loops():
    values = config.from_environ({"HVDKIT_CHECKPOINT_DIR": "ckpt", "HVDKIT_CHECKPOINT_STEPS": "7",
                                  "HVDKIT_AMP": "true", "HVDKIT_CACHE_DIR": "/x", "HVDKIT_MODEL": "123"})
    assert values == {"checkpoint_dir": "ckpt", "checkpoint_steps": 7, "amp": True, "model": "123"}
    with pytest.raises(ConfigError, match="checkpoint_steps must be int"):
        config.from_mapping(config.from_environ({"HVDKIT_CHECKPOINT_STEPS": "many"}))


def test_json_never_holds_nan():
    record = finite_or_none({"loss": math.nan, "rates": [1.0, math.inf], "ok": 2.5, "flag": True})
    assert record == {"loss": None, "rates": [1.0, None], "ok": 2.5, "flag": True}
    json.dumps(record, allow_nan=False)


def test_sync_batch_norm_is_refused_on_cpus(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.BatchNorm1d(4))
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU: the refusal is for CPU-only hosts")
    with pytest.raises(ConfigError, match="SyncBatchNorm runs on GPUs only"):
        sync_batch_norm(model)


def test_sync_batch_norm_converts_layers_keeping_their_state(monkeypatch):
    """hvd.SyncBatchNorm's forward needs a GPU, which this host may not have: torch's CUDA
    check is mocked here to test the conversion only (layers, weights, running stats)."""
    import horovod.torch as hvd

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 3, 1), torch.nn.Sequential(torch.nn.BatchNorm2d(3)))
    with torch.no_grad():
        model[1][0].weight.fill_(2.0)
        model[1][0].running_mean.fill_(0.5)
    converted = sync_batch_norm(model)
    layer = converted[1][0]
    assert isinstance(layer, hvd.SyncBatchNorm)
    assert torch.equal(layer.weight, torch.full((3,), 2.0)) and torch.equal(layer.running_mean, torch.full((3,), 0.5))


# -- real processes ------------------------------------------------------------------------

def _ported(np_, env=None):
    return launch.local_command("mpirun", np_, PORTED), {**os.environ, **(env or {})}


def _wait_for(path, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, f"the run ended before writing {path.name}"
        time.sleep(0.002)


@pytest.fixture(scope="module")
def ported_uninterrupted(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ported") / "ckpt"
    cmd, env = _ported(2, {"HVDKIT_CHECKPOINT_DIR": str(ckpt), "HVDKIT_CHECKPOINT_STEPS": "7"})
    proc = run(cmd, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = selftest.parse_records(proc.stdout, "summary")[0]
    assert summary["steps"] == 115 and summary["test_accuracy"] > 0.9, summary
    return final_weights(ckpt)


@pytest.mark.slow
def test_ported_horovod_example_resumes_after_sigkill_bitwise(tmp_path, ported_uninterrupted):
    ckpt = tmp_path / "ckpt"
    cmd, env = _ported(2, {"HVDKIT_CHECKPOINT_DIR": str(ckpt), "HVDKIT_CHECKPOINT_STEPS": "7"})
    proc = subprocess.Popen(cmd, env=selftest.mpi_root_env(env), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        _wait_for(checkpoint.path_for(str(ckpt), 35), proc)  # mid-epoch 2 (23 steps an epoch)
    finally:
        kill_tree(proc)
    newest = checkpoint.existing(str(ckpt))[-1]
    assert checkpoint.load(newest)["step"] < 115, "killed before the end"
    resumed = run(cmd, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {newest}" in resumed.stderr
    assert_bitwise_equal(final_weights(ckpt), ported_uninterrupted)


def _rank_pids(proc, script_name):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)
                 if any(script_name in part for part in p.cmdline())]
        if len(ranks) == 2:
            return ranks
        time.sleep(0.05)
    raise AssertionError("the two ranks did not start")


@pytest.mark.slow
def test_sigusr1_to_one_rank_stops_every_rank_at_one_step_in_an_own_loop(tmp_path, ported_uninterrupted):
    ckpt = tmp_path / "ckpt"
    cmd, env = _ported(2, {"HVDKIT_CHECKPOINT_DIR": str(ckpt), "HVDKIT_CHECKPOINT_STEPS": "7"})
    proc = subprocess.Popen(cmd, env=selftest.mpi_root_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        ranks = _rank_pids(proc, "hvdkit_digits.py")
        _wait_for(checkpoint.path_for(str(ckpt), 7), proc)
        ranks[1].send_signal(signal.SIGUSR1)  # one rank only, as when one node gets it first
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    assert proc.returncode != 0, err[-3000:]  # stopped and not requeued: not a success (mpirun says 1)
    [line] = [line for line in err.splitlines() if "hvdkit: stopped by SIGUSR1" in line]
    step = int(line.split(" at step ")[1].split(";")[0])
    assert step < 115, line  # the ranks agree on the step after the signal
    assert f"checkpoint of step {step} saved in {ckpt}; not a Slurm job" in line
    assert checkpoint.existing(str(ckpt))[-1] == checkpoint.path_for(str(ckpt), step)
    summary = selftest.parse_records(out, "summary")[0]
    assert summary["stopped"] is True and summary["steps"] == step and summary["exit_code"] == 138
    resumed = run(cmd, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_bitwise_equal(final_weights(ckpt), ported_uninterrupted)


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
    proc = run(launch.local_command("horovodrun --gloo", 2, own))
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


def _train(tmp_path, name, args, launcher=None):
    ckpt = tmp_path / name
    cmd = [*TRAIN, *LM, "--checkpoint-dir", str(ckpt), "--log-dir", str(tmp_path / f"{name}-logs"), *args]
    proc = run(launch.local_command("mpirun", 2, cmd) if launcher == "mpirun" else cmd)
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
        if name.endswith("self_attn.in_proj_bias"):  # (query, key, value) biases
            width = len(two_rank) // 3
            key_bias = slice(width, 2 * width)
            assert (two_rank[key_bias] - one_rank[key_bias]).abs().max() <= 5 * 1e-3
            two_rank[key_bias] = one_rank[key_bias]
        torch.testing.assert_close(two_rank, one_rank, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_language_model_resumes_after_sigkill_bitwise(tmp_path):
    args = ["--max-steps", "24", "--batch-size", "8", "--checkpoint-steps", "4", "--warmup-epochs", "0.01",
            "--amp", "--base-lr", "2e-3"]
    _, uninterrupted = _train(tmp_path, "straight", args, launcher="mpirun")
    ckpt = tmp_path / "killed"
    cmd = launch.local_command("mpirun", 2, [*TRAIN, *LM, "--checkpoint-dir", str(ckpt), "--log-dir",
                                      str(tmp_path / "killed-logs"), *args])
    proc = subprocess.Popen(cmd, env=selftest.mpi_root_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(checkpoint.path_for(str(ckpt), 12), proc)
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
        proc = run(launch.local_command("mpirun", 2, [*TRAIN, *args, *extra, "--checkpoint-dir", str(ckpt),
                                               "--log-dir", str(tmp_path / f"{name}-logs")]), timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        weights[name] = final_weights(ckpt)
    assert weights["eager"].keys() == weights["compiled"].keys(), "checkpoints hold the uncompiled module's keys"
    for name in weights["eager"]:  # inductor may fuse and reorder float ops
        torch.testing.assert_close(weights["compiled"][name], weights["eager"][name], atol=1e-5, rtol=1e-4)


def test_runs_started_at_once_get_directories_of_their_own(tmp_path):
    """The name is the start second; runs started in one second (a job array) must not share."""
    from concurrent.futures import ThreadPoolExecutor

    from hvdkit.rank.startup import new_run_dir

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
def test_readme_own_loop_example_runs_and_resumes(tmp_path):
    """The own-loop example of docs/own-loop.md, as a user would run it, then run again."""
    script = tmp_path / "own_loop.py"
    script.write_text(_first_python_block(REPO / "docs" / "own-loop.md"))
    command = launch.local_command("horovodrun --gloo", 2, [sys.executable, str(script)])
    proc = run(command, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = selftest.parse_records(proc.stdout, "summary")[0]
    # 3,584 samples, 2 ranks x 2 x 32 per step: 28 steps an epoch
    assert summary["world_size"] == 2 and summary["steps"] == 112 and summary["test_samples"] == 512
    assert summary["test_accuracy"] > 0.85, summary
    ckpt = tmp_path / "runs" / "own-loop" / "ckpt"
    assert checkpoint.existing(str(ckpt))[-1] == checkpoint.path_for(str(ckpt), 112)
    again = run(command, cwd=tmp_path)  # finished: resumes at its end and trains nothing more
    assert again.returncode == 0 and "(epoch 5, step 112)" in again.stderr, again.stderr[-2000:]


def _first_python_block(path, after=None):
    text = path.read_text() if after is None else path.read_text().split(after, 1)[1]
    return text.split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_own_loop_excerpt_is_the_tested_example():
    """README.md shows the heart of docs/own-loop.md's example: every line of it stands there."""
    excerpt = _first_python_block(REPO / "README.md", "## Your own loop")
    example = _first_python_block(REPO / "docs" / "own-loop.md").splitlines()
    assert len(excerpt.splitlines()) > 10
    assert [line for line in excerpt.splitlines() if line.strip() and line not in example] == []


def test_documented_port_diff_is_current():
    import difflib

    old, new = "examples/horovod_digits.py", "examples/hvdkit_digits.py"
    diff = "".join(difflib.unified_diff((REPO / old).read_text().splitlines(keepends=True),
                                        (REPO / new).read_text().splitlines(keepends=True), old, new))
    assert f"```diff\n{diff}```" in (REPO / "docs" / "own-loop.md").read_text()


EXTRA_STATE = '''
import sys, torch
import hvdkit

session = hvdkit.Session(checkpoint_dir=sys.argv[1], log_dir=sys.argv[2])
model = torch.nn.Linear(2, 1)
model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
print("restored", session.extra.get("best"), session.global_step)
for _ in range(3):
    optimizer.zero_grad()
    session.backward(model(torch.ones(4, 2)).pow(2).mean())
    session.step()
session.extra["best"] = session.global_step * 10
session.save()
session.finish()
'''


@pytest.mark.slow
def test_extra_state_and_step_survive_a_resume(tmp_path):
    script = tmp_path / "extra.py"
    script.write_text(EXTRA_STATE)
    cmd = [sys.executable, str(script), str(tmp_path / "ckpt"), str(tmp_path / "logs")]
    first, second = run(cmd), run(cmd)
    assert first.returncode == 0 and "restored None 0" in first.stdout, first.stderr[-2000:]
    assert second.returncode == 0 and "restored 30 3" in second.stdout, second.stderr[-2000:]


@pytest.mark.slow
def test_sync_batch_norm_flag_is_refused_in_one_line_on_cpus(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU: the refusal is for CPU-only hosts")
    proc = run([*TRAIN, "--sync-batch-norm", "--max-steps", "1", "--log-dir", str(tmp_path)])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == ("hvdkit train: sync_batch_norm: Horovod's SyncBatchNorm runs on "
                                                    "GPUs only and this host has none; drop sync_batch_norm "
                                                    "(--sync-batch-norm) on CPUs")


def test_plain_progress_lines_say_step_total_rate_and_eta():
    from hvdkit.rank.metrics import progress_text

    assert progress_text(50, 360, 10.0, 40) == "step 50/360 (13%), 4 steps/s, ETA 0:01:18,"
    assert progress_text(10, 360, 0.0, 0) == "step 10/360 (2%),"
    assert progress_text(7, 0, 3.0, 5) == "step 7"
    assert progress_text(9000, 10000, 100.0, 9000) == "step 9000/10000 (90%), 90 steps/s, ETA 0:00:11,"


def test_world_size_changes_time_what_each_change_lost():
    """Records as an elastic job wrote them (tests/test_multihost.py runs one for real): a host
    lost after step 15 (two resets, one change) and one that rejoined after step 75."""
    from hvdkit.rank.metrics import world_size_changes

    def train(step, size, t):
        return {"event": "train", "step": step, "world_size": size, "time": t}

    records = [{"event": "config", "world_size": 3, "time": 0.0},
               train(5, 3, 1.0), train(10, 3, 2.0), train(15, 3, 3.0),
               {"event": "reset", "step": 15, "world_size": 2, "time": 4.0},
               {"event": "reset", "step": 15, "world_size": 2, "time": 4.5},
               train(20, 2, 8.0), train(25, 2, 8.5), {"event": "test", "step": 25, "time": 8.6},
               train(75, 2, 13.5),
               {"event": "reset", "step": 70, "world_size": 3, "time": 20.0},  # 5 steps redone
               train(75, 3, 25.0)]
    # 3 -> 2: 5 s between reports, 5 steps at the new pace of 0.1 s; 2 -> 3: 11.5 s, no net
    # progress to take off (the pace would be the old one: no report follows).
    assert world_size_changes(records) == [{"from": 3, "to": 2, "step": 15, "lost_seconds": 4.5},
                                           {"from": 2, "to": 3, "step": 70, "lost_seconds": 11.5}]
    assert world_size_changes(records[:9]) == [{"from": 3, "to": 2, "step": 15, "lost_seconds": 4.5}]
    assert world_size_changes([train(5, 2, 1.0), {"event": "reset", "step": 5, "world_size": 1, "time": 2.0}]) == []


def test_cpu_jobs_across_hosts_send_large_allreduces_by_the_ring():
    """The settings a Session exports before hvd.init(); the rules file is read by Open MPI in
    every rank (the multi-host benchmark test runs with it)."""
    one_host = performance_settings(on_gpu=False, spans_hosts=False, environ={})
    assert one_host == {"OMPI_MCA_mpi_yield_when_idle": "1", "HOROVOD_CYCLE_TIME": "0.1"}
    hosts = performance_settings(on_gpu=False, spans_hosts=True, environ={})
    assert hosts["OMPI_MCA_coll_tuned_use_dynamic_rules"] == "1" and hosts["OMPI_MCA_btl_tcp_links"] == "2"
    rules = open(hosts["OMPI_MCA_coll_tuned_dynamic_rules_filename"]).read()
    assert rules == ALLREDUCE_RULES
    # allreduce (2), every communicator, below 1 MiB Open MPI's own choice (0), from 1 MiB the ring (4)
    assert rules.split("\n")[:7] == ["1", "2", "1", "1", "2", "0 0 0 0", "1048576 4 0 0"]
    # your own coll_tuned choice wins; GPUs keep Horovod's defaults
    mine = performance_settings(on_gpu=False, spans_hosts=True,
                                environ={"OMPI_MCA_coll_tuned_allreduce_algorithm": "3"})
    assert not any(name.startswith("OMPI_MCA_coll_tuned_") for name in mine) and "OMPI_MCA_btl_tcp_links" in mine
    assert performance_settings(on_gpu=True, spans_hosts=True, environ={}) == {}


@pytest.mark.slow
def test_own_errors_in_a_session_loop_are_one_line_once_under_plain_horovodrun(tmp_path):
    """Step 7's loss is NaN under `horovodrun -np 2 python loop.py`, as a user types it: hvdkit's
    NonFiniteError is printed once, as one line naming the last good checkpoint, with no
    traceback from any rank, and every rank exits 1 (an error). Then the same loop at one rank
    cannot resume that 2-rank checkpoint: one line, exit 2 (bad input), nothing written. A loop
    that catches the error still gets it."""
    ckpt = tmp_path / "ckpt"
    loop = [*SLOW_LOOP, "--epochs", "1", "--checkpoint-dir", str(ckpt), "--checkpoint-steps", "5",
            "--log-dir", str(tmp_path / "logs")]
    proc = run([launch.find_program("horovodrun"), "-np", "2", "-H", "localhost:2", *loop, "--nan-at-step", "7"],
               cwd=tmp_path)
    output = proc.stdout + proc.stderr
    kept = checkpoint.path_for(str(ckpt), 5)
    line = (f"hvdkit: error: the loss or gradients of step 7 (epoch 1) are not finite; stopped before applying them, "
            f"last good checkpoint {kept} kept; lower --base-lr, set --clip-grad-norm, or pass --on-nonfinite skip")
    assert proc.returncode == 1, output[-3000:]
    assert output.count("hvdkit: error:") == 1 and line in proc.stderr.splitlines(), output[-3000:]
    assert "Traceback" not in output and "NonFiniteError" not in output, output[-3000:]
    assert checkpoint.existing(str(ckpt)) == [kept]

    refused = run([*loop], cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert refused.stderr.splitlines() == [
        f"hvdkit: error: checkpoint {kept} was written by 2 ranks, this job has 1; resume with 2 ranks (the data "
        f"order and learning rate depend on it), or start afresh in another --checkpoint-dir"], refused.stderr
    assert checkpoint.existing(str(ckpt)) == [kept]

    caught = run([*loop, "--checkpoint-dir", str(tmp_path / "other"), "--nan-at-step", "3", "--catch"], cwd=tmp_path)
    assert caught.returncode == 3 and "caught: the loss or gradients of step 3" in caught.stdout, caught.stderr[-2000:]


DROPPED_SESSION = """
import atexit, gc, sys, weakref, torch
from torch.utils.data import TensorDataset
import hvdkit

# Registered before the Session, so it runs after hvdkit.rank.startup.exit_quickly (atexit is last-in, first-out).
atexit.register(lambda: print("frozen at exit", gc.get_freeze_count() > 0, flush=True))


def main():
    gc.disable()  # only reference counting may free it, as when a script's function returns
    session = hvdkit.Session(batch_size=4, num_workers=1, log_dir=sys.argv[1])
    loader = session.loader(TensorDataset(torch.randn(64, 3), torch.zeros(64)))
    linear = torch.nn.Linear(3, 1)
    model, optimizer = session.setup(linear, torch.optim.SGD(linear.parameters(), lr=0.1))
    next(iter(loader))
    dropped = weakref.ref(session)
    del session, loader, model, optimizer
    print("freed", dropped() is None, flush=True)


if __name__ == "__main__":
    main()
"""


def test_a_dropped_session_frees_its_loader_workers_and_the_process_exits(tmp_path):
    """The Session's parts point back at it weakly: a cycle kept the Session, and with it the
    loader's persistent workers, alive until exit, where multiprocessing waits for workers that
    ignore SIGTERM (hvdkit.data), and a finished `hvdkit train --num-workers 1` hung (seen in
    tests/test_stops.py). At exit, what is left is frozen before Python's last collections walk
    it (hvdkit.rank.startup.exit_quickly). One process, no launcher."""
    script = tmp_path / "dropped.py"
    script.write_text(DROPPED_SESSION)
    proc = run([sys.executable, str(script), str(tmp_path / "logs")], timeout=60)
    assert proc.returncode == 0 and "freed True" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "frozen at exit True" in proc.stdout, proc.stdout[-2000:]
