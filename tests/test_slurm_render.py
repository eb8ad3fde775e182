"""`hvdkit slurm render`: golden files, and bad requests refused in one line.

The golden files are the templates with a request filled in; after changing a template,
regenerate them with `python tests/test_slurm_render.py` and review the diff.
"""

import re
import sys
from pathlib import Path

import pytest

from hvdkit import slurm
from hvdkit.slurm import JobRequest, SlurmFormatError

GOLDEN = Path(__file__).parent / "golden"
CASES = {
    "srun-2x4-gpus.sbatch": JobRequest(command=["hvdkit", "train", "--model", "resnet50", "--epochs", "90"],
                                       nodes=2, tasks_per_node=4, gpus_per_node=4, cpus_per_task=8,
                                       time="02:00:00", partition="gpu", account="proj42"),
    "mpirun-array.sbatch": JobRequest(command=["hvdkit", "train", "--base-lr", "0.1"], nodes=2, launcher="mpirun",
                                      array="0-9%2", time="30:00"),
    "horovodrun-own-script.sbatch": JobRequest(command=["python", "train.py", "--lr", "3e-4"], nodes=4,
                                               tasks_per_node=2, launcher="horovodrun", time="1-00:00:00"),
    "requeue.sbatch": JobRequest(command=["hvdkit", "train", "--epochs", "300"], nodes=2, requeue=True,
                                 time="04:00:00"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_render_matches_golden(name):
    assert slurm.render(CASES[name]) == (GOLDEN / name).read_text()


@pytest.mark.parametrize("changes, message", [
    ({"nodes": 0}, "--nodes must be >= 1"),
    ({"tasks_per_node": 0}, "--tasks-per-node must be >= 1"),
    ({"gpus_per_node": 6, "tasks_per_node": 4}, "--gpus-per-node 6 is not a multiple of --tasks-per-node 4"),
    ({"time": "2h"}, "--time '2h' is not a Slurm time"),
    ({"time": "1:2:3:4"}, "is not a Slurm time"),
    ({"array": "0-9,x"}, "--array '0-9,x' is not a Slurm array"),
    ({"array": "5-2"}, "--array '5-2': the range 5-2 is empty"),
    ({"partition": "a b"}, "--partition 'a b' is not a Slurm partition name"),
    ({"account": "x;rm"}, "--account 'x;rm' is not a Slurm account name"),
    ({"launcher": "mpiexec"}, "--launcher must be one of srun, mpirun, horovodrun"),
    ({"requeue": True, "launcher": "mpirun"}, "--requeue uses the preemptible template"),
    ({"command": []}, "no command after '--'"),
    ({"command": ["python", "my train.py"]}, "'my train.py' would break"),
])
def test_impossible_requests_are_refused(changes, message):
    request = JobRequest(command=["hvdkit", "train"])
    for key, value in changes.items():
        setattr(request, key, value)
    with pytest.raises(SlurmFormatError, match=message.replace("(", r"\(")):
        slurm.render(request)


def test_cli_refuses_in_one_line():
    from conftest import run

    proc = run([sys.executable, "-m", "hvdkit", "slurm", "render", "--nodes", "0", "--", "hvdkit", "train"])
    assert proc.returncode == 2 and proc.stderr == "hvdkit slurm: --nodes must be >= 1 (got 0)\n"
    assert proc.stdout == ""


if __name__ == "__main__":
    for name, request in CASES.items():
        (GOLDEN / name).write_text(slurm.render(request))
        print(f"wrote {GOLDEN / name}")


@pytest.mark.parametrize("template", sorted(p.name for p in (Path(__file__).parents[1] / "slurm").glob("*.sbatch")))
def test_a_signalled_template_gives_a_stop_less_grace_than_the_signal_lead(template):
    """A template that has Slurm signal its job ahead of the time limit gives hvdkit's stop less
    time than that lead, so that the checkpoint is written and the job requeued before Slurm
    ends it; hvdkit warns when a checkpoint took longer to write than that grace."""
    text = (Path(__file__).parents[1] / "slurm" / template).read_text()
    lead = re.search(r"^#SBATCH --signal=USR1@(\d+)$", text, re.MULTILINE)
    grace = re.search(r"^export HVDKIT_STOP_GRACE=\$\{HVDKIT_STOP_GRACE:-(\d+)\}$", text, re.MULTILINE)
    if lead is None:
        assert grace is None, f"{template} sets a stop's grace but has Slurm send no signal ahead"
        return
    assert grace is not None, f"{template}: --signal=USR1@{lead[1]} and no HVDKIT_STOP_GRACE below it"
    assert 0 < int(grace[1]) <= int(lead[1]) - 15, (template, grace[1], lead[1])
