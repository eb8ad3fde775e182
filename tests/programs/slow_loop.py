"""An own training loop on hvdkit.Session whose steps last --step-seconds longer than they need.

Tests stop it part-way (a second Ctrl-C, a Slurm time limit) and compare its weights with a
run of the same loop at full speed: the pause changes when a step happens, never what it does.
``--nan-at-step K`` makes step K's loss NaN, as a diverging run's is; ``--catch`` catches
hvdkit's NonFiniteError in the loop, as a user may; ``--fused`` makes the optimizer torch's
fused SGD, which skips a non-finite step on the device (as the Session makes it on a GPU).

    python tests/programs/slow_loop.py --step-seconds 1 --checkpoint-dir ckpt
"""
import argparse
import time

import torch
from torch.utils.data import TensorDataset

import hvdkit
from hvdkit.rank.step.training import NonFiniteError

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=100)
parser.add_argument("--step-seconds", type=float, default=0.0)
parser.add_argument("--log-dir")
parser.add_argument("--checkpoint-dir")
parser.add_argument("--checkpoint-steps", type=int)
parser.add_argument("--nan-at-step", type=int, default=0)
parser.add_argument("--catch", action="store_true")
parser.add_argument("--fused", action="store_true")


def main():
    args = parser.parse_args()
    session = hvdkit.Session(seed=0, batch_size=8, log_dir=args.log_dir, checkpoint_dir=args.checkpoint_dir,
                             checkpoint_steps=args.checkpoint_steps)
    inputs = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    dataset = TensorDataset(inputs, inputs.sum(dim=1, keepdim=True))
    loader = session.loader(dataset)
    linear = torch.nn.Linear(8, 1)
    model, optimizer = session.setup(linear, torch.optim.SGD(linear.parameters(), lr=0.01, fused=args.fused or None))
    for _ in session.epochs(args.epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            if session.global_step + 1 == args.nan_at_step:
                loss = loss * float("nan")
            session.backward(loss)
            try:
                session.step()
            except NonFiniteError as exc:
                if not args.catch:
                    raise
                session.print(f"caught: {exc}")
                return 3
            session.print(f"step {session.global_step}")
            time.sleep(args.step_seconds)
            if session.should_stop():
                break
    return session.finish()["exit_code"]


if __name__ == "__main__":
    raise SystemExit(main())
