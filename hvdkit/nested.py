"""Tensors nested in dicts, lists and tuples (batches, state dicts, checkpoints): the one walker that
moves a batch to its device and splits it into micro-batches (hvdkit.rank.step.training, hvdkit.data),
stages, splits and joins a checkpoint (hvdkit.checkpoint) and compares two states
(hvdkit.rehearse.verdict)."""

from __future__ import annotations

import copy
from typing import Any, Callable, Iterator

import torch


class Index(int):
    """A place's step into a list or a tuple (a dict's key is itself), so that a place reads as
    Python would index it: ``optimizer.param_groups[0].lr``."""


def rebuild(value: Any, tensor: Callable[[torch.Tensor, tuple], Any],
            other: Callable[[Any, tuple], Any] = lambda leaf, place: leaf, place: tuple = ()) -> Any:
    """``value`` with each tensor replaced by ``tensor(it, its place)`` and each other leaf by
    ``other(it, its place)``, in order; dicts are copied shallowly, keeping their class and
    attributes (a state_dict's _metadata), lists, tuples and namedtuples rebuilt."""
    if isinstance(value, torch.Tensor):
        return tensor(value, place)
    if isinstance(value, dict):
        copied = copy.copy(value)
        for key, item in value.items():
            copied[key] = rebuild(item, tensor, other, (*place, key))
        return copied
    if isinstance(value, (list, tuple)):
        items = [rebuild(item, tensor, other, (*place, Index(i))) for i, item in enumerate(value)]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return other(value, place)


def leaves(value: Any) -> Iterator[tuple[tuple, Any]]:
    """(place, leaf) of every tensor and every other leaf, in rebuild's order."""
    found: list = []

    def keep(leaf: Any, place: tuple) -> Any:
        found.append((place, leaf))
        return leaf

    rebuild(value, keep, keep)
    return iter(found)


def place_text(place: tuple) -> str:
    """A place as Python would index it: ``model.w``, ``param_groups[0].lr``."""
    text = ""
    for step in place:
        text += f"[{int(step)}]" if isinstance(step, Index) else (f".{step}" if text else str(step))
    return text
