"""hvdkit.rank.start.parallelize: ``hvdkit train --tp N`` as users launch it, in real jobs (with ``--pp``:
tests/rank/test_pipelined.py).

The Session's tensor-parallel step is checked against the one-process step of the same global batch
in the differential harness (its ``tp-session`` arms, with and without ZeRO 1, at np 2 and 4 under
both controllers: tests/test_differential.py). Here the product's command: a run at tp 2 x dp 2
under horovodrun --gloo writes checkpoints that hold the whole model and optimizer state
(hvdkit.parallel.whole); resumed from its middle at np 1 (tp 1, its K doubled to keep the global
batch) and at tp 2 x dp 2 with ZeRO 2 within the data-parallel set and sequence parallelism under
mpirun, each follows the uninterrupted run: each
step's loss and the final weights within 1e-3 (fp32, relative norm); a rank killed at step 6 under
`hvdkit launch --max-restarts 1` (mpirun) with `--snapshot-steps 1` restarts the job, which
resumes from the snapshot of step 5 or 6 (each rank of a group writes its blocks; the reader joins
them) and ends bitwise at the uninterrupted run's weights (Gloo's); with dropout, a run resumed
from its middle ends bitwise where the whole run ends (the RNG tracker's state restored). And bad
input: one line, exit 2, before anything starts. A stop signal and a frozen rank at tp 2:
tests/rank/test_stops.py.
"""

import functools
import os
import re
import sys

import pytest

from conftest import (
    REPO,
    assert_bitwise_equal,
    assert_refused_before_anything_starts,
    gpt_train_flags,
    resumed_run,
    run,
    trained_run,
    trained_through_a_kill,
)
from conftest import relative_difference as relative
from hvdkit import checkpoint
from hvdkit.launch import planner

pytestmark = pytest.mark.slow

FLAGS = gpt_train_flags(4)
trained = functools.partial(trained_run, FLAGS)  # (directory, launcher, np, *args, env=None)


def test_a_run_at_tp2_dp2_restarts_bitwise_and_resumes_at_np1_and_with_zero_2_and_sequence_parallelism(tmp_path):
    whole = tmp_path / "tp2-dp2"
    losses, weights, _ = trained(whole, "horovodrun --gloo", 4, "--tp", "2")
    assert sorted(losses) == list(range(1, 9)), losses
    middle = checkpoint.path_for(str(whole / "ckpt"), 4)
    saved = checkpoint.load(middle)
    assert (saved["world_size"], saved["config"]["tp"]) == (4, 2)
    assert tuple(saved["model"]["tokens.weight"].shape) == (256, 128), "the whole model, not rank 0's block"
    index = list(saved["model"]).index("tokens.weight")  # the optimizer numbers the parameters in the model's order
    assert tuple(saved["optimizer"]["state"][index]["exp_avg"].shape) == (256, 128)

    restarted, proc = trained_through_a_kill(FLAGS, tmp_path / "restarted", "--tp", "2", "--snapshot-steps", "1")
    [resumed] = [line for line in proc.stderr.splitlines() if "resumed from" in line]
    # each rank of the host's group wrote its blocks, joined by the rank that read them
    assert re.search(r"hvdkit-snapshots-[^ ]*/tp-0/ckpt-step00000000[56]\.pt \(epoch 1, step [56]\)", resumed), resumed
    assert not os.path.exists(resumed.split("resumed from ")[1].split("/tp-0/")[0]), "the snapshots outlived the job"
    assert_bitwise_equal(restarted, weights)
    for name, launcher, np, args, said in (("np1", None, 1, (), "batches_per_allreduce 1 -> 2"),
                                           ("tp2-dp2-zero2-sequence-parallel", "mpirun", 4,
                                            ("--tp", "2", "--zero", "2", "--sequence-parallel"), None)):
        resumed, resumed_weights = resumed_run(FLAGS, middle, tmp_path / name, launcher, np, *args, said=said)
        for step, loss in resumed.items():
            assert abs(loss - losses[step]) <= 1e-3 * abs(losses[step]), (name, step, loss, losses[step])
        far = {key: relative(value, weights[key]) for key, value in resumed_weights.items()}
        assert max(far.values()) <= 1e-3, (name, sorted(far.items(), key=lambda item: -item[1])[:3])


def test_with_dropout_a_run_resumed_from_its_middle_ends_bitwise_where_the_whole_run_ends(tmp_path):
    """tests/programs/tp_dropout_resume.py at tp 2: the masks inside the regions are the RNG tracker's,
    restored with the checkpoint (without its restore the resumed run's weights differ)."""
    proc = run(planner.local_command("mpirun", 2, [sys.executable, str(REPO / "tests" / "programs" /
                                                                        "tp_dropout_resume.py"), str(tmp_path)]),
               timeout=300)
    assert proc.returncode == 0 and "tp_dropout_resume: ok" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("args, said", [
    (["--tp", "3"], "hvdkit train: tp: 3 does not divide the job's 2 ranks"),
    (["--tp", "2", "--model", "mlp", "--dataset", "synthetic"], "hvdkit train: tp: hvdkit has no plan for a "),
    (["--tp", "2", "--zero", "3"], "hvdkit train: config: tp is not yet for zero 3"),
    (["--tp", "2", "--zero", "1"], "hvdkit train: config: zero shards within the data-parallel set, and at tp 2 "),
    (["--sequence-parallel"], "hvdkit train: config: sequence_parallel splits the sequence across a tensor-parallel "
                              "group: give tp > 1 too"),
    (["--tp", "2", "--sequence-parallel", "--seq-len", "31"], "hvdkit train: tp: 2 does not divide the GPT's "
                                                              "sequence of 31 tokens"),
], ids=["tp-not-dividing-the-ranks", "a-model-without-a-plan", "zero-3-beside-tp", "zero-with-one-replica",
        "sequence-parallel-without-tp", "sequence-parallel-not-dividing-the-sequence"])
def test_bad_input_is_one_line_and_exit_2_before_anything_starts(tmp_path, args, said):
    assert_refused_before_anything_starts(FLAGS, tmp_path, 2, args, said)
