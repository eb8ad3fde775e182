"""A rank's start and its data: Horovod started for one training process with its device, seeds
and settings (startup), and each rank's shard of the data with the position a resume goes on from
(loaders), the model cut into its pipeline stage and split across its tensor-parallel group
(parallelize)."""
