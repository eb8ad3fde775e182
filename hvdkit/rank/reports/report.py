"""What a Session reports: metrics summed on each rank, combined in one allreduce at a report,
shown and written by rank 0; evaluation over every sample once; the run's summary.

``log()`` keeps a micro-batch's means and samples, summed on the device at the report (no op of
its own in a step, no read): no communication until ``report()``, whose one allreduce carries
every metric and the count.
Rank 0's sink (hvdkit.rank.reports.metrics) shows progress and writes metrics.jsonl and the trackers
(hvdkit.rank.reports.loggers), which it starts when the Session is set up.
"""

from __future__ import annotations

import itertools
import json
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch.utils.data import DataLoader

from hvdkit.config import logger_names, to_dict
from hvdkit.rank.agree.stragglers import StepTimes
from hvdkit.rank.memory import memory_of
from hvdkit.rank.reports import loggers
from hvdkit.rank.reports.metrics import Metrics, finite_or_none, world_size_changes
from hvdkit.rank.state import RunState
from hvdkit.rank.step.training import to_device

FOLD_EVERY = 64  # log() calls kept before they are summed: a loop that never reports holds no more


class Reports:
    """The metrics of one run, at the state's step, with each rank's step ``times``."""

    def __init__(self, cfg, hvd, device, state: RunState, times: StepTimes, own_loggers: Sequence = (),
                 mesh=None) -> None:
        """``own_loggers``: Logger objects of your own making, beside those ``cfg.logger`` names; ``mesh``:
        the job's (hvdkit.parallel.mesh; None: data parallelism alone), whose tensor-parallel group's
        ranks each log every sample they read alike, and whose pipelines log on their last stage only."""
        self.cfg, self.hvd, self.device, self.state, self.times = cfg, hvd, device, state, times
        self.copies = mesh.tp if mesh else 1  # the ranks that log each sample
        self.stages = mesh.pp if mesh else 1  # the metrics' names are agreed where stages log differently
        self.own_loggers = list(own_loggers)
        self.sums: dict[str, torch.Tensor] = {}
        self._logged: list[tuple] = []  # (samples, means) logged since the last fold
        self.count = torch.zeros((), device=device)
        self.last_count = 0.0
        self.sink: Optional[Metrics] = None
        self.samples, self.seconds = 0.0, 0.0
        self.window_start = self.wall_start = time.perf_counter()
        self._hosts: Optional[list] = None

    def log(self, samples: int, means: dict) -> None:
        """Keep a micro-batch's means (detached) and samples; they are summed on the device at the
        report, or every ``FOLD_EVERY`` calls (``_fold``): a step's log() makes no sum of its own."""
        self._logged.append((samples, {name: value.detach() if isinstance(value, torch.Tensor) else value
                                       for name, value in means.items()}))
        if len(self._logged) >= FOLD_EVERY:
            self._fold()

    def _fold(self) -> None:
        """The kept means into the sums: per metric, its values stacked and weighted by their samples."""
        logged, self._logged = self._logged, []
        if not logged:
            return
        device = self.device

        def scalars(values: list) -> torch.Tensor:
            if not any(isinstance(value, torch.Tensor) for value in values):
                return torch.tensor([float(value) for value in values], device=device)
            return torch.stack([value.to(device, torch.float32).reshape(()) if isinstance(value, torch.Tensor)
                                else torch.tensor(float(value), device=device) for value in values])

        weights = scalars([samples for samples, _ in logged])
        for name in dict.fromkeys(name for _, means in logged for name in means):
            places = [i for i, (_, means) in enumerate(logged) if name in means]
            total = (scalars([logged[i][1][name] for i in places]) * weights[places]).sum()
            self.sums[name] = self.sums[name] + total if name in self.sums else total
        self.count = self.count + weights.sum()

    def due(self, epoch_ended: bool) -> bool:
        """Every ``log_interval`` steps, at the end of each epoch and at the last step."""
        step = self.state.global_step
        return step % self.cfg.log_interval == 0 or epoch_ended or step == self.state.total_steps

    def report(self, stage: str, extra: dict) -> dict:
        """One allreduce of the metrics' sums and count and, at a training report, of every
        rank's step times (hvdkit.rank.agree.stragglers: each rank fills its own row)."""
        hvd, step = self.hvd, self.state.global_step
        self._fold()
        if self.stages > 1:  # only the last stage has a loss to log: every rank sums every name, some of zeros
            for name in sorted(set().union(*hvd.allgather_object(sorted(self.sums), name=f"hvdkit.{stage}.names"))):
                self.sums.setdefault(name, torch.zeros((), device=self.device))
        names = sorted(self.sums)
        times = self.times.row().to(self.device) if stage == "train" else torch.zeros(0, device=self.device)
        window = torch.cat([torch.stack([*(self.sums[n] for n in names), self.count.float()]).double(), times])
        reduced = hvd.allreduce(window, op=hvd.Sum, name=f"hvdkit.{stage}").tolist()  # the report's one read
        *sums, count = (value / self.copies for value in reduced[:len(names) + 1])
        self.last_count = count
        means = {name: total / count if count else float("nan") for name, total in zip(names, sums, strict=True)}
        values = {**extra, **means}
        if stage == "train":
            now = time.perf_counter()
            self.samples += count
            self.seconds += now - self.window_start
            values["samples_per_sec"] = count / max(now - self.window_start, 1e-9)
            per_rank = self.times.reported(reduced[len(names) + 1:], step, self.hosts())
            if per_rank:
                values["per_rank"] = per_rank
        self.metrics().record(stage, step, values, position=step)
        self.restart_window()  # evaluation and writing are not training time
        self.sums, self.count = {}, torch.zeros((), device=self.device)
        return means

    def restart_window(self) -> None:
        self.window_start = time.perf_counter()
        self.times.restart()

    def hosts(self) -> list[str]:
        """Every rank's host name, in rank order: gathered once, at the first training report."""
        if self._hosts is None:
            self._hosts = self.hvd.allgather_object(socket.gethostname(), name="hvdkit.hosts")
        return self._hosts

    def evaluate(self, eval_loader: DataLoader, metrics_of: Callable[[Any], tuple[int, dict]], autocast) -> dict:
        """``autocast``: the run's mixed precision context, as in training. Over each replica's first
        ``eval_batches`` batches where that is set."""
        model = self.state.model
        self._fold()
        training = self.sums, self.count
        self.sums, self.count = {}, torch.zeros((), device=self.device)
        model.eval()
        extra = self._forwards_short_of_the_most(eval_loader)
        with torch.no_grad(), autocast:
            batch = None
            for batch in itertools.islice(eval_loader, self.cfg.eval_batches or None):
                batch = to_device(batch, self.device)
                samples, means = metrics_of(batch)
                self.log(samples, means)
            for _ in range(extra):  # its last batch again, its metrics dropped: the others' gathers need it
                metrics_of(batch)
        result = self.report("test", {})
        model.train()
        self.sums, self.count = training
        return {**result, "samples": int(self.last_count)}

    def _forwards_short_of_the_most(self, eval_loader: DataLoader) -> int:
        """Under zero 3 each forward gathers the weights with every rank, so every rank makes as
        many as the rank with the most batches (a share of the evaluation set differs by one
        sample from rank to rank): how many this rank lacks. 0 otherwise."""
        if self.cfg.zero != 3:
            return 0
        batches = min(len(eval_loader), self.cfg.eval_batches or len(eval_loader))
        most = self.hvd.allreduce(torch.tensor([batches]), op=self.hvd.Max, name="hvdkit.evaluate.batches")
        return int(most[0]) - batches

    def start(self) -> Metrics:
        """Every rank, once (Session.setup, after the resume): the sink made, rank 0's trackers
        started, continuing the runs a resumed checkpoint names, and the config recorded. Returns
        the sink; other ranks' drops everything. LoggerError if a tracker cannot start."""
        if self.sink is None:
            main = self.hvd.rank() == 0
            trackers = loggers.Trackers(
                [*loggers.make(logger_names(self.cfg.logger), self.cfg.tracking_uri), *self.own_loggers]
                if main else [])
            if main:
                self.state.trackers.update(trackers.start(loggers.RunInfo(
                    self.state.log_dir, self.params(), dict(self.state.trackers))))
            self.sink = Metrics(self.state.log_dir, lambda state=self.state: state.total_steps, enabled=main,
                                trackers=trackers)
            self.sink.write({"event": "config", "world_size": self.hvd.size(), **to_dict(self.cfg)})
        return self.sink

    def metrics(self) -> Metrics:
        """The sink start() made; started here where the run reports before setup() did."""
        return self.sink if self.sink is not None else self.start()

    def params(self) -> dict:
        """What a tracker records of the run: its config, world size and versions."""
        import horovod

        import hvdkit

        config = {key: (",".join(map(str, value)) if isinstance(value, list) else value)
                  for key, value in to_dict(self.cfg).items()}
        return {**config, "world_size": self.hvd.size(), "hvdkit_version": hvdkit.__version__,
                "horovod_version": _horovod_build(horovod), "torch_version": torch.__version__}

    def throughput(self) -> float:
        return self.samples / self.seconds if self.seconds else 0.0

    def summary(self, extra: Optional[dict], skipped_steps: int) -> dict:
        """The run's summary record: written, printed by rank 0 as one JSON line, returned."""
        state = self.state
        memory = None if state.optimizer is None else self.hvd.allgather_object(  # per rank, in rank order
            {**memory_of(state.optimizer), "phases": state.peaks.summary()}, name="hvdkit.memory")
        summary = {"event": "summary", "epochs": state.epoch, "steps": state.global_step,
                   "world_size": self.hvd.size(), **(extra or {}), "memory": memory,
                   "per_rank": self.times.table(self._hosts or []), "stragglers": self.times.named,
                   "wall_seconds": time.perf_counter() - self.wall_start, "stopped": state.stopped,
                   "exit_code": state.exit_code, "skipped_steps": skipped_steps}
        self.metrics().finish(summary)
        self.metrics().close()
        if self.hvd.rank() == 0:
            print(json.dumps(finite_or_none(summary)), flush=True)
        return summary

    def elastic_reset(self, step: int) -> None:
        """Rank 0 may now be another process: it takes the sink and records the reset."""
        if self.sink is not None:
            self.sink.close()
        self.sink, self._hosts = None, None
        self.metrics().write({"event": "reset", "step": step, "world_size": self.hvd.size()})

    def world_size_changes(self) -> list:
        path = Path(self.state.log_dir) / "metrics.jsonl"
        if self.hvd.rank() != 0 or not path.exists():
            return []
        changes = world_size_changes([json.loads(line) for line in path.read_text().splitlines() if line.strip()])
        for change in changes:
            print(f"hvdkit: elastic: world size {change['from']} -> {change['to']}, going on from step "
                  f"{change['step']}; about {change['lost_seconds']:.1f} s lost", file=sys.stderr, flush=True)
        return changes


def _horovod_build(horovod) -> str:
    """The installed Horovod's version with its build (0.28.1+hvdkit.<digest>), as pip shows it."""
    import importlib.metadata

    try:
        return importlib.metadata.version("horovod")
    except importlib.metadata.PackageNotFoundError:  # a source tree on PYTHONPATH
        return horovod.__version__
