"""The reports (hvdkit.rank.reports.report), in a real Horovod process: metrics summed on the device,
the sample-weighted means of a report, rank 0's record. Reports in whole runs: tests/test_trainer.py."""

import pytest

from conftest import part_checked


@pytest.mark.slow
def test_a_report_gives_the_sample_weighted_means_at_its_cadence_and_writes_rank_0s_record(tmp_path):
    part_checked("reports", tmp_path)
