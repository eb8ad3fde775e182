"""Snapshots' file (``raw``): a checkpoint whose tensors lie in one of two slot files beside it,
as they lie in memory, for snapshots in host memory taken every step. A snapshot is then one
copy of the state into pages the slot already holds (no serialization, no new file of the state's
size: a tmpfs hands out and zeroes every page of a new file) and a checksum at memory speed
(xxh3-128); the checkpoint file itself, small, holds the state's structure, which slot, and the
slot's checksum, and is written atomically as every checkpoint is.

The slots alternate: a snapshot is copied into the slot the newest checkpoint in the directory
does not name, so a process killed while copying leaves that checkpoint whole; once copied, the
new checkpoint file names it."""

from __future__ import annotations

import mmap
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import xxhash

from hvdkit.nested import rebuild
from hvdkit.system import wholefiles

MAGIC = b"HVDKIT-CHECKPOINT 1 raw xxh3-128="
SLOTS = ("slot-a.data", "slot-b.data")
ALIGN = 64


@dataclass(frozen=True)
class _InSlot:
    """A tensor's place in the slot (not a tuple: the walker would walk into it)."""
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple


def _layout(state: dict) -> tuple[dict, list, int]:
    """(the structure, each tensor in it as an _InSlot; the tensors' flat bytes with their offsets;
    the slot's size). A tensor held twice is stored once."""
    tensors: list = []
    seen: dict = {}
    size = 0

    def place(tensor: torch.Tensor, where: tuple):
        nonlocal size
        if tensor.layout != torch.strided:  # sparse: pickled with the structure
            return tensor
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        if tensor.data_ptr() and key in seen:
            return seen[key]
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        seen[key] = _InSlot(size, flat.nbytes, tensor.dtype, tuple(tensor.shape))
        if flat.nbytes:
            tensors.append((size, flat.view(torch.uint8)))
        size += -(-flat.nbytes // ALIGN) * ALIGN
        return seen[key]

    return rebuild(state, place), tensors, size


def _slot_of(path: Path) -> Optional[str]:
    """The slot the checkpoint file ``path`` names; None where it names none or does not read."""
    try:
        header, _, payload = path.read_bytes().partition(b"\n")
        return pickle.loads(payload)["slot"] if header.startswith(MAGIC) else None
    except (OSError, pickle.UnpicklingError, EOFError, KeyError, TypeError):
        return None


class Mapped:
    """The slots a writer keeps mapped between snapshots: a new mapping would fault in every page
    at each copy, which costs more than the copy."""

    def __init__(self) -> None:
        self._maps: dict[Path, mmap.mmap] = {}
        # Set by the writer for each save: called once the tensors are in the slot (they may
        # change from then on), and what makes the rest of the state whole before it is written.
        self.after_copy: Callable[[], None] = lambda: None
        self.resolve: Callable[[object], object] = lambda structure: structure

    def pages(self, path: Path, size: int) -> mmap.mmap:
        """``path`` mapped, at least ``size`` bytes (the file grown where smaller)."""
        held = self._maps.get(path)
        if held is not None and len(held) >= size and os.path.exists(path):
            return held
        if held is not None:
            held.close()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            self._maps[path] = mmap.mmap(fd, max(size, 1))
        finally:
            os.close(fd)
        return self._maps[path]

    def close(self) -> None:
        """Unmap every slot (their memory goes once their files are removed too)."""
        for held in self._maps.values():
            held.close()
        self._maps = {}


def write(target: Path, state: dict, newest: Optional[Path], mapped: Mapped) -> str:
    """``state`` as checkpoint ``target``: its tensors copied into the slot that ``newest`` (the
    newest checkpoint in the directory) does not name, then the file naming it written atomically;
    returns the file's checksum."""
    structure, tensors, size = _layout(state)
    used = _slot_of(newest) if newest is not None else None
    slot = SLOTS[1] if used == SLOTS[0] else SLOTS[0]
    pages = mapped.pages(target.parent / slot, size)
    room = torch.frombuffer(pages, dtype=torch.uint8, count=size) if size else None
    for offset, data in tensors:
        room[offset:offset + data.numel()].copy_(data)
    del room, tensors  # no view of the pages may outlive the mapping; nor of the state
    mapped.after_copy()
    digest = xxhash.xxh3_128(memoryview(pages)[:size]).hexdigest()
    payload = pickle.dumps({"slot": slot, "size": size, "xxh3": digest, "state": mapped.resolve(structure)},
                           protocol=pickle.HIGHEST_PROTOCOL)
    checksum = xxhash.xxh3_128(payload).hexdigest()
    wholefiles.write_whole(target, (MAGIC + checksum.encode() + b"\n", payload))
    return checksum


def read(path: Path, payload: bytes, corrupted: Callable[[str], Exception]) -> dict:
    """The state of checkpoint ``path`` (its payload checked), its tensors read from its slot and
    checked; ``corrupted(why)``: the error to raise."""
    index = pickle.loads(payload)
    try:
        with open(path.parent / index["slot"], "rb") as file:
            data = bytearray(file.read(index["size"]))
    except OSError as exc:
        raise corrupted(f"its slot {index['slot']} does not read: {exc.strerror}") from None
    if len(data) != index["size"] or xxhash.xxh3_128(data).hexdigest() != index["xxh3"]:
        raise corrupted(f"its slot {index['slot']} does not hold it (checksum mismatch)")
    made: dict = {}  # a tensor held twice is one tensor again

    def tensor(leaf, where: tuple):
        if not isinstance(leaf, _InSlot):
            return leaf
        if leaf not in made:
            made[leaf] = (torch.frombuffer(data, dtype=torch.uint8, count=leaf.nbytes, offset=leaf.offset)
                          .view(leaf.dtype).reshape(leaf.shape).clone() if leaf.nbytes
                          else torch.empty(leaf.shape, dtype=leaf.dtype))
        return made[leaf]

    return rebuild(index["state"], lambda t, where: t, tensor)


def checksum(payload: bytes) -> str:
    return xxhash.xxh3_128(payload).hexdigest()
