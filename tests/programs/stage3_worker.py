"""ZeRO stage 3 in a real job, for tests/zero/test_stage3.py: every rank runs every check; rank 0 prints
one line each, ``stage3: <check>: ok`` or ``stage3: <check>: FAIL <what>``, then ``stage3: done``.

- ``<model> as stage 2``: the built-in GPT (tied output, dropout), resnet18 (BatchNorm's buffers) and the
  Hugging-Face-shaped causal LM (activation checkpointing) trained 3 steps with K=2, clipping and bf16
  autocast at stage 3 end with the weights and buffers of stage 2's run, and an evaluation forward after
  gives stage 2's outputs.
- ``<model> gathers let go``: no gathered vector is alive after a forward, nor after a step; at most three
  (the model's own units, the one in use, the one gathered ahead) at any gather; every parameter holds
  no elements between steps, and each rank's slices are its 1/N of the weights.
- ``uneven evaluation``: ``session.evaluate`` over shares one batch apart, every sample counted.
- ``refusals``: ``model.state_dict()``, a gradient hook on a parameter, a model on the meta device at
  stage 2 and one whose module has no ``reset_parameters`` at stage 3, each in one line.

With ``--sets``, at 4 ranks: ``two process sets`` only (``in_two_sets``); with ``--deferred DIR``: ``built
shard by shard`` only (``built_shard_by_shard``), its checkpoints in DIR.
"""

from __future__ import annotations

import math
import sys
import tempfile
import weakref
from pathlib import Path

import torch
import torchvision
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import hvdkit
from hvdkit.config import ConfigError
from hvdkit.models import TinyGPT

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from reference_models import CausalLM  # noqa: E402  -- tests/reference_models.py

STEPS, MICRO = 3, 2


def gpt():
    return TinyGPT(128, 16, width=32, layers=3, dropout=0.1, tie_output=True)


def resnet():
    return torchvision.models.resnet18(num_classes=10)


def causal_lm():
    return CausalLM(vocab=128, layers=3, checkpointed=True)


MODELS = {"gpt": gpt, "resnet18": resnet, "hf-causal-lm": causal_lm}


def batch(name: str, rank: int, step: int) -> tuple:
    generator = torch.Generator().manual_seed(100 * step + rank)
    if name == "resnet18":
        return torch.randn(2 * MICRO, 3, 32, 32, generator=generator), torch.randint(0, 10, (2 * MICRO,),
                                                                                       generator=generator)
    tokens = torch.randint(0, 128, (2 * MICRO, 17), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model, micro) -> torch.Tensor:
    x, y = micro
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


class Alive:
    """Weak references to the vectors a Gathering makes: how many are alive at each gather.

    Horovod's background thread lets go of a collective's tensors just after it says the collective
    is done, and on busy cores that can be a while later: each count first waits for an allreduce
    of its own, which that thread takes up only once it has let go of every collective before."""

    def __init__(self, gathering) -> None:
        self.vectors: dict[int, weakref.ref] = {}  # by identity: a vector gathered ahead is started once
        self.most = 0
        start, ask = gathering._start, gathering.ask

        def counted_start(n):
            start(n)
            if n in gathering._pending:
                vector = gathering._pending[n][1]
                self.vectors[id(vector)] = weakref.ref(vector)
            self.most = max(self.most, self.count())

        def counted_ask(n):
            vector = ask(n)
            self.most = max(self.most, self.count())
            return vector

        gathering._start, gathering.ask = counted_start, counted_ask

    def count(self) -> int:
        import horovod.torch as hvd

        hvd.allreduce(torch.zeros(1), name="stage3.alive")
        return sum(ref() is not None for ref in self.vectors.values())


def train(name: str, zero: int, log_dir: str) -> tuple[dict, torch.Tensor, list[str]]:
    """(weights and buffers, an evaluation's outputs, what failed of the gathers' checks)."""
    session = hvdkit.Session(seed=0, batch_size=2, batches_per_allreduce=MICRO, clip_grad_norm=1.0, amp=True,
                             zero=zero, logger="none", log_dir=log_dir)
    torch.manual_seed(0)
    model = MODELS[name]()
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    failed, alive = [], None
    if zero == 3:
        alive = Alive(optimizer.gathering)
        whole = sum(b.length for b in optimizer.buckets)
        held = sum(s.numel() for s in optimizer.slices)
        if not whole / session.size <= held < whole / session.size + len(optimizer.buckets):
            failed.append(f"slices hold {held} of {whole} elements at {session.size} ranks")
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in session.micro_batches(batch(name, session.rank, step)):
            with session.autocast():
                loss = loss_of(model, micro)
            left = alive.count() if alive is not None else 0  # every rank counts: each count is a collective
            if left:
                failed.append(f"step {step}: {left} gathered vectors alive after the forward")
            session.backward(loss)
        session.step()
        if alive is not None:
            left = alive.count()
            if left:
                failed.append(f"step {step}: {left} gathered vectors alive after the step")
            full = [n for n, p in model.named_parameters() if p.requires_grad and p.numel()]
            if full:
                failed.append(f"step {step}: {full[0]} holds its elements between steps")
    if alive is not None and alive.most > 3:
        failed.append(f"{alive.most} gathered vectors alive at once (at most 3)")
    model.eval()
    with torch.no_grad():
        outputs = model(batch(name, session.rank, STEPS)[0])
    state = optimizer.model_state_dict() if zero == 3 else {k: v.clone() for k, v in model.state_dict().items()}
    left = alive.count() if alive is not None else 0
    if left:
        failed.append(f"{left} gathered vectors alive after the evaluation")
    session.finish()
    return state, outputs, failed


def evaluated_unevenly(log_dir: str) -> list[str]:
    """session.evaluate over 11 samples, one a batch: the ranks' shares differ by one batch, and the
    ranks with fewer still meet the others' gathers. Its mean loss is the one of the gathered
    weights over the 11, computed here in one process."""
    session = hvdkit.Session(zero=3, logger="none", log_dir=log_dir)
    torch.manual_seed(0)
    model = gpt()
    model, optimizer = session.setup(model, torch.optim.AdamW(model.parameters()))
    tokens = torch.randint(0, 128, (11, 17), generator=torch.Generator().manual_seed(5))
    dataset = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])

    def metrics_of(micro):
        return len(micro[0]), {"loss": loss_of(model, micro)}

    result = session.evaluate(session.eval_loader(dataset, batch_size=1), metrics_of)
    alone = gpt()
    alone.load_state_dict(optimizer.model_state_dict())
    alone.eval()
    with torch.no_grad():
        expected = torch.stack([loss_of(alone, (x[None], y[None])) for x, y in dataset]).mean()
    session.finish()
    if result["samples"] != 11 or not math.isclose(result["loss"], expected.item(), rel_tol=1e-5):
        return [f"evaluated {result['samples']} samples to loss {result['loss']}, one process {expected.item()}"]
    return []


def refusals(log_dir: str) -> list[str]:
    failed = []
    session = hvdkit.Session(zero=3, logger="none", log_dir=log_dir)
    model = gpt()
    model, optimizer = session.setup(model, torch.optim.AdamW(model.parameters()))
    try:
        model.state_dict()
        failed.append("model.state_dict() was not refused")
    except ConfigError as error:
        if "\n" in str(error) or "session.save() writes them whole" not in str(error):
            failed.append(f"model.state_dict(): {error}")
    session.finish()
    session = hvdkit.Session(zero=3, logger="none", log_dir=log_dir + "-hook")
    model = gpt()
    model.head.weight.register_hook(lambda grad: grad * 2)
    try:
        session.setup(model, torch.optim.AdamW(model.parameters()))
        failed.append("a gradient hook was not refused")
    except ConfigError as error:
        if "tokens.weight has a gradient hook" not in str(error):
            failed.append(f"a gradient hook: {error}")
    session.finish()
    failed += _refused_on_meta(2, gpt, "the model is on the meta device: zero 3 builds it", log_dir + "-meta2")
    failed += _refused_on_meta(3, Scaled, "zero 3: the model (Scaled) holds weights on the meta device and has no "
                                          "reset_parameters()", log_dir + "-meta3")
    return failed


class Scaled(nn.Module):
    """A module of a user's, with a weight of its own made in __init__."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4))
        self.layer = nn.Linear(4, 4)

    def forward(self, x):
        return self.layer(x) * self.scale


def _refused_on_meta(zero: int, build, words: str, log_dir: str) -> list[str]:
    session = hvdkit.Session(zero=zero, logger="none", log_dir=log_dir)
    with torch.device("meta"):
        model = build()
    try:
        session.setup(model, torch.optim.AdamW(model.parameters()))
        failed = [f"a model on the meta device at zero {zero} was not refused"]
    except ConfigError as error:
        failed = [] if words in str(error) and "\n" not in str(error) else [f"meta at zero {zero}: {error}"]
    session.finish()
    return failed


def in_two_sets() -> list[str]:
    """At 4 ranks, stage 3 in each of two process sets of 2 made at hvd.init, each set training on
    its own batches: each ends with the weights one process reaches on its set's whole batch."""
    import horovod.torch as hvd

    from hvdkit.zero.stage3 import WeightShardedOptimizer

    halves = [[0, 1], [2, 3]]
    sets = [hvd.ProcessSet(half) for half in halves]
    hvd.init(process_sets=sets)
    which = hvd.rank() // 2
    mine = sets[which]

    def batches(member: int, step: int) -> tuple:
        generator = torch.Generator().manual_seed(1000 * which + 10 * step + member)
        tokens = torch.randint(0, 128, (2, 17), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]

    def made() -> nn.Module:  # no dropout: the two would draw their masks in another order
        return TinyGPT(128, 16, width=32, layers=3, tie_output=True)

    torch.manual_seed(which)  # the sets start from other weights too
    model, reference = made(), made()
    reference.load_state_dict(model.state_dict())
    optimizer = WeightShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), hvd, model,
                                       process_set=mine)
    optimizer.shard_model()
    alone = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        optimizer.zero_grad()
        loss_of(model, batches(mine.rank(), step)).backward()
        optimizer.step()
        alone.zero_grad()
        both = [batches(member, step) for member in range(2)]
        loss_of(reference, tuple(torch.cat(parts) for parts in zip(*both, strict=True))).backward()
        alone.step()
    ours, theirs = optimizer.model_state_dict(), reference.state_dict()
    differ = [key for key in theirs if not torch.allclose(ours[key], theirs[key], rtol=1e-4, atol=1e-5)]
    return [f"set {which} differs from one process: {', '.join(differ[:3])}"] if differ else []


class PeakTensorBytes(TorchDispatchMode):
    """The most bytes of tensor storage alive at once among the tensors torch's operators make
    while it is entered (counted from their storages: a view counts its storage once, and a
    storage is let go when the last tensor made on it is)."""

    def __init__(self) -> None:
        super().__init__()
        self.users: dict[int, int] = {}  # storage address -> tensors alive on it
        self.sizes: dict[int, int] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in torch.utils._pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided and not tensor.is_meta:
                key = tensor.untyped_storage().data_ptr()
                if not key:
                    continue
                if key not in self.users:
                    self.users[key], self.sizes[key] = 0, tensor.untyped_storage().nbytes()
                    self.now += self.sizes[key]
                    self.peak = max(self.peak, self.now)
                self.users[key] += 1
                weakref.finalize(tensor, self._gone, key)
        return out

    def _gone(self, key: int) -> None:
        self.users[key] -= 1
        if not self.users[key]:
            del self.users[key]
            self.now -= self.sizes.pop(key)


def built_shard_by_shard(log_dir: str) -> list[str]:
    """The GPT and the Hugging-Face-shaped model built on the meta device, then set up at stage 3:
    each one's weights equal to the eager build's under the same seed, bitwise, and the most tensor
    bytes alive on a rank during setup below its whole weights (the eager build's above them)."""
    failed = []
    for name, build in (("gpt", lambda: TinyGPT(256, 32, width=128, layers=8, tie_output=True)),
                        ("hf-causal-lm", lambda: CausalLM(vocab=256, width=128, layers=8))):
        torch.manual_seed(0)
        with PeakTensorBytes() as eager_peak:
            eager = build()
        whole = sum(p.numel() * p.element_size() for p in eager.parameters())
        session = hvdkit.Session(zero=3, logger="none", log_dir=f"{log_dir}/{name}")
        torch.manual_seed(0)
        with torch.device("meta"):
            model = build()
        with PeakTensorBytes() as peak:
            model, optimizer = session.setup(model, torch.optim.AdamW(model.parameters()))
        built = optimizer.model_state_dict()
        differ = [key for key, value in eager.state_dict().items() if not torch.equal(built[key], value)]
        if differ:
            failed.append(f"{name}: weights unlike the eager build's: {', '.join(differ[:3])}")
        if not peak.peak < whole <= eager_peak.peak:
            failed.append(f"{name}: {peak.peak} tensor bytes at most during setup, the whole weights {whole}, the "
                          f"eager build {eager_peak.peak}")
        session.finish()
    failed += resumed_on_meta(log_dir)
    return failed


def resumed_on_meta(log_dir: str) -> list[str]:
    """A checkpoint of a stage-3 run resumed into a model built on meta: the weights it saved."""
    keys = dict(zero=3, logger="none", checkpoint_dir=f"{log_dir}/ckpt")
    session = hvdkit.Session(log_dir=f"{log_dir}/saved", **keys)
    torch.manual_seed(0)
    model = gpt()
    model, optimizer = session.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    optimizer.zero_grad()
    session.backward(loss_of(model, batch("gpt", session.rank, 0)))
    session.step()
    session.save()
    saved = optimizer.model_state_dict()
    session.finish()
    session = hvdkit.Session(log_dir=f"{log_dir}/resumed", **keys)
    with torch.device("meta"):
        model = gpt()
    model, optimizer = session.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    resumed = optimizer.model_state_dict()
    session.finish()
    differ = [key for key in saved if not torch.equal(saved[key], resumed[key])]
    return [f"resumed into meta: unlike the saved weights: {', '.join(differ[:3])}"] if differ else []


def main() -> int:
    import horovod.torch as hvd

    if "--deferred" in sys.argv:  # its checkpoint folder, which every rank sees, follows it
        failed = built_shard_by_shard(sys.argv[sys.argv.index("--deferred") + 1])
        everyone = hvd.allgather_object(failed, name="stage3.deferred")
        problems = [f"rank {rank}: {'; '.join(lines[:2])}" for rank, lines in enumerate(everyone) if lines]
        if hvd.rank() == 0:
            print(f"stage3: built shard by shard: {'ok' if not problems else 'FAIL ' + ' | '.join(problems)}",
                  flush=True)
        return 0
    if "--sets" in sys.argv:
        failed = in_two_sets()
        everyone = hvd.allgather_object(failed, name="stage3.sets")
        problems = [f"rank {rank}: {'; '.join(lines[:2])}" for rank, lines in enumerate(everyone) if lines]
        if hvd.rank() == 0:
            print(f"stage3: two process sets: {'ok' if not problems else 'FAIL ' + ' | '.join(problems)}", flush=True)
        return 0
    with tempfile.TemporaryDirectory(prefix="hvdkit-stage3-") as scratch:
        checks = {}
        for name in MODELS:
            ours, our_outputs, failed = train(name, 3, f"{scratch}/{name}-3")
            theirs, their_outputs, _ = train(name, 2, f"{scratch}/{name}-2")
            differ = [key for key in theirs if not torch.allclose(ours[key].double(), theirs[key].double(),
                                                                  rtol=1e-5, atol=1e-6)]
            if not torch.allclose(our_outputs.double(), their_outputs.double(), rtol=1e-4, atol=1e-5):
                differ.append("the evaluation's outputs")
            checks[f"{name} as stage 2"] = [f"differ: {', '.join(differ[:3])}"] if differ else []
            checks[f"{name} gathers let go"] = failed
        checks["uneven evaluation"] = evaluated_unevenly(f"{scratch}/evaluation")
        checks["refusals"] = refusals(f"{scratch}/refusals")
        for check, failed in checks.items():
            everyone = hvd.allgather_object(failed, name=f"stage3.{check}")
            problems = [f"rank {rank}: {'; '.join(lines[:2])}" for rank, lines in enumerate(everyone) if lines]
            if hvd.rank() == 0:
                print(f"stage3: {check}: {'ok' if not problems else 'FAIL ' + ' | '.join(problems[:2])}", flush=True)
        if hvd.rank() == 0:
            print("stage3: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
