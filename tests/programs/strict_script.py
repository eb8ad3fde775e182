"""A user's own Horovod script that is not hvdkit: a strict argparse (any unknown flag is an
error), a few averaged training steps, and one JSON file per rank in $HVDKIT_LOG_DIR, the
run directory the job script hands over without touching its arguments."""

import argparse
import json
import os
from pathlib import Path

import horovod.torch as hvd
import torch

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()

hvd.init()
torch.manual_seed(hvd.rank())
model = torch.nn.Linear(4, 1)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size()),
                                     named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
for _ in range(args.steps):
    optimizer.zero_grad()
    model(torch.randn(8, 4)).pow(2).mean().backward()
    optimizer.step()
weights = hvd.allgather(model.weight.detach().reshape(1, -1))
out = Path(os.environ["HVDKIT_LOG_DIR"]) / f"strict-rank-{hvd.rank()}.json"
out.write_text(json.dumps({"rank": hvd.rank(), "size": hvd.size(), "lr": args.lr, "steps": args.steps,
                           "seed": os.environ.get("HVDKIT_SEED"),
                           "checkpoint_dir": os.environ.get("HVDKIT_CHECKPOINT_DIR"),
                           "ranks_agree": bool((weights == weights[0]).all())}))
