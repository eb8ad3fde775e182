"""Resume and the state kept for it: the run's checkpoints (checkpoints), which one a run takes
back and whether it may (reading), elastic runs' state in memory (elastic), and the snapshots in
host memory that hvdkit launch's restarts read (host_snapshots; ZeRO's shards and their buddy
copies: shard_snapshots)."""
