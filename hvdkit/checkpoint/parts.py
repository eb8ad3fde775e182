"""The one protocol for a checkpoint's parts. A rank's part (``part-N-of-M.pt`` in the shard
folder) holds what that rank writes of a save: its share of what every rank holds alike (the
weights and, under DistributedOptimizer, the optimizer state, with ``sharded_checkpoint``: tensors
balanced by bytes, numbered) and, under ZeRO, its shard of the optimizer state (``"zero"``).
Rank 0's main file holds the rest, a ``Part`` in place of each tensor another rank wrote, and the
list of parts with their checksums (``"parts"``); it is written only once every part is durable:
the checkpoint exists whole or not at all. Reading it checks every part and joins the tensors
back into one state."""

from __future__ import annotations

import hashlib
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
    """A parted checkpoint's state whole: every part its main file names is there with the checksum
    the main file committed (CheckpointError if not), and the tensors other ranks wrote are read
    back in place of their Parts. A part with none of them (a ZeRO shard alone) is checked in
    chunks and not read: no rank holds all of those."""
    wanted: set[str] = set()
    rebuild(state, lambda tensor, place: tensor, lambda leaf, place: wanted.add(leaf.file) if isinstance(leaf, Part)
            else leaf)
    tensors = {}
    for entry in state.get("parts") or ():
        if entry["file"] not in wanted:
            check_part(path, entry)
            continue
        try:
            digest, part = read_checked(shard_folder(path) / entry["file"])
        except CheckpointError as exc:
            raise CheckpointError(f"{path} is incomplete: {exc}") from None
        if digest != entry["sha256"]:
            raise CheckpointError(f"{path} is corrupted: its part {entry['file']} is not the one it was written with")
        tensors.update({(entry["file"], n): tensor for n, tensor in part.items() if isinstance(n, int)})
    for entry in legacy_shards(state):
        check_part(path, entry, "shard")
    whole = {key: value for key, value in state.items() if key != "parts"}
    return rebuild(whole, lambda tensor, place: tensor,
                   lambda leaf, place: tensors[leaf.file, leaf.number] if isinstance(leaf, Part) else leaf)


def legacy_shards(state: dict) -> list[dict]:
    """ZeRO's shard files as checkpoints before one protocol for parts named them, in the
    optimizer's manifest (``rank-N-of-M.pt``); none in a checkpoint written since."""
    manifest = state.get("optimizer")
    return manifest["shards"] if isinstance(manifest, dict) and "shards" in manifest else []


def check_part(path: Path, entry: dict, what: str = "part") -> None:
    """CheckpointError unless the part ``entry`` names is there with its checksum (read in chunks)."""
    file = shard_folder(path) / entry["file"]
    digest = hashlib.sha256()
    try:
        with open(file, "rb") as f:
            f.readline()
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    except OSError as exc:
        raise CheckpointError(f"{path} is incomplete: its {what} {file.name} cannot be read ({exc.strerror})") from None
    if digest.hexdigest() != entry["sha256"]:
        raise CheckpointError(f"{path} is corrupted: its {what} {file.name} fails its checksum")
