"""How a run is stopped and what it holds until it ends: stop signals, the agreed stop, requeues
and hvdkit's own errors as one line (stops); one run per directory (lock). The run's end, which
uses these and every other part, is hvdkit.rank.finish."""
