"""Tensor parallelism (hvdkit.parallel.mesh, .ops, .tensor): the mesh's groups alone; then each
layer in real jobs against the same layer whole in one process, in fp64
(tests/programs/tensor_parallel_worker.py), under mpirun and horovodrun --gloo at 2 and 4 ranks."""

import sys

import horovod.torch as hvd
import pytest

from conftest import REPO, run
from hvdkit.checks import selftest
from hvdkit.config import ConfigError
from hvdkit.models import TinyGPT
from hvdkit.parallel.mesh import Group, Mesh
from hvdkit.parallel.plan import ColwiseParallel, RowwiseParallel, gpt_plan, parallelize

WORKER = [sys.executable, str(REPO / "tests" / "programs" / "tensor_parallel_worker.py")]


def test_tensor_parallel_groups_are_consecutive_ranks_and_data_parallel_groups_hold_the_same_shards():
    mesh = Mesh(8, tp=2)
    assert mesh.dp == 4
    assert mesh.tp_ranks() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.dp_ranks() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # Horovod's ProcessSets as hvd.init takes them (made before it, on every rank in this order)
    assert [s.ranks for s in mesh.process_sets(hvd)] == [[0, 1], [2, 3], [4, 5], [6, 7], [0, 2, 4, 6], [1, 3, 5, 7]]
    assert Mesh(4, tp=4).process_sets(hvd) == [], "a group of the whole job is the global set, of one rank none"
    assert Mesh(4, tp=1).process_sets(hvd) == []


@pytest.mark.parametrize("size, tp", [(4, 3), (2, 0), (6, 4)])
def test_a_tp_that_does_not_divide_the_ranks_is_one_line(size, tp):
    with pytest.raises(ConfigError, match=rf"^tp: {tp} does not divide the job's {size} ranks"):
        Mesh(size, tp)


@pytest.mark.parametrize("model, tp, plan, line", [
    (lambda: TinyGPT(64, 16, width=32, heads=4), 8, None,
     "tp: 8 does not divide blocks.0.attention.q's 4 heads of 8 features; give a tp that divides the heads"),
    (lambda: TinyGPT(60, 16, width=64, heads=8), 8, None,
     "tp: tokens: its 60 along dimension 0 do not split over 8 ranks; give a tp that divides them"),
    (lambda: TinyGPT(64, 16, width=32, heads=4), 2, {"blocks.*.mlp": ColwiseParallel()},
     "tp: the plan's blocks.*.mlp names no module of TinyGPT"),
    (lambda: TinyGPT(64, 16, width=32, heads=4), 2, {"blocks.*.norm1": ColwiseParallel()},
     "tp: the plan splits blocks.0.norm1 by columns, which is a LayerNorm, not an nn.Linear"),
    (lambda: TinyGPT(64, 16, width=32, heads=4, tie_output=True), 2, {"head": ColwiseParallel()},
     "tp: tokens.weight is tied to a weight the plan splits, and the plan leaves it whole; split both alike "
     "(an embedding by rows, its output layer by columns), or untie them"),
    (lambda: TinyGPT(64, 16, width=32, heads=4), 2, {"blocks.*.up": ColwiseParallel(input="rows")},
     "tp: blocks.0.up: the input 'rows' is not one of whole, sequence, gathered"),
    (lambda: TinyGPT(64, 16, width=32, heads=4), 2, {"blocks.*.down": RowwiseParallel(output="columns")},
     "tp: blocks.0.down's output 'columns' is not whole or sequence"),
])
def test_a_plan_or_a_tp_that_does_not_fit_the_model_is_one_line(model, tp, plan, line):
    """Said before any collective (the sizes are known on every rank alike)."""
    mesh = Mesh(tp, tp)
    mesh.tp_group = Group(list(range(tp)), 0)  # what bind() finds on rank 0, without starting Horovod
    whole = model()
    with pytest.raises(ConfigError) as said:
        parallelize(whole, mesh, plan or gpt_plan(whole))
    assert str(said.value) == line


def test_sequence_parallelism_marks_the_replicated_parameters_each_rank_computes_on_its_part():
    """The norms' weights and biases and the row-parallel layers' biases: their gradients are
    summed over the group (hvdkit.parallel.grads); nothing else is, the split ones are blocks."""
    mesh = Mesh(2, 2)
    mesh.tp_group = Group([0, 1], 0)
    whole = TinyGPT(64, 16, width=32, layers=2, heads=4)
    model = parallelize(whole, mesh, gpt_plan(whole, sequence_parallel=True))
    marked = {name for name, param in model.named_parameters() if getattr(param, "sequence_parallel", False)}
    per_block = ("norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias", "attention.o.bias", "down.bias")
    assert marked == {"norm.weight", "norm.bias", *(f"blocks.{i}.{name}" for i in range(2) for name in per_block)}
    assert not any(getattr(param, "tp_dim", None) is not None for name, param in model.named_parameters()
                   if name in marked)


@pytest.mark.slow
@pytest.mark.parametrize("launch, said", [
    (["mpirun", "--oversubscribe", "-np", "4"], ["tp 2 x dp 2", "tp 4 x dp 1"]),
    (["horovodrun", "--gloo", "-np", "2"], ["tp 2 x dp 1"]),
], ids=["mpirun-4", "gloo-2"])
def test_each_layer_computes_what_the_whole_layer_does_with_the_same_gradients(launch, said):
    """Column- and row-parallel linear layers (with and without sequence parallelism, the output
    gathered or not), Megatron's MLP of the two, the vocabulary-parallel embedding and
    cross-entropy: outputs and gradients within 1e-10 of the whole layer's, two steps each. Under
    MPI at 4 ranks (groups smaller than the job's, and the whole job as one group) and under Gloo at
    2 (the job's own set): each controller, each kind of group, once."""
    proc = run([*launch, *WORKER], env=selftest.mpi_root_env(), timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for mesh in said:
        assert f"tensor parallel: ok at {mesh}" in proc.stdout, proc.stdout[-2000:]
