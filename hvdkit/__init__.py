"""hvdkit: a Horovod/MPI training toolkit for PyTorch.

``hvdkit.Session`` (the own-loop API), ``hvdkit.Trainer``, ``hvdkit.TrainConfig`` and ``hvdkit.run`` (a function on
every rank, from Python or a notebook) are imported on first use, so that
``python -m hvdkit.build`` runs before torch's and Horovod's heavier imports are needed.
"""

__version__ = "0.1.0"

_LAZY = {"Trainer": "hvdkit.trainer", "TrainConfig": "hvdkit.config", "Session": "hvdkit.session",
         "sync_batch_norm": "hvdkit.models", "run": "hvdkit.launch.spawn",
         "RunError": "hvdkit.launch.spawn"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hvdkit' has no attribute {name!r}")
