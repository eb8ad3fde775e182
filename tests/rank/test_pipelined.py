"""hvdkit.rank.step.pipelined: ``hvdkit train --pp M --micro-batches K`` as users launch it, in real jobs.

The pipeline's step is checked against the one-process step of the same global batch in the
differential harness (its ``pp`` rows at pp 2, pp 2 x dp 2, pp 4 and tp 2 x pp 2, under both
controllers: tests/test_differential.py). Here the product's command: the built-in GPT at tp 2 x pp 2
(np 4, mpirun, 1F1B over 4 micro-batches) follows the one-process run of the same global batch (K 4):
each step's loss and the final weights within 1e-3 (fp32, relative norm); its checkpoints hold the
whole model and optimizer state, joined across the stages by name (hvdkit.parallel.whole); a rank
killed at step 6 under `hvdkit launch --max-restarts 1` restarts the mesh from the checkpoint of step
4, which ends bitwise where the run that was not killed ends; resumed from its middle at np 1 (K
kept at 4) and at dp 4 under horovodrun --gloo (K 4 -> 1), each follows the uninterrupted run
within 1e-3. GPipe and a cut where the blocks' measured seconds balance the stages run in the stop
tests at pp 2 (tests/rank/test_stops.py). The MLP (an nn.Sequential, cut
between its children) at pp 2 under horovodrun --gloo, its accuracy logged by the last stage, follows
one process alike. A pipeline stuck in a stage's loss is named by its stage and micro-batch when
the stall limit ends it. And bad input: one line, exit 2, before anything starts. A stop signal
and a frozen rank at pp 2: tests/rank/test_stops.py.
"""

import functools
import sys

import pytest
import torch

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
from hvdkit.checks import selftest

pytestmark = pytest.mark.slow

FLAGS = gpt_train_flags(2)
trained = functools.partial(trained_run, FLAGS)  # (directory, launcher, np, *args, env=None)


def follows(name: str, losses: dict, weights: dict, reference_losses: dict, reference_weights: dict) -> None:
    """Each step's loss and the final weights (the model's relative norm difference) within 1e-3 of the
    reference run's. Not each tensor alone: the attention's key biases get no gradient (softmax does not
    change with a shift of every key), so AdamW steps them by the sign of rounding noise, which no two
    orders of summation share."""
    for step, loss in losses.items():
        assert abs(loss - reference_losses[step]) <= 1e-3 * abs(reference_losses[step]), (name, step, loss)
    assert sorted(weights) == sorted(reference_weights), name
    ours, theirs = (torch.cat([w[key].flatten().double() for key in sorted(w)]) for w in (weights, reference_weights))
    far = {key: relative(value, reference_weights[key]) for key, value in weights.items()}
    assert relative(ours, theirs) <= 1e-3, (name, relative(ours, theirs), sorted(far.items(), key=lambda x: -x[1])[:3])


def test_a_run_at_tp2_pp2_follows_one_process_restarts_bitwise_and_resumes_at_np1_and_dp4(tmp_path):
    losses, weights, proc = trained(tmp_path / "tp2-pp2", "mpirun", 4, "--tp", "2", "--pp", "2",
                                    "--micro-batches", "4")
    assert sorted(losses) == list(range(1, 9)), losses
    one_losses, one_weights, _ = trained(tmp_path / "one-process", None, 1, "--batches-per-allreduce", "4")
    follows("tp2-pp2 against one process", losses, weights, one_losses, one_weights)

    middle = checkpoint.path_for(str(tmp_path / "tp2-pp2" / "ckpt"), 4)
    saved = checkpoint.load(middle)
    assert (saved["world_size"], saved["config"]["tp"], saved["config"]["pp"]) == (4, 2, 2)
    assert tuple(saved["model"]["tokens.weight"].shape) == (256, 128), "the whole model, not a block"
    assert "head.weight" in saved["model"] and "blocks.3.down.weight" in saved["model"], "both stages' parts"
    # numbered in the whole model's order, as one process numbers it: the same moments at each number
    one = checkpoint.load(checkpoint.path_for(str(tmp_path / "one-process" / "ckpt"), 4))["optimizer"]["state"]
    assert sorted(saved["optimizer"]["state"]) == sorted(one)
    for key in ("exp_avg", "exp_avg_sq"):
        ours, theirs = (torch.cat([state[i][key].flatten() for i in sorted(state)]) for state in
                        (saved["optimizer"]["state"], one))
        assert relative(ours, theirs) <= 1e-3, key

    # a rank killed at step 6 under hvdkit launch --max-restarts 1: the mesh restarts from the checkpoint of
    # step 4 and ends bitwise where the run that was not killed ends
    restarted, proc = trained_through_a_kill(FLAGS, tmp_path / "restarted", "--tp", "2", "--pp", "2",
                                             "--micro-batches", "4")
    assert "(epoch 1, step 4)" in proc.stderr, proc.stderr[-3000:]
    assert_bitwise_equal(restarted, weights)

    for name, launcher, np, args, said in (
            ("np1", None, 1, (), "written with batches_per_allreduce 4, which this run keeps (it asked for 1)"),
            ("dp4", "horovodrun --gloo", 4, (), "batches_per_allreduce 4 -> 1 keeps the global batch of 8 samples")):
        resumed, resumed_weights = resumed_run(FLAGS, middle, tmp_path / name, launcher, np, *args, said=said)
        follows(name, resumed, resumed_weights, losses, weights)


def test_the_mlp_at_pp2_follows_one_process_with_its_accuracy_from_the_last_stage(tmp_path):
    mlp = ["--model", "mlp", "--dataset", "digits", "--optimizer", "sgd", "--base-lr", "0.05", "--eval-batches", "0"]
    losses, weights, proc = trained(tmp_path / "pp2", "horovodrun --gloo", 2, *mlp, "--pp", "2", "--micro-batches",
                                    "2")
    one_losses, one_weights, one = trained(tmp_path / "np1", None, 1, *mlp, "--batches-per-allreduce", "2")
    follows("the mlp at pp 2", losses, weights, one_losses, one_weights)
    ours, theirs = (selftest.parse_records(p.stdout, "summary")[0] for p in (proc, one))
    assert ours["test_samples"] == theirs["test_samples"], (ours, theirs)  # the last stage's, each sample once
    assert abs(ours["test_loss"] - theirs["test_loss"]) <= 1e-3 * theirs["test_loss"], (ours, theirs)
    assert abs(ours["train_accuracy"] - theirs["train_accuracy"]) <= 0.01, (ours, theirs)


@pytest.mark.parametrize("launcher", [["horovodrun", "--gloo"], ["mpirun"]], ids=["gloo-broadcasts", "mpi-sends"])
def test_a_stalled_pipeline_is_named_by_its_stage_and_micro_batch(tmp_path, launcher):
    """tests/programs/pipeline_stall.py: the last stage stuck in its loss of micro-batch 2 at step 3
    (time.sleep: its threads run on) under `hvdkit launch`, its transfers Horovod's broadcasts (Gloo)
    or MPI's point-to-point (mpirun); the job ends at the stall limit, exit 75, its line naming the
    stuck stage and micro-batch (and, over Horovod, the first stage waiting in the pipeline's
    transport for that micro-batch's gradient)."""
    program = REPO / "tests" / "programs" / "pipeline_stall.py"
    proc = run([sys.executable, "-m", "hvdkit", "launch", "-np", "2", "--launcher", *launcher, "--",
                sys.executable, str(program), "--at", "3", "--stall-timeout", "8", "--log-dir", str(tmp_path / "logs")],
               timeout=120)
    assert proc.returncode == 75, proc.stderr[-3000:]
    stuck = next(number for number, text in enumerate(program.read_text().splitlines(), 1) if "STUCK-SLEEP" in text)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("hvdkit launch: rank 1 (host ") and (
        "made no progress since training step 3, pipeline stage 1: the forward of micro-batch 2 (") in last, last
    assert f"stuck at tests/programs/pipeline_stall.py:{stuck} in loss_fn" in last, last
    if "--gloo" in launcher:
        assert "rank 0 waiting in Horovod's synchronize() from hvdkit/parallel/pipeline/transport.py" in last, last


@pytest.mark.parametrize("np, args, said", [
    (2, ["--pp", "3", "--micro-batches", "3"], "hvdkit train: pp: 3 stages of 1 ranks (pp x tp = 3) do not divide "
                                               "the job's 2 ranks"),
    (3, ["--pp", "3", "--micro-batches", "3"], "hvdkit train: pp: 3 stages do not divide the model's 4 blocks"),
    (2, ["--pp", "2"], "hvdkit train: config: 1f1b over 2 stages needs at least 2 micro-batches a step (it has 1)"),
    (2, ["--pp", "2", "--micro-batches", "2", "--pp-cuts", "blocks.9"], "hvdkit train: pp: the cuts blocks.9 are "
                                                                         "not 1 increasing block names"),
    (2, ["--pp", "2", "--micro-batches", "2", "--model", "resnet18", "--dataset", "synthetic"],
     "hvdkit train: pp: hvdkit cuts its GPT and an nn.Sequential into stages, not a ResNet"),
    (2, ["--pp", "2", "--micro-batches", "2", "--zero", "3"], "hvdkit train: config: pp is not yet for zero 3"),
    (2, ["--pp", "2", "--micro-batches", "2", "--zero", "1"], "hvdkit train: config: zero shards within the "
                                                               "data-parallel set, and at pp 2 the job's 2 ranks"),
    (2, ["--micro-batches", "2"], "hvdkit train: config: micro_batches and pp_cuts are the pipeline's"),
], ids=["pp-not-dividing-the-ranks", "stages-not-dividing-the-blocks", "1f1b-with-fewer-micro-batches-than-stages",
        "a-cut-naming-no-block", "a-model-without-a-cut", "zero-3-beside-pp", "zero-with-one-replica",
        "micro-batches-without-pp"])
def test_bad_input_is_one_line_and_exit_2_before_anything_starts(tmp_path, np, args, said):
    assert_refused_before_anything_starts(FLAGS, tmp_path, np, args, said)
