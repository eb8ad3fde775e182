"""Model parallelism on Horovod's process sets (docs/parallel.md), beside data parallelism: the
weights sharded (ZeRO stage 3), tensor and pipeline parallelism. Rank side, below hvdkit.zero.

``ops``: hvdkit's autograd functions over Horovod's collectives, each named by its caller.
"""
