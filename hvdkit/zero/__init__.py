"""The sharded optimizer (ZeRO stage 1 and 2 on Horovod's reduce-scatter and allgather,
``optimizer``) and its checkpoints, re-partitioned to any world size (``shards``)."""
