"""The bytes a rank holds for training, counted from the tensors' storages: the summary's memory
record (hvdkit.rank.memory) and the sharded optimizers' ``memory()``."""

from __future__ import annotations

import torch


def _nbytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one flat vector count once)."""
    storages = {}
    for t in tensors:
        if torch.is_tensor(t) and t.is_sparse:  # an embedding's sparse=True gradient: its indices and values
            parts = (t._indices(), t._values())
            storages.update((part.untyped_storage().data_ptr(), part.untyped_storage().nbytes())
                            for part in parts)
        elif torch.is_tensor(t):
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def held_bytes(params, grad_holders, states) -> dict:
    """Bytes of ``params``, of the gradients the ``grad_holders`` hold, and of the optimizer
    ``states`` (per-parameter dicts), counted from the tensors' storages."""
    return {"params": _nbytes(params), "grads": _nbytes(p.grad for p in grad_holders),
            "optimizer_state": _nbytes(v for state in states for v in state.values())}
