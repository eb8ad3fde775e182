"""What rank 0 writes (hvdkit.rank.reports.metrics): strict JSON, progress lines, elastic world size changes."""

import json
import math

from hvdkit.rank.reports.metrics import finite_or_none


def test_json_never_holds_nan():
    record = finite_or_none({"loss": math.nan, "rates": [1.0, math.inf], "ok": 2.5, "flag": True})
    assert record == {"loss": None, "rates": [1.0, None], "ok": 2.5, "flag": True}
    json.dumps(record, allow_nan=False)


def test_plain_progress_lines_say_step_total_rate_and_eta():
    from hvdkit.rank.reports.metrics import progress_text

    assert progress_text(50, 360, 10.0, 40) == "step 50/360 (13%), 4 steps/s, ETA 0:01:18,"
    assert progress_text(10, 360, 0.0, 0) == "step 10/360 (2%),"
    assert progress_text(7, 0, 3.0, 5) == "step 7"
    assert progress_text(9000, 10000, 100.0, 9000) == "step 9000/10000 (90%), 90 steps/s, ETA 0:00:11,"


def test_world_size_changes_time_what_each_change_lost():
    """Records as an elastic job wrote them (tests/rehearse/test_multihost.py runs one for real): a host
    lost after step 15 (two resets, one change) and one that rejoined after step 75."""
    from hvdkit.rank.reports.metrics import world_size_changes

    def train(step, size, t):
        return {"event": "train", "step": step, "world_size": size, "time": t}

    records = [{"event": "config", "world_size": 3, "time": 0.0},
               train(5, 3, 1.0), train(10, 3, 2.0), train(15, 3, 3.0),
               {"event": "reset", "step": 15, "world_size": 2, "time": 4.0},
               {"event": "reset", "step": 15, "world_size": 2, "time": 4.5},
               train(20, 2, 8.0), train(25, 2, 8.5), {"event": "test", "step": 25, "time": 8.6},
               train(75, 2, 13.5),
               {"event": "reset", "step": 70, "world_size": 3, "time": 20.0},  # 5 steps redone
               train(75, 3, 25.0)]
    # 3 -> 2: 5 s between reports, 5 steps at the new pace of 0.1 s; 2 -> 3: 11.5 s, no net
    # progress to take off (the pace would be the old one: no report follows).
    assert world_size_changes(records) == [{"from": 3, "to": 2, "step": 15, "lost_seconds": 4.5},
                                           {"from": 2, "to": 3, "step": 70, "lost_seconds": 11.5}]
    assert world_size_changes(records[:9]) == [{"from": 3, "to": 2, "step": 15, "lost_seconds": 4.5}]
    assert world_size_changes([train(5, 2, 1.0), {"event": "reset", "step": 5, "world_size": 1, "time": 2.0}]) == []


def test_a_world_size_change_before_the_first_train_report_is_one():
    """An elastic job that lost a host at step 32, before its first report at step 40 (a chaos
    rehearsal's, seed 1: its summary listed no change): the change is timed from the checkpoint
    record before it, at the config's world size."""
    from hvdkit.rank.reports.metrics import world_size_changes

    records = [{"event": "config", "world_size": 2}, {"event": "checkpoint", "step": 20, "time": 1.0},
               {"event": "test", "step": 32, "time": 1.2}, {"event": "checkpoint", "step": 32, "time": 1.25},
               {"event": "reset", "step": 32, "world_size": 1, "time": 2.0},
               {"event": "train", "step": 40, "world_size": 1, "time": 2.5},
               {"event": "train", "step": 80, "world_size": 1, "time": 3.0}]
    # 1.25 s from the checkpoint at 32 to the report at 40, less 8 steps at 0.0125 s.
    assert world_size_changes(records) == [{"from": 2, "to": 1, "step": 32, "lost_seconds": 1.15}]
    assert world_size_changes(records[:4] + records[5:]) == [], "no reset, no change"
