"""Which rank the others wait for: each rank's time per step, split, compared at every report.

A slow node (throttled, a noisy neighbour, a slow disk under its loader) makes every rank wait at
each allreduce, and the job is slower with nothing to say where. So each rank splits its time per
step into *wait*, blocked in the gradient reduction (``synchronize()``), and *compute*, the rest
of the step: loading its data, forward, backward, the optimizer. The slow rank computes longer;
the others wait about as long. At each report the per-rank means ride in the report's own
allreduce (each rank fills its row of a zeroed table), so this costs no collective of its own.
Rank 0 names a rank whose typical step (the median of its steps since the last report) computes
more than ``straggler_threshold`` above the median of the other ranks', by at least that fraction
of their whole step (compute and wait: what the slow rank costs each step), for ``IN_A_ROW``
reports in a row, once, with its host and how much slower it is. A slow node or loader is slow at
every step; a busy machine's jitter is not, and the two conditions keep it quiet. The median
leaves out the few steps a rank spent descheduled, which raise a busy rank's mean alone; the
fraction of the whole step leaves out a millisecond more of compute where every rank waits long
for the allreduce, as ranks sharing busy cores do.
Reports, evaluation and checkpoints are not step time: the clock restarts after them.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Optional, Sequence

import torch

IN_A_ROW = 3
COLUMNS = 3  # per rank: mean compute, mean wait, median compute


class StepTimes:
    """This rank's compute and wait per step since the last report, and a table of every rank's."""

    def __init__(self, rank: int, size: int, threshold: float) -> None:
        self.rank, self.size, self.threshold = rank, size, threshold
        self.elapsed = self.wait = 0.0  # seconds of the steps measured since the last report, and of their waits
        self.steps = 0
        self.computes: list[float] = []  # each measured step's compute since the last report, for its median
        self.wait_at_mark = 0.0
        self.mark: Optional[float] = None  # the end of the last step, or of a pause (report, evaluation)
        self.wait_started = 0.0
        self.streaks = [0] * size
        self.named: list[dict] = []  # the stragglers named so far
        self.totals = torch.zeros(size, 2, dtype=torch.float64)  # per rank: compute and wait seconds
        self.total_steps = 0

    def resize(self, rank: int, size: int) -> None:
        """Elastic: the ranks changed; every count starts over, with a row per rank."""
        self.__init__(rank, size, self.threshold)

    def waiting(self) -> None:
        """Called as this rank starts to wait for the averaged gradients."""
        self.wait_started = time.perf_counter()

    def waited(self) -> None:
        self.wait += time.perf_counter() - self.wait_started

    def step_ended(self) -> None:
        now = time.perf_counter()
        if self.mark is not None:
            self.elapsed += now - self.mark
            self.steps += 1
            self.computes.append(now - self.mark - (self.wait - self.wait_at_mark))
        else:
            self.wait = 0.0  # the first step after a pause has no start to measure from
        self.mark, self.wait_at_mark = now, self.wait

    def clear(self) -> None:
        """Forget the steps measured so far (a benchmark's warmup)."""
        self.elapsed = self.wait = 0.0
        self.steps = 0
        self.computes.clear()
        self.restart()

    def restart(self) -> None:
        """After a pause: the next step is measured from now."""
        self.mark, self.wait_at_mark = time.perf_counter(), self.wait

    def row(self) -> torch.Tensor:
        """This rank's row of the table (mean compute, mean wait and median compute, in seconds per
        step), the others zero: summed over ranks, the report's allreduce gives every row."""
        table = torch.zeros(self.size, COLUMNS, dtype=torch.float64)
        if self.steps:
            table[self.rank] = torch.tensor([(self.elapsed - self.wait) / self.steps, self.wait / self.steps,
                                             statistics.median(self.computes)])
        return table.flatten()

    def reported(self, flat: Sequence[float], step: int, hosts: list[str]) -> list[dict]:
        """The table as the report's allreduce summed it (read to the host once, with the report's
        metrics): kept for the summary, checked for a straggler (named on rank 0), and returned
        per rank in milliseconds."""
        rows = [list(flat[rank * COLUMNS:(rank + 1) * COLUMNS]) for rank in range(self.size)]
        self.elapsed = self.wait = 0.0
        measured = int(self.steps)
        self.steps = 0
        self.computes.clear()
        if not measured or not all(row[0] > 0 for row in rows):  # a rank without a timed step this time
            return []
        means = [row[:2] for row in rows]
        self.totals += torch.tensor(means, dtype=torch.float64) * measured
        self.total_steps += measured
        compute, step_time = [row[2] for row in rows], [c + w for c, w in means]
        if self.threshold and self.size > 1:
            for rank in range(self.size):
                others = statistics.median(compute[:rank] + compute[rank + 1:])
                others_step = statistics.median(step_time[:rank] + step_time[rank + 1:])
                excess = compute[rank] - others
                slow = excess > self.threshold * others and excess > self.threshold * others_step
                self.streaks[rank] = self.streaks[rank] + 1 if slow else 0
                if self.streaks[rank] == IN_A_ROW:
                    self._name(rank, hosts[rank], compute[rank], others, step)
        return [{"rank": rank, "compute_ms": round(c * 1e3, 3), "wait_ms": round(w * 1e3, 3)}
                for rank, (c, w) in enumerate(means)]

    def _name(self, rank: int, host: str, compute: float, others: float, step: int) -> None:
        slower = compute / others - 1
        self.named.append({"rank": rank, "host": host, "step": step, "compute_ms": round(compute * 1e3, 3),
                           "others_median_ms": round(others * 1e3, 3), "slower": round(slower, 4)})
        if self.rank == 0:
            print(f"hvdkit: straggler: rank {rank} on {host} computes {slower:.0%} longer per step than the other "
                  f"ranks' median (a typical step: {compute * 1e3:.1f} ms against {others * 1e3:.1f} ms) for "
                  f"{IN_A_ROW} reports in a row, up to step {step}; the others wait for it at every allreduce: look "
                  f"at {host}'s load and its data loading, or leave {host} out", file=sys.stderr, flush=True)

    def table(self, hosts: list[str]) -> list[dict]:
        """Every rank's mean compute and wait per step over the run, for the summary."""
        if not self.total_steps:
            return []
        means = (self.totals / self.total_steps).tolist()
        return [{"rank": rank, "host": hosts[rank], "compute_ms": round(c * 1e3, 3), "wait_ms": round(w * 1e3, 3)}
                for rank, (c, w) in enumerate(means)]
