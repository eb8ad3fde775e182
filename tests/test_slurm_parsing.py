"""Slurm's nodelist and tasks-per-node notations, expanded without scontrol."""

import pytest

from hvdkit import slurm
from hvdkit.slurm import SlurmFormatError


@pytest.mark.parametrize("nodelist, hosts", [
    ("node1", ["node1"]),
    ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
    ("a[1-2]-ib[0-1]", ["a1-ib0", "a1-ib1", "a2-ib0", "a2-ib1"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("rack1-n[001-002],rack2-n[010]", ["rack1-n001", "rack1-n002", "rack2-n010"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert slurm.expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist, message", [
    ("", "nodelist is empty"),
    ("gpu[01-03", "'[' without ']'"),
    ("gpu]01", "']' without '['"),
    ("gpu[3-1]", "runs backwards"),
    ("gpu[a-b]", "bad range 'a-b'"),
    ("gpu[]", "bad range ''"),
    ("a,,b", "empty name"),
])
def test_malformed_nodelists(nodelist, message):
    with pytest.raises(SlurmFormatError, match=message.replace("[", r"\[").replace("]", r"\]")):
        slurm.expand_nodelist(nodelist)


@pytest.mark.parametrize("spec, counts", [
    ("4", [4]), ("2(x3),1", [2, 2, 2, 1]), ("1,3(x2)", [1, 3, 3]),
])
def test_tasks_per_node(spec, counts):
    assert slurm.expand_tasks_per_node(spec) == counts


@pytest.mark.parametrize("spec", ["", "2(x)", "x3", "2(3)"])
def test_malformed_tasks_per_node(spec):
    with pytest.raises(SlurmFormatError, match="cannot read"):
        slurm.expand_tasks_per_node(spec)


def test_allocation_pairs_hosts_with_tasks():
    environ = {"SLURM_JOB_NODELIST": "gpu[01-03],cpu5", "SLURM_TASKS_PER_NODE": "2(x3),1"}
    assert slurm.allocation(environ) == [("gpu01", 2), ("gpu02", 2), ("gpu03", 2), ("cpu5", 1)]
    with pytest.raises(SlurmFormatError, match="gives 2 nodes, the nodelist 4"):
        slurm.allocation({**environ, "SLURM_TASKS_PER_NODE": "2(x2)"})
    with pytest.raises(SlurmFormatError, match="not inside a Slurm allocation"):
        slurm.allocation({})
