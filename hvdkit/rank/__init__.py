"""What runs inside every rank: start-up, the data each rank reads, the step, resume, reports,
the checks between ranks, and what ends a rank (stop signals, the watchdog, a lost launcher).

The Session (hvdkit.session) puts these parts together. Nothing here imports hvdkit.launch:
what a rank and its launcher agree on (the job directory, exit records, exit codes) is in
hvdkit.job.
"""
