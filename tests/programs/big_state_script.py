"""A user's own loop on hvdkit.Session whose checkpoints take long to write: a 4096x4096 layer,
134 MB with SGD's momentum, so that a test can act while a background save is in flight (its
temporary file is there). For tests/rank/test_checkpoints.py.

    mpirun -np 2 python tests/programs/big_state_script.py --checkpoint-dir ckpt --log-dir logs \
        --steps 20 --checkpoint-steps 5 [--sync]
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hvdkit

parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint-dir", required=True)
parser.add_argument("--log-dir", required=True)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--checkpoint-steps", type=int, default=5)
parser.add_argument("--sync", action="store_true", help="write checkpoints in the training thread")
args = parser.parse_args()

session = hvdkit.Session(batch_size=8, checkpoint_dir=args.checkpoint_dir, checkpoint_steps=args.checkpoint_steps,
                         log_dir=args.log_dir, async_checkpoint=not args.sync, log_interval=1000)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 4))
model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
numbers = torch.Generator().manual_seed(1)  # not the global RNG: a resume restores that one in setup()
data = TensorDataset(torch.randn(512, 4096, generator=numbers), torch.randint(0, 4, (512,), generator=numbers))
loader = session.loader(DataLoader(data, batch_size=8, drop_last=True))
for _ in session.epochs(100, max_steps=args.steps):
    for inputs, labels in loader:
        optimizer.zero_grad()
        session.backward(F.cross_entropy(model(inputs), labels))
        session.step()
        if session.should_stop() or session.global_step >= args.steps:
            break
session.finish()
