"""An own loop with trackers, in the shape users write it: ``Session(loggers=...)``, a plain
range over batches, a report every 5 steps, a checkpoint under ``if rank == 0``-free save.

    python tests/programs/loggers_script.py --loggers csv,tensorboard --steps 30 [--break-csv-at 10] [--no-finish]

``--break-csv-at N`` removes the CSV logger's folder after step N, as a full or vanished disk
would: that logger fails at its next report, and training must go on with the others.
``--no-finish`` ends without session.finish(), as many loops do.
"""
import argparse
import itertools
import shutil
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

import hvdkit


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--loggers", default="csv,tensorboard")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--break-csv-at", type=int)
    parser.add_argument("--no-finish", action="store_true")
    args = parser.parse_args()
    session = hvdkit.Session(loggers=args.loggers.split(","), seed=0, batch_size=8, log_interval=5)
    inputs = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    loader = session.loader(TensorDataset(inputs, inputs.sum(dim=1, keepdim=True)))
    linear = torch.nn.Linear(8, 1)
    model, optimizer = session.setup(linear, torch.optim.SGD(linear.parameters(), lr=0.01))
    batches = itertools.chain.from_iterable(itertools.repeat(loader))
    for step in range(1, args.steps + 1):
        x, y = next(batches)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        session.backward(loss)
        session.step()
        session.log(len(x), loss=loss)
        if step % 5 == 0:
            session.report(lr=0.01)
        if step == args.break_csv_at and session.rank == 0:
            shutil.rmtree(Path(session.log_dir) / "csv")
    if not args.no_finish:
        session.finish()


if __name__ == "__main__":
    main()
