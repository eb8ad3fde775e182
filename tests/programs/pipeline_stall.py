"""An own loop on hvdkit.Session with a pipeline of 2 stages whose last stage gets stuck in its loss
of micro-batch 2 at step --at (in Python's time.sleep: the rank's threads still run), so that the
pipeline stops there: the first stage waits for that micro-batch's gradient.

    horovodrun -np 2 python tests/programs/pipeline_stall.py --at 3 --stall-timeout 8 --log-dir logs
"""
import argparse
import time

import torch
from torch import nn

import hvdkit

parser = argparse.ArgumentParser()
parser.add_argument("--at", type=int, default=3)
parser.add_argument("--stall-timeout", type=float, default=8)
parser.add_argument("--log-dir")


def main():
    args = parser.parse_args()
    session = hvdkit.Session(seed=0, batch_size=2, pp=2, micro_batches=4, log_dir=args.log_dir,
                             stall_timeout=args.stall_timeout)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
    model, optimizer = session.setup(session.parallelize(model), torch.optim.SGD(model.parameters(), lr=0.01))
    inputs = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    seen = [0]

    def loss_fn(output, target):
        if session.global_step + 1 >= args.at and seen[0] % 4 == 2:
            time.sleep(600)  # STUCK-SLEEP
        seen[0] += 1
        return nn.functional.mse_loss(output, target)

    for _ in range(100):  # the stall limit ends the job at step --at
        optimizer.zero_grad()
        session.pipeline.step((inputs, torch.zeros(8, 16)), loss_fn)
        session.step()
    session.finish()


if __name__ == "__main__":
    main()
