"""The own-loop API (hvdkit.Session) with real mpirun and horovodrun processes: the ported Horovod
example, exact resume, preemption, the README's loop, one line for hvdkit's own errors."""

import ast
import os
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
    run,
    wait_for_file,
)
from hvdkit import checkpoint
from hvdkit.checks import selftest
from hvdkit.launch import mpi, planner

PORTED = [sys.executable, str(REPO / "examples" / "hvdkit_digits.py")]
SLOW_LOOP = [sys.executable, str(REPO / "tests" / "programs" / "slow_loop.py")]


# -- real processes ------------------------------------------------------------------------

def _ported(np_, env=None):
    return planner.local_command("mpirun", np_, PORTED), {**os.environ, **(env or {})}


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
        wait_for_file(checkpoint.path_for(str(ckpt), 35), proc)  # mid-epoch 2 (23 steps an epoch)
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
        wait_for_file(checkpoint.path_for(str(ckpt), 7), proc)
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


@pytest.mark.slow
def test_readme_own_loop_example_runs_and_resumes(tmp_path):
    """The own-loop example of docs/own-loop.md, as a user would run it, then run again."""
    script = tmp_path / "own_loop.py"
    script.write_text(_first_python_block(REPO / "docs" / "own-loop.md"))
    command = planner.local_command("horovodrun --gloo", 2, [sys.executable, str(script)])
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
    page = (REPO / "docs" / "own-loop.md").read_text()
    assert f"```diff\n{diff}```" in page

    def code(path: str) -> list:  # the lines after the module docstring
        lines = (REPO / path).read_text().splitlines()
        return lines[ast.parse("\n".join(lines)).body[0].end_lineno:]

    changed = [line[0] for line in difflib.unified_diff(code(old), code(new), lineterm="", n=0)
               if line[:1] in "-+" and line[:3] not in ("---", "+++")]
    assert f"the port removes {changed.count('-')} lines and adds {changed.count('+')}:" in page


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
def test_own_errors_in_a_session_loop_are_one_line_once_under_plain_horovodrun(tmp_path):
    """Step 7's loss is NaN under `horovodrun -np 2 python loop.py`, as a user types it: hvdkit's
    NonFiniteError is printed once, as one line naming the last good checkpoint, with no
    traceback from any rank, and every rank exits 1 (an error). Then the same loop at one rank
    cannot resume that 2-rank checkpoint: one line, exit 2 (bad input), nothing written. A loop
    that catches the error still gets it."""
    ckpt = tmp_path / "ckpt"
    loop = [*SLOW_LOOP, "--epochs", "1", "--checkpoint-dir", str(ckpt), "--checkpoint-steps", "5",
            "--log-dir", str(tmp_path / "logs")]
    proc = run([mpi.find_program("horovodrun"), "-np", "2", "-H", "localhost:2", *loop, "--nan-at-step", "7"],
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


@pytest.mark.slow
def test_a_mistake_in_a_sessions_keywords_is_one_line_from_rank_0_under_plain_horovodrun(tmp_path):
    """`hvdkit.Session(clip_grad_norm=0)` under `horovodrun -np 2 python loop.py`: the
    configuration is read before hvd.init, so rank 0 is known by the launcher's variables; it
    says the error in one line, no rank prints a traceback, the job exits 2 and nothing is written."""
    script = tmp_path / "loop.py"
    script.write_text("import hvdkit\nsession = hvdkit.Session(clip_grad_norm=0)\nprint('trained')\n")
    proc = run([mpi.find_program("horovodrun"), "-np", "2", "-H", "localhost:2", sys.executable, str(script)],
               cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    said = [line for line in output.splitlines() if "hvdkit" in line]
    assert len(said) == 1 and said[0].endswith("hvdkit: error: config: clip_grad_norm must be > 0 (got 0.0)"), said
    assert "Traceback" not in output and "trained" not in output, output[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop.py"], "nothing written"


@pytest.mark.slow
def test_a_non_finite_step_skipped_on_the_device_is_named_at_the_next_checkpoint(tmp_path):
    """Torch's fused SGD skips step 7 on the device and nothing reads its flag until the
    checkpoint at step 10: with stop, the same one line names step 7 there and checkpoint 5 is
    the last; with skip, the warning names step 7, the run ends 0 and every checkpoint is finite."""
    loop = [*SLOW_LOOP, "--epochs", "1", "--checkpoint-steps", "5", "--nan-at-step", "7", "--fused"]
    ckpt = tmp_path / "stop"
    proc = run([mpi.find_program("horovodrun"), "-np", "2", "-H", "localhost:2", *loop,
                "--checkpoint-dir", str(ckpt), "--log-dir", str(tmp_path / "logs")], cwd=tmp_path)
    kept = checkpoint.path_for(str(ckpt), 5)
    line = (f"hvdkit: error: the loss or gradients of step 7 (epoch 1) are not finite; stopped before applying them, "
            f"last good checkpoint {kept} kept; lower --base-lr, set --clip-grad-norm, or pass --on-nonfinite skip")
    assert proc.returncode == 1 and line in proc.stderr.splitlines(), proc.stderr[-3000:]
    printed = proc.stdout.splitlines()  # steps 8 and 9 were taken (and applied) before the read
    assert "step 9" in printed and "step 10" not in printed and checkpoint.existing(str(ckpt)) == [kept], printed
    skip = tmp_path / "skip"
    proc = run([mpi.find_program("horovodrun"), "-np", "2", "-H", "localhost:2", *loop,
                "--checkpoint-dir", str(skip), "--log-dir", str(tmp_path / "logs2")], cwd=tmp_path,
               env={**os.environ, "HVDKIT_ON_NONFINITE": "skip"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if "are not finite" in line]
    assert warnings == ["hvdkit: warning: the loss or gradients of step 7 are not finite; step skipped (1 so far)"], \
        proc.stderr[-3000:]
    files = checkpoint.existing(str(skip))
    assert files and all(torch.isfinite(t).all() for path in files for t in checkpoint.load(path)["model"].values())


DROPPED_SESSION = """
import atexit, gc, sys, weakref, torch
from torch.utils.data import TensorDataset
import hvdkit

# Registered before the Session, so it runs after hvdkit.rank.start.startup.exit_quickly (atexit is last-in, first-out).
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
    tests/rank/test_stops.py). At exit, what is left is frozen before Python's last collections walk
    it (hvdkit.rank.start.startup.exit_quickly). One process, no launcher."""
    script = tmp_path / "dropped.py"
    script.write_text(DROPPED_SESSION)
    proc = run([sys.executable, str(script), str(tmp_path / "logs")], timeout=60)
    assert proc.returncode == 0 and "freed True" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "frozen at exit True" in proc.stdout, proc.stdout[-2000:]
