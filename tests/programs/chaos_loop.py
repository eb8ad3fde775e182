"""A user's own loop for `hvdkit rehearse --chaos` (tests/rehearse/test_chaos.py).

    chaos_loop.py STEPS [--plant forget] [--plant linger]

Trains with ``hvdkit.Session`` (checkpoint_dir, checkpoint_steps, ... from HVDKIT_* variables)
to step STEPS: AdamW, a model of a few layers, each step's rows drawn from the step's number, so
a resumed run takes the steps an undisturbed one takes. Two planted defects, for the tool to
catch:
--plant forget: a resumed run starts its weights afresh (the resume skipped, as a loop that
    builds its model after loading the checkpoint would).
--plant linger: rank 1, on the job's first start, starts a process of its own that outlives the job.
"""

import argparse
import subprocess

import torch
import torch.nn.functional as F
from torch import nn

import hvdkit

ROWS = 8  # of a step, over all ranks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("steps", type=int)
    parser.add_argument("--plant", choices=["forget", "linger"], action="append", default=[])
    args = parser.parse_args()
    torch.set_num_threads(1)
    session = hvdkit.Session()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4))
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01)
    net, optimizer = session.setup(net, optimizer)
    if "forget" in args.plant and session.global_step > 0:
        with torch.no_grad():
            for parameter in net.parameters():
                parameter.normal_(0, 0.1)
    if "linger" in args.plant and session.rank == 1 and session.global_step == 0:
        subprocess.Popen(["sleep", "300"], start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    share = ROWS // session.size
    while session.global_step < args.steps:
        generator = torch.Generator().manual_seed(session.global_step)
        x, y = torch.randn(ROWS, 16, generator=generator), torch.randint(0, 4, (ROWS,), generator=generator)
        mine = slice(session.rank * share, (session.rank + 1) * share)
        optimizer.zero_grad()
        session.backward(F.cross_entropy(net(x[mine]), y[mine]))
        session.step()
    session.finish()


if __name__ == "__main__":
    main()
