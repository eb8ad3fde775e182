"""`hvdkit launch`: one command line over horovodrun, mpirun (Open MPI, MPICH, Intel MPI) and srun.

The plan (hvdkit.launch.planner: the launcher, its command, the hosts), the hosts compared first
when there are several (hvdkit.checks.hosts, what `hvdkit doctor -H` checks), and running it
(hvdkit.launch.supervise).
"""

from __future__ import annotations

import os
import sys
from typing import Mapping, Optional, Sequence

from hvdkit import job
from hvdkit.checks import hosts as compare
from hvdkit.launch import restarts, supervise
from hvdkit.launch.hostfile import (
    Host,
    LaunchError,
    format_hostfile,
    parse_hosts,
    read_hostfile,
    slurm_hosts,
)
from hvdkit.launch.mpi import find_program, mpirun_version
from hvdkit.launch.network import Network, NetworkError, remote_hosts, routable_network
from hvdkit.launch.planner import check_command, local_slots, parser, plan


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
        result = plan(args, command, os.environ, find_program, mpirun_version, os.geteuid() == 0, local_slots(),
                      launcher_args, network=_previewed if args.dry_run else routable_network)
        check_command(command)
        watched = {} if args.dry_run else remote_hosts(result.watch)
        job.stop_grace()
    except (LaunchError, NetworkError, ValueError) as exc:
        print(f"hvdkit launch: {exc}", file=sys.stderr)
        return job.BAD_INPUT
    if watched and not args.no_preflight:
        refused = preflight(result.hosts, os.environ, args.oversubscribe, args.verbose)
        if refused:
            return refused
    if args.dry_run or args.verbose:
        print(f"# launcher: {result.launcher} ({result.reason})")
        for note in result.notes:
            print(f"# {note}")
        print(result.render(), flush=True)
        if args.dry_run:
            return 0
    hosts = ",".join(f"{host.name}:{host.slots}" for host in result.hosts) or "this machine"
    return restarts.run(lambda extra: supervise.attempt(result.command, dict(os.environ, **result.env, **extra),
                                                        result.tagged, watched, result.ranks),
                        args.max_restarts, hosts)


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
