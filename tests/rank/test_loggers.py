"""Trackers (hvdkit.rank.reports.loggers, imported as hvdkit.rank.loggers): `--logger
mlflow,wandb,csv,tensorboard` on real 2-rank runs under plain mpirun and horovodrun, each tool's run read
back as the tool stores it (tests/programs/tracked.py) and compared with the run's metrics.jsonl; a
SIGKILLed job resumed continues the same MLflow run and W&B run; a tracker failing mid-run is one warning;
bad input is one line; `hvdkit plot`'s figures checked from their objects."""

import subprocess
import sys
import time

import psutil
import pytest

from conftest import REPO, kill_tree, metrics_records, run, wait_for_file
from hvdkit import checkpoint, config
from hvdkit import plot as plots
from hvdkit.checks import selftest
from hvdkit.launch import planner
from hvdkit.rank.reports import loggers
from programs import tracked

ALL = "mlflow,wandb,csv,tensorboard"
TRAIN = [sys.executable, "-m", "hvdkit", "train", "--epochs", "2", "--log-interval", "5", "--logger", ALL]


def reported(record):
    """What a report handed the trackers: a metrics.jsonl line less its event, step, time and epoch."""
    return {k: v for k, v in record.items() if k not in ("event", "step", "time", "epoch")}


def series(records, event, key):
    """(step, value) of ``key`` in each ``event`` report of a metrics.jsonl, as a tracker keeps it."""
    flat = [(r["step"], loggers.scalars(event, reported(r))) for r in records if r["event"] == event]
    return [(step, values[key]) for step, values in flat if key in values]


def same(found, expected, rel=1e-12):
    """The same steps, and values equal within ``rel`` (TensorBoard keeps float32)."""
    return [step for step, _ in found] == [step for step, _ in expected] and \
        [value for _, value in found] == pytest.approx([value for _, value in expected], rel=rel)


def no_wandb_process_left(folder):
    """W&B's service process of a run under ``folder`` ends with the run (or, after a SIGKILL, when
    it sees its parent gone): wait for that, by the processes' working directories."""
    def ours():
        found = []
        for process in psutil.process_iter(["name", "cwd"]):
            if "wandb" in (process.info["name"] or "") and str(folder) in (process.info["cwd"] or ""):
                found.append(process)
        return found

    deadline = time.monotonic() + 20
    while ours() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ours() == []


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """One run of `hvdkit train` at np=2 under plain mpirun with all four loggers, to the end."""
    folder = tmp_path_factory.mktemp("clean")
    proc = run(planner.local_command("mpirun", 2, [*TRAIN, "--max-steps", "30", "--log-dir", str(folder / "logs")]),
               cwd=folder, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder, metrics_records(folder / "logs" / "metrics.jsonl")


@pytest.fixture(scope="module")
def resumed_runs(tmp_path_factory):
    """A job under plain horovodrun --gloo SIGKILLed (launcher and ranks) after its step-20
    checkpoint, then the same command again, which resumes it and finishes. Each job's log
    directory is a new runs/<date>-<time>, as by default."""
    folder = tmp_path_factory.mktemp("resumed")
    command = planner.local_command("horovodrun --gloo", 2, [*TRAIN, "--max-steps", "40", "--checkpoint-steps", "10",
                                                           "--checkpoint-dir", str(folder / "ckpt")])
    env = dict(selftest.mpi_root_env(), PYTHONPATH=str(REPO))
    first = subprocess.Popen(command, cwd=folder, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        wait_for_file(folder / "ckpt" / "ckpt-step000000020.pt", first)
    finally:
        kill_tree(first)
    ids = checkpoint.load(folder / "ckpt" / "ckpt-step000000020.pt")["trackers"]
    second = run(command, cwd=folder, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    no_wandb_process_left(folder)
    return folder, ids, sorted((folder / "runs").iterdir())


@pytest.mark.slow
def test_each_tracker_holds_one_run_equal_to_the_jsonl_and_rank_1_wrote_nothing(clean_run):
    folder, records = clean_run
    logs = folder / "logs"
    summary = next(r for r in records if r["event"] == "summary")
    flat_summary = loggers.scalars("summary", {k: v for k, v in summary.items() if k not in ("event", "time")})
    keys = {(event, key) for event in ("train", "test") for r in records if r["event"] == event
            for key in loggers.scalars(event, reported(r))}
    assert ("train", "train/loss") in keys and ("train", "train/per_rank/rank1/wait_ms") in keys
    assert ("test", "test/accuracy") in keys and "summary/per_rank/rank1/compute_ms" in flat_summary

    # MLflow: one run in ./mlruns (a second rank writing would have made a second), every value.
    (mlflow_run,) = tracked.mlflow_runs(folder / "mlruns")
    assert mlflow_run["status"] == "FINISHED" and mlflow_run["name"] == "logs"
    assert mlflow_run["params"]["world_size"] == "2" and mlflow_run["params"]["model"] == "cnn"
    assert {"hvdkit_version", "horovod_version", "torch_version"} <= set(mlflow_run["params"])
    for event, key in keys:
        assert mlflow_run["history"][key] == series(records, event, key), key
    for key, value in flat_summary.items():
        assert mlflow_run["history"][key] == [(summary["steps"], value)], key

    # W&B: one offline run, the same series and summary.
    (wandb_run,) = tracked.wandb_runs(logs)
    assert wandb_run["config"]["world_size"] == 2 and wandb_run["config"]["model"] == "cnn"
    for event, key in keys:
        assert same(wandb_run["history"][key], series(records, event, key)), key
    assert {k: wandb_run["summary"][k] for k in flat_summary} == pytest.approx(flat_summary)

    # CSV: a row per report, no more (rank 1's rows would double them).
    rows = tracked.csv_rows(logs / "csv" / "metrics.csv")
    assert len(rows) == sum(r["event"] in ("train", "test") for r in records)
    for event, key in keys:
        assert [(int(r["step"]), float(r[key])) for r in rows if r[key]] == series(records, event, key), key
    pairs = {r["key"]: float(r["value"]) for r in tracked.csv_rows(logs / "csv" / "summary.csv")}
    assert pairs == flat_summary
    params = {r["key"]: r["value"] for r in tracked.csv_rows(logs / "csv" / "params.csv")}
    assert params["world_size"] == "2" and params["logger"] == ALL

    # TensorBoard: one event file (each writer's name holds its pid), float32 values.
    (scalars,) = tracked.tensorboard_scalars(logs).values()
    for event, key in keys:
        assert same(scalars[key], series(records, event, key), rel=1e-6), key
    for key, value in flat_summary.items():
        assert same(scalars[key], [(summary["steps"], value)], rel=1e-6), key
    no_wandb_process_left(folder)


@pytest.mark.slow
def test_a_killed_job_resumed_continues_the_same_mlflow_run_and_wandb_run(resumed_runs):
    folder, ids, run_dirs = resumed_runs
    assert len(run_dirs) == 2, run_dirs  # the killed job's log directory and the resumed one's
    (mlflow_run,) = tracked.mlflow_runs(folder / "mlruns")
    assert mlflow_run["id"] == ids["mlflow"] and mlflow_run["status"] == "FINISHED"
    steps = [step for step, _ in mlflow_run["history"]["train/loss"]]
    assert steps == sorted(steps) and steps[0] == 5 and steps[-1] == 40 and 15 in steps and 25 in steps, steps
    # W&B: an offline run per job, both with the id (`wandb sync` makes them one run). wandb-core
    # buffers the killed job's file, which a SIGKILL leaves empty; metrics.jsonl keeps that part.
    killed, resumed = (tracked.wandb_runs(run_dir) for run_dir in run_dirs)
    assert [found["folder"].rsplit("-", 1)[1] for found in killed + resumed] == [ids["wandb"], ids["wandb"]]
    assert resumed[0]["id"] == ids["wandb"]
    steps = [step for step, _ in resumed[0]["history"]["train/loss"]]
    assert min(steps) > 20 and max(steps) == 40, steps  # the resumed part


@pytest.mark.slow
def test_plot_draws_each_metric_throughput_and_every_ranks_compute_and_wait(resumed_runs, clean_run, tmp_path):
    _, _, run_dirs = resumed_runs
    clean, _ = clean_run
    for dirs in ([clean / "logs"], [*run_dirs]):
        runs = [plots.load(str(d)) for d in dirs]
        figures = plots.figures(runs)
        assert sorted(figures) == ["metrics.png", "ranks.png", "throughput.png"]
        metrics = figures["metrics.png"].axes
        assert [ax.get_title() for ax in metrics] == ["accuracy", "loss", "lr"]
        for ax in metrics:
            expected = {f"{r.name} {event}": len([x for x in r.reports(event) if ax.get_title() in x])
                        for r in runs for event in ("train", "test")}
            drawn = {line.get_label(): len(line.get_xdata()) for line in ax.get_lines()}
            assert drawn == {label: n for label, n in expected.items() if n}, ax.get_title()
        (rate,) = figures["throughput.png"].axes
        assert [len(line.get_ydata()) for line in rate.get_lines()] == [len(r.reports("train")) for r in runs]
        ranks = figures["ranks.png"].axes
        assert len(ranks) == len(runs)
        for ax, r in zip(ranks, runs, strict=True):
            timed = [x for x in r.reports("train") if x.get("per_rank")]
            assert [line.get_label() for line in ax.get_lines()] == [
                "rank 0 compute", "rank 0 wait", "rank 1 compute", "rank 1 wait"]
            wait = next(line for line in ax.get_lines() if line.get_label() == "rank 1 wait")
            assert list(wait.get_ydata()) == [x["per_rank"][1]["wait_ms"] for x in timed]
    out = tmp_path / "plots"
    proc = run([sys.executable, "-m", "hvdkit", "plot", *map(str, run_dirs), "--out", str(out)])
    assert proc.returncode == 0, proc.stderr
    for name in ("metrics.png", "throughput.png", "ranks.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG" and f"wrote {out / name}" in proc.stdout


@pytest.mark.slow
def test_a_tracker_failing_mid_run_is_one_warning_and_the_others_go_on(tmp_path):
    """The CSV logger's folder vanishes after step 10 of an own loop that never calls finish():
    one warning, the run ends 0, metrics.jsonl, TensorBoard and MLflow hold every report."""
    script = str(REPO / "tests" / "programs" / "loggers_script.py")
    proc = run(planner.local_command("mpirun", 2, [sys.executable, script,
                                                  "--loggers", "csv,tensorboard,mlflow", "--break-csv-at", "10",
                                                  "--no-finish"]),
               env=dict(selftest.mpi_root_env(), HVDKIT_LOG_DIR=str(tmp_path / "logs")), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("hvdkit: warning:")]
    assert len(warnings) == 1 and "the csv logger failed at step 15" in warnings[0], proc.stderr[-3000:]
    steps = [r["step"] for r in metrics_records(tmp_path / "logs" / "metrics.jsonl") if r["event"] == "train"]
    assert steps == [5, 10, 15, 20, 25, 30]
    (scalars,) = tracked.tensorboard_scalars(tmp_path / "logs").values()
    assert [step for step, _ in scalars["train/loss"]] == steps
    (mlflow_run,) = tracked.mlflow_runs(tmp_path / "mlruns")
    assert [step for step, _ in mlflow_run["history"]["train/loss"]] == steps
    assert mlflow_run["status"] == "FINISHED", "a loop without finish() still ends its run at exit"


@pytest.mark.slow
def test_an_unreachable_tracking_uri_is_one_line_before_training(tmp_path):
    proc = run(planner.local_command("horovodrun --gloo", 2, [
        sys.executable, "-m", "hvdkit", "train", "--max-steps", "5", "--logger", "mlflow,csv",
        "--tracking-uri", "http://127.0.0.1:1", "--checkpoint-dir", str(tmp_path / "ckpt"),
        "--log-dir", str(tmp_path / "logs")]), cwd=tmp_path, timeout=120)
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("hvdkit train:")]
    assert len(said) == 1 and said[0].startswith(
        "hvdkit train: the mlflow logger cannot start a run at http://127.0.0.1:1: "), proc.stderr[-3000:]
    assert proc.returncode != 0
    assert not list((tmp_path / "ckpt").glob("*.pt")) and not (tmp_path / "logs" / "metrics.jsonl").exists()


@pytest.mark.parametrize("flags, line", [
    (["--logger", "mlflow,neptune"], "hvdkit train: config: logger 'mlflow,neptune': unknown logger 'neptune': "
                                     "choose from tensorboard, csv, mlflow, wandb, or none"),
    (["--logger", "csv,wandb"], "hvdkit train: config: logger 'csv,wandb': the wandb logger needs the wandb "
                                "package: pip install 'hvdkit[wandb]'"),
])
def test_a_bad_logger_is_one_line_before_horovod_starts(tmp_path, flags, line):
    """The missing package is made missing as in an environment without the extra: import finds no wandb."""
    code = ("import sys; sys.modules['wandb'] = None; from hvdkit.cli import main; "
            f"sys.exit(main(['train', *{flags!r}, '--checkpoint-dir', {str(tmp_path / 'ckpt')!r}]))")
    proc = run([sys.executable, "-c", code], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [line], proc.stderr
    assert not (tmp_path / "ckpt").exists()


def test_logger_names_and_flat_scalars():
    assert config.logger_names("MLflow, csv,mlflow") == ["mlflow", "csv"] and config.logger_names("none") == []
    with pytest.raises(ValueError, match="unknown logger 'tb'"):
        config.logger_names("tb")
    flat = loggers.scalars("summary", {"steps": 3, "stopped": False, "note": "x", "loss": None,
                                       "per_rank": [{"rank": 1, "host": "a", "wait_ms": 2.5}],
                                       "memory": [{"phases": {"unit": "rss", "step": 7}}]})
    assert flat == {"summary/steps": 3.0, "summary/per_rank/rank1/wait_ms": 2.5,
                    "summary/memory/rank0/phases/step": 7.0}


@pytest.mark.parametrize("content, problem", [
    (None, "no metrics.jsonl there"),
    ('{"event": "config"}\nnot json\n', "line 2 is not JSON"),
    ('{"event": "config"}\n', "no training report yet"),
])
def test_plot_says_in_one_line_what_is_wrong_with_a_run_dir(tmp_path, content, problem):
    if content is not None:
        (tmp_path / "metrics.jsonl").write_text(content)
    proc = run([sys.executable, "-m", "hvdkit", "plot", str(tmp_path), "--out", str(tmp_path / "plots")])
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1 and problem in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"hvdkit plot: {tmp_path}") and not (tmp_path / "plots").exists()
