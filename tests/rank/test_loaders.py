"""The run's loaders (hvdkit.rank.start.loaders) as a user's script holds them."""

import subprocess
import sys

import pytest

from conftest import run

# The README's loop in main(), its session and loader kept as module globals (as scripts and
# notebooks do), with a loader worker; "break" leaves the epoch's iterator mid-way.
GLOBALS_SCRIPT = """
import sys, torch
import hvdkit
from torch.utils.data import TensorDataset


def main():
    global session, loader
    session = hvdkit.Session(batch_size=4, num_workers=1, log_dir=sys.argv[1])
    model = torch.nn.Linear(3, 2)
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = session.loader(TensorDataset(torch.randn(64, 3), torch.randint(0, 2, (64,))))
    for epoch in session.epochs(1):
        for batch in loader:
            optimizer.zero_grad()
            for x, y in session.micro_batches(batch):
                session.backward(torch.nn.functional.cross_entropy(model(x), y))
            session.step()
            if session.global_step == 3 and sys.argv[2] == "break":
                break
    session.finish()
    print("finished", flush=True)


if __name__ == "__main__":
    main()
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["whole", "break"])
def test_a_script_holding_its_loader_as_a_global_exits(tmp_path, how):
    """Its persistent worker ignores SIGTERM (a stop must reach the rank first), which is how
    multiprocessing ends its children at the interpreter's exit before waiting for them: the
    loaders' end at exit shuts it down first, and the process ends (it waited for good before)."""
    script = tmp_path / "train.py"
    script.write_text(GLOBALS_SCRIPT)
    try:
        proc = run([sys.executable, str(script), str(tmp_path / "logs"), how], timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the script printed its end but its process did not exit within 120 s")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("finished"), proc.stdout + proc.stderr[-2000:]
