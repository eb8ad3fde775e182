"""Where rank 0's metrics go: a progress bar or plain lines, metrics.jsonl, TensorBoard.

Other ranks get a sink that drops everything, so the loop calls it unconditionally and
only rank 0 prints or writes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional


class Metrics:
    def __init__(self, log_dir: Optional[str], total_steps: int, enabled: bool) -> None:
        self.enabled = enabled
        self.bar = None
        self.jsonl = None
        self.tensorboard = None
        if not enabled:
            return
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True)
        if log_dir:
            from torch.utils.tensorboard import SummaryWriter

            Path(log_dir).mkdir(parents=True, exist_ok=True)
            self.jsonl = open(Path(log_dir) / "metrics.jsonl", "a")
            self.tensorboard = SummaryWriter(log_dir)

    def record(self, event: str, step: int, values: dict, advance: int = 0) -> None:
        """One report: to the bar (or a plain line), one JSONL line, one TensorBoard scalar each."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(advance)
            self.bar.set_postfix({k: _short(v) for k, v in values.items() if k in _SHOWN})
        else:
            shown = " ".join(f"{k} {_short(v)}" for k, v in values.items() if k in _SHOWN)
            print(f"[{event}] step {step} {shown}", file=sys.stderr, flush=True)
        self.write({"event": event, "step": step, **values})
        if self.tensorboard is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and key not in ("epoch",):
                    self.tensorboard.add_scalar(f"{event}/{key}", value, step)

    def write(self, record: dict) -> None:
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


_SHOWN = ("epoch", "loss", "accuracy", "lr", "images_per_sec")


def _short(value):
    if isinstance(value, float):
        return f"{value:.4g}"
    return value
