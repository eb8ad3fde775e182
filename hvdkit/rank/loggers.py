"""The documented home of the logger classes (docs/tracking.md); they live in
hvdkit.rank.reports.loggers."""

from hvdkit.rank.reports.loggers import CSV, Logger, LoggerError, MLflow, RunInfo, TensorBoard, Trackers, Wandb, make

__all__ = ["CSV", "Logger", "LoggerError", "MLflow", "RunInfo", "TensorBoard", "Trackers", "Wandb", "make"]
