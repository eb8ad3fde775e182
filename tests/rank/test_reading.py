"""Which checkpoint a run takes back (hvdkit.rank.resume.reading), in a real Horovod process: the K a
sharded run resumed at another world size goes on with, in a copy of its config. The resumes at other
world sizes end to end are in tests/zero/test_zero.py."""

import pytest

from conftest import part_checked


@pytest.mark.slow
def test_a_sharded_run_reads_ahead_the_k_that_keeps_the_global_batch_and_an_unsharded_one_refuses(tmp_path):
    part_checked("reading", tmp_path)
