"""Whole-file writes (hvdkit.system.wholefiles): a failed write leaves the old file and no temporary."""

import pytest

from hvdkit.system import wholefiles


def test_a_failed_whole_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "record.json"
    target.write_text("old")
    with pytest.raises(TypeError):
        wholefiles.write_whole(target, (b"half of the new", object()))  # fails after its first part is written
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["record.json"]
    wholefiles.write_whole(target, "new")
    assert target.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["record.json"]
