"""The snapshots in host memory (hvdkit.rank.resume.host_snapshots) that hvdkit launch's restarts read:
kept only under it, and only where two fit. A restart that resumes from one: tests/launch/test_restarts.py."""

import os
import re
import socket
import subprocess
import sys

from conftest import TWO_RANK_TRAIN, run
from hvdkit import checkpoint


def test_snapshots_outside_hvdkit_launch_are_one_line_and_exit_2(tmp_path):
    proc = run([sys.executable, "-m", "hvdkit", "train", *TWO_RANK_TRAIN, "--snapshot-steps", "1", "--checkpoint-dir",
                str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "logs")],
               env={**os.environ, "HVDKIT_SNAPSHOT_DIR": ""})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "hvdkit train: snapshot_steps: snapshots are kept for the restarts of hvdkit launch --max-restarts N (which "
        "names where each host keeps them); run under it, or drop snapshot_steps")
    assert not checkpoint.existing(str(tmp_path / "ckpt"))


def test_snapshots_larger_than_the_room_where_they_are_kept_are_one_line_and_exit_2(tmp_path):
    """Two snapshots that do not fit in the memory free where they are kept (a 256 KiB tmpfs here):
    the first snapshot ends the run with the sizes in one line, exit 2; no checkpoint is written."""
    place = tmp_path / "shm"
    place.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(place)], check=True)
    try:
        proc = run([sys.executable, "-m", "hvdkit", "train", *TWO_RANK_TRAIN, "--snapshot-steps", "1",
                    "--checkpoint-dir", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "logs")],
                   env={**os.environ, "HVDKIT_SNAPSHOT_DIR": str(place / "job")})
        left = list(place.iterdir())
    finally:
        subprocess.run(["umount", str(place)], check=True)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"hvdkit train: snapshot_steps: two snapshots of this state take \d+\.\d MiB and "
                        rf"{place}/job/{socket.gethostname()} has 0\.\d MiB free; snapshot a smaller state, or drop "
                        rf"snapshot_steps",
                        last), last
    assert not checkpoint.existing(str(tmp_path / "ckpt")) and left in ([], [place / "job"])
