"""Model parallelism on Horovod's process sets (docs/model-parallelism.md), beside data parallelism: the
weights sharded (ZeRO stage 3), tensor and pipeline parallelism. Rank side, below hvdkit.zero.

``mesh``: the job's ranks as (pp, dp, tp) groups, each a Horovod process set made at ``hvd.init``.
``ops``: hvdkit's autograd functions over Horovod's collectives, each named by its caller.
``tensor``: tensor parallelism's layers (column-, row-parallel linear, vocabulary-parallel
embedding and cross-entropy), each made from the whole layer it replaces.
``plan``: ``parallelize(model, mesh, plan)``, the styles by module name (sequence parallelism's
too), and the GPT's plan.
``grads``: where each parameter's gradient is (ZeRO's slices too), sequence parallelism's sums.
``norms``: the whole model's gradient norm across the mesh, and clipping by it.
``rng``: the RNG tracker of dropout inside the tensor-parallel regions.
``pipeline``: stages, schedules and the transport between them (pipeline parallelism).
"""
