"""A sharded save's parts: every rank writes a part of what every rank holds alike (the weights
and, under DistributedOptimizer, the optimizer state), tensors balanced by bytes, into the
checkpoint's shard folder; rank 0's main file holds the rest and a ``Part`` in place of each
tensor another rank wrote, and is written only once every part is durable, with their checksums:
the checkpoint exists whole or not at all. Reading it joins the parts back into one state."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from hvdkit.checkpoint.format import MAGIC, CheckpointError, read_checked, shard_folder
from hvdkit.nested import rebuild


class Part:
    """In a sharded checkpoint's main file, a tensor another rank wrote: its part file in the
    shard folder and its number there."""

    def __init__(self, file: str, number: int) -> None:
        self.file, self.number = file, number


def part_name(rank: int, size: int) -> str:
    return f"part-{rank:05d}-of-{size:05d}.pt"


def split(state: dict, shared: Iterable[torch.Tensor], size: int) -> tuple[dict, list[dict]]:
    """(the main file's state, each rank's part: number -> tensor) of a sharded save. The tensors
    in ``shared`` (the same on every rank) are split among the ranks by bytes, the largest first
    to the rank with the fewest, so that every rank computes the same split; rank 0 keeps its own
    in the main file, where each other rank's is a Part."""
    shared_ptrs = {t.data_ptr() for t in shared if t.layout == torch.strided and t.numel()}
    numbers: dict[tuple, int] = {}  # a tensor's memory, shape and dtype -> its number
    tensors: list[torch.Tensor] = []

    def identity(value: torch.Tensor) -> tuple:
        return value.data_ptr(), tuple(value.shape), value.stride(), value.dtype

    def number(value: torch.Tensor, place: tuple) -> torch.Tensor:
        if value.layout == torch.strided and value.data_ptr() in shared_ptrs and identity(value) not in numbers:
            numbers[identity(value)] = len(tensors)
            tensors.append(value)
        return value

    rebuild(state, number)
    owner, load = {}, [0] * size
    for n in sorted(range(len(tensors)), key=lambda n: -tensors[n].nbytes):
        owner[n] = rank = load.index(min(load))
        load[rank] += tensors[n].nbytes
    parts: list[dict] = [{} for _ in range(size)]
    for n, rank in owner.items():
        if rank:
            parts[rank][n] = tensors[n]

    def placed(value: torch.Tensor, place: tuple) -> Any:
        n = numbers.get(identity(value)) if value.layout == torch.strided else None
        return value if n is None or not owner[n] else Part(part_name(owner[n], size), n)

    return rebuild(state, placed), parts


PART_WAIT_SECONDS = 600.0  # a rank whose part does not appear by then failed, or does not share the directory


def await_parts(main: Path, names: Sequence[str], ending: threading.Event) -> list[dict]:
    """The parts of checkpoint ``main`` as the other ranks finish them (each is renamed into place
    once durable), with the checksums their headers hold; CheckpointError once ``ending`` is set."""
    folder, found = shard_folder(main), {}
    deadline = time.monotonic() + PART_WAIT_SECONDS
    while len(found) < len(names):
        for name in names:
            if name not in found:
                try:
                    with open(folder / name, "rb") as f:
                        found[name] = f.readline()[len(MAGIC):].strip().decode()
                except FileNotFoundError:
                    pass
        if len(found) < len(names):
            missing = ", ".join(name for name in names if name not in found)
            if ending.is_set():
                raise CheckpointError(f"checkpoint {main} not written: the job ended before {missing} appeared in "
                                      f"{folder}; the previous checkpoints are untouched")
            if time.monotonic() > deadline:
                raise CheckpointError(f"checkpoint {main} not written: {missing} did not appear in {folder} within "
                                      f"{PART_WAIT_SECONDS:g} s (a rank failed to write it, or {main.parent} is not "
                                      f"shared by every host); the previous checkpoints are untouched")
            ending.wait(0.02)
    return [{"file": name, "sha256": found[name]} for name in names]


def join_parts(path: Path, state: dict) -> dict:
    """A sharded checkpoint's state whole, its parts read back in place of their Parts;
    CheckpointError if a part is missing, altered, or not the one the main file committed."""
    entries = state.get("parts")
    if not entries:
        return state
    tensors = {}
    for entry in entries:
        try:
            digest, part = read_checked(shard_folder(path) / entry["file"])
        except CheckpointError as exc:
            raise CheckpointError(f"{path} is incomplete: {exc}") from None
        if digest != entry["sha256"]:
            raise CheckpointError(f"{path} is corrupted: its part {entry['file']} is not the one it was written with")
        tensors.update({(entry["file"], n): tensor for n, tensor in part.items()})
    whole = {key: value for key, value in state.items() if key != "parts"}
    return rebuild(whole, lambda tensor, place: tensor,
                   lambda leaf, place: tensors[leaf.file, leaf.number] if isinstance(leaf, Part) else leaf)
