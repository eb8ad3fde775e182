"""`hvdkit launch`: golden commands per launcher and MPI, bad input, and real launches here."""

import os
import re
import shlex
import sys
import time

import pytest

from conftest import REPO, run
from hvdkit.checks import selftest
from hvdkit.launch import cli as launch
from hvdkit.launch import commands, hostfile, network
from hvdkit.launch import rank_output as lines
from hvdkit.launch.commands import LaunchSpec
from hvdkit.launch.hostfile import Host, LaunchError
from hvdkit.launch.network import NetworkError

WORKER = ["python", "train.py"]


# --- golden commands: one per launcher and MPI implementation ------------------------------

def test_openmpi_golden():
    spec = LaunchSpec(np=8, command=WORKER, hosts=[Host("h1", 4), Host("h2", 4)], forward=["NCCL_DEBUG", "PATH"],
                      set_env={"OMP_NUM_THREADS": "4"}, as_root=True)
    assert commands.openmpi_command(spec) == [
        "mpirun", "-np", "8", "-H", "h1:4,h2:4", "-bind-to", "none", "-map-by", "slot", "--tag-output",
        "--allow-run-as-root",
        "-x", "NCCL_DEBUG", "-x", "PATH", "-x", "OMP_NUM_THREADS=4",
        "-mca", "pml", "ob1", "-mca", "btl", "^openib", "python", "train.py"]


def test_openmpi_golden_hostfile_oversubscribed_not_root():
    spec = LaunchSpec(np=4, command=WORKER, hostfile="hosts.txt", hosts=[Host("h1", 2)], oversubscribe=True)
    assert commands.openmpi_command(spec) == [
        "mpirun", "-np", "4", "--hostfile", "hosts.txt", "-bind-to", "none", "-map-by", "slot", "--tag-output",
        "--oversubscribe", "-mca", "pml", "ob1", "-mca", "btl", "^openib", "python", "train.py"]


def test_launcher_flags_pass_through_after_hvdkit_defaults_they_replace():
    own = ["--bind-to", "core", "-mca", "btl", "tcp,self", "--report-bindings"]
    spec = LaunchSpec(np=2, command=WORKER, launcher_args=own)
    assert commands.openmpi_command(spec) == [
        "mpirun", "-np", "2", "-map-by", "slot", "--tag-output", "-mca", "pml", "ob1", *own, *WORKER]
    for builder in (commands.horovodrun_command, commands.hydra_command, commands.intel_command, commands.srun_command):
        assert builder(LaunchSpec(np=2, command=WORKER, launcher_args=["--x-flag", "v"]))[-4:] == [
            "--x-flag", "v", *WORKER]


def test_mpich_golden():
    spec = LaunchSpec(np=8, command=WORKER, hosts=[Host("h1", 4), Host("h2", 4)], forward=["NCCL_DEBUG", "PATH"],
                      set_env={"OMP_NUM_THREADS": "4"}, as_root=True)
    assert commands.hydra_command(spec) == [
        "mpirun", "-np", "8", "-hosts", "h1:4,h2:4", "-genvlist", "NCCL_DEBUG,PATH",
        "-genv", "OMP_NUM_THREADS", "4", "python", "train.py"]


def test_intel_golden():
    spec = LaunchSpec(np=8, command=WORKER, hosts=[Host("h1", 4), Host("h2", 4)], forward=["PATH"],
                      set_env={"I_MPI_DEBUG": "5"})
    assert commands.intel_command(spec) == [
        "mpirun", "-n", "8", "-hosts", "h1,h2", "-ppn", "4", "-genvlist", "PATH",
        "-genv", "I_MPI_DEBUG", "5", "python", "train.py"]
    with pytest.raises(LaunchError, match="different slot counts need --hostfile"):
        commands.intel_command(LaunchSpec(np=3, command=WORKER, hosts=[Host("h1", 2), Host("h2", 1)]))


def test_horovodrun_and_srun_golden():
    spec = LaunchSpec(np=8, command=WORKER, hosts=[Host("h1", 4), Host("h2", 4)], controller="gloo",
                      set_env={"NCCL_DEBUG": "INFO"})
    assert commands.horovodrun_command(spec) == ["horovodrun", "-np", "8", "-H", "h1:4,h2:4", "--gloo", *WORKER]
    assert commands.srun_command(spec) == ["srun", "--ntasks=8", "--mpi=pmix", "--kill-on-bad-exit=1", "--label",
                                         "--export=ALL,NCCL_DEBUG=INFO",
                                         "--nodelist=h1,h2", *WORKER]


OPENMPI = "mpirun (Open MPI) 4.1.4\n\nReport bugs to http://www.open-mpi.org/community/help/\n"
MPICH = "HYDRA build details:\n    Version:                                 4.0.2\n"
INTEL = "Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619\n"


def _plan(argv, environ=None, mpi=OPENMPI, on_path=("mpirun", "horovodrun", "srun"), root=False, cores=2):
    args = launch.parser().parse_args(argv)
    which = lambda name: f"/opt/bin/{name}" if name in on_path else None  # noqa: E731
    return launch.plan(args, WORKER, environ or {}, which, lambda _: mpi, root, cores)


def test_the_hosts_of_a_rehearsal_are_found_as_a_slurm_allocations_are():
    """Inside `hvdkit rehearse`, HVDKIT_HOSTS lists the hosts; -H wins, and so does a Slurm allocation."""
    rehearsal = {"HVDKIT_HOSTS": "node0:1,node1:1"}
    for launcher in ("horovodrun", "mpirun"):
        plan = _plan(["-np", "2", "--launcher", launcher], rehearsal)
        assert "node0:1,node1:1" in plan.command and "hosts from $HVDKIT_HOSTS (hvdkit rehearse)" in plan.reason
        assert plan.watch == ["node0", "node1"], "a lost host ends the job, as with -H"
    assert "h9:2" in _plan(["-np", "2", "--launcher", "mpirun", "-H", "h9:2"], rehearsal).command
    in_job = _plan(["-np", "2", "--launcher", "horovodrun"], {**rehearsal, "SLURM_JOB_ID": "7",
                                                             "SLURM_JOB_NODELIST": "n[1-2]"})
    assert "n1:1,n2:1" in in_job.command


def test_auto_prefers_srun_in_an_allocation_then_mpirun_then_gloo():
    in_slurm = _plan(["-np", "2"], {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]"})
    assert in_slurm.launcher == "srun" and "Slurm allocation 7" in in_slurm.reason
    assert _plan(["-np", "2"]).launcher == "mpirun"
    fallback = _plan(["-np", "2"], on_path=("horovodrun",))
    assert fallback.launcher == "horovodrun" and "no mpirun" in fallback.reason
    assert _plan(["-np", "2", "--gloo"]).command[-3:] == ["--gloo", *WORKER]


@pytest.mark.parametrize("version, builder", [(OPENMPI, "-bind-to"), (MPICH, "-genvlist"), (INTEL, "-ppn")])
def test_mpirun_flags_follow_the_implementation(version, builder):
    result = _plan(["-np", "4", "-H", "a:2,b:2", "-x", "FOO=1"], {"NCCL_DEBUG": "INFO"}, mpi=version)
    assert builder in result.command


def test_root_and_oversubscribe_only_when_needed():
    plain = _plan(["-np", "2"]).command
    assert "--allow-run-as-root" not in plain and "--oversubscribe" not in plain
    as_root = _plan(["-np", "4"], root=True)
    assert "--allow-run-as-root" in as_root.command and "--oversubscribe" in as_root.command
    assert as_root.notes == ["added --oversubscribe: -np 4 is more than this machine's 2 cores"]
    assert "--oversubscribe" not in _plan(["-np", "4", "-H", "a:2,b:2"]).command
    assert "--oversubscribe" in _plan(["-np", "6", "-H", "a:2,b:2", "--oversubscribe"]).command


def test_environment_forwarding():
    environ = {"NCCL_SOCKET_IFNAME": "ib0", "HOROVOD_CYCLE_TIME": "1", "PATH": "/bin", "HOME": "/root",
               "LD_LIBRARY_PATH": "/lib"}
    command = _plan(["-np", "2", "-x", "WANDB_MODE", "-x", "SEED=3"], environ).command
    forwarded = [command[i + 1] for i, arg in enumerate(command) if arg == "-x"]
    # HVDKIT_JOB_DIR: set by hvdkit launch for the ranks' documented exit codes and heartbeats.
    assert forwarded == ["HOROVOD_CYCLE_TIME", "LD_LIBRARY_PATH", "NCCL_SOCKET_IFNAME", "PATH", "WANDB_MODE",
                         "HVDKIT_JOB_DIR", "SEED=3"]


def test_horovodrun_uses_the_allocation_hosts_in_slurm():
    environ = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)"}
    result = _plan(["-np", "4", "--launcher", "horovodrun"], environ)
    assert result.command[:5] == ["/opt/bin/horovodrun", "-np", "4", "-H", "n1:2,n2:2"]


def test_an_elastic_job_runs_under_horovodrun_with_its_discovery_script_hosts():
    discovery = ["--min-np", "2", "--max-np", "4", "--host-discovery-script", "discover.sh"]
    args = launch.parser().parse_args(["-np", "4"])
    which = lambda name: f"/opt/bin/{name}"  # noqa: E731
    result = launch.plan(args, WORKER, {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]"}, which,
                         lambda _: OPENMPI, False, 2, launcher_args=discovery)
    assert result.launcher == "horovodrun" and "elastic" in result.reason
    assert result.command == ["/opt/bin/horovodrun", "-np", "4", *discovery, *WORKER]  # no -H: discovery's hosts
    assert result.watch == [], "hosts leave and join an elastic job"
    for argv, message in ((["-np", "4", "-H", "a:2,b:2"], "drop -H/--hostfile"),
                          (["-np", "4", "--launcher", "mpirun"], "elastic jobs run under horovodrun, not mpirun")):
        with pytest.raises(LaunchError, match=message):
            launch.plan(launch.parser().parse_args(argv), WORKER, {}, which, lambda _: OPENMPI, False, 2,
                        launcher_args=discovery)


def test_render_is_copy_pasteable():
    result = _plan(["-np", "2", "--launcher", "horovodrun", "--mpi"], root=True)
    text = result.render()
    assert shlex.split(text) == ["env", "OMPI_ALLOW_RUN_AS_ROOT=1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1",
                                 *result.command]


# --- the network between hosts -----------------------------------------------------------------

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
    args = launch.parser().parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    which = lambda name: f"/opt/bin/{name}"  # noqa: E731
    own = argv[argv.index("--") + 1:] if "--" in argv else []
    return launch.plan(args, WORKER, environ or {}, which, lambda _: mpi, False, 2, own,
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


def test_a_host_that_does_not_resolve_is_one_line_before_the_job():
    args = launch.parser().parse_args(["-np", "2", "-H", "h1:1,nosuchhost:1", "--launcher", "mpirun"])

    def lookup(names):
        return network.routable_network(names, _resolve, lambda a: "10.1.0.11", lambda: INTERFACES)
    with pytest.raises(LaunchError, match="^host nosuchhost does not resolve"):
        launch.plan(args, WORKER, {}, lambda name: f"/opt/bin/{name}", lambda _: OPENMPI, False, 2, network=lookup)
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
    answering["10.1.0.13"] = False
    deadline = time.monotonic() + 5
    while watch.lost is None and time.monotonic() < deadline:
        time.sleep(0.05)
    watch.stop()
    assert re.fullmatch(r"host h3 \(10\.1\.0\.13\) has not answered on the network for \d+ s; ending the job",
                        watch.lost or "")


# --- hostfiles --------------------------------------------------------------------------------

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


def test_host_lists():
    assert hostfile.parse_hosts("a:2,b:1") == [Host("a", 2), Host("b", 1)]
    with pytest.raises(LaunchError, match="host 'b' has no slot count"):
        hostfile.parse_hosts("a:2,b")


# --- the command line: bad input stops before anything starts ---------------------------------

HVDKIT = [sys.executable, "-m", "hvdkit", "launch"]


@pytest.mark.parametrize("argv, line, env", [
    (["-np", "3", "-H", "localhost:2"], "hvdkit launch: -np 3 is more than the 2 slots in localhost:2", None),
    (["-np", "2", "--hostfile", "EMPTY"], "hvdkit launch: hostfile EMPTY lists no hosts", None),
    (["-np", "2", "--hostfile", "BAD"], "hvdkit launch: hostfile BAD line 1: cannot read", None),
    (["-np", "2", "-H", "localhost"], "hvdkit launch: -H: host 'localhost' has no slot count", None),
    (["-np", "2", "--launcher", "mpiexec"], "hvdkit launch: argument --launcher: invalid choice: 'mpiexec'", None),
    (["-np", "2", "--launcher", "mpirun"], "hvdkit launch: mpirun not found on PATH", {"PATH": "/nonexistent"}),
    (["-np", "2", "--launcher", "srun"], "hvdkit launch: srun not found on PATH",
     {"PATH": "/nonexistent", "SLURM_JOB_ID": "1"}),
    (["-np", "2", "--launcher", "srun"], "hvdkit launch: srun: not inside a Slurm allocation", None),
    (["-np", "2", "NOSEP"], "hvdkit launch: put '--' before the command", None),
    (["-np", "2", "--", "/no/such/cmd"], "hvdkit launch: /no/such/cmd: no such command on this host", None),
    (["-np", "2", "--", "nosuchcmd"], "hvdkit launch: nosuchcmd: no such command on this host", None),
    (["-np", "2", "--launcher", "mpirun"], "hvdkit launch: HVDKIT_STOP_GRACE='soon': expected the seconds",
     {"HVDKIT_STOP_GRACE": "soon"}),
])
def test_bad_input_is_one_line_and_nothing_starts(tmp_path, argv, line, env):
    (tmp_path / "EMPTY").write_text("")
    (tmp_path / "BAD").write_text("localhost two\n")
    marker = tmp_path / "started"
    argv = [a.replace("NOSEP", "touch") for a in argv]
    command = [] if "touch" in argv or "--" in argv else ["--", "touch", str(marker)]
    full_env = None
    if env is not None:
        full_env = {k: v for k, v in os.environ.items() if k != "SLURM_JOB_ID"}
        full_env.update(env)
    proc = run([*HVDKIT, *argv, *command], env=full_env, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(line), proc.stderr
    assert not marker.exists()


# --- real launches on this machine ------------------------------------------------------------

REAL = {
    "horovodrun --gloo": (["--launcher", "horovodrun", "--gloo"], "gloo", "horovodrun"),
    "horovodrun --mpi": (["--launcher", "horovodrun", "--mpi"], "mpi", "mpirun (Open MPI)"),
    "mpirun (auto)": ([], "mpi", "mpirun (Open MPI)"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(REAL))
def test_real_launch_reports_consistent_ranks(name):
    flags, controller, launcher = REAL[name]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = run([*HVDKIT, "-np", "2", *flags, "--verbose", "--", *selftest.worker_command()], env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.startswith("# launcher: ")
    results = selftest.parse_results(proc.stdout)
    assert [(r["rank"], r["launcher_rank"], r["size"], r["launcher_size"]) for r in results] == [(0, 0, 2, 2),
                                                                                               (1, 1, 2, 2)]
    assert {r["launcher"] for r in results} == {launcher}
    assert {r["controller"] for r in results} == {controller}
    assert selftest.check(results) == []


@pytest.mark.slow
def test_dry_run_line_runs_as_printed(tmp_path):
    proc = run([*HVDKIT, "-np", "2", "--dry-run", "--", sys.executable, "-c",
                "import os; print('rank ' + os.environ['OMPI_COMM_WORLD_RANK'], flush=True)"])
    assert proc.returncode == 0, proc.stderr
    printed = proc.stdout.strip().splitlines()[-1]
    again = run(["bash", "-c", printed], cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert sorted(again.stdout.split("\n")[:2]) == ["rank 0", "rank 1"]


# Each rank writes half a line, waits, then the rest: the launcher sees the other rank's half in between.
HALVES = ("import os, sys, time\n"
          "r = next(os.environ[v] for v in ('OMPI_COMM_WORLD_RANK', 'HOROVOD_RANK') if v in os.environ)\n"
          "for i in range(4):\n"
          "    print(f'rank {r} first half,', end='', flush=True); time.sleep(0.15 + 0.1 * int(r))\n"
          "    print(f' second half {i}', flush=True); print(f'rank {r} to stderr {i}', file=sys.stderr)\n")
LINE = re.compile(r"\[(?:1,)?(\d)\]<(stdout|stderr)>:rank (\d) (?:first half, second half|to stderr) \d")


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--launcher", "mpirun"], ["--launcher", "horovodrun", "--mpi"],
                                   ["--launcher", "horovodrun", "--gloo"]], ids=" ".join)
def test_ranks_lines_are_never_glued_together(flags):
    proc = run([*HVDKIT, "-np", "2", *flags, "--", sys.executable, "-c", HALVES],
               env=dict(os.environ, PYTHONUNBUFFERED="1"), timeout=120, raw=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for stream, text in (("stdout", proc.stdout), ("stderr", proc.stderr)):
        lines = [line for line in text.splitlines() if "rank" in line]
        assert len(lines) == 8, text
        for line in lines:
            match = LINE.fullmatch(line)
            assert match and match.group(1) == match.group(3) and match.group(2) == stream, line


@pytest.mark.parametrize("cut", range(1, 60))
def test_joiner_rebuilds_each_ranks_lines_wherever_reads_split_them(cut):
    """Open MPI's --tag-output stream of two ranks writing half lines (as measured), read in two
    pieces split at every position, including inside a tag."""
    stream = (b"[1,1]<stdout>:r1-a-[1,0]<stdout>:r0-a-[1,0]<stdout>:b0\n[1,1]<stdout>:b1\n"
              b"mpirun: a line of its own\n[1,0]<stdout>:last")
    out = []
    joiner = lines.Joiner(out.append)
    joiner.feed(stream[:cut])
    joiner.feed(stream[cut:])
    joiner.close()
    assert all(line.endswith(b"\n") for line in out)
    assert sorted(line.rstrip(b"\n") for line in out) == sorted([
        b"[1,0]<stdout>:r0-a-b0", b"[1,1]<stdout>:r1-a-b1", b"mpirun: a line of its own", b"[1,0]<stdout>:last"])


@pytest.mark.slow
def test_launcher_flags_reach_the_launcher():
    proc = run([*HVDKIT, "-np", "2", "--launcher", "mpirun", "--display-map", "-mca", "btl", "tcp,self", "--",
                *selftest.worker_command()], timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "JOB MAP" in proc.stdout + proc.stderr  # what --display-map prints
    assert selftest.check(selftest.parse_results(proc.stdout)) == []


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


@pytest.mark.parametrize("script", ["horovodrun.sh", "mpirun.sh", "srun.sh"])
def test_launcher_scripts_print_usage_and_dry_run(script):
    path = REPO / "launchers" / script
    usage = run([str(path)])
    assert usage.returncode == 2 and usage.stderr.startswith(f"usage: launchers/{script} ")
    if script == "srun.sh":
        return  # srun needs an allocation: the Slurm tests run it for real
    proc = run([str(path), "-np", "2", "--dry-run", "--", "python", "train.py"])
    assert proc.returncode == 0, proc.stderr
    assert shlex.split(proc.stdout.strip().splitlines()[-1])[-2:] == ["python", "train.py"]
    assert script.split(".")[0] in proc.stdout.splitlines()[0]
