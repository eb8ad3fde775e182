"""What a run reports: metrics combined across the ranks at each report and the summary
(report), rank 0's progress and metrics.jsonl (metrics), the trackers (loggers), and where in a
step memory peaks (memory)."""
