"""What a run is at: its counters and the objects it trains, in one place that the Session's
parts are handed (Fabric's strategy is handed its accelerator and precision alike). The
Session, the loaders and a resume write the counters; the other parts read them."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Optional

from hvdkit.rank.memory import PhasePeaks


@dataclass
class RunState:
    global_step: int = 0  # optimizer steps taken
    epoch: int = 0  # epochs finished
    total_steps: int = 0  # for the progress bar: set by epochs(), or by the user who knows it
    stopped: bool = False  # the ranks agreed on a stop and its checkpoint is written
    exit_code: int = 0
    log_dir: str = ""
    model: Any = None
    optimizer: Any = None  # Horovod's DistributedOptimizer, or the sharded one
    inner: Any = None  # the optimizer the user made, which that one wraps
    scheduler: Any = None
    scaler: Any = None  # fp16's GradScaler
    extra: dict = field(default_factory=dict)  # the user's own picklable state, in every checkpoint
    trackers: dict = field(default_factory=dict)  # logger name: its run's id, kept in checkpoints (resumes go on)
    resumed_config: Optional[dict] = None  # the config keys of the checkpoint resumed from
    peaks: PhasePeaks = field(default_factory=PhasePeaks)  # peak memory per phase, for the summary
    rng_tracker: Any = None  # tensor parallelism's dropout generator (hvdkit.parallel.rng), kept in checkpoints
    unsettled: list = field(default_factory=list)  # steps whose non-finite flags are not read yet (TrainingStep)


def say(hvd, message: str) -> None:
    """``message`` on stderr from rank 0 only: one line for the job, not one a rank."""
    if hvd.rank() == 0:
        print(message, file=sys.stderr, flush=True)


def state_field(name: str, doc: str) -> property:
    """An attribute of the object holding a RunState as ``_state`` (the Session), kept in that
    state, which the parts read."""
    return property(lambda self: getattr(self._state, name), lambda self, value: setattr(self._state, name, value),
                    doc=doc)
