"""Where rank 0's reports go besides metrics.jsonl: TensorBoard, CSV, MLflow and Weights & Biases.

Chosen with ``--logger`` / ``HVDKIT_LOGGER`` / ``Session(loggers=...)``, several at once
(``mlflow,wandb,csv,tensorboard``). Only rank 0 has loggers, and what they are given is already
reduced across the ranks: each report's metrics (``train/loss``, ``train/rank1/wait_ms``), the
run's parameters at the start (the config, world size and versions) and its summary at the end
(``summary/...``: steps, memory, per-rank compute and wait, stragglers).

Each tracker starts its run when the Session is set up, after a resume, and the id it gives
goes into every checkpoint, so that a resumed job continues the same MLflow run and W&B run
instead of starting another. MLflow and W&B are optional extras (``pip install
hvdkit[mlflow]``); a missing one is one line before ``hvd.init()``. A tracker that fails at its
start is one line and no training; one that fails later is one warning, and training goes on
with the others: metrics.jsonl holds everything either way.
"""

from __future__ import annotations

import atexit
import csv
import io
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

from hvdkit import job
from hvdkit.system import wholefiles


class LoggerError(RuntimeError):
    """A tracker could not start its run (an unreachable tracking URI, say): one line, no training."""

    exit_code = job.BAD_INPUT


@dataclass
class RunInfo:
    """What a tracker starts its run with."""

    log_dir: str
    params: dict  # flat: the config's keys, world_size, versions
    resume: dict = field(default_factory=dict)  # logger name: the id of the run to continue

    @property
    def name(self) -> str:
        """The run's name: its log directory's."""
        return Path(self.log_dir).name


def scalars(prefix: str, values: dict) -> dict[str, float]:
    """The numbers in ``values`` under ``prefix/``, nested ones joined by '/'; a list of rows
    with a ``rank`` (per-rank compute and wait, memory) as ``rank<N>/...``. Booleans, text and
    missing values are left out."""
    flat: dict[str, float] = {}

    def walk(key: str, value) -> None:
        if isinstance(value, bool) or value is None:
            return
        if isinstance(value, (int, float)):
            flat[key] = float(value)
        elif isinstance(value, dict):
            for name, inner in value.items():
                walk(f"{key}/{name}", inner)
        elif isinstance(value, (list, tuple)):
            for index, inner in enumerate(value):
                if isinstance(inner, dict):  # a row per rank
                    walk(f"{key}/rank{inner.get('rank', index)}", {k: v for k, v in inner.items() if k != "rank"})
                else:
                    walk(f"{key}/{index}", inner)

    for name, value in values.items():
        walk(f"{prefix}/{name}" if prefix else name, value)
    return flat


def take_loggers(loggers: Union[str, Sequence, None], keys: dict) -> list:
    """``Session(loggers=...)``: the names go to the ``logger`` key (as ``--logger``), the Logger
    objects of your own are returned."""
    if loggers is None:
        return []
    loggers = [loggers] if isinstance(loggers, str) else list(loggers)
    keys["logger"] = ",".join(name for name in loggers if isinstance(name, str)) or "none"
    return [logger for logger in loggers if not isinstance(logger, str)]


class Logger:
    """One tracker. ``start`` returns the id of the run it writes to (None: nothing to resume)."""

    name = ""

    def start(self, run: RunInfo) -> Optional[str]:
        return None

    def log(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def finish(self, step: int, summary: dict[str, float], record: dict) -> None:
        """The run's summary: ``summary`` flat (``summary/...``), ``record`` as metrics.jsonl has it."""
        self.log(step, summary)

    def close(self) -> None:
        pass


class TensorBoard(Logger):
    """Event files in the log directory: a scalar per metric, the config and summary as text."""

    name = "tensorboard"

    def start(self, run: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(run.log_dir)
        self.writer.add_text("params", _table(run.params))

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def finish(self, step: int, summary: dict[str, float], record: dict) -> None:
        self.log(step, summary)
        self.writer.add_text("summary", "```\n" + json.dumps(record, indent=1) + "\n```", step)

    def close(self) -> None:
        self.writer.close()


class CSV(Logger):
    """``csv/metrics.csv`` in the log directory, a row per report and a column per metric (as
    Lightning's CSVLogger), plus ``params.csv`` and ``summary.csv`` (key, value). A report with a
    metric not seen before rewrites the file with the new column; resumed runs append."""

    name = "csv"

    def start(self, run: RunInfo) -> None:
        self.folder = Path(run.log_dir) / "csv"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / "metrics.csv"
        self.rows: list[dict] = []
        self.columns: list[str] = ["step"]
        if self.path.exists():
            with open(self.path, newline="") as f:
                reader = csv.DictReader(f)
                self.columns = list(reader.fieldnames or ["step"])
                self.rows = list(reader)
        _write_pairs(self.folder / "params.csv", run.params)

    def log(self, step: int, values: dict[str, float]) -> None:
        row = {"step": step, **values}
        self.rows.append(row)
        new = [key for key in values if key not in self.columns]
        if new or not self.path.exists():
            self.columns += new
            _replace(self.path, lambda f: self._write(f, self.rows))
        else:
            with open(self.path, "a", newline="") as f:
                csv.DictWriter(f, self.columns).writerow(row)

    def _write(self, f, rows) -> None:
        writer = csv.DictWriter(f, self.columns)
        writer.writeheader()
        writer.writerows(rows)

    def finish(self, step: int, summary: dict[str, float], record: dict) -> None:
        _write_pairs(self.folder / "summary.csv", summary)


class MLflow(Logger):
    """An MLflow run: the tracking URI given (``--tracking-uri``, else $MLFLOW_TRACKING_URI),
    else a file store ``mlruns`` in the working directory, as MLflow's own default was;
    experiment $MLFLOW_EXPERIMENT_NAME or "hvdkit". The summary is metrics ``summary/...`` and
    the artifact ``summary.json``."""

    name = "mlflow"

    def __init__(self, tracking_uri: Optional[str] = None) -> None:
        self.tracking_uri = tracking_uri

    def start(self, run: RunInfo) -> str:
        # A server that does not answer is one line within seconds, not MLflow's minutes of retries.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or Path("mlruns").resolve().as_uri()
        if uri.startswith("file:") or "://" not in uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps it for those who ask
        from mlflow import MlflowClient
        from mlflow.entities import Metric, Param

        self.metric = Metric
        try:
            self.client = client = MlflowClient(uri)
            previous = run.resume.get(self.name)
            if previous:
                client.update_run(previous, status="RUNNING")
                self.run_id = previous
            else:
                name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "hvdkit")
                experiment = client.get_experiment_by_name(name)
                experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
                self.run_id = client.create_run(experiment_id, run_name=run.name).info.run_id
                params = [Param(key, str(value)[:6000]) for key, value in run.params.items()]
                for first in range(0, len(params), 100):  # MLflow takes 100 params a batch
                    client.log_batch(self.run_id, params=params[first:first + 100])
        except Exception as exc:
            raise LoggerError(f"the mlflow logger cannot start a run at {uri}: {_first_line(exc)}") from None
        return self.run_id

    def log(self, step: int, values: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [self.metric(key, value, now, step) for key, value in values.items()]
        for first in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[first:first + 1000])

    def finish(self, step: int, summary: dict[str, float], record: dict) -> None:
        self.log(step, summary)
        self.client.log_dict(self.run_id, record, "summary.json")
        self.status = "KILLED" if record.get("exit_code") else "FINISHED"  # a stop's exit code: resumable

    def close(self) -> None:
        """The run's end (at the process's, for a loop that never finished the Session): FINISHED,
        or KILLED after a stop that the next job resumes."""
        self.client.set_terminated(self.run_id, status=getattr(self, "status", "FINISHED"))


class Wandb(Logger):
    """A W&B run in the log directory's ``wandb/``, offline unless $WANDB_MODE says otherwise
    (compute nodes have no internet: ``wandb sync`` it later); project $WANDB_PROJECT or
    "hvdkit". A resumed job passes the same id, which ``wandb sync`` makes one run. The
    summary goes into the run's summary (``summary/...``)."""

    name = "wandb"

    def start(self, run: RunInfo) -> str:
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        try:
            self.run = wandb.init(dir=run.log_dir, project=os.environ.get("WANDB_PROJECT", "hvdkit"),
                                  mode=None if os.environ.get("WANDB_MODE") else "offline", name=run.name,
                                  id=run.resume.get(self.name), resume="allow" if run.resume.get(self.name) else None,
                                  config=run.params, reinit="create_new",
                                  # rank 0's output stays as it is (the launcher tags it, hvdkit's one-line
                                  # errors go through it) unless $WANDB_CONSOLE asks W&B to capture it
                                  settings=wandb.Settings(console=os.environ.get("WANDB_CONSOLE", "off")))
        except Exception as exc:
            raise LoggerError(f"the wandb logger cannot start a run: {_first_line(exc)}") from None
        return self.run.id

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def finish(self, step: int, summary: dict[str, float], record: dict) -> None:
        self.run.summary.update(summary)

    def close(self) -> None:
        self.run.finish()


KINDS = {kind.name: kind for kind in (TensorBoard, CSV, MLflow, Wandb)}


def make(chosen: Sequence[str], tracking_uri: Optional[str] = None) -> list[Logger]:
    return [MLflow(tracking_uri) if name == "mlflow" else KINDS[name]() for name in chosen]


class Trackers:
    """Rank 0's loggers: started together, each report to each; one that fails after its start
    is dropped with one warning, and the others go on."""

    def __init__(self, loggers: Sequence[Logger]) -> None:
        self.loggers = list(loggers)
        self.ids: dict[str, str] = {}

    def start(self, run: RunInfo) -> dict[str, str]:
        """Start every logger's run; the ids to keep in checkpoints. LoggerError if one cannot."""
        for logger in self.loggers:
            try:
                found = logger.start(run)
            except LoggerError:
                raise
            except Exception as exc:
                raise LoggerError(f"the {logger.name} logger cannot start: {_first_line(exc)}") from None
            if found:
                self.ids[logger.name] = found
        # A loop that never calls session.finish() still ends its trackers' runs (W&B's files,
        # MLflow's status) when the process exits.
        atexit.register(self.close)
        return self.ids

    def log(self, step: int, values: dict[str, float]) -> None:
        self._each("step", step, lambda logger: logger.log(step, values))

    def finish(self, step: int, record: dict) -> None:
        summary = scalars("summary", {k: v for k, v in record.items() if k != "event"})
        self._each("summary", step, lambda logger: logger.finish(step, summary, record))

    def close(self) -> None:
        atexit.unregister(self.close)
        self._each("close", None, lambda logger: logger.close())
        self.loggers = []

    def _each(self, what: str, step: Optional[int], call) -> None:
        for logger in list(self.loggers):
            try:
                call(logger)
            except Exception as exc:
                at = f"at step {step}" if step is not None else f"at {what}"
                print(f"hvdkit: warning: the {logger.name} logger failed {at} ({_first_line(exc)}); training goes on "
                      f"without it, and metrics.jsonl keeps every report", file=sys.stderr, flush=True)
                self.loggers.remove(logger)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _table(params: dict) -> str:
    return "\n".join(f"    {key}: {value}" for key, value in params.items())


def _write_pairs(path: Path, values: dict) -> None:
    def write(f) -> None:
        writer = csv.writer(f)
        writer.writerow(["key", "value"])
        writer.writerows(values.items())

    _replace(path, write)


def _replace(path: Path, write) -> None:
    """Write ``path`` whole (wholefiles.write_whole): a kill mid-write leaves the old file."""
    text = io.StringIO(newline="")
    write(text)
    wholefiles.write_whole(path, text.getvalue())
