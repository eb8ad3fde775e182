"""Where a run is (hvdkit.rank.state): one RunState per run that the parts share, the Session's
attributes kept in it, and rank 0's one line."""

from types import SimpleNamespace

from hvdkit.rank.state import RunState, say, state_field


class Holder:
    step = state_field("global_step", "optimizer steps taken")

    def __init__(self, state):
        self._state = state


def test_a_holders_attribute_is_its_states_and_two_runs_share_nothing():
    first, second = RunState(), RunState()
    first.extra["mine"] = 1
    first.unsettled.append(3)
    assert second.extra == {} and second.unsettled == [] and first.peaks is not second.peaks
    holder = Holder(first)
    holder.step = 7
    assert first.global_step == 7 and holder.step == 7 and second.global_step == 0
    first.global_step = 9  # a part moves it on: the holder reads the same
    assert holder.step == 9 and Holder.step.__doc__ == "optimizer steps taken"


def test_only_rank_0_says_a_line(capsys):
    for rank in (1, 0):
        say(SimpleNamespace(rank=lambda r=rank: r), f"hvdkit: from rank {rank}")
    assert capsys.readouterr().err == "hvdkit: from rank 0\n"
