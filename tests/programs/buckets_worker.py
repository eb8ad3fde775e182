"""Bucket views (hvdkit.rank.step.buckets) against Horovod's own DistributedOptimizer, in every rank of a
real job: the same averaged gradients, step after step, in the loop shapes users write, on each
rank's GPU where there is one (tests/checks/test_gpu.py); and hvdkit's step that updates each
bucket as it lands, to the bit the step at once (SGD with momentum, Adam, AdamW; with and without
clipping; fp32 and bf16 autocast). Prints "buckets: ok on <device type>" on
rank 0, or fails with the assertion.

`horovodrun -np N python tests/programs/buckets_worker.py`"""

import copy
import os

import horovod.torch as hvd
import torch
from torch import nn

from hvdkit.parallel.mesh import Mesh
from hvdkit.rank.step import buckets


class Net(nn.Module):
    """Buckets of several parameters, one frozen, and a branch only odd ranks use."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.frozen = nn.Linear(64, 64)
        self.frozen.requires_grad_(False)
        self.branch = nn.Linear(64, 64)
        self.head = nn.Linear(64, 3)

    def forward(self, x):
        h = self.frozen(self.body(x))
        if hvd.rank() % 2:
            h = h + self.branch(h)
        return self.head(h)


def pair(passes: int, fp16: bool, device: torch.device):
    """The model twice: under hvdkit's bucket views, and under Horovod's DistributedOptimizer."""
    torch.manual_seed(0)
    ours = Net().to(device)
    theirs = copy.deepcopy(ours)
    made = buckets.gradient_buckets(ours, cap=64 * 64 * 4, first_cap=64 * 3 * 4)  # several: the head's alone
    optimizer = buckets.with_bucket_views(torch.optim.SGD(ours.parameters(), lr=0.1), ours.named_parameters(),
                                           hvd.Compression.fp16 if fp16 else hvd.Compression.none, passes, made)
    reference = hvd.DistributedOptimizer(
        torch.optim.SGD(theirs.parameters(), lr=0.1), named_parameters=theirs.named_parameters(),
        compression=hvd.Compression.fp16 if fp16 else hvd.Compression.none, backward_passes_per_step=passes)
    assert len(made) >= 3 and len(optimizer._flat) == len(made), (len(made), len(optimizer._flat))
    return ours, optimizer, theirs, reference


def train(model, optimizer, steps: int, passes: int, zero_first: bool,
          device: torch.device) -> list[list[torch.Tensor]]:
    """The loop users write; the gradients after each step's synchronize."""
    seen = []
    for step in range(steps):
        if zero_first:
            optimizer.zero_grad()
        for micro in range(passes):
            torch.manual_seed(1000 * step + 10 * micro + hvd.rank())
            loss = model(torch.randn(16, 8, device=device)).square().mean()
            loss.backward()
        optimizer.synchronize()
        seen.append([p.grad.clone() if p.grad is not None else None for p in model.parameters()])
        with optimizer.skip_synchronize():
            optimizer.step()
        if not zero_first:
            optimizer.zero_grad()
    return seen


def check(passes: int, fp16: bool, zero_first: bool, device: torch.device) -> None:
    ours, optimizer, theirs, reference = pair(passes, fp16, device)
    got = train(ours, optimizer, 4, passes, zero_first, device)
    want = train(theirs, reference, 4, passes, zero_first, device)
    exact = not fp16 and hvd.size() & (hvd.size() - 1) == 0  # halving, quartering is exact
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        for name, x, y in zip([n for n, _ in ours.named_parameters()], a, b, strict=True):
            assert (x is None) == (y is None), (step, name)
            if x is None:
                continue
            # fp16: the ranks' sum in another order may differ by an fp16 unit in the last place
            # (6e-5 at 0.1), as Horovod's own fused and unfused sums do
            rtol, atol = (1e-3, 1e-4) if fp16 else (1e-6, 1e-6)
            same = torch.equal(x, y) if exact else torch.allclose(x, y, rtol=rtol, atol=atol)
            assert same, f"passes {passes} fp16 {fp16}: step {step}, {name} differs by {(x - y).abs().max()}"
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-5), "the weights parted"
    flats = {flat.untyped_storage().data_ptr() for flat in optimizer._flat.values()}
    optimizer.zero_grad()
    loss = ours(torch.randn(4, 8, device=device)).sum()
    loss.backward()
    optimizer.synchronize()
    in_buckets = [p.grad.untyped_storage().data_ptr() in flats for p in ours.parameters() if p.requires_grad]
    assert all(in_buckets), "every trained parameter's gradient is a view of its bucket after synchronize"
    with optimizer.skip_synchronize():
        optimizer.step()


def stepped_pair(optimizer_class, options: dict, clip, amp: bool, device: torch.device):
    """The model twice, each under hvdkit's TrainingStep over bucket views (several buckets): one
    that steps each bucket as it lands (on_nonfinite stop, no clipping), one that steps them all at
    once (on_nonfinite skip, the same arithmetic otherwise). With clipping, both at once."""
    from hvdkit.config import TrainConfig
    from hvdkit.rank.agree.stragglers import StepTimes
    from hvdkit.rank.state import RunState
    from hvdkit.rank.step.training import TrainingStep

    torch.manual_seed(0)
    first = Net().to(device)
    pairs = []
    for model, policy in ((first, "stop"), (copy.deepcopy(first), "skip")):
        made = buckets.gradient_buckets(model, cap=64 * 64 * 4, first_cap=64 * 3 * 4)
        inner = optimizer_class(model.parameters(), **options)
        optimizer = buckets.with_bucket_views(inner, model.named_parameters(), hvd.Compression.none, 1, made)
        state = RunState(model=model, optimizer=optimizer, inner=inner)
        cfg = TrainConfig(on_nonfinite=policy, clip_grad_norm=clip, amp=amp)
        times = StepTimes(hvd.rank(), hvd.size(), 0.15)
        step = TrainingStep(cfg, hvd, device, state, times, lambda: "no checkpoint_dir", Mesh(hvd.size()))
        pairs.append((model, optimizer, step))
    return pairs


def train_steps(model, optimizer, step, steps: int, amp: bool, device: torch.device, poison_at: int = -1) -> None:
    """The Session's step as its own loop makes it: zero_grad, forward (bf16 autocast where ``amp``),
    TrainingStep.backward, TrainingStep.apply."""
    for index in range(steps):
        optimizer.zero_grad()
        torch.manual_seed(1000 * index + hvd.rank())
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = model(torch.randn(16, 8, device=device)).square().mean()
        step.backward(loss * (float("nan") if index == poison_at else 1.0))
        step.apply()


def check_overlap(optimizer_class, options: dict, clip, amp: bool, device: torch.device) -> None:
    """Stepped as the buckets land, the weights and the optimizer's state are the step at once's,
    to the bit; with clipping, the overlap is off."""
    (ours, our_optimizer, our_step), (theirs, their_optimizer, their_step) = stepped_pair(
        optimizer_class, options, clip, amp, device)
    what = f"{optimizer_class.__name__} {options} clip {clip} amp {amp}"
    assert our_step._overlaps(our_optimizer) == (clip is None), what
    assert not their_step._overlaps(their_optimizer), what
    train_steps(ours, our_optimizer, our_step, 4, amp, device)
    train_steps(theirs, their_optimizer, their_step, 4, amp, device)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b), f"{what}: {name} differs by {(a - b).abs().max()}"
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        a, b = our_optimizer.state.get(p, {}), their_optimizer.state.get(q, {})
        assert a.keys() == b.keys() and all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a), \
            f"{what}: {name}'s optimizer state differs"


def check_overlap_stops_on_a_nonfinite_step(device: torch.device) -> None:
    """A non-finite step stops the run, its first bucket not stepped, and says so in one line."""
    from hvdkit.rank.step.training import NonFiniteError

    (model, optimizer, step), _ = stepped_pair(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, None, False, device)
    train_steps(model, optimizer, step, 1, False, device)
    before = [p.detach().clone() for p in model.parameters()]
    try:
        train_steps(model, optimizer, step, 1, False, device, poison_at=0)
    except NonFiniteError as error:
        assert "step 1 (epoch 1) are not finite; stopped, no checkpoint holding it" in str(error), error
    else:
        raise AssertionError("a non-finite step was stepped")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)), "a NaN bucket was stepped"
    assert not optimizer._handles, "an allreduce was left in flight"


def check_fused_overlap_trains_no_further_after_a_nonfinite_bucket(device: torch.device) -> None:
    """A user's ``fused=True`` SGD takes the GPU's path on a CPU too: a bad bucket is skipped on the
    device and its flag read at the next settle. The buckets before the bad one were stepped; from
    there no bucket is stepped, in that step or the next ones, until the settle stops the run
    naming the bad step."""
    from hvdkit.rank.step.training import NonFiniteError

    (model, optimizer, step), _ = stepped_pair(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "fused": True},
                                               None, False, device)
    assert step._overlaps(optimizer) and optimizer.bucket_count() > 2
    first = model.body[0].weight  # in the last bucket to land
    poisoned = first.register_hook(lambda grad: grad * float("nan") if step.state.global_step == 1 else grad)
    train_steps(model, optimizer, step, 1, False, device)
    step.state.global_step = 1
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    train_steps(model, optimizer, step, 1, False, device)
    stepped = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert "head.weight" in stepped and "body.0.weight" not in stepped, stepped  # a bucket before the bad one went
    poisoned.remove()
    after_bad = {name: p.detach().clone() for name, p in model.named_parameters()}
    train_steps(model, optimizer, step, 2, False, device)  # finite steps, before any settle
    assert all(torch.equal(p, after_bad[name]) for name, p in model.named_parameters()), \
        "a model stepped in part trained on before the settle"
    try:
        step.settle()
    except NonFiniteError as error:
        assert "step 2 (epoch 1) are not finite; stopped, no checkpoint holding it" in str(error), error
    else:
        raise AssertionError("the settle did not stop the run")


def check_a_skipped_step_leaves_the_next_one_reduced(device: torch.device) -> None:
    """on_nonfinite skip, stepped at once: a skipped step calls no optimizer.step(), which is what
    clears Horovod's "synchronized" flag; the next steps' gradients must still be reduced. Three
    steps, the second poisoned, end where the first and third alone end, to the bit."""
    _, (model, optimizer, step) = stepped_pair(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, None, False, device)
    reference = copy.deepcopy(model)
    reference_optimizer = hvd.DistributedOptimizer(torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9),
                                                   named_parameters=reference.named_parameters())
    for index in range(3):
        optimizer.zero_grad()
        torch.manual_seed(1000 * index + hvd.rank())
        loss = model(torch.randn(16, 8, device=device)).square().mean()
        step.backward(loss * (float("nan") if index == 1 else 1.0))
        step.apply()
        if index == 1:
            continue
        reference_optimizer.zero_grad()
        torch.manual_seed(1000 * index + hvd.rank())
        reference(torch.randn(16, 8, device=device)).square().mean().backward()
        reference_optimizer.step()
    assert step.skipped == 1
    for (name, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), f"after a skipped step, {name}: {(a - b).abs().max()}"


def main() -> None:
    from hvdkit.rank.start.startup import reproducible_settings

    os.environ.update(reproducible_settings())  # as the Session starts Horovod: each bucket fused alone, the same sums
    hvd.init()
    device = torch.device("cuda", hvd.local_rank()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if hvd.size() == 1:
        # One GPU: Horovod's optimizer hooks its gradients at one rank only when elastic, a variable
        # it reads when the optimizer is made (its C++ read it at init), so both optimizers reduce.
        os.environ["HOROVOD_ELASTIC"] = "1"
    for passes, fp16, zero_first in [(1, False, True), (1, False, False), (2, False, True), (1, True, True)]:
        check(passes, fp16, zero_first, device)
    if hvd.size() > 1:  # bucket views are made at two ranks and more
        for optimizer_class, options in [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
                                         (torch.optim.Adam, {"lr": 1e-2}),
                                         (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})]:
            for clip, amp in [(None, False), (None, True), (0.5, False)]:
                check_overlap(optimizer_class, options, clip, amp, device)
        check_overlap_stops_on_a_nonfinite_step(device)
        check_fused_overlap_trains_no_further_after_a_nonfinite_bucket(device)
        check_a_skipped_step_leaves_the_next_one_reduced(device)
    if hvd.rank() == 0:
        print(f"buckets: ok on {device.type}", flush=True)
    hvd.join()


if __name__ == "__main__":
    main()
