"""A user's own loop on hvdkit.Session with two faults to plant, for tests/rank/test_consistency.py and
tests/rank/test_stragglers.py:

- ``--plant K``: after step K, rank 1 (or ``--plant-rank``) changes one weight (fc.weight[0, 0]) on
  its own, the bug the consistency check is for (rank-dependent code touching the model);
- ``--slow-rank R --slow-ms S``: the test hook for a straggler: rank R's data loader sleeps S ms
  for every batch, as a node with a slow disk or a busy CPU would load slower;

``--tp N`` splits the model across groups of N ranks (hidden by columns, fc by rows; the planted
weight is then in a block); and, for a run with nothing wrong, ``--norm`` (a batch norm and dropout), ``--amp`` (bf16 on
CPUs), ``--fp16-allreduce`` and ``--accumulate K`` micro-batches per allreduce.

    horovodrun -np 2 python tests/programs/checks_script.py --plant 7 --check-every 5 --checkpoint-steps 6 \
        --checkpoint-dir ckpt --log-dir logs
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, default_collate

import hvdkit
from hvdkit.parallel.plan import ColwiseParallel, RowwiseParallel

parser = argparse.ArgumentParser()
parser.add_argument("--plant", type=int, default=0, help="after this step, rank 1 changes fc.weight[0, 0]; 0: never")
parser.add_argument("--plant-rank", type=int, default=1)
parser.add_argument("--tp", type=int, default=1)
parser.add_argument("--check-every", type=int, default=100)
parser.add_argument("--checkpoint-steps", type=int)
parser.add_argument("--slow-rank", type=int, help="this rank's data loader sleeps --slow-ms for every batch")
parser.add_argument("--slow-ms", type=float, default=0.0)
parser.add_argument("--width", type=int, default=32, help="hidden units: more, for more compute per step")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--norm", action="store_true", help="a batch norm and dropout after the hidden layer")
parser.add_argument("--amp", action="store_true")
parser.add_argument("--fp16-allreduce", action="store_true")
parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per allreduce")
parser.add_argument("--checkpoint-dir")
parser.add_argument("--log-dir", required=True)
args = parser.parse_args()

session = hvdkit.Session(batch_size=32, log_interval=10, check_consistency_steps=args.check_every,
                         checkpoint_steps=args.checkpoint_steps, checkpoint_dir=args.checkpoint_dir,
                         log_dir=args.log_dir, amp=args.amp, fp16_allreduce=args.fp16_allreduce,
                         batches_per_allreduce=args.accumulate, tp=args.tp)
torch.manual_seed(0)
model = nn.Sequential()
model.add_module("hidden", nn.Linear(64, args.width))
if args.norm:  # each rank's own statistics, and its own dropout masks
    model.add_module("norm", nn.BatchNorm1d(args.width))
    model.add_module("dropout", nn.Dropout(0.2))
model.add_module("relu", nn.ReLU())
model.add_module("fc", nn.Linear(args.width, 4))
model = session.parallelize(model, {"hidden": ColwiseParallel(), "fc": RowwiseParallel()}) if args.tp > 1 else model
model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
data = TensorDataset(torch.randn(4096, 64), torch.randint(0, 4, (4096,)))


def collate(samples):
    if session.rank == args.slow_rank:
        time.sleep(args.slow_ms / 1000)
    return default_collate(samples)


loader = session.loader(DataLoader(data, batch_size=32, collate_fn=collate, drop_last=True))
for _ in session.epochs(100, max_steps=args.steps):
    for batch in loader:
        optimizer.zero_grad()
        for inputs, labels in session.micro_batches(batch):
            with session.autocast():
                loss = F.cross_entropy(model(inputs), labels)
            session.backward(loss)
            session.log(len(labels), loss=loss)
        session.step()
        if session.global_step == args.plant and session.rank == args.plant_rank:
            with torch.no_grad():
                model.fc.weight[0, 0] += 1e-3
        if session.report_due():
            session.report("train")
        if session.should_stop() or session.global_step >= args.steps:
            break
session.finish()
