"""`hvdkit doctor --hosts` on three namespace hosts (hvdkit.rehearse.namespaces), run from h1 as a
user logged in there would. Each check's mismatch is planted on h2 alone, the way a real host
differs: a file only that host sees (another torch's metadata, another mpirun), its sshd stopped,
its link renamed, its sessions' clock moved (libfaketime), a directory of its own. Each is
undone after its test, so the hosts are made once.
"""

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import require_namespaces
from hvdkit import job
from hvdkit.checks import selftest
from hvdkit.launch.mpi import find_program
from hvdkit.rehearse import namespaces as namespace_hosts

pytestmark = pytest.mark.slow
FAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"


@pytest.fixture(scope="module")
def hosts():
    require_namespaces()
    with namespace_hosts.Hosts(3) as made:
        yield made


def doctor(hosts, *args, env=None):
    return subprocess.run(hosts.on("h1", [sys.executable, "-m", "hvdkit", "doctor", *args]),
                          env=hosts.env(env), capture_output=True, text=True, timeout=120)


def findings(done):
    return [line for line in done.stderr.splitlines() if line.startswith("doctor: ")]


@pytest.mark.parametrize("listed", ["h1:1,h2:1", "h1:1,h2:1,h3:1", "h1,h2"])  # bare names, as mpirun's -H
def test_hosts_that_agree_pass(hosts, tmp_path, listed):
    done = doctor(hosts, "-H", listed, "--dir", str(tmp_path))
    assert done.returncode == job.OK and findings(done) == [], done.stdout + done.stderr
    rows = done.stdout.splitlines()
    assert rows[0].split()[:3] == ["HOST", "REACH", "PYTHON"], done.stdout
    for name in listed.replace(":1", "").split(","):
        [row] = [r for r in rows if r.split()[:2] == [name, "ok"]]
        assert " ok " in row and "eth0 10.231.0.0/24" in row and " shared " in row, done.stdout
        assert (" 1/" if ":1" in listed else " -/") in row, row  # SLOTS/CORES: 1 slot named, or none
    count = listed.count(",") + 1
    assert f"doctor: {count} hosts checked in " in rows[-1] and rows[-1].endswith(": all hosts agree"), rows[-1]
    print(rows[-1])  # the time it took, for the notes


def _metadata_of(dist):
    files = importlib.metadata.distribution(dist).files
    return str(next(f for f in files if f.name == "METADATA" and f.parent.name.endswith(".dist-info")).locate())


def plant_torch_version(hosts, tmp_path):
    real = _metadata_of("torch")
    fake = tmp_path / "METADATA"
    fake.write_text(Path(real).read_text().replace(f"Version: {importlib.metadata.version('torch')}",
                                                   "Version: 2.13.0", 1))
    hosts.bind("h2", str(fake), real)
    return lambda: hosts.unbind("h2", real)


def plant_mpi_version(hosts, tmp_path):
    real = os.path.realpath(find_program("mpirun"))
    fake = tmp_path / "mpirun"
    fake.write_text("#!/bin/sh\necho 'mpirun (Open MPI) 4.0.7'\n")
    fake.chmod(0o755)
    hosts.bind("h2", str(fake), real)
    return lambda: hosts.unbind("h2", real)


def plant_no_ssh(hosts, tmp_path):
    hosts.stop_sshd("h2")
    return lambda: hosts.restart_sshd("h2")


def plant_renamed_interface_and_stock_horovod(hosts, tmp_path):
    """h2 names the network ens5 and has Horovod's own basics.py (PyPI's 0.28.1), whose ranks take
    the launching host's name: hvdkit's Horovod takes care of the first, not with the second."""
    from hvdkit.build import builder

    with tarfile.open(builder.cache_dir() / "sdist" / "horovod-0.28.1.tar.gz") as sdist:
        stock = sdist.extractfile("horovod-0.28.1/horovod/common/basics.py").read()
    (tmp_path / "basics.py").write_bytes(stock)
    installed = str(Path(importlib.util.find_spec("horovod").submodule_search_locations[0]) / "common" / "basics.py")
    hosts.rename("h2", "ens5")
    hosts.bind("h2", str(tmp_path / "basics.py"), installed)

    def undo():
        hosts.unbind("h2", installed)
        hosts.rename("h2", "eth0")
    return undo


def plant_unshared_directory(hosts, tmp_path):
    own = tmp_path / "h2-own"
    own.mkdir()
    hosts.bind("h2", str(own), str(tmp_path / "runs"))  # h2 sees a directory of its own there
    return lambda: hosts.unbind("h2", str(tmp_path / "runs"))


def plant_clock_offset(hosts, tmp_path):
    if not Path(FAKETIME).exists():
        pytest.fail(f"{FAKETIME} is missing: `make test-setup` installs libfaketime")
    hosts.restart_sshd("h2", env={"LD_PRELOAD": FAKETIME, "FAKETIME": "+30s"})
    return lambda: hosts.restart_sshd("h2")


def plant_nothing(hosts, tmp_path):
    return lambda: None


PLANTS = {  # what is planted on h2, and the line the doctor must print about it
    "ssh refused": (plant_no_ssh, "h2:1", "doctor: h2: not reachable without a prompt (ssh: connect to host h2 "
                                          "port 22: Connection refused)"),
    "another torch": (plant_torch_version, "h2:1", "doctor: h2: torch 2.13.0, this host "
                                                   f"{importlib.metadata.version('torch')}; every rank must run"),
    "another MPI": (plant_mpi_version, "h2:1", "doctor: h2: MPI Open MPI 4.0.7, this host Open MPI "),
    "interface renamed, stock Horovod": (plant_renamed_interface_and_stock_horovod, "h2:1",
                                         "doctor: h2: the job's network 10.231.0.0/24 is ens5 there, eth0 here, and "
                                         "its Horovod gives every rank one name; build Horovod with hvdkit"),
    "directory not shared": (plant_unshared_directory, "h2:1", "doctor: h2: {runs} is not shared: a file written "
                                                               "there on this host is not there; "),
    "clock ahead": (plant_clock_offset, "h2:1", "doctor: h2: its clock is 30."),
    "more slots than cores": (plant_nothing, f"h2:{len(os.sched_getaffinity(0)) + 2}",
                              f"doctor: h2: {len(os.sched_getaffinity(0)) + 2} slots but "
                              f"{len(os.sched_getaffinity(0))} cores; "),
}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_a_mismatch_on_one_host_is_one_line_naming_it_and_exit_1(hosts, tmp_path, plant):
    make, h2, expected = PLANTS[plant]
    (tmp_path / "runs").mkdir()
    undo = make(hosts, tmp_path)
    try:
        done = doctor(hosts, "-H", f"h1:1,{h2},h3:1", "--dir", str(tmp_path / "runs"))
    finally:
        undo()
    said = findings(done)
    assert done.returncode == job.FAILED, done.stdout + done.stderr
    assert len(said) == 1 and said[0].startswith(expected.format(runs=tmp_path / "runs")), done.stdout + done.stderr
    assert "problem" in done.stdout.splitlines()[-1], done.stdout


def test_a_host_naming_the_network_otherwise_is_a_note_with_hvdkits_horovod(hosts, tmp_path):
    """Its ranks take their own name (hvdkit/build/patches/0006; test_multihost trains so)."""
    hosts.rename("h2", "ens5")
    try:
        done = doctor(hosts, "-H", "h1:1,h2:1,h3:1", "--dir", str(tmp_path))
    finally:
        hosts.rename("h2", "eth0")
    assert done.returncode == job.OK and findings(done) == [], done.stdout + done.stderr
    assert "doctor: note: h2 names the job's network 10.231.0.0/24 ens5 (eth0 here): its ranks take their own " \
           "name (hvdkit's Horovod)" in done.stdout, done.stdout
    assert " ens5 10.231.0.0/24 " in [r for r in done.stdout.splitlines() if r.startswith("h2 ")][0], done.stdout


def test_gpus_on_a_host_are_compared_with_a_stand_in_nvidia_smi(hosts, tmp_path):
    """No GPU here: nvidia-smi is a script (the only stand-in in this file) that lists one GPU with
    another driver on h2 than on this host, as after a partial driver upgrade."""
    def smi(folder, driver):
        folder.mkdir()
        (folder / "nvidia-smi").write_text(f"#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, {driver}'\n")
        (folder / "nvidia-smi").chmod(0o755)
        return f"{folder}:{os.environ['PATH']}"

    here = smi(tmp_path / "here", "580.65.06")
    hosts.restart_sshd("h2", env={"PATH": smi(tmp_path / "h2", "575.57.08")})
    try:
        done = doctor(hosts, "-H", "h1:1,h2:2", "--dir", str(tmp_path), env={**os.environ, "PATH": here})
    finally:
        hosts.restart_sshd("h2")
    said = findings(done)
    assert done.returncode == job.FAILED, done.stdout + done.stderr
    assert said[0] == ("doctor: h2: GPU driver 575.57.08, this host 580.65.06; install the same driver on every "
                       "host"), said
    assert said[1] == "doctor: h2: 2 slots but 1 GPUs; one rank per GPU: h2:1", said
    assert "1 NVIDIA H100 80GB HBM3 (575.57.08)" in done.stdout, done.stdout


def test_hvdkit_launch_compares_the_hosts_first_and_starts_nothing_when_they_differ(hosts, tmp_path):
    """The same checks before a multi-host start; --no-preflight starts anyway (h2's torch differs
    only in its metadata here, so the job runs)."""
    started = tmp_path / "started"
    command = [sys.executable, "-c", f"import socket; open('{started}-' + socket.gethostname(), 'w')"]
    undo = plant_torch_version(hosts, tmp_path)
    try:
        refused = subprocess.run(hosts.on("h1", [sys.executable, "-m", "hvdkit", "launch", "-np", "2", "-H",
                                                 "h1:1,h2:1", "--", *command]),
                                 env=hosts.env(), capture_output=True, text=True, timeout=120)
        nothing_started = list(tmp_path.glob("started-*")) == []
        forced = subprocess.run(hosts.on("h1", [sys.executable, "-m", "hvdkit", "launch", "--no-preflight", "-np",
                                                "2", "-H", "h1:1,h2:1", "--", *command]),
                                env=selftest.mpi_root_env(hosts.env()), capture_output=True, text=True, timeout=120)
    finally:
        undo()
    assert refused.returncode == job.BAD_INPUT, refused.stderr
    assert refused.stderr.splitlines() == [
        f"hvdkit launch: h2: torch 2.13.0, this host {importlib.metadata.version('torch')}; every rank must run the "
        "same build: install the same versions on every host (a shared environment, or one image)",
        "hvdkit launch: not started: the hosts differ as above (--no-preflight starts anyway)"], refused.stderr
    assert nothing_started
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("started-*")) == ["started-h1", "started-h2"]


def test_bad_host_lists_and_selftest_with_hosts_are_one_line(hosts):
    for args, said in ((["-H", "h2:0"], "hvdkit doctor: -H: host 'h2' has slot count '0', expected a number >= 1"),
                       (["-H", "h1:1", "--selftest"], "hvdkit doctor: --selftest runs on this machine; run it "
                                                      "without --hosts or --hostfile")):
        done = doctor(hosts, *args)
        assert done.returncode == job.BAD_INPUT and done.stderr.strip() == said, done.stderr
