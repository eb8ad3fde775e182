"""hvdkit's fixes to Horovod (its C++ and its launcher), as patch files in this folder, and how a
build applies them.

Each ``NNNN-*.patch`` is one fix, with a header saying what it fixes and why (measured where it
changes speed), and the upstream issue or pull request where there is one; the builder applies
them in order after the ``cxx-standard-N.patch`` for torch's C++ standard. They apply to
Horovod's 0.28.1 source distribution exactly, with GNU patch and no fuzz:

    cd horovod-0.28.1 && for p in cxx-standard-20.patch 0*.patch; do patch -p1 < $p; done
"""

from __future__ import annotations

import hashlib
import re
import subprocess
from pathlib import Path
from typing import Optional, Sequence

from hvdkit.build.toolchain import HOROVOD_VERSION, BuildError, last_line

FOLDER = Path(__file__).resolve().parent


def for_standard(standard: int) -> list[Path]:
    """The patches a build applies to Horovod's source, in order: the C++ standard torch's
    headers need (none for 14, Horovod's own), then every numbered fix (hvdkit/build/patches/, each
    with a header saying what it fixes, why, and where upstream stands)."""
    first = [FOLDER / f"cxx-standard-{standard}.patch"] if standard != 14 else []
    return [*first, *sorted(FOLDER.glob("[0-9][0-9][0-9][0-9]-*.patch"))]


def apply(src_dir: Path, patches: Sequence[Path]) -> None:
    """Apply each patch in order with GNU patch, exactly (no fuzz); one that does not apply
    stops the build, before it changes a file."""
    for patch in patches:
        for check in (["--dry-run"], []):
            result = subprocess.run(["patch", "-p1", "--forward", "--batch", "--fuzz=0", "--no-backup-if-mismatch",
                                     "--reject-file=-", *check, "-d", str(src_dir), "-i", str(patch)],
                                    capture_output=True, text=True)
            if result.returncode != 0:
                why = last_line(result.stdout + result.stderr)
                raise BuildError(f"{patch.name} does not apply to {src_dir} ({why}); "
                                 f"is this Horovod {HOROVOD_VERSION}?")


def digest(standard: int, paths: Optional[Sequence[Path]] = None) -> str:
    """Part of the cache key: a wheel built from other changes is not reused. Only what patch
    applies counts, from each file's first ``---``/``diff`` line: a header (what a fix is, why,
    which test checks it) can be corrected without rebuilding Horovod everywhere."""
    hasher = hashlib.sha256()
    for patch in for_standard(standard) if paths is None else paths:
        hasher.update(changes(patch.read_bytes()) + b"\0")
    return hasher.hexdigest()[:12]


def changes(text: bytes) -> bytes:
    """A patch file without its header: what GNU patch reads."""
    match = re.search(rb"^(?:--- |diff )", text, re.M)
    return text[match.start():] if match else text
