"""Gradient buckets (hvdkit.rank.step.buckets): DDP's bucket rule, and Horovod's DistributedOptimizer
over buckets whose gradients are views of one tensor, checked against Horovod's own in real jobs."""

import sys

import pytest
import torch

from conftest import REPO, run
from hvdkit.rank.step.buckets import gradient_buckets


def test_gradients_go_in_fixed_buckets_in_backward_order_and_sparse_ones_alone():
    """The buckets Horovod reduces the gradients in (each fused alone, so the sums are the same
    every run at any world size): trained parameters last-first, each bucket closed once it holds
    its cap, the first's smaller, as DDP's."""
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 256),
                                torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
    model[1].requires_grad_(False)
    names = {id(p): name for name, p in model.named_parameters()}

    def named(buckets):
        return [[names[id(p)] for p in bucket] for bucket in buckets]

    # sizes: 3.bias 16 bytes, 3.weight 4096, 2.bias 1024, 2.weight 262144
    assert named(gradient_buckets(model, cap=256 * 256 * 4, first_cap=4096)) == [
        ["3.bias", "3.weight"], ["2.bias", "2.weight"]], "the frozen layer and the sparse embedding left out"
    assert named(gradient_buckets(model, cap=2048, first_cap=16)) == [
        ["3.bias"], ["3.weight"], ["2.bias", "2.weight"]]
    assert gradient_buckets(model) == [[model[3].bias, model[3].weight, model[2].bias, model[2].weight]]


def test_resnet18s_first_bucket_is_its_last_layer_alone_as_ddps():
    """The link starts with the first gradients backward makes: resnet18's classifier (2 MB)
    is a bucket of its own, the rest in buckets of at least 25 MiB, the last one what is left."""
    import torchvision

    model = torchvision.models.resnet18()
    buckets = gradient_buckets(model)
    sizes = [sum(p.numel() * 4 for p in bucket) for bucket in buckets]
    assert buckets[0] == [model.fc.bias, model.fc.weight]
    assert all(size >= 25 << 20 for size in sizes[1:-1]) and sum(sizes) == 46758048



@pytest.mark.slow
@pytest.mark.parametrize("launcher", [["horovodrun", "--gloo", "-np", "2"],
                                      ["mpirun", "--oversubscribe", "-np", "3"]], ids=["horovodrun-gloo-2", "mpirun-3"])
def test_bucket_views_average_as_horovods_own_optimizer_in_the_loops_users_write(launcher):
    """Step after step, the same averaged gradients as Horovod's DistributedOptimizer (to the bit
    at 2 ranks, where halving is exact): zero_grad() before or after the step, two micro-batches
    per step, fp16 compression, a branch only some ranks use, a frozen layer; and the gradients
    are views of their buckets after synchronize (tests/programs/buckets_worker.py)."""
    proc = run([*launcher, sys.executable, str(REPO / "tests" / "programs" / "buckets_worker.py")], timeout=240)
    assert proc.returncode == 0 and "buckets: ok on cpu" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("keys, ranks, path", [
    ({}, 2, "bucket views"), ({}, 8, "bucket views"), ({"fp16_allreduce": True}, 2, "bucket views"),
    ({"batches_per_allreduce": 4}, 3, "bucket views"),
    ({}, 1, "tensor by tensor"),  # nothing to reduce
    ({"use_adasum": True}, 2, "tensor by tensor"), ({"gradient_predivide_factor": 2.0}, 2, "tensor by tensor"),
    ({"elastic": True}, 2, "tensor by tensor"),
    ({"zero": 1}, 2, "sharded"), ({"zero": 2}, 4, "sharded"),
])
def test_which_runs_average_their_gradients_in_bucket_views(keys, ranks, path):
    """The default path of a run's gradients (docs/own-loop.md#the-steps-optimizations); each is
    checked against Horovod's DistributedOptimizer by tests/programs/differential.py."""
    from hvdkit.config import TrainConfig
    from hvdkit.rank.step.buckets import gradient_path

    assert gradient_path(TrainConfig(**keys), ranks) == path
