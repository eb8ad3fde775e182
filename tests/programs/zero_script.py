"""A user's own loop with a sharded optimizer, for tests/zero/test_zero.py.

    zero_script.py STEPS OUT [--export DIR] [--kill-at STEP]

Trains with ``hvdkit.Session`` (its keys from HVDKIT_* variables: zero, checkpoint_dir,
batch_size, batches_per_allreduce, ...) to step STEPS, AdamW with two param groups, a frozen
layer and a warmup schedule; rank 0 then saves the weights to OUT. Each step's rows over all
ranks are the same at any world size (rank r takes its share), so runs at different sizes with
the same global batch reach the same weights.
--export DIR: start from an export (hvdkit checkpoint export) with plain torch, unsharded:
    the optimizer and scheduler load its files as they are, then train on from its step.
--kill-at STEP: rank 0 SIGKILLs itself when it is about to write the main file of that step's
    checkpoint, every rank's shard being written: a sharded save cut at its worst moment.
"""

import argparse
import json
import os
import signal
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import hvdkit

ROWS = 12  # of a step, over all ranks


def model() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    net[0].requires_grad_(False)
    return net


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("steps", type=int)
    parser.add_argument("out")
    parser.add_argument("--export")
    parser.add_argument("--kill-at", type=int)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.kill_at is not None:
        from hvdkit.checkpoint import writer as checkpoint_writer  # where the background thread calls it

        write_main = checkpoint_writer.save

        def killed_before_the_main_file(directory, step, state, keep, *rest):
            if step == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return write_main(directory, step, state, keep, *rest)
        checkpoint_writer.save = killed_before_the_main_file

    session = hvdkit.Session()
    net = model()
    optimizer = torch.optim.AdamW([{"params": [*net[0].parameters(), *net[2].parameters()], "weight_decay": 0.1},
                                   {"params": list(net[4].parameters()), "lr": 0.02}], lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 8))
    if args.export:
        exported = Path(args.export)
        net.load_state_dict(torch.load(exported / "model.pt"))
        optimizer.load_state_dict(torch.load(exported / "optimizer.pt"))
        scheduler.load_state_dict(torch.load(exported / "scheduler.pt"))
    net, optimizer = session.setup(net, optimizer, scheduler)
    if args.export:
        session.global_step = json.loads((exported / "export.json").read_text())["step"]
    cfg = session.cfg
    share = cfg.batch_size * cfg.batches_per_allreduce
    assert share * session.size == ROWS, (share, session.size)
    while session.global_step < args.steps:
        generator = torch.Generator().manual_seed(session.global_step)
        x, y = torch.randn(ROWS, 10, generator=generator), torch.randint(0, 4, (ROWS,), generator=generator)
        mine = slice(session.rank * share, (session.rank + 1) * share)
        optimizer.zero_grad()
        for xs, ys in session.micro_batches((x[mine], y[mine])):
            session.backward(F.cross_entropy(net(xs), ys))
        session.step()
    weights = optimizer.model_state_dict() if cfg.zero == 3 else net.state_dict()  # zero 3: every rank gathers
    if session.rank == 0:
        torch.save(weights, args.out)
    session.finish()


if __name__ == "__main__":
    main()
