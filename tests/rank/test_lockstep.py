"""The lines hvdkit.rank.agree.lockstep says when the ranks are out of step, from the rows the ranks send
(real runs of each shape: tests/test_hangs.py), and the stop grace period's setting."""

import pytest

from hvdkit import job
from hvdkit.rank.agree import lockstep

STEP, SAVE, REPORT, END, FINISH = (lockstep.CALLS.index(call) + 1 for call in (
    "session.step()", "session.save()", "session.report()",
    "the end of an epoch (session.epochs() or session.join())", "session.finish()"))


def test_ranks_at_the_same_call_after_the_same_steps_agree_and_the_stop_is_theirs():
    assert lockstep.mismatch([[STEP, 16, 0], [STEP, 16, 15], [STEP, 16, 0]]) is None


def test_a_call_on_rank_0_only_names_the_call_and_says_to_call_it_everywhere():
    line = lockstep.mismatch([[SAVE, 10, 0], [STEP, 10, 0], [STEP, 10, 0]])
    assert line == ("the ranks made different hvdkit calls (rank 0 at session.save() after step 10, ranks 1, 2 at "
                    "session.step() (step 11)): session.save() must be called by every rank at the same point of "
                    "the loop, not under `if rank == 0` (rank 0 alone writes the file)")


def test_at_two_ranks_the_odd_call_is_the_one_that_is_not_a_step():
    line = lockstep.mismatch([[STEP, 10, 0], [REPORT, 10, 0]])
    assert line.startswith("the ranks made different hvdkit calls (rank 1 at session.report() after step 10, rank 0 "
                           "at session.step() (step 11)): session.report() must be called by every rank")


def test_a_rank_that_ended_its_steps_early_is_said_to_have_taken_fewer_steps():
    for end in (END, FINISH):
        line = lockstep.mismatch([[STEP, 50, 0], [end, 40, 0]])
        assert line.startswith("the ranks took different numbers of steps (rank 1 at "), line
        assert "give each the same number of batches" in line


def test_the_same_call_at_different_steps_is_a_step_count_difference():
    line = lockstep.mismatch([[STEP, 50, 0], [STEP, 49, 0]])
    assert line.startswith("the ranks took different numbers of steps (")


def test_many_ranks_are_counted_not_listed():
    rows = [[STEP, 5, 0]] * 20 + [[SAVE, 5, 0]]
    assert "ranks 0, 1, 2, 3, 4, 5 and 14 more at session.step() (step 6)" in lockstep.mismatch(rows)


def test_the_stop_grace_period_is_10_s_unless_set():
    assert job.stop_grace({}) == 10.0
    assert job.stop_grace({"HVDKIT_STOP_GRACE": "3.5"}) == 3.5
    for bad in ("soon", "-1", "inf", "nan"):
        with pytest.raises(ValueError, match=f"^HVDKIT_STOP_GRACE='{bad}': expected the seconds"):
            job.stop_grace({"HVDKIT_STOP_GRACE": bad})
