"""What a launch line becomes: the launcher chosen, and its command from the builders.

`hvdkit launch` (hvdkit.launch.cli) runs the plan; `hvdkit doctor --selftest` and the tests run
the same command (``local_command``) directly. Which launcher and which MPI, the command for it
(hvdkit.launch.commands) over the hosts given (hvdkit.launch.hostfile): all input is checked
before anything starts, so a bad host list fails in one line, not in an MPI stack trace on node 37.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

from hvdkit import job
from hvdkit.args import LINK_RATE, OneLineParser, bits_per_second
from hvdkit.launch import guard
from hvdkit.launch.commands import (
    MPIRUN_BUILDERS,
    LaunchSpec,
    elastic,
    forwarded_names,
    horovodrun_command,
    network_chosen,
    srun_command,
)
from hvdkit.launch.hostfile import (
    HOSTFILE_FORMATS,
    Host,
    LaunchError,
    host_list,
    needed,
    parse_hosts,
    ranks_by_host,
    read_hostfile,
    several,
    slurm_hosts,
    split_groups,
)
from hvdkit.launch.mpi import find_program, mpi_flavor, mpirun_version
from hvdkit.launch.network import Network, NetworkError, routable_network
from hvdkit.system.launchers import BY_NAME, CHOICES, HOROVODRUN, MPIRUN, SRUN

REHEARSAL_HOSTS = "HVDKIT_HOSTS"  # host:slots,... that `hvdkit rehearse` sets; read where -H/--hostfile are not given


# ---------------------------------------------------------------------------
# Which launcher and which MPI.
# ---------------------------------------------------------------------------

def choose_launcher(requested: str, controller: Optional[str], environ: Mapping[str, str],
                    which: Callable[[str], Optional[str]], is_elastic: bool = False) -> tuple[str, str]:
    """(launcher, reason). auto: srun in a Slurm allocation, mpirun if on PATH, else horovodrun --gloo;
    horovodrun for elastic jobs, which only it runs."""
    if requested in BY_NAME:
        if is_elastic and not BY_NAME[requested].elastic:
            raise LaunchError(f"--host-discovery-script: elastic jobs run under horovodrun, not {requested}")
        return requested, "asked for with --launcher"
    if is_elastic:
        return HOROVODRUN.name, "--host-discovery-script: elastic jobs run under horovodrun"
    if controller == "gloo":
        return HOROVODRUN.name, "--gloo: only horovodrun starts Gloo jobs"
    if "SLURM_JOB_ID" in environ and which(SRUN.name):
        return SRUN.name, f"inside Slurm allocation {environ['SLURM_JOB_ID']}"
    if which(MPIRUN.name):
        return MPIRUN.name, f"mpirun found at {which(MPIRUN.name)}"
    return HOROVODRUN.name, "no Slurm allocation and no mpirun on PATH: horovodrun with Gloo"


def check_slots(spec: LaunchSpec, local_slots: int) -> Optional[str]:
    """Refuse np beyond the slots listed; on this machine alone, oversubscribe instead.

    Returns why --oversubscribe was turned on, if it was.
    """
    if spec.oversubscribe:
        return None
    if spec.hosts is not None:
        total = sum(h.slots for h in spec.hosts)
        if spec.np > total:
            where = spec.hostfile or host_list(spec.hosts)
            raise LaunchError(f"-np {spec.np} is more than the {total} slots in {where}; "
                              f"add slots or pass --oversubscribe")
        return None
    if spec.np > local_slots:
        spec.oversubscribe = True
        return f"-np {spec.np} is more than this machine's {local_slots} cores"
    return None


# ---------------------------------------------------------------------------
# The command line.
# ---------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = OneLineParser(bare=True, prog="hvdkit launch",
                      usage="hvdkit launch -np N [options] [LAUNCHER FLAGS] -- COMMAND ...",
                      description="Start COMMAND on N ranks with horovodrun, mpirun or srun.",
                      epilog="Any other flag before '--' is passed to the launcher as given (after hvdkit's own), "
                             "e.g. hvdkit launch -np 4 --launcher mpirun --bind-to core -mca btl tcp,self -- python "
                             "train.py; --dry-run shows where it goes.", allow_abbrev=False)
    p.add_argument("-np", "--num-proc", dest="np", type=int, help="number of ranks")
    hosts = p.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", help="host1:4,host2:4 (default: this machine, the Slurm allocation, or "
                                              "$HVDKIT_HOSTS inside `hvdkit rehearse`)")
    hosts.add_argument("--hostfile", help="hostfile: 'host:N' or 'host slots=N' lines")
    p.add_argument("--launcher", choices=CHOICES, default="auto", help="default: auto")
    ctl = p.add_mutually_exclusive_group()
    ctl.add_argument("--gloo", dest="controller", action="store_const", const="gloo", help="Gloo controller")
    ctl.add_argument("--mpi", dest="controller", action="store_const", const="mpi", help="MPI controller")
    p.add_argument("-x", dest="env", action="append", default=[], metavar="VAR[=VAL]",
                   help="forward VAR, or set it to VAL, in every rank (repeatable)")
    p.add_argument("--oversubscribe", action="store_true", help="allow more ranks than slots")
    p.add_argument("--srun-mpi", default="pmix", help="srun's --mpi plugin (default: pmix)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="start a job that failed (a rank died, a stall, a lost host) again, up to N times; "
                        "it resumes from its newest checkpoint, a lost host's ranks on the hosts listed beyond "
                        "-np's need (default: 0)")
    p.add_argument("--standby", action=argparse.BooleanOptionalAction, default=None,
                   help="with --max-restarts: start each restart's ranks ahead of need, waiting, so that a restart "
                        "does not wait for their start (default: for hvdkit train; a script of your own opts in "
                        "where it uses hvdkit.Session, whose ranks wait before hvd.init)")
    p.add_argument("--no-preflight", action="store_true",
                   help="start on several hosts without comparing them first (what `hvdkit doctor -H` checks)")
    p.add_argument("--dry-run", action="store_true", help="print the launcher, the reason and the command")
    p.add_argument("--verbose", action="store_true", help="print what --dry-run prints, then run")
    p.add_argument("--list-hosts", action="store_true",
                   help="print the hosts (from -H, --hostfile or the Slurm allocation) as a hostfile and exit")
    p.add_argument("--hosts-format", choices=HOSTFILE_FORMATS, default="horovodrun",
                   help="--list-hosts format: horovodrun (host:N, what elastic discovery wants), "
                        "openmpi (host slots=N) or mpich (host:N)")
    return p


@dataclass
class Plan:
    launcher: str
    reason: str
    command: list
    env: dict  # set in the launcher's own environment
    notes: list = field(default_factory=list)
    tagged: bool = False  # output tagged per chunk with the rank ([1,0]<stdout>:), joined into lines
    ranks: dict = field(default_factory=dict)  # {host: the ranks it runs}, to name them when it is lost
    hosts: list = field(default_factory=list)  # the listed hosts (-H, --hostfile, a rehearsal) the ranks run on
    spares: list = field(default_factory=list)  # listed beyond -np's need: a restart's in place of a lost host

    @property
    def watch(self) -> list[str]:
        """The hosts that supervise.run ends the job without (srun's are Slurm's to watch)."""
        return [h.name for h in self.hosts]

    def render(self) -> str:
        """Copy-pasteable: `env NAME=VALUE ... launcher args`."""
        prefix = ["env", *(f"{k}={v}" for k, v in self.env.items())] if self.env else []
        return shlex.join(prefix + self.command)


def plan(args: argparse.Namespace, command: list[str], environ: Mapping[str, str],
         which: Callable[[str], Optional[str]], mpi_version: Callable[[str], str],
         as_root: bool, local_slots: int, launcher_args: Sequence[str] = (), supervised: bool = True,
         network: Callable[[Sequence[str]], Optional[Network]] = lambda names: None) -> Plan:
    """Decide the launcher and build its command; raises LaunchError on bad input. ``supervised``:
    run by `hvdkit launch` (supervise.run), which gives every rank its job directory.
    ``network`` finds the interface to the hosts (routable_network; none in golden tests)."""
    if not command:
        raise LaunchError("no command after '--'")
    if args.np is None or args.np < 1:
        raise LaunchError("-np N is required, N >= 1")
    given = read_hostfile(args.hostfile) if args.hostfile else parse_hosts(args.hosts) if args.hosts else None
    set_env, extra = _variables(args.env)
    is_elastic = elastic(launcher_args)
    launcher, reason = choose_launcher(args.launcher, args.controller, environ, which, is_elastic)
    chosen = BY_NAME[launcher]
    program = which(launcher)
    if program is None:
        raise LaunchError(f"{launcher} not found on PATH; {chosen.install}")
    if not chosen.gloo and args.controller == "gloo":
        raise LaunchError(f"--gloo needs horovodrun; {launcher} starts MPI jobs")
    if chosen.in_allocation and "SLURM_JOB_ID" not in environ:
        raise LaunchError(f"{launcher}: not inside a Slurm allocation (run under salloc or sbatch, or pick another "
                          f"launcher)")
    hosts, listed, where = _hosts(given, args, launcher, environ, is_elastic)
    reason += where
    spares = []
    if listed and hosts and not args.oversubscribe:
        hosts, spares = needed(hosts, args.np)

    # Under hvdkit launch each rank runs under a guard that says how a killed rank ended (not elastic:
    # Horovod's driver restarts its workers itself).
    ranks_run = guard.command(sys.executable, command) if supervised and not is_elastic else list(command)
    spec = LaunchSpec(np=args.np, command=ranks_run, hosts=hosts, hostfile=args.hostfile,
                      controller=args.controller, set_env=set_env, oversubscribe=args.oversubscribe,
                      as_root=as_root, srun_mpi=args.srun_mpi, program=program, launcher_args=list(launcher_args),
                      restarts=supervised and getattr(args, "max_restarts", 0) > 0)
    oversubscribed = check_slots(spec, local_slots)
    placed = ranks_by_host(hosts, args.np) if listed else {}
    split = split_groups(placed, tensor_parallel_size(command, {**environ, **set_env}))
    if split:
        raise LaunchError(split)
    if chosen is HOROVODRUN:
        env = dict(set_env)
        if as_root and args.controller != "gloo":  # its mpirun refuses root without these
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        if args.controller != "gloo" and listed and several(hosts):
            env.update(data_path({**environ, **set_env}))
        return _spared(Plan(launcher, reason, horovodrun_command(spec), env, tagged=True, ranks=placed,
                            hosts=hosts if listed else []), spares)
    if chosen is SRUN:
        return Plan(launcher, reason, srun_command(spec), {})
    # What hvdkit launch sets for its ranks.
    launch_side = [job.JOB_DIR, job.RESTART, job.SNAPSHOTS, job.LINK, job.STANDBY] if supervised else []
    return _spared(_mpirun_plan(spec, reason, mpi_version(program), oversubscribed, environ, network,
                                [*extra, *launch_side], placed, hosts if listed else []), spares)


def tensor_parallel_size(command: Sequence[str], environ: Mapping[str, str]) -> int:
    """The ``tp`` of a training command: ``--tp N`` (or ``--tp=N``) given to ``hvdkit train``
    (``hvdkit train``, ``python -m hvdkit train``), else HVDKIT_TP in the ranks' environment (as a
    Session reads it); 1 where neither says (a script of your own with Session(tp=N) is checked by its
    ranks instead: hvdkit.rank.start.startup)."""
    words = list(command)
    for at in range(len(words) - 1):
        if words[at].endswith("hvdkit") and words[at + 1] == "train":
            for index, word in enumerate(words[at + 2:], start=at + 2):
                if word == "--tp" and index + 1 < len(words) and words[index + 1].isdigit():
                    return int(words[index + 1])
                if word.startswith("--tp=") and word[5:].isdigit():
                    return int(word[5:])
    told = environ.get("HVDKIT_TP", "")
    size = int(told) if told.isdigit() else 1
    return size


def _spared(result: Plan, spares: list) -> Plan:
    if spares:
        result.spares = spares
        result.notes.append(f"spare hosts: {host_list(spares)} (beyond -np's need; with --max-restarts, a "
                            f"restart runs on them in place of a lost host)")
    return result


def _variables(items: Sequence[str]) -> tuple[dict, list]:
    """-x VAR=VAL (set in every rank) and -x VAR (forwarded from here)."""
    set_env, extra = {}, []
    for item in items:
        name, sep, value = item.partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise LaunchError(f"-x {item!r}: not a variable name")
        if sep:
            set_env[name] = value
        else:
            extra.append(name)
    return set_env, extra


def job_hosts(hosts: Optional[str], hostfile: Optional[str], environ: Mapping[str, str]) -> Optional[list[Host]]:
    """The hosts a launch from here runs on, in rank order, wherever they are listed: -H, --hostfile,
    a rehearsal's $HVDKIT_HOSTS, the Slurm allocation; None where none is (this machine alone).
    For what must know the hosts before the ranks start, such as torch.distributed's MASTER_ADDR."""
    if hostfile:
        return read_hostfile(hostfile)
    if hosts:
        return parse_hosts(hosts)
    if "SLURM_JOB_NODELIST" in environ:
        return slurm_hosts(environ)
    if REHEARSAL_HOSTS in environ:
        return parse_hosts(environ[REHEARSAL_HOSTS])
    return None


def _hosts(hosts: Optional[list], args: argparse.Namespace, launcher: str, environ: Mapping[str, str],
           is_elastic: bool) -> tuple[Optional[list], bool, str]:
    """The hosts (None: the launcher's own default) from those given with -H or --hostfile, whether
    they were listed (given, or a rehearsal's: compared and watched; srun's are Slurm's), and where
    they came from, for the reason."""
    where = ""
    rehearsed = hosts is None and not is_elastic and REHEARSAL_HOSTS in environ and "SLURM_JOB_NODELIST" not in environ
    if rehearsed:  # `hvdkit rehearse` lists its hosts here, as Slurm lists an allocation's nodes
        hosts = parse_hosts(environ[REHEARSAL_HOSTS])
        where = f"; hosts from ${REHEARSAL_HOSTS} (hvdkit rehearse)"
    if is_elastic and hosts is not None:  # choose_launcher made it horovodrun
        raise LaunchError("--host-discovery-script gives an elastic job its hosts; drop -H/--hostfile "
                          "(with both, horovodrun ignores them)")
    if launcher == HOROVODRUN.name and hosts is None and not is_elastic:
        if "SLURM_JOB_NODELIST" in environ:
            hosts = slurm_hosts(environ)
            where = "; hosts from the Slurm allocation"
        else:
            hosts = [Host("localhost", args.np)]  # horovodrun's own default for one machine
    return hosts, bool(args.hosts or args.hostfile or rehearsed), where


def _mpirun_plan(spec: LaunchSpec, reason: str, version_text: str, oversubscribed: Optional[str],
                 environ: Mapping[str, str], network: Callable[[Sequence[str]], Optional[Network]],
                 forward: list, placed: dict, watched: list) -> Plan:
    """mpirun's command for its flavour, pinned to the interface that reaches the hosts."""
    flavor = mpi_flavor(version_text)
    if flavor == "unknown":
        raise LaunchError(f"cannot tell which MPI {spec.program} is from `mpirun --version`")
    notes = [f"added --oversubscribe: {oversubscribed}"] if oversubscribed and flavor == "openmpi" else []
    # horovodrun tests the hosts' interfaces itself; mpirun takes the first that answers.
    if spec.hosts and flavor in ("openmpi", "mpich") and not network_chosen(environ, spec.launcher_args):
        try:
            spec.network = network([h.name for h in spec.hosts])
        except NetworkError as exc:
            raise LaunchError(str(exc)) from None
        if spec.network:
            if "NCCL_SOCKET_IFNAME" not in environ:
                spec.set_env["NCCL_SOCKET_IFNAME"] = spec.network.interface
            notes.append(f"network: {spec.network.interface} ({spec.network.cidr}), this host's route to "
                         f"{', '.join(spec.network.peers)}; MPI and NCCL pinned to it")
    data = data_path({**environ, **spec.set_env}) if several(spec.hosts) else {}
    if data:
        spec.set_env.update(data)
        notes.append(f"{LINK_RATE}={environ[LINK_RATE]}: MPI moves the tensors (HOROVOD_CPU_OPERATIONS=mpi), "
                     f"as fast as Gloo or faster on links of {FAST_LINK_GBIT:g} Gbit/s and more")
    spec.forward = forwarded_names(environ, forward)
    return Plan("mpirun", f"{reason}; {flavor}", MPIRUN_BUILDERS[flavor](spec), {}, notes,
                tagged=flavor == "openmpi", ranks=placed, hosts=watched)


FAST_LINK_GBIT = 10


def data_path(environ: Mapping[str, str]) -> dict:
    """What moves a CPU job's tensors across hosts, set alike in every rank: on links the user (or a
    rehearsal) says are 10 Gbit/s or faster, MPI (HOROVOD_CPU_OPERATIONS=mpi); else nothing, and the
    ranks give Gloo the tensors (hvdkit.rank.start.startup.gloo_data_settings). Measured on both link
    speeds: docs/performance.md#across-hosts."""
    rate = environ.get(LINK_RATE)
    if not rate or "HOROVOD_CPU_OPERATIONS" in environ:  # the user's, exported or given with -x
        return {}
    try:
        fast = bits_per_second(rate) >= FAST_LINK_GBIT * 1e9
    except ValueError as exc:
        raise LaunchError(f"{LINK_RATE}: {exc}") from None
    return {"HOROVOD_CPU_OPERATIONS": "mpi"} if fast else {}


def local_command(how: str, np: int, command: Sequence[str], hosts: Optional[str] = None) -> list[str]:
    """The launcher command that `hvdkit launch -np NP --launcher HOW [-H HOSTS] -- COMMAND`
    runs from this host (HOW: "mpirun", "horovodrun --gloo", ...), from the same builders: for
    `doctor --selftest` and the tests, which run it directly (as root, with
    `selftest.mpi_root_env()`)."""
    args = parser().parse_args(["-np", str(np), "--launcher", *how.split(), *(["-H", hosts] if hosts else [])])
    return plan(args, list(command), os.environ, find_program, mpirun_version, os.geteuid() == 0,
                local_slots(), supervised=False, network=routable_network).command


def local_slots() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def check_command(command: Sequence[str]) -> None:
    """The program to run on every rank exists here, so a typo is one line, not an MPI error box."""
    program = command[0]
    found = os.access(program, os.X_OK) and not os.path.isdir(program) if "/" in program else shutil.which(program)
    if not found:
        raise LaunchError(f"{program}: no such command on this host (check the path, or activate the environment "
                          f"it is installed in)")
