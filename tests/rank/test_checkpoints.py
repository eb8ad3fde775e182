"""A run's checkpoints (hvdkit.rank.resume.checkpoints) with real ranks: resumed bitwise, refused where a
resume would change the run, fallen back from where one is unusable, kept where the disk fills,
and background saves met by kills and stops. Nothing lost, nothing hung."""

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


def _run_to(tmp_path_factory, steps: int):
    """Checkpoints and logs of a run to ``steps``, made once for the tests that copy and resume it."""
    tmp = tmp_path_factory.mktemp(f"steps-{steps}")
    first = _one_epoch(tmp, "--max-steps", str(steps))
    assert first.returncode == 0, first.stderr
    return tmp


@pytest.fixture(scope="module")
def thirty_steps(tmp_path_factory):
    return _run_to(tmp_path_factory, 30)


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
    return _run_to(tmp_path_factory, 5)  # on one rank


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
    whole and the second's temporary is there. A stop's grace of 60 s: finishing the write in flight
    and then the stop's own (134 MB each) ran past the default 10 s once in CI, beside the suite's
    other worker; what is tested here is their order, not the disk's speed."""
    proc = subprocess.Popen(big_state(launcher, ckpt, logs), env={**selftest.mpi_root_env(), job.STOP_GRACE: "60"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
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
