"""Checkpoints that are never half-written and never silently wrong: one package, one protocol.

- ``format``: a checkpoint's names and its file (checksummed header, atomic write, verified read);
- ``parts``: the parts of a save (a sharded checkpoint's, ZeRO's shards), written by every rank and
  committed by rank 0's main file, which names each with its checksum;
- ``writer``: saving at once or in the background, and keeping the newest ``keep``;
- here: reading a checkpoint whole (parts joined, ZeRO's shards checked) and the newest valid one.

Loading verifies the checksums and falls back to the previous file. ZeRO's shards
(hvdkit.zero.shards) are parts like any other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from hvdkit.checkpoint.format import (
    MAGIC,
    PATTERN,
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
from hvdkit.checkpoint.parts import PART_WAIT_SECONDS, Part, join_parts, legacy_shards, part_name, split
from hvdkit.checkpoint.writer import Later, Writer, save

__all__ = ["MAGIC", "PART_WAIT_SECONDS", "PATTERN", "PREFIX", "SHARDS", "SUFFIX", "CheckpointError", "Later", "Part",
           "Writer",
           "clean_partials", "existing", "is_shard_folder", "join_parts", "legacy_shards", "load", "load_latest",
           "load_whole", "part_name", "path_for", "rank_of_part", "read_checked", "save", "shard_folder",
           "split", "step_in", "step_of", "write"]


def load_whole(path: Path) -> dict:
    """The state of checkpoint ``path`` with its parts checked and joined; CheckpointError if any
    part is missing or altered."""
    return join_parts(path, load(path))


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
