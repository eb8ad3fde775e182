"""Hostfiles and host lists (hvdkit.launch.hostfile): each launcher's format, mistakes named by
line, and the host list an elastic job's discovery script prints."""

import os
import sys

import pytest

from conftest import REPO, run
from hvdkit.launch import hostfile
from hvdkit.launch.hostfile import Host, LaunchError, parse_hosts, read_hostfile

HVDKIT = [sys.executable, "-m", "hvdkit", "launch"]


@pytest.mark.parametrize("fmt, text", [
    ("horovodrun", "h1:4\nh2:2\n"), ("openmpi", "h1 slots=4\nh2 slots=2\n"), ("mpich", "h1:4\nh2:2\n"),
])
def test_hostfile_formats_round_trip(tmp_path, fmt, text):
    hosts = [Host("h1", 4), Host("h2", 2)]
    assert hostfile.format_hostfile(hosts, fmt) == text
    path = tmp_path / "hosts"
    path.write_text("# a comment\n\n" + text)
    assert hostfile.read_hostfile(str(path)) == hosts


@pytest.mark.parametrize("text, message", [
    ("", "lists no hosts"),
    ("# only a comment\n", "lists no hosts"),
    ("h1\n", "line 1: host 'h1' has no slot count (write h1:N)"),
    ("h1:4\nh2 slots=two\n", "line 2: host 'h2' has slot count 'two'"),
    ("h1:0\n", "slot count '0'"),
    ("h1 4\n", "line 1: cannot read 'h1 4'"),
])
def test_malformed_hostfiles(tmp_path, text, message):
    path = tmp_path / "hosts"
    path.write_text(text)
    with pytest.raises(LaunchError, match=message.replace("(", r"\(").replace(")", r"\)")):
        hostfile.read_hostfile(str(path))


def test_bare_names_where_slots_are_not_needed(tmp_path):
    """`hvdkit doctor -H node0,node1` compares hosts, as mpirun's -H takes them: slots 0, not given."""
    assert parse_hosts("node0,node1:4", bare=True) == [Host("node0", 0), Host("node1", 4)]
    (tmp_path / "hosts").write_text("node0\nnode1 slots=2\n")
    assert read_hostfile(str(tmp_path / "hosts"), bare=True) == [Host("node0", 0), Host("node1", 2)]
    with pytest.raises(LaunchError, match="host 'node0' has no slot count"):
        parse_hosts("node0")  # a launch needs them


def test_host_lists():
    assert hostfile.parse_hosts("a:2,b:1") == [Host("a", 2), Host("b", 1)]
    with pytest.raises(LaunchError, match="host 'b' has no slot count"):
        hostfile.parse_hosts("a:2,b")


def test_list_hosts_for_elastic_discovery(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=2\nnode2:1\n")
    proc = run([*HVDKIT, "--list-hosts", "--hostfile", str(hostfile)])
    assert proc.returncode == 0 and proc.stdout == "node1:2\nnode2:1\n"
    slurm_env = dict(os.environ, SLURM_JOB_NODELIST="gpu[01-02]", SLURM_TASKS_PER_NODE="4(x2)")
    proc = run([*HVDKIT, "--list-hosts", "--hosts-format", "openmpi"], env=slurm_env)
    assert proc.returncode == 0 and proc.stdout == "gpu01 slots=4\ngpu02 slots=4\n"
    script = REPO / "launchers" / "discover_hosts.sh"
    proc = run([str(script)], env=dict(os.environ, HVDKIT_HOSTS_FILE=str(hostfile)))
    assert proc.returncode == 0 and proc.stdout == "node1:2\nnode2:1\n", proc.stderr


def test_ranks_fill_the_hosts_slots_in_order():
    hosts = [Host("a", 2), Host("b", 2), Host("c", 4)]
    assert hostfile.ranks_by_host(hosts, 5) == {"a": [0, 1], "b": [2, 3], "c": [4]}
    assert hostfile.ranks_by_host(hosts, 2) == {"a": [0, 1], "b": [], "c": []}
    assert hostfile.needed(hosts, 3) == (hosts[:2], hosts[2:]) and hostfile.needed(hosts, 9) == (hosts, [])
