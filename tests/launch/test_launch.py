"""`hvdkit launch`: the plan (which launcher, hosts and flags), bad input, and real launches here.
The commands each launcher gets are golden-tested in tests/launch/test_commands.py; hostfiles, the network
and the joining of rank output each in a file of their own; supervise in tests/launch/test_supervise.py."""

import functools
import os
import re
import shlex
import sys

import pytest

from conftest import INTEL, MPICH, OPENMPI, REPO, run
from hvdkit.checks import selftest
from hvdkit.launch import guard, planner
from hvdkit.launch.hostfile import LaunchError

WORKER = ["python", "train.py"]


def _plan(argv, environ=None, mpi=OPENMPI, on_path=("mpirun", "horovodrun", "srun"), root=False, cores=2):
    args = planner.parser().parse_args(argv)
    which = lambda name: f"/opt/bin/{name}" if name in on_path else None  # noqa: E731
    return planner.plan(args, WORKER, environ or {}, which, lambda _: mpi, root, cores)


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


@pytest.mark.parametrize("launcher", ["horovodrun", "mpirun"])
def test_hosts_beyond_the_ranks_need_are_spares_neither_started_nor_watched(launcher):
    """A restart (--max-restarts) runs on them in place of a lost host (tests/rehearse/test_chaos.py)."""
    result = _plan(["-np", "3", "--launcher", launcher, "-H", "a:2,b:1,c:1,d:2"])
    assert "a:2,b:1" in result.command and not any("c:1" in arg for arg in result.command)
    assert result.watch == ["a", "b"] and [h.name for h in result.spares] == ["c", "d"]
    assert result.notes[-1] == ("spare hosts: c:1,d:2 (beyond -np's need; with --max-restarts, a restart runs on "
                                "them in place of a lost host)")
    assert _plan(["-np", "6", "--launcher", launcher, "-H", "a:2,b:1,c:1,d:2"]).spares == []


def test_auto_prefers_srun_in_an_allocation_then_mpirun_then_gloo():
    in_slurm = _plan(["-np", "2"], {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]"})
    assert in_slurm.launcher == "srun" and "Slurm allocation 7" in in_slurm.reason
    assert _plan(["-np", "2"]).launcher == "mpirun"
    fallback = _plan(["-np", "2"], on_path=("horovodrun",))
    assert fallback.launcher == "horovodrun" and "no mpirun" in fallback.reason
    assert _plan(["-np", "2", "--gloo"]).command[-7:] == ["--gloo", *guard.command(sys.executable, WORKER)]


def test_each_rank_runs_under_its_guard_where_hvdkit_launch_watches_it():
    """The guard (hvdkit.launch.guard) says how a killed rank ended; not for an elastic job, whose
    workers Horovod's driver starts again itself, nor for a command run without hvdkit launch."""
    for launcher in ("mpirun", "horovodrun", "srun"):
        environ = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]"} if launcher == "srun" else {}
        command = _plan(["-np", "2", "--launcher", launcher], environ).command
        assert command[-6:] == [sys.executable, "-m", "hvdkit.launch.guard", "--", *WORKER], (launcher, command)
    args = planner.parser().parse_args(["-np", "2", "--launcher", "mpirun"])
    plain = planner.plan(args, WORKER, {}, lambda name: f"/opt/bin/{name}", lambda _: OPENMPI, False, 2,
                         supervised=False).command
    assert "hvdkit.launch.guard" not in plain and plain[-2:] == WORKER
    assert guard.is_guard(_plan(["-np", "2", "--launcher", "horovodrun"]).command[-6:])
    args = planner.parser().parse_args(["-np", "2", "--launcher", "horovodrun"])
    elastic = planner.plan(args, WORKER, {}, lambda name: f"/opt/bin/{name}", lambda _: OPENMPI, False, 2,
                           ["--host-discovery-script", "discover.sh"]).command
    assert "hvdkit.launch.guard" not in elastic and elastic[-2:] == WORKER


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
               "LD_LIBRARY_PATH": "/lib", "OMP_NUM_THREADS": "1"}
    command = _plan(["-np", "2", "-x", "WANDB_MODE", "-x", "SEED=3"], environ).command
    forwarded = [command[i + 1] for i, arg in enumerate(command) if arg == "-x"]
    # HVDKIT_JOB_DIR: set by hvdkit launch for the ranks' documented exit codes and heartbeats;
    # HVDKIT_RESTART, HVDKIT_SNAPSHOT_DIR, HVDKIT_LAUNCHER_LINK, HVDKIT_STANDBY: the attempt's number,
    # the snapshots' place, hvdkit launch's line to the ranks and whether they wait on it (a standby
    # attempt's) under --max-restarts.
    # OMP_NUM_THREADS: a rank on another host computes with the threads asked for here (found by
    # tests/rehearse/test_chaos.py: its remote rank used two and ended 2e-6 from the run it replays).
    assert forwarded == ["HOROVOD_CYCLE_TIME", "LD_LIBRARY_PATH", "NCCL_SOCKET_IFNAME", "OMP_NUM_THREADS", "PATH",
                         "WANDB_MODE", "HVDKIT_JOB_DIR", "HVDKIT_RESTART", "HVDKIT_SNAPSHOT_DIR",
                         "HVDKIT_LAUNCHER_LINK", "HVDKIT_STANDBY", "SEED=3"]


def test_horovodrun_uses_the_allocation_hosts_in_slurm():
    environ = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)"}
    result = _plan(["-np", "4", "--launcher", "horovodrun"], environ)
    assert result.command[:5] == ["/opt/bin/horovodrun", "-np", "4", "-H", "n1:2,n2:2"]


def test_an_elastic_job_runs_under_horovodrun_with_its_discovery_script_hosts():
    discovery = ["--min-np", "2", "--max-np", "4", "--host-discovery-script", "discover.sh"]
    args = planner.parser().parse_args(["-np", "4"])
    which = lambda name: f"/opt/bin/{name}"  # noqa: E731
    result = planner.plan(args, WORKER, {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]"}, which,
                         lambda _: OPENMPI, False, 2, launcher_args=discovery)
    assert result.launcher == "horovodrun" and "elastic" in result.reason
    assert result.command == ["/opt/bin/horovodrun", "-np", "4", *discovery, *WORKER]  # no -H: discovery's hosts
    assert result.watch == [], "hosts leave and join an elastic job"
    for argv, message in ((["-np", "4", "-H", "a:2,b:2"], "drop -H/--hostfile"),
                          (["-np", "4", "--launcher", "mpirun"], "elastic jobs run under horovodrun, not mpirun")):
        with pytest.raises(LaunchError, match=message):
            planner.plan(planner.parser().parse_args(argv), WORKER, {}, which, lambda _: OPENMPI, False, 2,
                        launcher_args=discovery)


def test_render_is_copy_pasteable():
    result = _plan(["-np", "2", "--launcher", "horovodrun", "--mpi"], root=True)
    text = result.render()
    assert shlex.split(text) == ["env", "OMPI_ALLOW_RUN_AS_ROOT=1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1",
                                 *result.command]


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


@pytest.mark.slow
def test_launcher_flags_reach_the_launcher():
    proc = run([*HVDKIT, "-np", "2", "--launcher", "mpirun", "--display-map", "-mca", "btl", "tcp,self", "--",
                *selftest.worker_command()], timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "JOB MAP" in proc.stdout + proc.stderr  # what --display-map prints
    assert selftest.check(selftest.parse_results(proc.stdout)) == []


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


@pytest.mark.parametrize("hosts, command, environ, refused", [
    ("a:3,b:3", ["hvdkit", "train", "--tp", "2"], {}, "tp 2: the tensor-parallel group of ranks 2-3 would span hosts "
                                                      "a and b (ranks per host: a 3, b 3)"),
    ("a:3,b:3", [sys.executable, "-m", "hvdkit", "train", "--tp=2"], {}, "ranks 2-3 would span"),
    ("a:3,b:3", ["python", "train.py"], {"HVDKIT_TP": "2"}, "ranks 2-3 would span"),  # a Session's own variable
    ("a:2,b:4", ["hvdkit", "train", "--tp", "2"], {}, None),
    ("a:3,b:3", ["hvdkit", "train", "--model", "mlp"], {}, None),
    ("a:3,b:3", ["python", "train.py", "--tp", "2"], {}, None),  # a script's own flag: its ranks check it
])
def test_a_tensor_parallel_group_across_hosts_is_refused_in_one_line(hosts, command, environ, refused):
    """hvdkit launch places consecutive ranks on each host's slots: a tp group that would span two hosts
    (its every layer's allreduces on the network) is one line before anything starts."""
    args = planner.parser().parse_args(["-np", "6", "-H", hosts, "--launcher", "mpirun"])
    plan = functools.partial(planner.plan, args, command, environ, lambda name: f"/opt/bin/{name}",
                             lambda _: OPENMPI, False, 2)
    if refused is None:
        assert plan().command[-len(command):] == command
    else:
        with pytest.raises(LaunchError, match=re.escape(refused)):
            plan()
