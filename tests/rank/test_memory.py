"""hvdkit.rank.memory: each phase's peak is its own, not the process's so far (real allocations)."""

import torch

from hvdkit.rank.memory import PhasePeaks, peak_rss

MB = 2**20


def test_each_phase_reports_its_own_peak_and_the_largest_of_its_repeats():
    peaks = PhasePeaks()
    with peaks.phase("big"):
        block = torch.ones(300 * MB // 4)  # touched: resident
        del block
    with peaks.phase("small"):
        block = torch.ones(20 * MB // 4)
        del block
    with peaks.phase("small"):  # a repeat keeps the larger peak
        pass
    summary = peaks.summary()
    assert summary["unit"] == "rss"
    assert summary["big"] - summary["small"] >= 250 * MB, summary
    assert 0 < summary["small"] <= summary["big"] <= peak_rss()


def test_a_steps_phases_are_measured_on_the_first_steps_and_every_50th():
    """A steady step's phases cost no system call: measured at steps 0-2, then one in STEP_PHASES_EVERY."""
    from hvdkit.rank import memory

    peaks = PhasePeaks()
    measured = []
    for step in range(120):
        with peaks.step_phase(f"step {step}", step):
            pass
        measured += [step] if f"step {step}" in peaks.peaks else []
    assert measured == [0, 1, 2, 50, 100] and memory.STEP_PHASES_EVERY == 50
