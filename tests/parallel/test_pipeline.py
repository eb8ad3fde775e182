"""Pipeline parallelism (hvdkit.parallel.pipeline): the mesh's pipeline axis, the schedules as
lists of actions, and the GPT's cut, in one process; the stages in real jobs against the
one-process step are rows of the differential harness (``pp-2-gpt-gpipe`` at pp 2, ``pp-2-gpt-1f1b``
at pp 2 and pp 2 x dp 2 under mpirun, 1F1B under horovodrun --gloo: tests/test_differential.py)."""

import copy
import itertools
import random
import statistics
import time

import horovod.torch as hvd
import pytest
import torch

from hvdkit.config import ConfigError
from hvdkit.models import TinyGPT
from hvdkit.parallel.mesh import Group, Mesh
from hvdkit.parallel.pipeline.schedules import SCHEDULES, Action, check_schedule, gpipe, one_f_one_b
from hvdkit.parallel.pipeline.stages import (
    Pipeline,
    balanced_cuts,
    gpt_block_seconds,
    gpt_cuts,
    gpt_stage,
    sequential_stage,
)
from hvdkit.parallel.plan import gpt_plan, parallelize


def test_the_pipeline_is_the_outermost_axis_and_its_neighbours_are_process_sets():
    mesh = Mesh(8, tp=2, pp=2)
    assert mesh.dp == 2
    assert mesh.tp_ranks() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.dp_ranks() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.pp_ranks() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert Mesh(6, pp=3).pairs() == [[0, 2], [2, 4], [1, 3], [3, 5]]
    shared: dict = {}
    sets = [s.ranks for s in mesh.process_sets(hvd, shared)]
    assert sets == [[0, 1], [2, 3], [4, 5], [6, 7], [0, 2], [1, 3], [4, 6], [5, 7], [0, 4], [1, 5], [2, 6], [3, 7]]
    # another mesh of the job makes only the sets not made yet
    assert [s.ranks for s in Mesh(8, tp=2).process_sets(hvd, shared)] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert [s.ranks for s in Mesh(8, pp=2).process_sets(hvd, shared)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # at 3 stages and more, each pipeline's ends are a set of their own (a tied embedding's)
    assert Mesh(6, pp=3).ends_ranks() == [[0, 4], [1, 5]]
    assert [s.ranks for s in Mesh(6, pp=3).process_sets(hvd)][-2:] == [[0, 4], [1, 5]]


@pytest.mark.parametrize("size, tp, pp, line", [
    (4, 1, 3, "pp: 3 stages of 1 ranks (pp x tp = 3) do not divide the job's 4 ranks; give a pp and tp whose "
              "product does"),
    (8, 2, 3, "pp: 3 stages of 2 ranks (pp x tp = 6) do not divide the job's 8 ranks; give a pp and tp whose "
              "product does"),
])
def test_stages_that_do_not_divide_the_ranks_are_one_line(size, tp, pp, line):
    with pytest.raises(ConfigError) as said:
        Mesh(size, tp, pp)
    assert str(said.value) == line


def test_the_schedules_are_gpipes_and_1f1bs_orders():
    assert [gpipe(s, 2, 4) for s in range(2)] == [[Action("F", i) for i in range(4)] + [Action("B", i) for i in
                                                                                         range(4)]] * 2
    assert repr(one_f_one_b(0, 2, 4)) == "[F0, F1, B0, F2, B1, F3, B2, B3]"
    assert repr(one_f_one_b(1, 2, 4)) == "[F0, B0, F1, B1, F2, B2, F3, B3]"
    assert repr(one_f_one_b(0, 4, 4)) == "[F0, F1, F2, F3, B0, B1, B2, B3]", "the first stage fills the pipeline"
    for name in SCHEDULES:
        for stages in range(1, 6):
            for micro_batches in range(stages, 10):
                check_schedule(name, stages, micro_batches)


def test_1f1b_with_fewer_micro_batches_than_stages_is_one_line():
    with pytest.raises(ConfigError, match=r"^pp: 1F1B needs at least as many micro-batches as stages \(2 < 4\)"):
        one_f_one_b(0, 4, 2)


def test_the_checker_finds_lists_that_deadlock():
    """Stage 0 waits for micro-batch 0's gradient before it sends micro-batch 1's activation, which
    stage 1 waits for before it sends that gradient."""
    crossed = {0: [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],
               1: [Action("F", 0), Action("F", 1), Action("B", 0), Action("B", 1)]}
    SCHEDULES["crossed"] = lambda stage, stages, micro_batches: crossed[stage]
    try:
        with pytest.raises(AssertionError, match=r"crossed at 2 stages and 2 micro-batches deadlocks: stage 0 at B0, "
                                                 r"stage 1 at F1"):
            check_schedule("crossed", 2, 2)
    finally:
        del SCHEDULES["crossed"]


def test_the_gpts_stages_hold_each_parameter_once_and_compute_the_whole_model():
    torch.manual_seed(0)
    whole = TinyGPT(64, 16, width=32, layers=4, heads=4).double()
    stages = [gpt_stage(copy.deepcopy(whole), s, 2) for s in range(2)]
    names = [name for stage in stages for name, _ in stage.named_parameters()]
    assert names == [name for name, _ in whole.named_parameters()], "the whole model's names, in its order"
    tokens = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(stages[1](stages[0](tokens)), whole(tokens), rtol=0, atol=0)
    assert set(stages[0].state_dict()) | set(stages[1].state_dict()) == set(whole.state_dict())


@pytest.mark.parametrize("model, stages, line", [
    (lambda: TinyGPT(64, 16, width=32, layers=3), 2, "pp: 2 stages do not divide the model's 3 blocks; give a pp "
                                                     "that divides them, or cuts (block names, or \"parameters\")"),
])
def test_a_cut_that_does_not_fit_the_model_is_one_line(model, stages, line):
    with pytest.raises(ConfigError) as said:
        gpt_stage(model(), 0, stages)
    assert str(said.value) == line


def test_a_schedule_unknown_or_a_batch_the_micro_batches_do_not_divide_is_one_line():
    mesh = Mesh(2, pp=2)
    mesh.pp_group = Group([0, 1], 0)  # what bind() finds on rank 0, without starting Horovod
    stage = gpt_stage(TinyGPT(64, 16, width=32, layers=2), 0, 2)
    with pytest.raises(ConfigError, match=r"^pp: the schedule 'zb' is not one of gpipe, 1f1b$"):
        Pipeline(stage, mesh, "zb")
    pipeline = Pipeline(stage, mesh, "gpipe", micro_batches=4)
    with pytest.raises(ConfigError, match=r"^pp: 4 micro-batches do not divide the batch of 6; give a batch size"):
        pipeline.step(torch.zeros(6, 16, dtype=torch.long), torch.zeros(6, 16, dtype=torch.long), None)


def test_each_stage_of_the_gpt_gets_the_plan_of_the_modules_it_holds():
    """tp x pp: a stage split over its tensor-parallel group by the GPT's plan (run at tp 2 x pp 2
    in the harness's ``tp-2-pp-2-gpt-1f1b`` row)."""
    mesh = Mesh(4, tp=2, pp=2)
    mesh.tp_group = Group([0, 1], 0)
    first, last = (gpt_stage(TinyGPT(64, 16, width=32, layers=4, heads=4), s, 2) for s in range(2))
    assert "tokens" in gpt_plan(first) and "head" not in gpt_plan(first)
    assert "head" in gpt_plan(last) and "tokens" not in gpt_plan(last)
    split = parallelize(last, mesh, gpt_plan(last))
    assert {name for name, p in split.named_parameters() if getattr(p, "tp_dim", None) is not None} == {
        f"blocks.{i}.{layer}.{kind}" for i in (2, 3) for layer in ("attention.q", "attention.k", "attention.v",
                                                                   "attention.o", "up", "down")
        for kind in ("weight", "bias") if not (layer in ("attention.o", "down") and kind == "bias")} | {"head.weight"}


def test_a_cut_is_where_its_block_names_say_or_balanced_by_parameters():
    model = TinyGPT(64, 16, width=32, layers=3)
    assert [list(gpt_stage(model, s, 2, ["blocks.1"]).blocks) for s in range(2)] == [["0"], ["1", "2"]]
    # a vocabulary of 4096 x 64 on each end: the ends take fewer blocks
    wide = TinyGPT(4096, 16, width=64, layers=12)
    assert gpt_cuts(wide, 2, "parameters") == [6]
    assert gpt_cuts(wide, 4, "parameters") == [1, 5, 11]
    sizes = [sum(p.numel() for p in gpt_stage(wide, s, 4, "parameters").parameters()) for s in range(4)]
    assert max(sizes) < 1.6 * min(sizes), sizes


def test_a_balanced_cut_gives_the_costliest_stage_the_least_cost_and_measured_time_balances_the_gpt():
    """``balanced_cuts`` over given costs (each against every cut there is), and over ``gpt_block_seconds``
    of a GPT whose vocabulary makes its embedding large but quick and its output layer slow: the
    measured cut gives the first stage more blocks than the parameters' cut, and its costliest
    stage is no slower. The measuring leaves no gradient behind."""
    assert balanced_cuts([1, 1, 1, 1, 1, 1], 2) == [2]  # embeddings, 4 blocks, output: 3 units a stage
    assert balanced_cuts([0, 1, 1, 1, 1, 9], 2) == [3]  # a heavy output layer: the last stage holds 1 block
    with pytest.raises(ConfigError, match="pp: 4 stages need at least as many blocks; the model has 3"):
        balanced_cuts([1, 1, 1, 1, 1], 4)

    def costliest(costs, cuts):
        bounds = [0, *[c + 1 for c in cuts], len(costs)]  # in costs' indices: the embeddings' first
        return max(sum(costs[first:end]) for first, end in zip(bounds, bounds[1:], strict=False))

    generator = random.Random(0)
    for _ in range(40):
        costs = [generator.choice([0, 0.5, 1, 2, 3, 8]) for _ in range(generator.randint(4, 10))]
        stages = generator.randint(2, min(4, len(costs) - 2))
        best = min(costliest(costs, cuts) for cuts in itertools.combinations(range(1, len(costs) - 2), stages - 1))
        assert costliest(costs, balanced_cuts(costs, stages)) == best, (costs, stages)

    torch.manual_seed(0)
    wide = TinyGPT(4096, 32, width=64, layers=12)
    assert len(gpt_block_seconds(wide, 4, repeats=1)) == 14  # the wall clock's: a loaded machine's, noisy
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # the work each part does, as the one thread's CPU time: whatever else the machine runs
        seconds = gpt_block_seconds(wide, 4, clock=time.thread_time)
    finally:
        torch.set_num_threads(threads)
    assert len(seconds) == 14 and all(t > 0 for t in seconds)
    block = statistics.median(seconds[1:-1])
    assert seconds[-1] > 1.5 * block and seconds[0] < 0.5 * block, seconds  # a 4096-way softmax; a lookup
    assert all(p.grad is None for p in wide.parameters())
    cuts, by_parameters = balanced_cuts(seconds, 4), gpt_cuts(wide, 4, "parameters")
    assert cuts[0] > by_parameters[0], (cuts, by_parameters)  # the embedding is large but quick
    assert costliest(seconds, cuts) <= costliest(seconds, by_parameters), seconds


@pytest.mark.parametrize("cuts, line", [
    (["blocks.0"], "pp: the cuts blocks.0 are not 1 increasing block names of blocks.1 to blocks.3, where stages 1 "
                   "to 1 begin"),
    (["blocks.2", "blocks.1"], "pp: the cuts blocks.2, blocks.1 are not 1 increasing block names"),
    (["norm"], "pp: the cuts norm are not 1 increasing block names"),
])
def test_cuts_that_name_no_boundary_are_one_line(cuts, line):
    with pytest.raises(ConfigError) as said:
        gpt_cuts(TinyGPT(64, 16, width=32, layers=4), 2, cuts)
    assert str(said.value).startswith(line)


def test_a_sequential_model_is_cut_at_its_named_children_and_the_stages_compute_the_whole():
    torch.manual_seed(0)
    whole = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 3)).double()
    first, last = (sequential_stage(whole, s, 2, cuts=["2"]) for s in range(2))
    assert list(first.state_dict()) == ["0.weight", "0.bias"] and list(last.state_dict())[:2] == ["2.weight", "2.bias"]
    x = torch.randn(5, 8, dtype=torch.float64)
    torch.testing.assert_close(last(first(x)), whole(x), rtol=0, atol=0)
    with pytest.raises(ConfigError, match=r"^pp: 2 stages do not divide the model's 5 modules; give a pp"):
        sequential_stage(whole, 0, 2)
    with pytest.raises(ConfigError, match=r"^pp: the cuts 0 are not 1 increasing names of the model's modules after "
                                          r"its first \(1, 2, 3, \.\.\.\)$"):
        sequential_stage(whole, 0, 2, cuts=["0"])
