"""An own loop on hvdkit.Session whose rank 1 holds 16 MB more at each step (``--leak rank``) or
whose DataLoader workers do at each sample (``--leak worker``), once the file ``--flag`` exists:
a test confines the process to a memory cgroup first, and the kernel's out-of-memory killer ends
it there. Without the flag it trains in small steps until --steps.

    python tests/programs/leaky.py --leak worker --flag /tmp/leak-now --log-dir logs
"""
import argparse
import os
import time

import torch
from torch.utils.data import Dataset

import hvdkit

parser = argparse.ArgumentParser()
parser.add_argument("--leak", choices=["rank", "worker"], required=True)
parser.add_argument("--flag", required=True)
parser.add_argument("--steps", type=int, default=100000)
parser.add_argument("--log-dir")
parser.add_argument("--checkpoint-dir")

MB16 = 16 * 2 ** 20
held = []


class Samples(Dataset):
    def __init__(self, leaks, flag):
        self.leaks, self.flag = leaks, flag
        self.inputs = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.inputs)

    def __getitem__(self, index):
        if self.leaks and os.path.exists(self.flag):
            held.append(b"\x01" * MB16)  # written, so resident
        return self.inputs[index], self.inputs[index].sum(dim=0, keepdim=True)


def main():
    args = parser.parse_args()
    session = hvdkit.Session(seed=0, batch_size=4, num_workers=1 if args.leak == "worker" else 0,
                             log_dir=args.log_dir, checkpoint_dir=args.checkpoint_dir, checkpoint_steps=10)
    loader = session.loader(Samples(args.leak == "worker" and session.rank == 1, args.flag))
    linear = torch.nn.Linear(8, 1)
    model, optimizer = session.setup(linear, torch.optim.SGD(linear.parameters(), lr=0.01))
    for _ in session.epochs(100000):
        for x, y in loader:
            optimizer.zero_grad()
            session.backward(torch.nn.functional.mse_loss(model(x), y))
            session.step()
            session.print(f"step {session.global_step}")
            if args.leak == "rank" and session.rank == 1 and os.path.exists(args.flag):
                held.append(b"\x01" * MB16)
            time.sleep(0.02)
            if session.should_stop() or session.global_step >= args.steps:
                break
        if session.global_step >= args.steps:
            break
    return session.finish()["exit_code"]


if __name__ == "__main__":
    raise SystemExit(main())
