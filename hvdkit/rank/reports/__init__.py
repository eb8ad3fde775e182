"""What a run reports: metrics combined across the ranks at each report and the summary
(report), rank 0's progress and metrics.jsonl (metrics), and the trackers (loggers). Where in a
step memory peaks, which every part's phases are measured by, is hvdkit.rank.memory."""
