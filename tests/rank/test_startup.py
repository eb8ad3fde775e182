"""A rank's start-up (hvdkit.rank.start.startup): the settings exported before hvd.init(), and a crash's stacks."""

import ipaddress
import re
import signal
import socket
import sys

import psutil
import pytest

from conftest import run
from hvdkit.parallel.mesh import Mesh
from hvdkit.rank.start.startup import (
    ALLREDUCE_RULES,
    data_path_hint,
    gloo_data_settings,
    groups_across_hosts,
    interface_on,
    performance_settings,
)


def test_cpu_jobs_across_hosts_send_large_allreduces_by_the_ring():
    """The settings a Session exports before hvd.init(); the rules file is read by Open MPI in
    every rank (the multi-host benchmark test runs with it)."""
    one_host = performance_settings(on_gpu=False, spans_hosts=False, environ={})
    assert one_host == {"OMPI_MCA_mpi_yield_when_idle": "1", "HOROVOD_CYCLE_TIME": "0.1"}
    hosts = performance_settings(on_gpu=False, spans_hosts=True, environ={})
    assert hosts["OMPI_MCA_coll_tuned_use_dynamic_rules"] == "1" and hosts["OMPI_MCA_btl_tcp_links"] == "2"
    assert hosts["HOROVOD_CYCLE_TIME"] == "5", "across hosts the background thread negotiates every 5 ms"
    rules = open(hosts["OMPI_MCA_coll_tuned_dynamic_rules_filename"]).read()
    assert rules == ALLREDUCE_RULES
    # allreduce (2), every communicator, below 1 MiB Open MPI's own choice (0), from 1 MiB the ring (4)
    assert rules.split("\n")[:7] == ["1", "2", "1", "1", "2", "0 0 0 0", "1048576 4 0 0"]
    # your own coll_tuned choice wins; GPUs keep Horovod's defaults
    mine = performance_settings(on_gpu=False, spans_hosts=True,
                                environ={"OMPI_MCA_coll_tuned_allreduce_algorithm": "3"})
    assert not any(name.startswith("OMPI_MCA_coll_tuned_") for name in mine) and "OMPI_MCA_btl_tcp_links" in mine
    assert performance_settings(on_gpu=True, spans_hosts=True, environ={}) == {"HOROVOD_ENABLE_ASYNC_COMPLETION": "1"}


def _an_interface():
    """(name, address) of this host's first non-loopback IPv4 interface."""
    for name, addresses in psutil.net_if_addrs().items():
        for address in addresses:
            if address.family == socket.AF_INET and not ipaddress.ip_address(address.address).is_loopback:
                return name, address.address
    raise AssertionError("this host has no non-loopback IPv4 interface, which every test host has")


def test_across_hosts_gloo_moves_the_tensors_on_the_interface_mpi_was_pinned_to():
    """hvdkit launch pins Open MPI to the hosts' network (btl_tcp_if_include, a CIDR); the ranks
    give Gloo the interface holding it, so its sockets reach the same hosts."""
    name, address = _an_interface()
    pinned = {"OMPI_MCA_btl_tcp_if_include": f"{address}/32"}
    assert gloo_data_settings(pinned) == {"HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_IFACE": name}
    assert gloo_data_settings({"OMPI_MCA_btl_tcp_if_include": name})["HOROVOD_GLOO_IFACE"] == name
    assert performance_settings(on_gpu=False, spans_hosts=True, environ=pinned, gloo_built=True)[
        "HOROVOD_CPU_OPERATIONS"] == "gloo"
    # one host: Open MPI's shared memory; a Horovod without Gloo, or GPUs: nothing changes
    assert "HOROVOD_CPU_OPERATIONS" not in performance_settings(on_gpu=False, spans_hosts=False, environ=pinned,
                                                                gloo_built=True)
    assert "HOROVOD_CPU_OPERATIONS" not in performance_settings(on_gpu=False, spans_hosts=True, environ=pinned)
    assert "HOROVOD_CPU_OPERATIONS" not in performance_settings(on_gpu=True, spans_hosts=True, environ=pinned,
                                                                gloo_built=True)


def test_the_users_choice_stands_and_no_interface_found_keeps_mpi():
    assert gloo_data_settings({"HOROVOD_CPU_OPERATIONS": "mpi"}) == {}
    assert gloo_data_settings({"HOROVOD_GLOO_IFACE": "ib0"}) == {"HOROVOD_CPU_OPERATIONS": "gloo"}
    assert interface_on("^lo,docker0") is None, "an exclusion names no interface to use"
    assert interface_on("127.0.0.0/8") is None, "loopback reaches no other host"
    elsewhere = next(net for net in ("203.0.113.0/24", "198.51.100.0/24", "192.0.2.0/24")
                     if not any(ipaddress.ip_address(a.address.split("%")[0]) in ipaddress.ip_network(net)
                                for addresses in psutil.net_if_addrs().values() for a in addresses
                                if a.family == socket.AF_INET))
    assert interface_on(elsewhere) is None, f"{elsewhere}: a network this host is not on"


def test_where_mpi_moves_the_tensors_because_nothing_chose_rank_0_says_what_to_pass():
    hint = data_path_hint(True, {})
    assert "HOROVOD_CPU_OPERATIONS=gloo" in hint and "\n" not in hint
    assert data_path_hint(True, {"HOROVOD_CPU_OPERATIONS": "mpi"}) is None, "chosen: by you or hvdkit launch"
    assert data_path_hint(False, {}) is None, "one host, GPUs, elastic or no Gloo: nothing to say"


def test_stall_settings():
    from hvdkit.rank.start.startup import stall_settings

    assert stall_settings(300) == {"HOROVOD_STALL_CHECK_TIME_SECONDS": "60",
                                   "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "305", "HOROVOD_GLOO_TIMEOUT_SECONDS": "305"}
    assert stall_settings(6) == {"HOROVOD_STALL_CHECK_TIME_SECONDS": "2", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "11",
                                 "HOROVOD_GLOO_TIMEOUT_SECONDS": "11"}
    assert stall_settings(0) == {"HOROVOD_STALL_CHECK_DISABLE": "1"}


@pytest.mark.slow
def test_a_rank_that_crashes_in_c_code_prints_its_python_stacks(tmp_path):
    """A segmentation fault in a rank (here a read of address 0 from the user's script) ends it with
    Python's stacks on its stderr, naming the user's function, not with only the launcher's
    "Segmentation fault"."""
    script = tmp_path / "crashing_loop.py"
    script.write_text("import ctypes\nimport hvdkit\n\n\ndef users_step():\n    ctypes.string_at(0)\n\n\n"
                      "session = hvdkit.Session(log_dir=%r, stall_timeout=0)\nusers_step()\n" % str(tmp_path / "run"))
    proc = run([sys.executable, str(script)], timeout=120)
    assert proc.returncode == -signal.SIGSEGV, proc.stderr[-3000:]
    assert "Fatal Python error: Segmentation fault" in proc.stderr, proc.stderr[-3000:]
    assert re.search(r'File ".*crashing_loop.py", line 6 in users_step', proc.stderr), proc.stderr[-3000:]


def test_a_tensor_parallel_group_across_hosts_is_said_by_rank_0():
    """Under srun or a plain mpirun (hvdkit launch refuses it before starting), the ranks find that a
    tensor-parallel group spans hosts from their host names, gathered once at the start."""
    mesh = Mesh(6, tp=2)
    assert groups_across_hosts(mesh, ["a", "a", "b", "b", "c", "c"]) is None
    assert groups_across_hosts(mesh, ["a", "a", "a", "b", "b", "b"]) == (
        "tp 2: the tensor-parallel group of ranks 2-3 spans hosts a and b: every layer's allreduces cross the "
        "network; run a multiple of 2 ranks on each host")
