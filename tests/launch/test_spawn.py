"""hvdkit.run: the notebook under examples/ in a real Jupyter kernel, and a user's script calling
it (tests/programs/spawn_caller.py), with real launches: values back in rank order, a rank's exception or
unpicklable value named, Ctrl-C stopping every rank with a checkpoint and nothing left running,
nor after the caller is ended by a signal or killed."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from conftest import REPO, run, wait_for
from hvdkit import checkpoint
from hvdkit.checks import selftest
from hvdkit.launch import spawn

CALLER = REPO / "tests" / "programs" / "spawn_caller.py"
NOTEBOOK = REPO / "examples" / "hvdkit_run.ipynb"  # its settings are conftest.TWO_RANK_TRAIN


def test_the_launch_line_of_hvdkit_run_golden():
    assert spawn.launch_command(2, "gloo", "/runs/d", hosts="h1:1,h2:1", env={"OMP_NUM_THREADS": "1"}) == [
        sys.executable, "-m", "hvdkit", "launch", "-np", "2", "--launcher", "horovodrun", "--gloo",
        "-H", "h1:1,h2:1", "-x", "PYTHONUNBUFFERED=1", "-x", "OMP_NUM_THREADS=1",
        "--", sys.executable, "-m", "hvdkit.launch.spawn", "/runs/d"]
    assert spawn.launch_command(3, "mpirun", "/runs/d")[3:9] == ["launch", "-np", "3", "--launcher", "mpirun", "-x"]


def test_bad_arguments_are_one_line_before_anything_starts():
    import hvdkit

    with pytest.raises(ValueError, match=r"^hvdkit.run: launcher='srun'; expected one of horovodrun, mpirun, gloo$"):
        hvdkit.run(print, launcher="srun")
    with pytest.raises(ValueError, match=r"^hvdkit.run: np=0; expected a whole number >= 1$"):
        hvdkit.run(print, np=0)
    lock = __import__("threading").Lock()
    with pytest.raises(hvdkit.RunError, match=r"^hvdkit.run: 'print' or its arguments cannot be pickled to send "
                                              r"to the ranks: cannot pickle '_thread.lock' object$"):
        hvdkit.run(print, lock)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["horovodrun", "mpirun", "gloo"])
def test_the_notebook_trains_on_every_rank_to_the_weights_of_hvdkit_train(launcher, tmp_path, monkeypatch,
                                                                          two_ranks_trained):
    import nbformat
    import torch
    from nbclient import NotebookClient

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    cells = {tag: cell for cell in notebook.cells for tag in cell.metadata.get("tags", [])}
    cells["parameters"].source = f'LAUNCHER = "{launcher}"\nNP = 2'
    notebook.cells.append(nbformat.v4.new_code_cell('torch.save([r["weights"] for r in results], "weights.pt")'))
    for name, value in selftest.mpi_root_env({}).items():
        monkeypatch.setenv(name, value)
    notebook = NotebookClient(notebook, timeout=300, kernel_name="python3",
                              resources={"metadata": {"path": str(tmp_path)}}).execute()

    cells = {tag: cell for cell in notebook.cells for tag in cell.metadata.get("tags", [])}
    assert cells["values"].outputs[0]["data"]["text/plain"] == "[(0, 20), (1, 20)]"
    assert cells["same-weights"].outputs[0]["data"]["text/plain"] == "True"
    printed = "".join(output.get("text", "") for output in cells["run"].outputs if output["output_type"] == "stream")
    assert any(line.startswith("[0] [train] step 20/20") for line in printed.splitlines()), printed[-2000:]
    for weights in torch.load(tmp_path / "weights.pt"):
        assert weights.keys() == two_ranks_trained.keys()
        for name, value in weights.items():
            assert torch.equal(value, two_ranks_trained[name]), name


@pytest.mark.slow
def test_a_rank_that_raises_or_returns_what_cannot_be_pickled_is_named_in_the_caller():
    proc = run([sys.executable, str(CALLER), "errors", "gloo"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    raised, unpicklable = (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{"))
    host = os.uname().nodename
    assert raised["rank"] == 1 and raised["host"] == host
    assert raised["error"].startswith(f"rank 1 on {host} raised ValueError: rank one's bad value\n\n"
                                      "rank 1's traceback:\nTraceback (most recent call last):\n")
    assert "in raises_on_rank_one\n" in raised["error"] and raised["cause"] == 'ValueError("rank one\'s bad value")'
    assert unpicklable["error"] == (f"hvdkit.run: rank {unpicklable['rank']} on {host} returned a generator, which "
                                    "cannot be pickled to send back: cannot pickle 'generator' object")


@pytest.mark.slow
def test_ctrl_c_in_the_caller_stops_every_rank_with_a_checkpoint_and_leaves_nothing(tmp_path):
    import psutil

    mark = uuid.uuid4().hex  # in the environment of everything the caller starts
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    proc = run([sys.executable, str(CALLER), "interrupt", "horovodrun", str(ckpt), str(logs)],
               env=dict(os.environ, HVDKIT_TEST_MARK=mark), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(proc.stdout.splitlines()[-1])
    assert record["interrupted"] and record["sent_after"] >= 5, record
    assert record["returned_after"] < 15, record
    (stopped,) = [line for line in proc.stderr.splitlines() if line.startswith("hvdkit launch: stopped by SIGINT")]
    step = int(stopped.split(" at step ")[1].split(";")[0])
    assert checkpoint.existing(str(ckpt))[-1] == checkpoint.path_for(str(ckpt), step), stopped
    left = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("HVDKIT_TEST_MARK") == mark:
                left.append(process.cmdline())
        except psutil.Error:
            pass
    assert left == []


def _marked(mark):
    import psutil

    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("HVDKIT_TEST_MARK") == mark:
                found.append(process)
        except psutil.Error:
            pass
    return found


@pytest.mark.slow
@pytest.mark.parametrize("ending", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_caller_ended_by_a_scheduler_or_killed_takes_its_job_with_it(tmp_path, ending):
    """As `timeout 20 python caller.py` does, or a notebook server shutting down: the ranks stop
    (SIGTERM: with their checkpoint, then the caller ends by the signal) and nothing of the job
    runs 20 s later."""
    mark = uuid.uuid4().hex
    ckpt, logs, tmp = tmp_path / "ckpt", tmp_path / "logs", tmp_path / "tmp"
    tmp.mkdir()
    caller = subprocess.Popen([sys.executable, str(CALLER), "forever", "gloo", str(ckpt), str(logs)],
                              env=dict(os.environ, HVDKIT_TEST_MARK=mark, TMPDIR=str(tmp)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (logs / "metrics.jsonl").exists() and '"train"' in (logs / "metrics.jsonl").read_text(),
                 caller, "training to report")
        caller.send_signal(ending)
        _, err = caller.communicate(timeout=30)
        assert caller.returncode == -ending, err[-3000:]
        deadline = time.monotonic() + 20
        while _marked(mark) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _marked(mark)
        assert left == [], [p.cmdline() for p in left]
        if ending == signal.SIGTERM:
            assert "hvdkit.run: SIGTERM passed to every rank" in err, err[-3000:]
            assert checkpoint.existing(str(ckpt)), err[-3000:]
            assert list(tmp.glob(".hvdkit-run-*")) == [], "the call's directory goes before the caller does"
    finally:
        for process in _marked(mark):
            process.kill()
        caller.kill()
        caller.wait()
