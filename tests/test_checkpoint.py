"""Checkpoints, resume and failures, with real processes: nothing lost, nothing hung."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from conftest import (
    REPO,
    assert_bitwise_equal,
    elastic_on_this_host,
    final_weights,
    kill_tree,
    leaves,
    metrics_records,
    run,
    untagged,
    wait_for,
    wait_for_file,
)
from hvdkit import checkpoint, job
from hvdkit.checks import selftest
from hvdkit.launch import planner
from hvdkit.system import wholefiles

pytestmark = pytest.mark.slow

TRAIN = [sys.executable, "-m", "hvdkit", "train"]
# The step schedule does not depend on the total number of steps, so a run stopped by
# --max-steps and then resumed follows the same learning rates as one that never stopped.
RUN = ["--model", "mlp", "--epochs", "4", "--lr-schedule", "step", "--lr-decay-epochs", "2", "3"]


def mpirun_train(ckpt, logs, *args):
    return planner.local_command("mpirun", 2, [*TRAIN, "--checkpoint-dir", str(ckpt), "--log-dir", str(logs), *RUN,
                                              *args])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    proc = run(mpirun_train(tmp / "ckpt", tmp / "logs"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return final_weights(tmp / "ckpt")


def test_resume_mid_epoch_is_bitwise_identical(tmp_path, uninterrupted):
    # 1,437 digits on 2 ranks x 32: 23 steps an epoch, so step 30 is mid-epoch 2.
    first = run(mpirun_train(tmp_path / "ckpt", tmp_path / "logs", "--max-steps", "30"))
    assert first.returncode == 0, first.stderr[-3000:]
    assert [p.name for p in checkpoint.existing(str(tmp_path / "ckpt"))] == ["ckpt-step000000023.pt",
                                                                           "ckpt-step000000030.pt"]
    second = run(mpirun_train(tmp_path / "ckpt", tmp_path / "logs"))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stderr and "ckpt-step000000030.pt (epoch 2, step 30)" in second.stderr
    summary = selftest.parse_records(second.stdout, "summary")[0]
    assert summary["steps"] == 92 and summary["epochs"] == 4
    assert_bitwise_equal(final_weights(tmp_path / "ckpt"), uninterrupted)


def test_sigkill_then_resume_is_bitwise_identical(tmp_path, uninterrupted):
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    proc = subprocess.Popen(mpirun_train(ckpt, logs, "--checkpoint-steps", "7"), env=selftest.mpi_root_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not checkpoint.path_for(str(ckpt), 14).exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its second checkpoint"
        time.sleep(0.002)
    kill_tree(proc)
    newest = checkpoint.existing(str(ckpt))[-1]
    assert checkpoint.load(newest)["step"] < 92, "killed before the end"
    resumed = run(mpirun_train(ckpt, logs, "--checkpoint-steps", "7"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {newest}" in resumed.stderr
    assert_bitwise_equal(final_weights(ckpt), uninterrupted)


@pytest.mark.parametrize("launcher", ["mpirun", "horovodrun --gloo"])
def test_a_sharded_checkpoint_killed_and_resumed_is_bitwise_identical(tmp_path, launcher, uninterrupted):
    """--sharded-checkpoint: each rank writes a part, balanced by bytes, and rank 0's main file
    commits them; killed after its second checkpoint and resumed, the run ends with the unsharded
    run's weights; export reads it as one; a checkpoint whose part is lost is passed over."""
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    args = ["--sharded-checkpoint", "--checkpoint-steps", "7", "--keep-checkpoints", "20"]
    proc = subprocess.Popen(planner.local_command(launcher, 2, [*TRAIN, "--checkpoint-dir", str(ckpt), "--log-dir",
                                                              str(logs), *RUN, *args]),
                            env=selftest.mpi_root_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_for_file(checkpoint.path_for(str(ckpt), 14), proc)
    finally:
        kill_tree(proc)
    newest = checkpoint.existing(str(ckpt))[-1]
    assert checkpoint.step_of(newest) < 92, "killed before the end"
    main = checkpoint.load(newest)
    assert [p["file"] for p in main["parts"]] == ["part-00001-of-00002.pt"]
    part = checkpoint.load(checkpoint.shard_folder(newest) / "part-00001-of-00002.pt")
    whole = checkpoint.load_whole(newest)
    total = sum(t.nbytes for t in leaves([whole["model"], whole["optimizer"]["state"]]) if torch.is_tensor(t))
    assert abs(sum(t.nbytes for t in part.values()) - total / 2) < 0.2 * total, "the ranks' shares differ"
    assert any(isinstance(v, checkpoint.Part) for v in main["model"].values()), "rank 1 wrote no weights"
    resumed = run(planner.local_command(launcher, 2, [*TRAIN, "--checkpoint-dir", str(ckpt), "--log-dir", str(logs),
                                                      *RUN, *args]))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {newest}" in resumed.stderr
    assert_bitwise_equal(final_weights(ckpt), uninterrupted)
    last = checkpoint.existing(str(ckpt))[-1]
    exported = run([*TRAIN[:-1], "checkpoint", "export", str(ckpt), str(tmp_path / "export")])
    assert exported.returncode == 0, exported.stderr
    assert_bitwise_equal(torch.load(tmp_path / "export" / "model.pt"), uninterrupted)
    (checkpoint.shard_folder(last) / "part-00001-of-00002.pt").unlink()
    warnings = []
    path, _ = checkpoint.load_latest(str(ckpt), warnings.append)
    assert path == checkpoint.existing(str(ckpt))[-2] and len(warnings) == 1, warnings
    assert warnings[0].startswith(f"{last} is incomplete: cannot read checkpoint "), warnings


def test_training_longer_by_epochs_matches_an_uninterrupted_run(tmp_path, uninterrupted):
    """A finished 2-epoch run resumed with --epochs 4 is the 4-epoch run (a step schedule)."""
    first = run(mpirun_train(tmp_path / "ckpt", tmp_path / "logs", "--epochs", "2"))
    assert first.returncode == 0, first.stderr[-3000:]
    second = run(mpirun_train(tmp_path / "ckpt", tmp_path / "logs", "--epochs", "4"))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "trains to step 92 instead of 46; the step schedule does not depend on the end" in second.stderr
    assert_bitwise_equal(final_weights(tmp_path / "ckpt"), uninterrupted)


def test_training_longer_stretches_a_cosine_schedule(tmp_path):
    """After a resume with a larger --max-steps each step's lr is the longer run's."""
    def lrs(logs):
        return {r["step"]: r["lr"] for r in metrics_records(logs / "metrics.jsonl") if r["event"] == "train"}

    args = ["--lr-schedule", "cosine", "--warmup-epochs", "0", "--log-interval", "1"]
    longer = _one_epoch(tmp_path / "longer", *args, "--max-steps", "40")
    assert longer.returncode == 0, longer.stderr
    first = _one_epoch(tmp_path, *args, "--max-steps", "20")
    assert first.returncode == 0, first.stderr
    second = _one_epoch(tmp_path, *args, "--max-steps", "40", "--log-dir", str(tmp_path / "logs2"))
    assert second.returncode == 0, second.stderr
    # The 20-step decay had reached 0; the 40-step one is half way down from 0.025.
    assert "trains to step 40 instead of 20; the cosine decay now ends at step 40: lr at step 20 0 -> 0.0125" \
        in second.stderr, second.stderr
    resumed, expected = lrs(tmp_path / "logs2"), lrs(tmp_path / "longer" / "logs")
    assert sorted(resumed) == list(range(21, 41))
    assert resumed == pytest.approx({step: expected[step] for step in resumed}, rel=1e-12)


@pytest.fixture(scope="module")
def thirty_steps(tmp_path_factory):
    """Checkpoints and logs of a 30-step run, copied by each test that resumes it."""
    tmp = tmp_path_factory.mktemp("thirty")
    first = _one_epoch(tmp, "--max-steps", "30")
    assert first.returncode == 0, first.stderr
    return tmp


@pytest.mark.parametrize("change", [["--batch-size", "64"], ["--batches-per-allreduce", "2"], ["--base-lr", "0.1"],
                                   ["--seed", "7"]])
def test_a_resume_that_would_change_the_run_is_refused(tmp_path, thirty_steps, change):
    """The 3,729-line loop of issue 12: a resume with another batch size pointed past its epoch."""
    shutil.copytree(thirty_steps, tmp_path, dirs_exist_ok=True)
    before = _snapshot(tmp_path)
    proc = _one_epoch(tmp_path, *change, "--max-steps", "40")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("hvdkit train: checkpoint "), proc.stderr
    assert f"was written with {change[0]} " in proc.stderr and f"drop {change[0]}," in proc.stderr
    assert _snapshot(tmp_path) == before


def _one_epoch(tmp_path, *args, env=None):
    return run([*TRAIN, "--model", "mlp", "--epochs", "1", "--checkpoint-steps", "5", "--keep-checkpoints", "3",
                "--checkpoint-dir", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "logs"), *args], env=env)


def test_corrupted_newest_checkpoint_falls_back_with_a_warning(tmp_path):
    first = _one_epoch(tmp_path, "--max-steps", "20")
    assert first.returncode == 0, first.stderr
    files = checkpoint.existing(str(tmp_path / "ckpt"))
    assert [f.name for f in files] == ["ckpt-step000000010.pt", "ckpt-step000000015.pt", "ckpt-step000000020.pt"]
    data = bytearray(files[-1].read_bytes())
    data[-100] ^= 0xFF
    files[-1].write_bytes(bytes(data))
    second = _one_epoch(tmp_path)
    assert second.returncode == 0, second.stderr
    assert f"hvdkit: warning: {files[-1]} is corrupted (checksum mismatch); using ckpt-step000000015.pt instead" \
        in second.stderr
    assert "resumed from" in second.stderr and "(epoch 1, step 15)" in second.stderr


@pytest.fixture(scope="module")
def five_steps(tmp_path_factory):
    """Checkpoints and logs of a 5-step run on one rank, copied by each test that resumes it."""
    tmp = tmp_path_factory.mktemp("five")
    first = _one_epoch(tmp, "--max-steps", "5")
    assert first.returncode == 0, first.stderr
    return tmp


def _snapshot(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case, args, line, code", [
    ("only-corrupted", [], "is corrupted (checksum mismatch)", 1),
    ("other-model", ["--model", "cnn"], "was written with --model mlp and this run asks for cnn", 2),
    ("no-resume", ["--no-resume"], "holds checkpoints of an earlier run", 2),
    ("elastic", ["--elastic"], "was written by a fixed-size run (without --elastic): resume it the same way", 2),
])
def test_unusable_checkpoints_stop_in_one_line_and_touch_nothing(tmp_path, five_steps, case, args, line, code):
    shutil.copytree(five_steps, tmp_path, dirs_exist_ok=True)
    if case == "only-corrupted":
        path = checkpoint.existing(str(tmp_path / "ckpt"))[0]
        path.write_bytes(path.read_bytes()[:-10])
    before = _snapshot(tmp_path)
    proc = _one_epoch(tmp_path, *args)
    assert proc.returncode == code
    assert proc.stderr.startswith("hvdkit train: ") and line in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert _snapshot(tmp_path) == before, "existing checkpoints and logs untouched"


def test_resume_with_another_world_size_is_refused(tmp_path, five_steps):
    shutil.copytree(five_steps, tmp_path, dirs_exist_ok=True)
    before = _snapshot(tmp_path / "ckpt")
    proc = run(planner.local_command("mpirun", 2, [*TRAIN, "--model", "mlp", "--epochs", "1",
                                           "--checkpoint-dir", str(tmp_path / "ckpt"),
                                           "--log-dir", str(tmp_path / "logs2")]))
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("hvdkit train:")]
    assert len(lines) == 1 and "was written by 1 ranks, this job has 2" in lines[0], proc.stderr[-2000:]
    assert _snapshot(tmp_path / "ckpt") == before


def small_tmpfs(tmp_path, size: str):
    """A tmpfs of ``size`` at tmp_path/disk, for a disk that fills; unmounted after the test."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill the disk needs root (CI runs as root)")
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.fixture
def small_disk(tmp_path):
    """Room for one mlp checkpoint (about 140 KiB), not for two."""
    yield from small_tmpfs(tmp_path, "200k")


@pytest.mark.parametrize("ranks", [1, 2])
def test_disk_full_keeps_the_previous_checkpoint(tmp_path, small_disk, ranks):
    """At 2 ranks (plain horovodrun --gloo) rank 0's line is the job's only one: rank 1, whose Horovod
    shut down as rank 0 ended, does not take rank 0 for a rank gone without a word."""
    args = [*TRAIN, "--model", "mlp", "--epochs", "1", "--checkpoint-steps", "5",
            "--checkpoint-dir", str(small_disk), "--log-dir", str(tmp_path / "logs")]
    proc = run(args if ranks == 1 else planner.local_command("horovodrun --gloo", ranks, args))
    assert proc.returncode == 1
    said = [line for line in untagged(proc.stderr).splitlines() if line.startswith("hvdkit")]
    assert said == [
        f"hvdkit train: cannot write checkpoint {small_disk}/ckpt-step000000010.pt: No space left on device; "
        f"the previous checkpoints are untouched"], proc.stderr[-3000:]
    assert [p.name for p in small_disk.iterdir()] == ["ckpt-step000000005.pt"], "no partial file left"
    assert checkpoint.load(small_disk / "ckpt-step000000005.pt")["step"] == 5


# --- background saves (async_checkpoint, on by default) ---------------------------------------

BIG_STATE = [sys.executable, str(REPO / "tests" / "programs" / "big_state_script.py")]
BIG_LAUNCHERS = ["mpirun", "horovodrun --gloo"]


def big_state(launcher, ckpt, logs, *args):
    """A Session loop whose 134 MB checkpoints (every 5 steps of 20) take a second to write."""
    return planner.local_command(launcher, 2, [*BIG_STATE, "--checkpoint-dir", str(ckpt), "--log-dir", str(logs),
                                               *args])


def partials(ckpt):
    return sorted(p.name for p in ckpt.glob(f".{checkpoint.PREFIX}*{wholefiles.PARTIAL}"))


def start_until_second_save(launcher, ckpt, logs):
    """The job, once its second save (step 10) is being written in the background: the first is
    whole and the second's temporary is there."""
    proc = subprocess.Popen(big_state(launcher, ckpt, logs), env=selftest.mpi_root_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for(lambda: checkpoint.path_for(str(ckpt), 5).exists() and partials(ckpt), proc,
                 "the second checkpoint's background write")
    except BaseException:
        kill_tree(proc)
        raise
    return proc


@pytest.fixture(scope="module")
def big_state_run(tmp_path_factory):
    """The run undisturbed, its checkpoints written in the training thread, with a stop's grace
    shorter than they take to write: (its final weights, its stderr)."""
    tmp = tmp_path_factory.mktemp("big-state")
    proc = run(big_state("mpirun", tmp / "ckpt", tmp / "logs", "--sync"), env={**os.environ, job.STOP_GRACE: "0.01"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = selftest.parse_records(proc.stdout, "summary")[0]["checkpoints"]
    assert summary["background"] is False and summary["saves"] == 4
    saves = [r for r in metrics_records(tmp / "logs" / "metrics.jsonl") if r["event"] == "checkpoint"]
    assert [r["step"] for r in saves] == [5, 10, 15, 20]
    # In the training thread a save holds training for its write, counted once.
    assert all(2 * r["write_seconds"] > r["stall_seconds"] >= r["write_seconds"] > 0 for r in saves), saves
    assert all(r["background"] is False for r in saves)
    return final_weights(tmp / "ckpt"), proc.stderr


@pytest.fixture(scope="module")
def big_state_reference(big_state_run):
    return big_state_run[0]


def test_a_checkpoint_that_outlasts_a_stops_grace_is_warned_about_once(big_state_run):
    warnings = [line for line in big_state_run[1].splitlines() if "warning" in line]
    assert len(warnings) == 1, big_state_run[1][-3000:]
    assert re.fullmatch(r"hvdkit: warning: the last checkpoint took \d+\.\d s to write, more than the 0.01 s a stop "
                        r"gives a rank to save and end \(HVDKIT_STOP_GRACE\); at a stop it would be cut off and the "
                        r"run would resume from the checkpoint before: raise HVDKIT_STOP_GRACE, and under Slurm the "
                        r"lead time of --signal \(USR1@N\) above it", warnings[0]), warnings


@pytest.mark.parametrize("launcher", ["mpirun"])  # a SIGKILL of the whole tree: no launcher's part in it
def test_a_job_killed_during_a_background_save_resumes_from_the_one_before(tmp_path, launcher, big_state_reference):
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    proc = start_until_second_save(launcher, ckpt, logs)
    kill_tree(proc)
    assert [p.name for p in checkpoint.existing(str(ckpt))] == ["ckpt-step000000005.pt"]
    assert partials(ckpt), "the job was killed after its write ended, not during it"
    resumed = run(big_state(launcher, ckpt, logs))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {ckpt / 'ckpt-step000000005.pt'}" in resumed.stderr
    assert partials(ckpt) == []
    assert_bitwise_equal(final_weights(ckpt), big_state_reference)
    summary = selftest.parse_records(resumed.stdout, "summary")[0]["checkpoints"]
    assert summary["background"] is True and summary["saves"] == 3, summary
    saves = [r for r in metrics_records(logs / "metrics.jsonl") if r["event"] == "checkpoint"]
    assert [r["step"] for r in saves][-3:] == [10, 15, 20] and all(r["background"] for r in saves[-3:])


@pytest.mark.parametrize("launcher", BIG_LAUNCHERS)
def test_a_stop_during_a_background_save_finishes_it_then_writes_its_own(tmp_path, launcher, big_state_reference):
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    proc = start_until_second_save(launcher, ckpt, logs)
    try:
        # To the ranks, as Slurm signals each task: plain mpirun would give them 1 s (docs/stops-and-recovery.md).
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)
                 if p.name().startswith("python") and any(part.endswith("big_state_script.py") for part in p.cmdline())]
        assert len(ranks) == 2, ranks
        for rank in ranks:
            rank.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        kill_tree(proc)
    steps = [checkpoint.step_of(p) for p in checkpoint.existing(str(ckpt))]
    assert f"stopped by SIGTERM at step {steps[-1]}; checkpoint of step {steps[-1]} saved" in stderr, stderr[-3000:]
    assert steps[:2] == [5, 10] and steps[-1] > 10, (steps, stderr[-3000:])  # the one in flight, then the stop's
    assert partials(ckpt) == []
    resumed = run(big_state(launcher, ckpt, logs))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {checkpoint.path_for(str(ckpt), steps[-1])}" in resumed.stderr
    assert_bitwise_equal(final_weights(ckpt), big_state_reference)


@pytest.fixture
def disk_for_one_big_checkpoint(tmp_path):
    """Room for one 134 MB checkpoint, not for two."""
    yield from small_tmpfs(tmp_path, "200m")


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
@pytest.mark.parametrize("launcher", BIG_LAUNCHERS)
def test_a_disk_that_fills_during_a_background_save_ends_the_job_in_one_line(tmp_path, launcher, sharded,
                                                                             disk_for_one_big_checkpoint):
    """Sharded, the disk fills under rank 0's main file or rank 1's part, whichever is written
    last: that rank says so. The other rank, in backward when it ends, must not hang (0010's fix)."""
    disk = disk_for_one_big_checkpoint
    proc = run(big_state(launcher, disk, tmp_path / "logs"),
               env={**os.environ, "HVDKIT_SHARDED_CHECKPOINT": str(sharded).lower()})
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    main = disk / "ckpt-step000000010.pt"
    lines = {f"hvdkit: error: cannot write checkpoint {path}: No space left on device; the previous checkpoints "
             f"are untouched" for path in [main, *[checkpoint.shard_folder(main) / "part-00001-of-00002.pt"] * sharded]}
    assert len(errors) == 1 and errors[0] in lines, proc.stderr[-3000:]
    assert [p.name for p in checkpoint.existing(str(disk))] == ["ckpt-step000000005.pt"]
    if not sharded:
        assert [p.name for p in disk.iterdir()] == ["ckpt-step000000005.pt"], "no partial file left"
    assert checkpoint.load_whole(disk / "ckpt-step000000005.pt")["step"] == 5


def test_a_background_save_writes_the_state_as_it_was_when_saved(tmp_path):
    writer = checkpoint.Writer()
    weights = torch.arange(1_000_000, dtype=torch.float32)
    model = torch.nn.BatchNorm1d(3).state_dict()  # an OrderedDict with the _metadata load_state_dict reads
    state = {"model": {"w": weights, "tied": weights}, "optimizer": {"param_groups": [{"lr": 0.1}]}, "step": 5,
             "norm": model}
    target = writer.save(str(tmp_path), 5, state, keep=3)
    weights.add_(1)  # the training goes on while the thread writes
    state["optimizer"]["param_groups"][0]["lr"] = 0.2
    writer.finish()
    saved = checkpoint.load(target)
    assert torch.equal(saved["model"]["w"], torch.arange(1_000_000, dtype=torch.float32))
    assert saved["model"]["tied"].data_ptr() == saved["model"]["w"].data_ptr(), "shared memory stays shared"
    assert saved["optimizer"]["param_groups"][0]["lr"] == 0.1 and saved["step"] == 5
    assert type(saved["norm"]) is type(model) and saved["norm"]._metadata == model._metadata
    writer.save(str(tmp_path), 6, state, keep=3)  # the host buffers are reused: the new values are saved
    writer.finish()
    assert torch.equal(checkpoint.load(checkpoint.path_for(str(tmp_path), 6))["model"]["w"], weights)
    assert (writer.saves, writer.waits) == (2, 0) and writer.writing > 0 and writer.stall > 0
    assert [(r["step"], r["background"]) for r in writer.take_done()] == [(5, True), (6, True)]
    assert writer.take_done() == []


def test_a_snapshot_reads_back_every_tensor_as_it_was_from_alternating_slots(tmp_path):
    """A snapshot's file (raw: its tensors' bytes in a slot beside it, xxh3-128): dtypes numpy
    lacks, a scalar, an empty tensor, a strided view, tied weights stored once and read back as
    one, a state_dict's metadata, plain values. The next snapshot goes into the other slot, so the
    one before still reads; a byte changed in the file or in its slot is a checksum mismatch."""
    from hvdkit.checkpoint import slots
    from hvdkit.rehearse import verdict

    norm = torch.nn.BatchNorm1d(3).state_dict()
    tied = torch.randn(5, 4)
    state = {"model": norm, "tied": [tied, tied], "bf16": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
             "strided": torch.randn(4, 6)[:, ::2], "scalar": torch.tensor(3.5), "empty": torch.empty(0, 4),
             "flags": torch.tensor([True, False]), "step": 7, "nested": {"lr": 0.1, "names": ("a", "b")}}
    first, second = checkpoint.path_for(str(tmp_path), 7), checkpoint.path_for(str(tmp_path), 8)
    mapped = slots.Mapped()
    digest = checkpoint.write(first, state, raw=mapped)
    assert first.read_bytes().startswith(b"HVDKIT-CHECKPOINT 1 raw xxh3-128=" + digest.encode() + b"\n")
    checkpoint.write(second, {**state, "step": 8, "tied": [tied + 1, tied + 1]}, raw=mapped)
    mapped.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name, second.name, "slot-a.data", "slot-b.data"]
    back = checkpoint.load(first)
    assert verdict.difference(back, state) is None and back["step"] == 7 and back["nested"]["names"] == ("a", "b")
    assert back["tied"][0] is back["tied"][1] and back["bf16"].dtype == torch.bfloat16
    assert back["empty"].shape == (0, 4) and torch.equal(back["strided"], state["strided"])
    assert type(back["model"]) is type(norm) and back["model"]._metadata == norm._metadata
    assert torch.equal(checkpoint.load(second)["tied"][1], tied + 1)
    for changed, why in ((tmp_path / "slot-b.data", "slot slot-b.data does not hold it"), (first, "checksum")):
        data = bytearray(changed.read_bytes())
        data[-3 if changed == first else 0] ^= 1
        changed.write_bytes(bytes(data))
        with pytest.raises(checkpoint.CheckpointError, match=f"corrupted.*{why}"):
            checkpoint.load(second if changed != first else first)


def test_a_value_known_after_the_save_returns_is_waited_for_by_the_writing_thread(tmp_path):
    """checkpoint.Later (a snapshot's RNG gather in flight): save() returns without calling it;
    the thread writes what it returns once it does."""
    import threading

    gathered = threading.Event()
    writer = checkpoint.Writer()
    target = writer.save(str(tmp_path), 3, {"rng": checkpoint.Later(lambda: gathered.wait(60) and [1, 2])}, keep=1)
    assert writer.in_flight() and not target.exists()
    gathered.set()
    writer.finish()
    assert checkpoint.load(target)["rng"] == [1, 2]


def test_a_sharded_state_splits_by_bytes_and_joins_whole(tmp_path):
    """Three ranks' parts of a state with tied weights, a buffer no rank shares and the
    optimizer's state; written as the ranks' writers do (one in the background), read as one."""
    tied = torch.randn(64, 32)
    shared = [tied, torch.randn(1000), torch.randn(10), torch.randn(300)]
    model = torch.nn.BatchNorm1d(3).state_dict()
    state = {"model": {"a": tied, "a_again": tied, "b": shared[1], "norm": model},
             "optimizer": {"state": {0: {"momentum": shared[2], "step": torch.tensor(3.0)}, 1: {"m": shared[3]}},
                           "param_groups": [{"lr": 0.1}]}, "step": 7}
    main, parts = checkpoint.split(state, shared, 3)
    # The largest first, each to the rank with the fewest bytes: 8192 to rank 0, 4000 to 1, 1200 and 40 to 2.
    assert parts[0] == {} and [sum(t.nbytes for t in p.values()) for p in parts[1:]] == [4000, 1240]
    assert main["model"]["a"] is tied and main["model"]["b"].file == "part-00001-of-00003.pt"
    assert torch.equal(main["model"]["norm"]["running_mean"], model["running_mean"]), "not shared: in the main file"
    assert type(main["model"]["norm"]) is type(model) and state["model"]["a"] is tied, "the state is left as it was"
    writers = [checkpoint.Writer(background=rank == 1) for rank in range(3)]
    for rank in (2, 1):
        writers[rank].save(str(tmp_path), 7, None, keep=3, part=(checkpoint.part_name(rank, 3), parts[rank]),
                           deferred=shared)
    writers[0].save(str(tmp_path), 7, main, keep=3, parts=[checkpoint.part_name(r, 3) for r in (1, 2)])
    writers[1].finish()
    whole = checkpoint.load_whole(checkpoint.path_for(str(tmp_path), 7))
    assert "parts" not in whole and whole["step"] == 7 and whole["optimizer"]["param_groups"] == [{"lr": 0.1}]
    for key in ("a", "a_again", "b"):
        assert torch.equal(whole["model"][key], state["model"][key]), key
    assert torch.equal(whole["optimizer"]["state"][1]["m"], shared[3])
    assert whole["model"]["norm"]._metadata == model._metadata


def _held_copies(monkeypatch):
    """The thread's deferred copies held until the event is set (a test seam in hvdkit's own code)."""
    import threading

    from hvdkit.checkpoint import writer

    release, real_copy = threading.Event(), writer._copy

    def held_copy(copies):
        release.wait(30)
        return real_copy(copies)

    monkeypatch.setattr(writer, "_copy", held_copy)
    return release


def test_deferred_tensors_are_copied_by_the_thread_before_the_next_update(tmp_path, monkeypatch):
    """The weights are copied while the next forward runs (which changes batch norm's statistics,
    copied before save() returns); before_update() waits for that copy, then the step may change them."""
    import threading

    release = _held_copies(monkeypatch)
    writer = checkpoint.Writer()
    weights, statistics = torch.zeros(1000), torch.zeros(10)
    target = writer.save(str(tmp_path), 1, {"w": weights, "running_mean": statistics}, keep=3, deferred=[weights])
    statistics.add_(1)  # the next forward
    waited = threading.Event()
    updater = threading.Thread(target=lambda: (writer.before_update(), waited.set()))
    updater.start()
    assert not waited.wait(0.3), "before_update() returned before the deferred copy was made"
    release.set()
    updater.join(30)
    weights.add_(1)  # the optimizer step
    writer.finish()
    saved = checkpoint.load(target)
    assert torch.equal(saved["w"], torch.zeros(1000)) and torch.equal(saved["running_mean"], torch.zeros(10))
    record, = writer.take_done()
    assert record["step"] == 1 and record["stall_seconds"] >= 0.3, record


def test_deferred_tensors_changed_before_the_update_fail_that_save_in_one_line(tmp_path, monkeypatch):
    """A loop that changes the weights in place between a background save and the next optimizer step
    (weight clipping after step()) would have a checkpoint of either values: it is not written."""
    writer = checkpoint.Writer()
    writer.save(str(tmp_path), 1, {"w": torch.zeros(10)}, keep=3)
    writer.finish()
    release = _held_copies(monkeypatch)  # the second save's copy only: the first is written as it comes
    weights = torch.zeros(10)
    writer.save(str(tmp_path), 2, {"w": weights}, keep=3, deferred=[weights])
    weights.clamp_(min=1)
    release.set()
    writer.wait()
    with pytest.raises(checkpoint.CheckpointError) as error:
        writer.check()
    assert str(error.value) == (
        f"checkpoint {tmp_path}/ckpt-step000000002.pt not written: 1 tensors of the weights or the optimizer's "
        f"state changed in place after the save and before the next optimizer step, while being copied in the "
        f"background; change them in the optimizer step, or save with --no-async-checkpoint "
        f"(async_checkpoint=False); the previous checkpoints are untouched")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-step000000001.pt"]


def test_a_save_waits_for_the_one_in_flight_and_a_failed_one_is_said_once(tmp_path, monkeypatch):
    """The thread is held at the write (a test seam in hvdkit's own code): the next save must wait."""
    import threading

    from hvdkit.checkpoint import writer as checkpoint_writer

    release, real_save = threading.Event(), checkpoint_writer.save

    def held_save(*args, **kwargs):
        release.wait(30)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(checkpoint_writer, "save", held_save)
    writer = checkpoint.Writer()
    writer.save(str(tmp_path), 1, {"step": 1}, keep=3)
    assert writer.in_flight()
    threading.Timer(0.2, release.set).start()
    writer.save(str(tmp_path), 2, {"step": 2}, keep=3)  # returns once the first is written
    assert checkpoint.path_for(str(tmp_path), 1).exists() and writer.waits == 1
    writer.finish()
    (tmp_path / "blocked").write_text("a file where the next save wants a directory")
    writer.save(str(tmp_path / "blocked"), 3, {"step": 3}, keep=3)
    writer.wait()
    with pytest.raises(checkpoint.CheckpointError, match="cannot write checkpoint .*blocked/ckpt-step000000003.pt"):
        writer.check()
    writer.check()  # said once
    assert [p.name for p in checkpoint.existing(str(tmp_path))] == ["ckpt-step000000001.pt", "ckpt-step000000002.pt"]


# --- failure semantics: one rank fails, the whole job ends, non-zero, within 60 s ------------

FAILING_RANK = """
import os, signal, sys, time
import torch, horovod.torch as hvd
hvd.init()
for step in range(1000):
    if hvd.rank() == 1 and step == 3:
        if sys.argv[1] == "raise":
            raise RuntimeError("rank 1 fails on purpose")
        os.kill(os.getpid(), signal.SIGKILL)
    hvd.allreduce(torch.ones(4), name=f"step.{step}")
    time.sleep(0.01)
"""

LAUNCHES = {
    "horovodrun --gloo": lambda cmd: planner.local_command("horovodrun --gloo", 2, cmd),
    "horovodrun --mpi": lambda cmd: planner.local_command("horovodrun --mpi", 2, cmd),
    "mpirun": lambda cmd: planner.local_command("mpirun", 2, cmd),
}


@pytest.mark.parametrize("how", ["raise", "kill"])
@pytest.mark.parametrize("launcher", list(LAUNCHES))
def test_a_failing_rank_ends_the_job_within_60s(tmp_path, launcher, how):
    script = tmp_path / "fail.py"
    script.write_text(FAILING_RANK)
    start = time.monotonic()
    proc = subprocess.Popen(LAUNCHES[launcher]([sys.executable, str(script), how]), env=selftest.mpi_root_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        pytest.fail(f"{launcher}: the job was still running 60 s after rank 1 failed ({how})")
    assert proc.returncode != 0, output[-2000:]
    assert time.monotonic() - start < 60


STALLING_RANK = """
import os, sys, time
import torch, horovod.torch as hvd
from hvdkit.rank.startup import stall_settings
from hvdkit.rank.watchdog import Watchdog
os.environ.update(stall_settings(float(sys.argv[1])))  # what the Trainer sets up
hvd.init()
watchdog = Watchdog(float(sys.argv[1]), hvd.rank())
hvd.allreduce(torch.ones(1), name="warmup")
watchdog.beat("training step 7")
if hvd.rank() == 1:
    time.sleep(600)  # stops calling collectives without failing
hvd.allreduce(torch.ones(4), name="grad.layer1.weight")
"""


@pytest.mark.parametrize("launcher", ["horovodrun --gloo", "mpirun"])
def test_a_stalled_collective_is_named_and_ends_the_job(tmp_path, launcher):
    script = tmp_path / "stall.py"
    script.write_text(STALLING_RANK)
    proc = subprocess.Popen(LAUNCHES[launcher]([sys.executable, str(script), "6"]), env=selftest.mpi_root_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        pytest.fail(f"{launcher}: a stall with a 6 s timeout was still hanging after 60 s")
    assert proc.returncode != 0
    if launcher == "mpirun":  # Horovod's stall inspector names the tensor and the missing rank before the limit
        assert "Missing ranks:" in output and "grad.layer1.weight" in output, output[-3000:]
    # hvdkit's watchdog ends the job at the limit and says where each rank was (under Gloo Horovod says
    # nothing). Both ranks' watchdogs run; whichever fires first ends the job, so either may speak.
    assert re.search(r"hvdkit: rank [01] made no progress for \d+ s in training step 7", output), output[-3000:]


def test_stall_settings():
    from hvdkit.rank.startup import stall_settings

    assert stall_settings(300) == {"HOROVOD_STALL_CHECK_TIME_SECONDS": "60",
                                   "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "305", "HOROVOD_GLOO_TIMEOUT_SECONDS": "305"}
    assert stall_settings(6) == {"HOROVOD_STALL_CHECK_TIME_SECONDS": "2", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "11",
                                 "HOROVOD_GLOO_TIMEOUT_SECONDS": "11"}
    assert stall_settings(0) == {"HOROVOD_STALL_CHECK_DISABLE": "1"}


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


# --- elastic training: a worker removed from discovery, then added back -----------------------

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


def test_requeues_are_bounded(tmp_path):
    """Past the bound, no scontrol requeue is run and the exit code says the job stopped."""
    from hvdkit.rank import stops

    assert stops.requeue({}, 3) == "not a Slurm job: rerun the same command to resume"
    limited = stops.requeue({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "3"}, 3)
    assert limited == "not requeued: job 7 was restarted 3 times already (--max-requeues 3)"
    stopped = {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "3"}
    assert stops.after_stop(signal.SIGUSR1, stopped, 3) == (limited, 138)
    assert not stops.will_requeue(signal.SIGUSR1, stopped, 3)
    assert stops.will_requeue(signal.SIGUSR1, dict(stopped, SLURM_RESTART_COUNT="2"), 3)
    assert not stops.will_requeue(signal.SIGTERM, dict(stopped, SLURM_RESTART_COUNT="0"), 3)


def test_without_scontrol_every_rank_exits_138_for_the_job_script_to_requeue(monkeypatch, tmp_path):
    """In a container under Slurm (slurm/container.sbatch) the ranks see the job but not Slurm's
    commands: no rank takes the stop for a requeue, and the script outside requeues on 138."""
    from hvdkit.rank import stops

    monkeypatch.setenv("PATH", str(tmp_path))
    job = {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "0"}
    said, code = stops.after_stop(signal.SIGUSR1, job, 3)
    assert code == 138 and said == ("not requeued from here: no scontrol on PATH (a container?); every rank exits "
                                    "138 for the job script to requeue job 7")
    assert not stops.will_requeue(signal.SIGUSR1, job, 3)


def test_a_failed_whole_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "record.json"
    target.write_text("old")
    with pytest.raises(TypeError):
        wholefiles.write_whole(target, (b"half of the new", object()))  # fails after its first part is written
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["record.json"]
    wholefiles.write_whole(target, "new")
    assert target.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["record.json"]


def test_a_killed_save_leaves_no_temporary_file(tmp_path):
    """A save killed mid-write leaves .ckpt-step….pt.PID.partial; the next save removes it."""
    stale = tmp_path / f".{checkpoint.path_for(str(tmp_path), 5).name}.4242{wholefiles.PARTIAL}"
    stale.write_bytes(b"half a checkpoint")
    checkpoint.save(str(tmp_path), 6, {"step": 6}, keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-step000000006.pt"]


GOLDEN_CHECKPOINTS = REPO / "tests" / "golden" / "checkpoints"


@pytest.mark.parametrize("kind", ["sharded", "zero"])
def test_checkpoints_written_by_an_earlier_hvdkit_load_whole_and_export(kind, tmp_path):
    """A checkpoint of each format written at e52fb9d (tests/golden/checkpoints/README.md): a
    sharded save's parts and ZeRO's shards join into the same state, bit for bit, as the plain
    checkpoint of the same two steps, and each exports to plain torch files."""
    from hvdkit.rehearse import verdict

    plain_path, path = (checkpoint.existing(str(GOLDEN_CHECKPOINTS / name))[-1] for name in ("plain", kind))
    plain, state = verdict.plain(plain_path), verdict.plain(path)
    assert plain["step"] == 2 and list(plain["model"]) == ["1.weight", "1.bias", "3.weight", "3.bias", "5.weight",
                                                            "5.bias"]
    assert verdict.difference(plain, state) is None
    for source, out in ((plain_path, tmp_path / "plain"), (path, tmp_path / kind)):
        proc = run([sys.executable, "-m", "hvdkit", "checkpoint", "export", str(source), str(out)])
        assert proc.returncode == 0, proc.stderr[-2000:]
    for name in ("model.pt", "optimizer.pt"):
        assert verdict.difference(torch.load(tmp_path / "plain" / name), torch.load(tmp_path / kind / name)) is None
