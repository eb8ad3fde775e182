"""Training loops on hvdkit.Session in the shapes users write them (Horovod's examples, the
Fabric and Accelerate docs), each training the same 60 steps of a Linear model; or a shape
that cannot work, which must end the job at once with one line.

    python tests/programs/shapes_script.py --shape SHAPE [--shape SHAPE ...] [--repeat N] --out DIR

Each shape that trains runs in a Session of its own, one after another in this one job (N
times each: the hang of issue 37 was a race), and rank 0 writes each run's final weights to
DIR/SHAPE-I.pt. Shapes:

  canonical         session.epochs(), should_stop() after every step, a break at 60 steps
  no-should-stop    the same loop without should_stop() (the hang of issue 37)
  plain-range       a plain range over batches, no epochs(), no should_stop()
  own-backward      loss.backward() and session.step(), no session.backward
  eval-in-epoch     evaluation and reports inside the epoch, should_stop() only at its end
  rank0-save        `if session.rank == 0: session.save()`             (cannot work)
  rank0-report      a report on rank 0 only                             (cannot work)
  uneven-steps      rank 1 takes 10 steps fewer                         (cannot work)
  uneven-steps-slow the same, the others slow in the backward after rank 1's last step
  raise-on-rank1    an exception in the loop body on rank 1             (cannot work)
  stuck-collective  rank 1 waits in an allreduce no other rank joins    (a stop cannot reach a step)
  sleep-in-step     every step sleeps 1 s, for stop signals to arrive part-way
"""
import argparse
import itertools
import os
import time
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

import hvdkit

STEPS = 60


def dataset():
    inputs = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    return TensorDataset(inputs, inputs.sum(dim=1, keepdim=True))


def start(args, **keys):
    session = hvdkit.Session(seed=0, batch_size=8, log_dir=args.log_dir, checkpoint_dir=args.checkpoint_dir,
                             stall_timeout=args.stall_timeout, **keys)
    loader = session.loader(dataset())
    linear = torch.nn.Linear(8, 1)
    model, optimizer = session.setup(linear, torch.optim.SGD(linear.parameters(), lr=0.01))
    return session, loader, model, optimizer


def loss_of(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def canonical(args):
    session, loader, model, optimizer = start(args)
    for _ in session.epochs(100, max_steps=STEPS):
        for batch in loader:
            optimizer.zero_grad()
            session.backward(loss_of(model, batch))
            session.step()
            if session.should_stop() or session.global_step >= STEPS:
                break
    return session, model


def no_should_stop(args):
    session, loader, model, optimizer = start(args)
    steps = 0
    for _ in session.epochs(100):
        for batch in loader:
            optimizer.zero_grad()
            session.backward(loss_of(model, batch))
            session.step()
            steps += 1
            if steps >= STEPS:
                break
        if steps >= STEPS:
            break
    return session, model


def plain_range(args):
    session, loader, model, optimizer = start(args)
    batches = itertools.chain.from_iterable(_epochs(loader))
    for _ in range(STEPS):
        optimizer.zero_grad()
        session.backward(loss_of(model, next(batches)))
        session.step()
    return session, model


def _epochs(loader):
    for epoch in itertools.count():
        loader.sampler.set_epoch(epoch)
        yield loader


def own_backward(args):
    session, loader, model, optimizer = start(args)
    for _ in session.epochs(100, max_steps=STEPS):
        for batch in loader:
            optimizer.zero_grad()
            loss_of(model, batch).backward()
            session.step()
            if session.global_step >= STEPS:
                break
    return session, model


def eval_in_epoch(args):
    session, loader, model, optimizer = start(args, log_interval=5)
    held_out = session.eval_loader(dataset())
    for _ in session.epochs(100, max_steps=STEPS):
        for batch in loader:
            optimizer.zero_grad()
            loss = loss_of(model, batch)
            session.backward(loss)
            session.log(len(batch[0]), loss=loss)
            session.step()
            if session.report_due():
                session.report("train")
            if session.global_step % 7 == 0:
                session.evaluate(held_out, lambda b: (len(b[0]), {"loss": loss_of(model, b)}))
            if session.global_step >= STEPS:
                break
        if session.should_stop():
            break
    return session, model


def mark(what):
    """When the shape goes wrong, for the test that times how soon the job ends after it."""
    print(f"MARK {time.time()} {what}", flush=True)


def until_it_fails(args, after_step):
    """The canonical loop without an end, ``after_step(session)`` after each step: for the shapes
    that cannot work and for stops."""
    session, loader, model, optimizer = start(args)
    for _ in session.epochs(100):
        for batch in loader:
            optimizer.zero_grad()
            loss = loss_of(model, batch)
            session.backward(loss)
            session.log(len(batch[0]), loss=loss)
            session.step()
            after_step(session)
    return session, model


def rank0_save(args):
    def save_on_rank_0(session):
        if session.rank == 0 and session.global_step % 10 == 0:
            mark("save on rank 0")
            session.save()

    return until_it_fails(args, save_on_rank_0)


def rank0_report(args):
    def report_on_rank_0(session):
        if session.rank == 0 and session.global_step % 10 == 0:
            mark("report on rank 0")
            session.report("train")

    return until_it_fails(args, report_on_rank_0)


def uneven_steps(args, slow_after=None):
    session, loader, model, optimizer = start(args)
    batches = itertools.chain.from_iterable(_epochs(loader))
    for step in range(STEPS - 10 * (session.rank == 1)):
        optimizer.zero_grad()
        loss = loss_of(model, next(batches))
        if step == slow_after:
            loss = SlowBackward.apply(loss)
        session.backward(loss)
        session.step()
    if session.rank == 1:
        mark("rank 1 took its last step")
    return session, model


class SlowBackward(torch.autograd.Function):
    """Its backward takes 2 s, before any gradient reaches the model."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2)
        return grad


def uneven_steps_slow(args):
    """Rank 1 takes 10 steps fewer; the others' backward of the step after its last is slow, so
    that rank 1 has left (and Horovod shut down) before they start that step's allreduces: the
    race in which rank 0 said "Horovod shut down" instead of why (CI, stop 47)."""
    return uneven_steps(args, slow_after=STEPS - 10)


def raise_on_rank1(args):
    def raise_at_step_20(session):
        if session.rank == 1 and session.global_step == 20:
            mark("rank 1 raises")
            raise ValueError("a bad batch on rank 1")

    return until_it_fails(args, raise_at_step_20)


def stuck_collective(args):
    import horovod.torch as hvd

    def stick_at_step_5(session):
        if session.global_step == 5:
            print(f"rank {session.rank} stuck", flush=True)
            Path(args.log_dir, f"stuck-rank-{session.rank}").touch()  # for tests: a launcher may hold the line back
            if session.rank == 1:
                hvd.allreduce(torch.zeros(1), name="never.joined")

    return until_it_fails(args, stick_at_step_5)


def sleep_in_step(args):
    def sleep(session):
        session.print(f"step {session.global_step}")
        time.sleep(1)

    return until_it_fails(args, sleep)


SHAPES = {fn.__name__.replace("_", "-"): fn for fn in (
    canonical, no_should_stop, plain_range, own_backward, eval_in_epoch, rank0_save, rank0_report, uneven_steps,
    uneven_steps_slow, raise_on_rank1, stuck_collective, sleep_in_step)}

parser = argparse.ArgumentParser()
parser.add_argument("--shape", action="append", choices=SHAPES, required=True)
parser.add_argument("--out")
parser.add_argument("--log-dir")
parser.add_argument("--checkpoint-dir")
parser.add_argument("--stall-timeout", type=float, default=300.0)
parser.add_argument("--repeat", type=int, default=1)


def main():
    args = parser.parse_args()
    code = 0
    for shape, run in itertools.product(args.shape, range(args.repeat)):
        session, model = SHAPES[shape](args)
        code = session.finish()["exit_code"] or code
        if session.rank == 0 and args.out:
            os.makedirs(args.out, exist_ok=True)
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
                       Path(args.out, f"{shape}-{run}.pt"))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
