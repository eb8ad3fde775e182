"""What runs inside every rank, by concern; each subpackage's docstring names its modules. Lowest
first: a package imports only itself and those listed before it (tests/test_layout.py keeps it so).

- ``state``: where the run is (its counters and the objects it trains), shared by the parts;
  ``memory``: where in a step memory peaks (the state's phase peaks), and what a rank holds.
- ``agree/``: the ranks' meetings (lockstep), their copies compared (consistency), stragglers.
- ``step/``: the training step and its guard (training), the distributed optimizer (buckets), a
  pipeline stage's passes (pipelined).
- ``reports/``: metrics combined at each report and the summary (report), rank 0's output
  (metrics), the trackers (loggers; users import them as ``hvdkit.rank.loggers``).
- ``liveness/``: the watchdog and its stacks, the watches on the launcher (orphan, lifeline), the
  line to hvdkit launch (link).
- ``ending/``: stop signals, requeues and hvdkit's own errors in one line (stops), one run per
  directory (lock).
- ``start/``: Horovod started for one training process (startup), the data each rank reads (loaders), the model
  cut and split for the mesh (parallelize).
- ``resume/``: checkpoints and resume (checkpoints), which one a run takes back (reading), elastic
  runs, snapshots in host memory.
- ``finish``: the run's end, with its checkpoint and summary, over every part above.

The Session (hvdkit.session) holds the run's state and makes the parts, each handed that state and
what else it uses (none holds the Session); none starts anything when made. The calls that start
them, in order:

1. ``Session.__init__``: Horovod (``startup.start``); the resume read ahead
   (``CheckpointReader.read_ahead``: a sharded run resumed at another world size takes another K,
   returned in a copy of the config, which every part is then made with).
2. ``Session.__init__`` makes every part, then ``Session._start``: the watchdog's thread
   (``Watchdog.start``); the stop signals' handlers (``StopSignal.install``: on an elastic run
   only on the driver's host); hvdkit's own errors said in one line, the launcher line's hook for
   a save in flight, the lifeline's probes and the run's locks (``Ending.start``); the watch on
   the launcher (``orphan.watch``, where the handlers are installed).
3. ``Session.setup``: the resume read (``RunCheckpoints.resume_or_broadcast``), then the reports' trackers
   (``Reports.start``: they continue the runs the checkpoint names), then the heartbeats and
   stacks once the run is accepted (``Watchdog.share``).

Nothing here imports hvdkit.launch: what a rank and its launcher agree on (the job directory,
exit records, exit codes) is in hvdkit.job.
"""
