"""Checkpoints that are never half-written and never silently wrong: one package, one protocol.

- ``format``: a checkpoint's names and its file (checksummed header, atomic write, verified read);
- ``parts``: a sharded save's parts, written by every rank and committed by rank 0's main file;
- ``writer``: saving at once or in the background, and keeping the newest ``keep``;
- here: reading a checkpoint whole (parts joined, ZeRO's shards checked) and the newest valid one.

Loading verifies the checksum and falls back to the previous file. ZeRO's shards
(hvdkit.zero.shards) are named and checked through this package too.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable, Optional

from hvdkit.checkpoint.format import (
    MAGIC,
    PREFIX,
    SHARDS,
    SUFFIX,
    CheckpointError,
    clean_partials,
    existing,
    is_shard_folder,
    load,
    path_for,
    rank_of_part,
    read_checked,
    shard_folder,
    step_in,
    step_of,
    write,
)
from hvdkit.checkpoint.parts import PART_WAIT_SECONDS, Part, join_parts, part_name, split
from hvdkit.checkpoint.writer import Writer, save

__all__ = ["MAGIC", "PART_WAIT_SECONDS", "PREFIX", "SHARDS", "SUFFIX", "CheckpointError", "Part", "Writer",
           "check_shards", "clean_partials", "existing", "is_shard_folder", "join_parts", "load", "load_latest",
           "load_whole", "part_name", "path_for", "rank_of_part", "read_checked", "save", "shard_folder",
           "split", "step_in", "step_of", "write"]


def load_whole(path: Path) -> dict:
    """The state of checkpoint ``path`` with its parts joined, after checking that a sharded run's
    shards are all there and intact; CheckpointError if any is not."""
    state = join_parts(path, load(path))
    check_shards(path, state)
    return state


def check_shards(path: Path, state: dict) -> None:
    """CheckpointError unless every shard a sharded checkpoint names is there and intact
    (read in chunks: no rank holds them all)."""
    manifest = state.get("optimizer")
    if not (isinstance(manifest, dict) and "shards" in manifest):
        return
    for entry in manifest["shards"]:
        shard = shard_folder(path) / entry["file"]
        digest = hashlib.sha256()
        try:
            with open(shard, "rb") as f:
                f.readline()
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
        except OSError as exc:
            raise CheckpointError(f"{path} is incomplete: its shard {shard.name} cannot be read "
                                  f"({exc.strerror})") from None
        if digest.hexdigest() != entry["sha256"]:
            raise CheckpointError(f"{path} is corrupted: its shard {shard.name} fails its checksum")


def load_latest(directory: str, warn: Callable[[str], None]) -> Optional[tuple[Path, dict]]:
    """The newest checkpoint that verifies, warning about each newer one that does not.

    None when the directory holds no checkpoint; CheckpointError when it holds only bad ones.
    """
    files = existing(directory)
    problems = []
    for path in reversed(files):
        try:
            state = load_whole(path)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        for problem in problems:
            warn(f"{problem}; using {path.name} instead")
        return path, state
    if problems:
        raise CheckpointError(f"no valid checkpoint in {directory}: " + "; ".join(problems))
    return None
