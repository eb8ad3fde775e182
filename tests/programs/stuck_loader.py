"""An own loop on hvdkit.Session whose dataset gets stuck on rank --rank once step --at is done:
``--how sleep`` in Python's time.sleep (the GIL released, the rank's threads still run), ``--how
gil`` in a C call that holds the GIL (libc's sleep through ctypes.PyDLL), so that no Python
thread of that rank runs again. The other ranks wait for it in the step's collective.

    python tests/programs/stuck_loader.py --how gil --at 3 --stall-timeout 8 --log-dir logs
"""
import argparse
import ctypes
import time

import torch
from torch.utils.data import Dataset

import hvdkit

parser = argparse.ArgumentParser()
parser.add_argument("--how", choices=["sleep", "gil"], required=True)
parser.add_argument("--at", type=int, default=3)
parser.add_argument("--rank", type=int, default=1)
parser.add_argument("--stall-timeout", type=float, default=8)
parser.add_argument("--log-dir")


class Slow(Dataset):
    def __init__(self, session, args):
        self.session, self.args = session, args
        self.inputs = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.inputs)

    def __getitem__(self, index):
        if self.session.rank == self.args.rank and self.session.global_step >= self.args.at:
            if self.args.how == "sleep":
                time.sleep(600)  # STUCK-SLEEP
            else:
                ctypes.PyDLL(None).sleep(600)  # STUCK-GIL
        return self.inputs[index], self.inputs[index].sum(dim=0, keepdim=True)


def main():
    args = parser.parse_args()
    session = hvdkit.Session(seed=0, batch_size=8, log_dir=args.log_dir, stall_timeout=args.stall_timeout)
    loader = session.loader(Slow(session, args))
    linear = torch.nn.Linear(8, 1)
    model, optimizer = session.setup(linear, torch.optim.SGD(linear.parameters(), lr=0.01))
    for _ in session.epochs(100):
        for x, y in loader:
            optimizer.zero_grad()
            session.backward(torch.nn.functional.mse_loss(model(x), y))
            session.step()
            session.print(f"step {session.global_step}")
            if session.should_stop():
                break
    return session.finish()["exit_code"]


if __name__ == "__main__":
    raise SystemExit(main())
