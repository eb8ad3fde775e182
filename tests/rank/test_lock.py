"""The directory lock on its own (hvdkit.rank.ending.lock); two real runs on one directory are in
tests/rank/test_stops.py."""

import errno
import fcntl
import json
import os

import pytest

from hvdkit.rank.ending import lock


def test_a_held_directory_is_refused_naming_the_holder_and_released_at_the_end(tmp_path):
    first = lock.DirectoryLock(str(tmp_path), "checkpoint_dir")
    first.acquire()
    assert json.loads((tmp_path / lock.NAME).read_text())["pid"] == os.getpid()
    with pytest.raises(lock.DirectoryInUse, match=rf"checkpoint_dir {tmp_path} is in use by another run "
                                                  rf"\(pid {os.getpid()} on "):
        lock.DirectoryLock(str(tmp_path), "checkpoint_dir").acquire()  # flock: per open file, so this conflicts
    first.release()
    assert not (tmp_path / lock.NAME).exists()
    again = lock.DirectoryLock(str(tmp_path), "checkpoint_dir")
    again.acquire()
    again.release()


def test_a_filesystem_without_flock_warns_and_runs(tmp_path, monkeypatch, capsys):
    """Lustre mounted without -o flock answers ENOSYS; no such filesystem here, so flock is
    replaced by one that answers as it does."""
    def no_flock(handle, operation):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    lock.DirectoryLock(str(tmp_path), "log_dir").acquire()
    assert capsys.readouterr().err == (f"hvdkit: warning: cannot lock log_dir {tmp_path} (Function not implemented): "
                                       f"a second run on it would not be refused\n")
