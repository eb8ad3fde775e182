"""`hvdkit launch`: one command line over horovodrun, mpirun (Open MPI, MPICH, Intel MPI) and srun.

The plan (hvdkit.launch.planner: the launcher, its command, the hosts), the hosts compared first
when there are several (hvdkit.checks.hosts, what `hvdkit doctor -H` checks), and running it
(hvdkit.launch.supervise).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Iterable, Mapping, Optional, Sequence

from hvdkit import job
from hvdkit.checks import hosts as compare
from hvdkit.launch import restarts, supervise
from hvdkit.launch.hostfile import (
    Host,
    LaunchError,
    format_hostfile,
    host_list,
    parse_hosts,
    read_hostfile,
    slurm_hosts,
)
from hvdkit.launch.mpi import find_program, mpirun_version
from hvdkit.launch.network import Network, NetworkError, remote_hosts, routable_network
from hvdkit.launch.planner import Plan, check_command, elastic, local_slots, parser, plan
from hvdkit.system.launchers import BY_NAME

REMOVE_SECONDS = 15  # ssh's connect timeout (5 s) and the removal


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    if "--" in argv:
        split = argv.index("--")
        own, command = argv[:split], argv[split + 1:]
    else:
        own, command = argv, None
    args, launcher_args = parser().parse_known_args(own)
    try:
        if launcher_args and command is None and not args.list_hosts:
            raise LaunchError("put '--' before the command, e.g. hvdkit launch -np 2 -- python train.py")
        if launcher_args and args.list_hosts:
            raise LaunchError(f"unrecognized arguments: {' '.join(launcher_args)}")
        if args.list_hosts:
            hosts = (read_hostfile(args.hostfile) if args.hostfile else
                     parse_hosts(args.hosts) if args.hosts else slurm_hosts(os.environ))
            sys.stdout.write(format_hostfile(hosts, args.hosts_format))
            return 0
        if command is None:
            raise LaunchError("put '--' before the command, e.g. hvdkit launch -np 2 -- python train.py")
        if args.max_restarts < 0:
            raise LaunchError(f"--max-restarts must be 0 or more (got {args.max_restarts})")
        if args.standby and not args.max_restarts:
            raise LaunchError("--standby starts the ranks of a restart ahead of need: it goes with --max-restarts N")
        result = plan(args, command, os.environ, find_program, mpirun_version, os.geteuid() == 0, local_slots(),
                      launcher_args, network=_previewed if args.dry_run else routable_network)
        check_command(command)
        watched = {} if args.dry_run else remote_hosts(result.watch)
        job.stop_grace()
    except (LaunchError, NetworkError, ValueError) as exc:
        print(f"hvdkit launch: {exc}", file=sys.stderr)
        return job.BAD_INPUT
    if watched and not args.no_preflight:
        refused = preflight(result.hosts + result.spares, os.environ, args.oversubscribe, args.verbose)
        if refused:
            return refused
    if args.dry_run or args.verbose:
        print(f"# launcher: {result.launcher} ({result.reason})")
        for note in result.notes:
            print(f"# {note}")
        print(result.render(), flush=True)
        if args.dry_run:
            return 0
    plans = {frozenset(): result}

    def without(lost: frozenset) -> Plan:
        """The plan on the hosts given less those lost: spares take their ranks (LaunchError where
        too few slots are left)."""
        if lost not in plans:
            left = [host for host in result.hosts + result.spares if host.name not in lost]
            if not left:
                raise LaunchError("no host is left")
            replanned = argparse.Namespace(**{**vars(args), "hosts": host_list(left), "hostfile": None})
            plans[lost] = plan(replanned, command, os.environ, find_program, mpirun_version, os.geteuid() == 0,
                               local_slots(), launcher_args, network=routable_network)
        return plans[lost]

    # Not where the launcher says so (hvdkit.launchers: srun); elastic: no restarts.
    ahead = args.max_restarts and BY_NAME[result.launcher].starts_ahead and not elastic(launcher_args) and (
        args.standby if args.standby is not None else runs_hvdkit_train(command))
    standby: dict[frozenset, supervise.Launched] = {}  # the next attempt, started ahead, by the hosts lost before it

    def start(extra: Mapping[str, str], lost: frozenset) -> supervise.Ended:
        chosen = without(lost)
        ready = standby.pop(lost, None)
        for other in standby.values():  # started for hosts that are lost since
            other.discard()
        standby.clear()
        if ready is not None and ready.child.poll() is not None:  # its launcher ended: one of its ranks did
            ready.discard()
            ready = None
        env = dict(os.environ, **chosen.env, **extra)
        watch = remote_hosts(chosen.watch)

        def start_the_next() -> supervise.Launched:
            standby[lost] = supervise.Launched(chosen.command, {**env, job.RESTART: str(int(extra[job.RESTART]) + 1)},
                                               chosen.tagged, watch, standby=True)
            return standby[lost]

        last = int(extra[job.RESTART]) >= args.max_restarts
        return supervise.attempt(chosen.command, env, chosen.tagged, watch, chosen.ranks, standby=ready,
                                 ahead=start_the_next if ahead and not last else None)

    try:
        return restarts.run(start, args.max_restarts, lambda lost: _where(without(lost)),
                            lambda place, lost: remove_elsewhere(
                                place, remote_hosts([h.name for h in result.hosts + result.spares]).keys() - lost))
    finally:
        for unused in standby.values():
            unused.discard()


def runs_hvdkit_train(command: Sequence[str]) -> bool:
    """Whether ``command`` is `hvdkit train` (or `python -m hvdkit train`), whose ranks wait before
    hvd.init when started as a standby (job.STANDBY); another program would train at once."""
    words = list(command)
    if words and os.path.basename(words[0]).startswith("python") and words[1:2] == ["-m"]:
        words = words[2:]
    return len(words) > 1 and os.path.basename(words[0]) == "hvdkit" and words[1] == "train"


def _where(result: Plan) -> str:
    return ",".join(f"{host.name}:{host.slots}" for host in result.hosts) or "this machine"


def remove_elsewhere(place: str, hosts: Iterable[str]) -> None:
    """Remove ``place`` on each of ``hosts`` (ssh, as the launchers go there), all at once; a host
    that does not answer within ssh's connect timeout keeps it."""
    removals = [subprocess.Popen(compare.ssh_command(host, ["rm", "-rf", place]), stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for host in sorted(hosts)]
    for removal in removals:
        try:
            removal.wait(timeout=REMOVE_SECONDS)
        except subprocess.TimeoutExpired:
            removal.kill()
            removal.wait()


def preflight(hosts: Sequence[Host], environ: Mapping[str, str], oversubscribe: bool, verbose: bool) -> int:
    """The checks of `hvdkit doctor -H` before a multi-host start: a problem is one line each, and
    nothing starts (BAD_INPUT); --oversubscribe accepts more slots than cores."""
    checked = compare.check(hosts, directory=compare.default_directory(environ))
    problems = [f for f in checked.findings if not (oversubscribe and f.kind == "slots")]
    for note in checked.notes if verbose else []:
        print(f"# note: {note}")
    for finding in problems:
        print(f"hvdkit launch: {finding.line().removeprefix('doctor: ')}", file=sys.stderr)
    if problems:
        print("hvdkit launch: not started: the hosts differ as above (--no-preflight starts anyway)",
              file=sys.stderr)
        return job.BAD_INPUT
    return job.OK


def _previewed(names: Sequence[str]) -> Optional[Network]:
    """--dry-run may preview a job for hosts that do not resolve where it runs (a laptop)."""
    try:
        return routable_network(names)
    except NetworkError:
        return None


def discover_hosts() -> int:
    """`hvdkit-discover-hosts`, elastic Horovod's host discovery script: the hosts of
    $HVDKIT_HOSTS_FILE (edit it while the job runs), else of the Slurm allocation."""
    hostfile = os.environ.get("HVDKIT_HOSTS_FILE")
    return main(["--list-hosts", *(["--hostfile", hostfile] if hostfile else [])])
