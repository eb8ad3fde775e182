"""The network between hosts (hvdkit.launch.network): the interface MPI and NCCL are pinned to,
a host that does not resolve, a host that stops answering."""

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import MPICH, OPENMPI, run
from hvdkit.launch import network, planner
from hvdkit.launch.hostfile import LaunchError
from hvdkit.launch.network import NetworkError
from hvdkit.system import probes

WORKER = ["python", "train.py"]

INTERFACES = {"lo": [("127.0.0.1", "255.0.0.0")], "eth0": [("10.1.0.11", "255.255.255.0")],
              "docker0": [("172.17.0.1", "255.255.0.0")]}
ADDRESSES = {"h1": "10.1.0.11", "h2": "10.1.0.12", "h3": "10.1.0.13", "localhost": "127.0.0.1"}


def _resolve(name):
    if name not in ADDRESSES:
        raise OSError(-2, "Name or service not known")
    return ADDRESSES[name]


def _network(names, source=lambda address: "10.1.0.11"):
    return network.routable_network(names.split(","), _resolve, source, lambda: INTERFACES)


def test_the_network_is_this_hosts_route_to_the_others():
    assert _network("h1,h2,h3") == network.Network("eth0", "10.1.0.0/24", ("h2", "h3"))
    assert _network("h1,localhost") is None, "one machine: nothing to pin"
    with pytest.raises(NetworkError, match=r"^host h9 does not resolve on this host \(check /etc/hosts or DNS\)$"):
        _network("h1,h9")

    def unreachable(address):
        raise OSError(101, "Network is unreachable")
    with pytest.raises(NetworkError, match=r"^no route from this host to h2 \(10.1.0.12\): Network is unreachable$"):
        _network("h1,h2", unreachable)


def _pinned_plan(argv, environ=None, mpi=OPENMPI):
    args = planner.parser().parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    which = lambda name: f"/opt/bin/{name}"  # noqa: E731
    own = argv[argv.index("--") + 1:] if "--" in argv else []
    return planner.plan(args, WORKER, environ or {}, which, lambda _: mpi, False, 2, own,
                       network=lambda names: network.Network("eth0", "10.1.0.0/24", ("h2", "h3")))


def test_mpirun_across_hosts_is_pinned_to_that_network_unless_the_user_chose():
    result = _pinned_plan(["-np", "3", "-H", "h1:1,h2:1,h3:1", "--launcher", "mpirun"])
    pinned = result.command.index("btl_tcp_if_include") - 1
    assert result.command[pinned:pinned + 6] == ["-mca", "btl_tcp_if_include", "10.1.0.0/24",
                                                 "-mca", "oob_tcp_if_include", "10.1.0.0/24"]
    assert "NCCL_SOCKET_IFNAME=eth0" in result.command
    assert result.notes == ["network: eth0 (10.1.0.0/24), this host's route to h2, h3; MPI and NCCL pinned to it"]
    hydra = _pinned_plan(["-np", "3", "-H", "h1:1,h2:1,h3:1", "--launcher", "mpirun"], mpi=MPICH).command
    assert hydra[hydra.index("-iface") + 1] == "eth0"
    for chose in (_pinned_plan(["-np", "3", "-H", "h1:1,h2:1,h3:1", "--", "-mca", "btl_tcp_if_exclude", "docker0"]),
                  _pinned_plan(["-np", "3", "-H", "h1:1,h2:1,h3:1"], {"OMPI_MCA_btl_tcp_if_include": "ib0"})):
        assert "btl_tcp_if_include" not in chose.command and not chose.notes
    horovodrun = _pinned_plan(["-np", "3", "-H", "h1:1,h2:1,h3:1", "--launcher", "horovodrun"]).command
    assert "-mca" not in horovodrun, "horovodrun tests the hosts' interfaces itself"
    assert "btl_tcp_if_include" not in _pinned_plan(["-np", "2", "--launcher", "mpirun"]).command
    assert result.watch == ["h1", "h2", "h3"] and _pinned_plan(["-np", "2", "--launcher", "mpirun"]).watch == []


def test_on_links_of_10_gbits_and_more_mpi_moves_the_tensors_in_every_rank():
    """Across hosts the ranks give Gloo the tensors (hvdkit.rank.start.startup.gloo_data_settings);
    where the link is known fast, the launcher tells every rank alike to leave them to MPI."""
    hosts = ["-np", "3", "-H", "h1:1,h2:1,h3:1"]
    fast = _pinned_plan([*hosts, "--launcher", "mpirun"], {"HVDKIT_LINK_RATE": "10gbit"})
    assert "HOROVOD_CPU_OPERATIONS=mpi" in fast.command and "HVDKIT_LINK_RATE" in fast.command
    assert any(note.startswith("HVDKIT_LINK_RATE=10gbit: MPI moves the tensors") for note in fast.notes)
    horovodrun = _pinned_plan([*hosts, "--launcher", "horovodrun"], {"HVDKIT_LINK_RATE": "25gbit"})
    assert horovodrun.env["HOROVOD_CPU_OPERATIONS"] == "mpi"
    for left in (_pinned_plan([*hosts, "--launcher", "mpirun"], {"HVDKIT_LINK_RATE": "1gbit"}),
                 _pinned_plan([*hosts, "--launcher", "mpirun"]),
                 _pinned_plan(["-np", "2", "--launcher", "mpirun"], {"HVDKIT_LINK_RATE": "10gbit"}),
                 _pinned_plan([*hosts, "--launcher", "mpirun"], {"HVDKIT_LINK_RATE": "40gbit",
                                                                 "HOROVOD_CPU_OPERATIONS": "gloo"}),
                 _pinned_plan([*hosts, "-x", "HOROVOD_CPU_OPERATIONS=gloo", "--launcher", "mpirun"],
                              {"HVDKIT_LINK_RATE": "40gbit"})):
        assert "HOROVOD_CPU_OPERATIONS=mpi" not in left.command
    chosen = _pinned_plan([*hosts, "-x", "HOROVOD_CPU_OPERATIONS=gloo", "--launcher", "horovodrun"],
                          {"HVDKIT_LINK_RATE": "25gbit"})
    assert chosen.env["HOROVOD_CPU_OPERATIONS"] == "gloo", "the user's -x wins (hvdkit bench's --knob passes it so)"
    assert "HOROVOD_CPU_OPERATIONS" not in _pinned_plan([*hosts, "--launcher", "horovodrun", "--gloo"],
                                                        {"HVDKIT_LINK_RATE": "25gbit"}).env
    with pytest.raises(LaunchError, match=r"^HVDKIT_LINK_RATE: rate 'fast': expected a number and gbit"):
        _pinned_plan([*hosts, "--launcher", "mpirun"], {"HVDKIT_LINK_RATE": "fast"})


def test_a_host_that_does_not_resolve_is_one_line_before_the_job():
    args = planner.parser().parse_args(["-np", "2", "-H", "h1:1,nosuchhost:1", "--launcher", "mpirun"])

    def lookup(names):
        return network.routable_network(names, _resolve, lambda a: "10.1.0.11", lambda: INTERFACES)
    with pytest.raises(LaunchError, match="^host nosuchhost does not resolve"):
        planner.plan(args, WORKER, {}, lambda name: f"/opt/bin/{name}", lambda _: OPENMPI, False, 2, network=lookup)
    proc = run([sys.executable, "-m", "hvdkit", "launch", "-np", "2", "-H", "localhost:1,nosuchhost.invalid:1",
                "--launcher", "horovodrun", "--", "true"])
    assert proc.returncode == 2
    assert proc.stderr == ("hvdkit launch: host nosuchhost.invalid does not resolve on this host "
                           "(check /etc/hosts or DNS)\n")


def test_host_watch_names_a_host_that_stopped_answering():
    answering = {"10.1.0.12": True, "10.1.0.13": True}
    watch = network.HostWatch({"h2": "10.1.0.12", "h3": "10.1.0.13"}, lost_after=0.3,
                              probe=answering.__getitem__, every=0.05)
    time.sleep(0.5)
    assert watch.lost is None
    answering["10.1.0.13"] = None
    deadline = time.monotonic() + 5
    while watch.lost is None and time.monotonic() < deadline:
        time.sleep(0.05)
    watch.stop()
    assert re.fullmatch(r"host h3 \(10\.1\.0\.13\) has not answered on the network for \d+ s; ending the job",
                        watch.lost or "")


def test_a_probe_tells_a_listener_from_a_refusal():
    """A rank's lifeline needs its launcher's server (accepted); a host watch only the host (refused
    will do). Silence (None) needs a host that drops packets: test_multihost's lost host."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert probes.probe("127.0.0.1", port) is True
    assert probes.probe("127.0.0.1", port) is False and network.probe_host("127.0.0.1", port) is not None


def test_a_host_gone_when_the_launcher_failed_is_named_with_its_ranks_at_once():
    """Open MPI ends a job within a second of losing a host's daemon, before the watch's 15 s:
    one probe then tells which host went, and which ranks with it."""
    answering = {"10.1.0.12": True, "10.1.0.13": None}
    watch = network.HostWatch({"h2": "10.1.0.12", "h3": "10.1.0.13"}, probe=answering.__getitem__,
                              ranks={"h2": [1], "h3": [2, 3]})
    assert watch.confirm() == ("host h3 (10.1.0.13, ranks 2, 3) does not answer on the network; "
                               "the job ended without it")
    everyone = network.HostWatch({"h2": "10.1.0.12"}, probe=answering.__getitem__)
    assert everyone.confirm() is None, "a job that failed with every host answering: the launcher's own code"


def test_a_host_whose_sshd_went_is_gone_for_the_job_and_one_that_never_had_one_is_not():
    """Its processes died, sshd with them (as the rehearsal's host-lost leaves a host for a second
    before its link goes): no launcher can start a rank there, so a restart must go without it. A
    host whose port 22 refused from the start is reached otherwise (containers): not lost for that."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        watch = network.HostWatch({"h2": "127.0.0.1"}, probe=lambda address: network.probe_host(address, port))
        wait_for(lambda: watch.with_sshd == {"h2"})
    assert watch.confirm() == "host h2 (127.0.0.1) refuses ssh (port 22) since the job began: no rank starts " \
                              "there; the job ended without it"
    assert watch.lost_host == "h2"
    never = network.HostWatch({"h2": "127.0.0.1"}, probe=lambda address: network.probe_host(address, port))
    assert never.confirm() is None and never.with_sshd == set()


def wait_for(condition, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the watch's first probe did not come"
        time.sleep(0.01)


def test_a_processs_presence_port_is_refused_once_it_is_killed_though_its_forked_child_lives():
    """hvdkit.rank.liveness.watchdog's way to know at once that a rank is gone: a real process holds a
    Presence, forks a child that outlives it (as a DataLoader worker may), then is SIGKILLed."""
    program = ("import os, sys, time\nfrom hvdkit.system import probes\npresence = probes.Presence()\n"
               "if os.fork() == 0:\n    time.sleep(60)\n    os._exit(0)\n"
               "print(presence.port, flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        port = int(proc.stdout.readline())
        answers = probes.probe_all([("127.0.0.1", port)] * 3, timeout=5)
        assert answers == {("127.0.0.1", port): True}, answers
        proc.kill()
        proc.wait()
        assert probes.probe_all([("127.0.0.1", port)], timeout=5) == {("127.0.0.1", port): False}, \
            "the forked child closed its copy"
    finally:
        with contextlib.suppress(ProcessLookupError):  # the child, by its group, as the process is gone
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
