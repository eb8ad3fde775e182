"""ZeRO stage 3 (hvdkit.zero.stage3, hvdkit.zero.gathering): the built-in GPT, resnet18 and the
Hugging-Face-shaped causal LM trained in real jobs (tests/programs/stage3_worker.py) to stage 2's
weights, their gathered weights let go after use; which modules are gathered together. Stage 3
against the unsharded step over the harness's matrix: tests/test_differential.py's zero-3 rows;
its checkpoints at other world sizes and stages: tests/zero/test_zero.py."""

import sys

import pytest
from torch import nn

from conftest import REPO, run
from hvdkit.checks import selftest
from hvdkit.models import TinyGPT
from hvdkit.zero.gathering import group_names

WORKER = [sys.executable, str(REPO / "tests" / "programs" / "stage3_worker.py")]
CHECKS = [f"{model} {what}" for model in ("gpt", "resnet18", "hf-causal-lm") for what in ("as stage 2",
                                                                                        "gathers let go")]


@pytest.mark.slow
@pytest.mark.parametrize("launch", [["horovodrun", "--gloo", "-np", "2"], ["mpirun", "--oversubscribe", "-np", "3"]],
                         ids=["gloo-2", "mpirun-3"])
def test_stage_3_trains_three_models_as_stage_2_and_lets_gathered_weights_go(launch):
    proc = run([*launch, *WORKER], env=selftest.mpi_root_env(), timeout=300)
    said = [line[line.index("stage3: "):] for line in proc.stdout.splitlines() if "stage3: " in line]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert said == [f"stage3: {check}: ok" for check in [*CHECKS, "uneven evaluation", "refusals"]] + [
        "stage3: done"], "\n".join(said)


@pytest.mark.slow
def test_stage_3_shards_within_each_of_two_process_sets_made_at_hvd_init():
    proc = run(["mpirun", "--oversubscribe", "-np", "4", *WORKER, "--sets"], env=selftest.mpi_root_env(), timeout=240)
    said = proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.returncode == 0 and "stage3: two process sets: ok" in proc.stdout, said


@pytest.mark.slow
def test_a_model_built_on_meta_is_made_shard_by_shard_as_the_eager_build_at_np_4(tmp_path):
    """Also resumed from a stage-3 checkpoint into a model built on meta."""
    proc = run(["mpirun", "--oversubscribe", "-np", "4", *WORKER, "--deferred", str(tmp_path)],
               env=selftest.mpi_root_env(), timeout=240)
    said = proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.returncode == 0 and "stage3: built shard by shard: ok" in proc.stdout, said


def test_each_block_of_a_module_list_or_sequential_is_a_group_by_default():
    gpt = TinyGPT(64, 16, width=32, layers=3)
    assert group_names(gpt) == ["blocks.0", "blocks.1", "blocks.2"]
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    assert group_names(mlp) == ["0", "2"], "a layer without parameters is no group"
    nested = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2))), nn.Linear(2, 2))
    assert group_names(nested) == ["0", "1"], "the outermost blocks only"


def test_zero_groups_name_the_groups_by_pattern_outermost_first():
    gpt = TinyGPT(64, 16, width=32, layers=2)
    assert group_names(gpt, ["blocks.*", "norm"]) == ["blocks.0", "blocks.1", "norm"]
    assert group_names(gpt, ["blocks.*.attention"]) == ["blocks.0.attention", "blocks.1.attention"]
    assert group_names(gpt, ["nothing.*"]) == []
