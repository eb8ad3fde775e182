"""A run with dropout at tp 2 resumed from its middle ends bitwise where the uninterrupted run ends:
the masks inside the tensor-parallel regions come from the RNG tracker, whose state the checkpoint
keeps with each rank's own generators (tests/rank/test_tensor_parallel.py).

    mpirun -np 2 python tests/programs/tp_dropout_resume.py DIR

Three Sessions in one job: the whole run (8 steps), a run stopped after step 4 (its checkpoint), and
that run resumed to step 8. Prints ``tp_dropout_resume: ok`` on rank 0, or fails its assertion.
"""

import sys
from pathlib import Path

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import hvdkit
from hvdkit.models import TinyGPT
from hvdkit.parallel.plan import whole_state_dict

DIRECTORY = Path(sys.argv[1])
TOKENS = torch.randint(0, 64, (256, 17), generator=torch.Generator().manual_seed(0))


def trained(name: str, steps: int) -> dict:
    """A Session's run to ``steps`` in DIRECTORY/name (resuming what is there): the whole weights."""
    session = hvdkit.Session(tp=2, batch_size=8, seed=3, logger="none", checkpoint_steps=4,
                             checkpoint_dir=str(DIRECTORY / name / "ckpt"), log_dir=str(DIRECTORY / name / "logs"))
    torch.manual_seed(0)
    model = session.parallelize(TinyGPT(64, 16, width=32, layers=2, heads=4, dropout=0.3))
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    loader = session.loader(torch.utils.data.TensorDataset(TOKENS))
    for _ in session.epochs(100, max_steps=steps):
        for (tokens,) in loader:
            optimizer.zero_grad()
            logits = model(tokens[:, :-1])
            session.backward(F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()))
            session.step()
            if session.should_stop() or session.global_step >= steps:
                break
    weights = whole_state_dict(model, session.mesh.tp_group, f"tp_dropout_resume.{name}")
    session.finish()
    return weights


whole = trained("whole", 8)
trained("resumed", 4)
resumed = trained("resumed", 8)
for key, value in whole.items():
    assert torch.equal(value, resumed[key]), f"{key} differs after the resume"
if hvd.rank() == 0:
    print("tp_dropout_resume: ok", flush=True)
