"""Pipeline parallelism on Horovod's process sets (docs/model-parallelism.md): a model cut into
stages along the mesh's pipeline axis, stepped by a schedule over micro-batches.

``stages``: the cut (the built-in GPT's) and ``Pipeline``, this rank's stage and its step.
``schedules``: GPipe and 1F1B as lists of actions, and the loop that runs one.
``transport``: activations and gradients between neighbouring stages, over Horovod's collectives.
"""
