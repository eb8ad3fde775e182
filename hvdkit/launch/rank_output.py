"""A launcher's output as whole lines, each rank's own: partial writes are joined, never glued.

A rank that writes part of a line (Python's print with PYTHONUNBUFFERED=1 writes the text and
the newline separately; a block-buffered pipe flushes mid-line) reaches the launcher's output
as a chunk, and another rank's chunk can land between its two halves. Open MPI's
``--tag-output`` (and horovodrun, which tags the same way) prefixes every chunk with its rank,
``[1,0]<stdout>:``, so the halves can be found again: ``Joiner`` keeps a partial line per tag
and writes a line only when it is complete, with one write, tag first. Text without a tag is
the launcher's own and is passed on as whole lines too.
"""

from __future__ import annotations

import os
import re
import threading
from typing import Callable, Optional

# [job,rank]<stdout>: from Open MPI's --tag-output (horovodrun --mpi), [rank]<stdout>: from horovodrun --gloo
TAG = re.compile(rb"\[(\d+)(?:,(\d+))?\]<(stdout|stderr|stddiag)>:")  # groups: rank or job, rank, stream
_PARTIAL_TAG = re.compile(rb"\[[\d,]*(?:\](?:<[a-z]*>?)?)?")  # a tag cut off by the end of a read


class Joiner:
    """Feed it a launcher's stream in chunks as read; it passes whole lines to ``write``."""

    def __init__(self, write: Callable[[bytes], None]) -> None:
        self.write = write
        self.buffer = b""
        self.owner: Optional[bytes] = None  # the tag of the text now arriving; None: the launcher's
        self.pending: dict = {}  # tag -> the start of its current line

    def feed(self, data: bytes) -> None:
        self.buffer += data
        pos = 0
        while True:
            match = TAG.search(self.buffer, pos)
            end = match.start() if match else self._held_back(pos)
            self._text(self.buffer[pos:end])
            if not match:
                break
            self.owner, pos = match.group(), match.end()
        self.buffer = self.buffer[end:]

    def close(self) -> None:
        """End of the stream: what is left of any line is written as a line."""
        self._text(self.buffer)
        self.buffer = b""
        for owner, rest in list(self.pending.items()):
            if rest:
                self.write((owner or b"") + rest + b"\n")
        self.pending.clear()

    def _held_back(self, pos: int) -> int:
        """Where the text that is surely not the start of a tag ends."""
        start = self.buffer.rfind(b"[", pos)
        if start >= 0 and len(self.buffer) - start < 32 and _PARTIAL_TAG.fullmatch(self.buffer, start):
            return start
        return len(self.buffer)

    def _text(self, text: bytes) -> None:
        while text:
            line, newline, text = text.partition(b"\n")
            rest = self.pending.pop(self.owner, b"") + line
            if not newline:
                self.pending[self.owner] = rest
                return
            self.write((self.owner or b"") + rest + b"\n")
            self.owner = None  # after a newline, text without a tag is the launcher's


def untagged(text: str) -> str:
    """A launcher's whole output as a user reads it from one rank: lines joined, tags gone."""
    joined: list = []
    joiner = Joiner(joined.append)
    joiner.feed(text.encode())
    joiner.close()
    return TAG.sub(b"", b"".join(joined)).decode(errors="replace")


def pump(source: int, fd: int) -> threading.Thread:
    """A thread that reads ``source`` to its end through a Joiner writing to ``fd``, each line
    with one write."""
    def write(line: bytes) -> None:
        try:
            os.write(fd, line)
        except OSError:  # the reader went away (`| head`): keep draining, so the launcher never blocks
            pass

    def run() -> None:
        joiner = Joiner(write)
        while True:
            data = os.read(source, 65536)
            if not data:
                break
            joiner.feed(data)
        joiner.close()
        os.close(source)

    thread = threading.Thread(target=run, name=f"lines-{fd}", daemon=True)
    thread.start()
    return thread
