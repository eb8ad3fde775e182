"""A checkpoint of the GPT's earlier layout (tests/reference_models.py PackedGPT, q, k and v packed)
resumed by hvdkit.models.TinyGPT through the Session's resume, in every rank of a real job, against
the earlier layout resumed from the same checkpoint.

    mpirun -np 2 python tests/programs/gpt_resume.py DIR

Two steps of the packed layout are checkpointed in DIR/packed; a copy of it is resumed by TinyGPT
and one by PackedGPT, each taking a third step. Rank 0 prints "gpt resume: steps <new> <packed>,
weights differ by <largest difference>" (the new layout's weights in the packed names).
"""

import os
import shutil
import sys

import horovod.torch as hvd
import torch

import hvdkit
from hvdkit.models import TinyGPT

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from reference_models import PackedGPT  # noqa: E402  -- tests/reference_models.py

VOCAB, SEQ = 32, 8


def train(model, directory: str, steps: int):
    """A Session over ``model`` with SGD and momentum, checkpointing into ``directory`` and resuming
    from it; ``steps`` steps after the resume. (steps taken in all, the weights)."""
    session = hvdkit.Session(seed=0, batch_size=4, logger="none", log_dir=directory + "-logs",
                             checkpoint_dir=directory)
    net, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for _ in range(steps):
        step = session.global_step
        generator = torch.Generator().manual_seed(100 * step + session.rank)
        tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=generator)
        optimizer.zero_grad()
        logits = net(tokens[:, :-1])
        session.backward(torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)))
        session.step()
    session.save()
    taken = session.global_step
    session.finish()
    return taken, net


def main() -> None:
    root = sys.argv[1]
    torch.manual_seed(0)
    train(PackedGPT(VOCAB, SEQ), os.path.join(root, "packed"), 2)
    if hvd.rank() == 0:
        for name in ("new", "again"):
            shutil.copytree(os.path.join(root, "packed"), os.path.join(root, name))
    hvd.allreduce(torch.zeros(1), name="gpt_resume.copied")  # every rank waits for the copies
    torch.manual_seed(1)  # other initial weights: the checkpoint's must replace them
    new_steps, new = train(TinyGPT(VOCAB, SEQ, width=16, layers=2, heads=4), os.path.join(root, "new"), 1)
    packed_steps, packed = train(PackedGPT(VOCAB, SEQ), os.path.join(root, "again"), 1)
    theirs = packed.state_dict()
    difference = max((value - theirs[name]).abs().max().item() for name, value in new.packed_state_dict().items())
    if hvd.rank() == 0:
        print(f"gpt resume: steps {new_steps} {packed_steps}, weights differ by {difference:.1e}", flush=True)


if __name__ == "__main__":
    main()
