"""ZeRO's shards in host memory and their buddy copies (hvdkit.rank.resume.shard_snapshots): who keeps
whose shard, and the step a resume takes. Restarts that resume from them: tests/rehearse/test_chaos.py."""

from hvdkit.rank.resume.shard_snapshots import buddies, folder_name, plan


def test_each_shard_has_a_buddy_on_another_host_and_a_resume_takes_the_newest_step_every_shard_has():
    assert buddies(["a", "a", "b", "b"]) == [2, 2, 0, 0]
    assert buddies(["a", "b", "c"]) == [1, 2, 0]
    assert buddies(["a", "a", "a"]) == [None, None, None], "one host: a copy there saves nothing"
    assert folder_name(0, 3, [2]) == "zero-of-3-holds-0-2"
    # Ranks 0, 1, 2 on hosts a, b, c; b lost: shard 1 is kept only by rank 2, which wrote step 12
    # before the end, and rank 0 only 11: 11 is the newest step with all three.
    reports = [[("a/zero-of-3-holds-0-2", [0, 2], [11, 10])], [], [("c/zero-of-3-holds-2-1", [2, 1], [12, 11])]]
    assert plan(reports, 3, newer_than=5) == (11, {0: (0, "a/zero-of-3-holds-0-2"), 1: (2, "c/zero-of-3-holds-2-1"),
                                                   2: (0, "a/zero-of-3-holds-0-2")})
    assert plan(reports, 3, newer_than=11) is None, "a checkpoint as new: the checkpoint"
    assert plan(reports[:1], 3, newer_than=5) is None, "shard 1 nowhere"
