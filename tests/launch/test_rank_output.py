"""Rank output as whole lines (hvdkit.launch.rank_output): halves of lines two ranks write at once
are joined, wherever the launcher's reads split them, and never glued to another rank's."""

import os
import re
import sys

import pytest

from conftest import run
from hvdkit.launch import rank_output

HVDKIT = [sys.executable, "-m", "hvdkit", "launch"]


# Each rank writes half a line, waits, then the rest: the launcher sees the other rank's half in between.
HALVES = ("import os, sys, time\n"
          "r = next(os.environ[v] for v in ('OMPI_COMM_WORLD_RANK', 'HOROVOD_RANK') if v in os.environ)\n"
          "for i in range(4):\n"
          "    print(f'rank {r} first half,', end='', flush=True); time.sleep(0.15 + 0.1 * int(r))\n"
          "    print(f' second half {i}', flush=True); print(f'rank {r} to stderr {i}', file=sys.stderr)\n")
LINE = re.compile(r"\[(?:1,)?(\d)\]<(stdout|stderr)>:rank (\d) (?:first half, second half|to stderr) \d")


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--launcher", "mpirun"], ["--launcher", "horovodrun", "--mpi"],
                                   ["--launcher", "horovodrun", "--gloo"]], ids=" ".join)
def test_ranks_lines_are_never_glued_together(flags):
    proc = run([*HVDKIT, "-np", "2", *flags, "--", sys.executable, "-c", HALVES],
               env=dict(os.environ, PYTHONUNBUFFERED="1"), timeout=120, raw=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for stream, text in (("stdout", proc.stdout), ("stderr", proc.stderr)):
        lines = [line for line in text.splitlines() if "rank" in line]
        assert len(lines) == 8, text
        for line in lines:
            match = LINE.fullmatch(line)
            assert match and match.group(1) == match.group(3) and match.group(2) == stream, line


@pytest.mark.parametrize("cut", range(1, 60))
def test_joiner_rebuilds_each_ranks_lines_wherever_reads_split_them(cut):
    """Open MPI's --tag-output stream of two ranks writing half lines (as measured), read in two
    pieces split at every position, including inside a tag."""
    stream = (b"[1,1]<stdout>:r1-a-[1,0]<stdout>:r0-a-[1,0]<stdout>:b0\n[1,1]<stdout>:b1\n"
              b"mpirun: a line of its own\n[1,0]<stdout>:last")
    out = []
    joiner = rank_output.Joiner(out.append)
    joiner.feed(stream[:cut])
    joiner.feed(stream[cut:])
    joiner.close()
    assert all(line.endswith(b"\n") for line in out)
    assert sorted(line.rstrip(b"\n") for line in out) == sorted([
        b"[1,0]<stdout>:r0-a-b0", b"[1,1]<stdout>:r1-a-b1", b"mpirun: a line of its own", b"[1,0]<stdout>:last"])
