"""How a run ends: stop signals, the agreed stop, requeues and hvdkit's own errors as one line
(stops); the run's end with its checkpoint and summary (finish); one run per directory (lock)."""
