"""The Session's parts tested on their own, each handed what it uses (no Session, fake or real):
tests/programs/parts_worker.py runs each in a real Horovod process of world size 1 (the reading
and the reports: tests/rank/test_reading.py, tests/rank/test_report.py)."""

import pytest

from conftest import part_checked


@pytest.mark.slow
@pytest.mark.parametrize("part", ["loaders", "step", "checkpoints", "start_nothing"])
def test_a_part_works_with_what_it_is_handed(part, tmp_path):
    part_checked(part, tmp_path)
