"""`hvdkit rehearse`: a multi-node job tried on this machine before it costs cluster hours.

    hvdkit rehearse --hosts 2 --slots 1 [--bandwidth 1gbit] [--delay 1ms] [--kill-host 1 --after 30s] \
        -- hvdkit launch -np 2 -- hvdkit train ...
    hvdkit rehearse --hosts 2 --slurm -- sbatch --nodes 2 slurm/multi-node-srun.sbatch

The hosts are network namespaces (hvdkit.rehearse.namespaces), node0 to nodeN-1, each with its own address,
name and sshd, on a private switch; the filesystem (this directory, the virtual environment) is
shared, as a cluster's home is. The command runs on node0 as a user logged in there, with the
hosts in its environment:

    HVDKIT_HOSTS       node0:1,node1:1     (horovodrun -H; `hvdkit launch` reads it by itself)
    HVDKIT_HOSTFILE    a hostfile, "node0 slots=1" lines (mpirun --hostfile, horovodrun --hostfile)
    HVDKIT_HOSTS_FILE  the same file, for elastic discovery (--host-discovery-script hvdkit-discover-hosts)
    OMPI_MCA_hwloc_base_binding_policy=none   unless --cpus or already set: the hosts share this
                       machine's cores, and plain mpirun would bind each host's first rank to core 0
    HVDKIT_LINK_RATE   each host's link rate, with --bandwidth (1gbit): `hvdkit bench` reads it for its floor,
                       `hvdkit launch` to choose what moves the tensors

``--kill-host I --after T`` fails nodeI T after the start: its processes die, its sshd too, its
link goes down, and it leaves the hostfile, as a lost machine leaves a cluster's discovery.
``--after SIGUSR1`` fails it when this process receives SIGUSR1 (``kill -USR1 PID``): at the
moment the job is where the failure should find it, however long its start took.
``--slurm`` makes the hosts a Slurm cluster (hvdkit.rehearse.slurm_cluster), runs the command (an sbatch
line) on node0, the login node, and waits for every job it submitted to end.

``--chaos K`` runs the command through K faults drawn from ``--chaos-seed``, restarting it after
each ending, and holds its final checkpoint to an undisturbed run's (hvdkit.rehearse.chaos).

A stop signal (Ctrl-C, SIGTERM, SIGHUP) goes to the command, which has ``--grace`` seconds to save
and end; then every process on the hosts ends and the hosts are removed. Exit: the command's code
(or 1 if a Slurm job did not complete), 128 + the signal after a stop, 2 for bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

from hvdkit import job
from hvdkit.args import LINK_RATE, OneLineParser, bits_per_second, checked, duration
from hvdkit.launch.restarts import SNAPSHOT_TAG
from hvdkit.rehearse import faults as fault_menu
from hvdkit.rehearse import goodput
from hvdkit.rehearse.namespaces import (
    FIRST_HOST,
    MAX_HOSTS,
    SUBNET,
    Hosts,
    HostsUnavailable,
    seconds,
    unavailable,
)
from hvdkit.system import proctree, sighandlers

STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
BINDING = "OMPI_MCA_hwloc_base_binding_policy"  # mpirun's --bind-to, as a variable
ELASTIC = ("--elastic", "--min-np", "--max-np", "--host-discovery-script")  # in a command: an elastic job


def _moment(text: str):
    """When a host fails: a duration after the start, or ON_SIGNAL."""
    return ON_SIGNAL if text.upper() in ("SIGUSR1", "USR1") else duration(text)


ON_SIGNAL = "SIGUSR1"


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(bare=True, prog="hvdkit rehearse", usage="hvdkit rehearse --hosts N [options] -- COMMAND ...",
                      description="Run COMMAND on node0 of N hosts made on this machine (network namespaces "
                                  "with sshd), then remove them.", allow_abbrev=False)
    p.add_argument("--hosts", type=int, default=2, help="how many hosts (default 2)")
    p.add_argument("--slots", type=int, default=1, help="slots per host in HVDKIT_HOSTS and the hostfile (default 1)")
    p.add_argument("--bandwidth", type=checked(bits_per_second), help="shape each host's link: 1gbit, 100mbit")
    p.add_argument("--delay", type=checked(seconds), help="delay each packet a host sends: 1ms (needs tc netem)")
    p.add_argument("--cpus", action="store_true", help="each host computes on its own share of this machine's cores")
    p.add_argument("--kill-host", type=int, metavar="I", help="fail nodeI (1..N-1) --after the start")
    p.add_argument("--after", type=_moment, metavar="T",
                   help="when --kill-host fails its host: 30s, 2m, or SIGUSR1 (on kill -USR1 to this process)")
    p.add_argument("--slurm", action="store_true", help="make the hosts a Slurm cluster; COMMAND is an sbatch line")
    p.add_argument("--grace", type=duration, default=60.0,
                   help="after a stop signal, how long the command may take to save and end (default 60s)")
    chaos = p.add_argument_group("chaos", "run the command through K faults, restarted after each, and hold its "
                                          "final checkpoint to an undisturbed run's (docs/rehearse.md#chaos---chaos-k)")
    chaos.add_argument("--chaos", type=int, metavar="K", help="how many faults")
    chaos.add_argument("--chaos-seed", type=int, metavar="S", help="the schedule's seed (default: drawn, and printed)")
    chaos.add_argument("--faults", metavar="LIST", help="the faults to draw from, comma-separated (default: all "
                                                        "the hosts allow): " + ", ".join(fault_menu.FAULTS))
    chaos.add_argument("--reference", type=Path, metavar="DIR",
                       help="the checkpoints of an undisturbed run of the command (default: run it first)")
    chaos.add_argument("--checkpoint-dir", type=Path, metavar="DIR",
                       help="where the job writes its checkpoints (default: the command's --checkpoint-dir, "
                            "else $HVDKIT_CHECKPOINT_DIR)")
    chaos.add_argument("--tolerance", type=float, metavar="D",
                       help="an elastic job's final model may be this far from the undisturbed run's: relative L2 "
                            f"distance of the weights (default {fault_menu.ELASTIC_TOLERANCE}); others are held "
                            "bitwise")
    chaos.add_argument("--min-diagnosed", type=float, metavar="F",
                       help="fail the run where fewer than this fraction of its endings named their cause and "
                            "the rank or host struck (0 to 1; default: reported, not held)")
    chaos.add_argument("--out", type=Path, metavar="DIR",
                       help="for the report and each attempt's output (default runs/rehearse/chaos-<time>)")
    return p


def check(args: argparse.Namespace, command: Sequence[str]) -> Optional[str]:
    """What is wrong with the arguments, in one line, or None."""
    if not command:
        return "give the command after '--', e.g. hvdkit rehearse --hosts 2 -- hvdkit launch -np 2 -- hvdkit train"
    if args.hosts < 1 or args.slots < 1:
        return "--hosts and --slots must be at least 1"
    if args.hosts > MAX_HOSTS:
        return (f"--hosts {args.hosts}: at most {MAX_HOSTS} hosts fit the rehearsal's network "
                f"({SUBNET}.{FIRST_HOST} to {SUBNET}.254)")
    if (args.kill_host is None) != (args.after is None):
        return "--kill-host and --after go together: --kill-host 1 --after 30s"
    if args.kill_host is not None and args.hosts < 2:
        return "--kill-host needs --hosts 2 or more: node0 runs the command, as the node you log in to"
    if args.kill_host is not None and not 1 <= args.kill_host < args.hosts:
        return (f"--kill-host {args.kill_host}: pick a host from 1 to {args.hosts - 1} "
                "(node0 runs the command, as the node you log in to)")
    if args.slurm and args.kill_host is not None:
        return "--kill-host is for launches on the hosts; under --slurm, drain a node with scontrol instead"
    if args.chaos is None:
        given = [flag for flag, value in (("--chaos-seed", args.chaos_seed), ("--faults", args.faults),
                                          ("--reference", args.reference), ("--checkpoint-dir", args.checkpoint_dir),
                                          ("--tolerance", args.tolerance), ("--min-diagnosed", args.min_diagnosed),
                                          ("--out", args.out)) if value is not None]
        return f"{given[0]} goes with --chaos K" if given else None
    return check_chaos(args, command)


def check_chaos(args: argparse.Namespace, command: Sequence[str]) -> Optional[str]:
    if args.chaos < 0:
        return f"--chaos {args.chaos}: the number of faults is 0 or more"
    if args.slurm or args.kill_host is not None:
        return "--chaos strikes its own faults on launches from node0: not with --slurm or --kill-host"
    problem = fault_menu.menu(args.faults, args.hosts, elastic(command))[1]
    if problem:
        return problem
    if args.tolerance is not None and not elastic(command):
        return "--tolerance is for an elastic job's final model; a fixed-size job's is held bitwise"
    if args.tolerance is not None and not args.tolerance >= 0:
        return f"--tolerance {args.tolerance}: a distance, 0 or more"
    if args.min_diagnosed is not None and not 0 <= args.min_diagnosed <= 1:
        return f"--min-diagnosed {args.min_diagnosed}: a fraction of the endings, from 0 to 1"
    ckpt = args.checkpoint_dir or fault_menu.command_checkpoint_dir(command, dict(os.environ))
    if not ckpt:
        return ("--chaos needs the job's checkpoint directory: give the command --checkpoint-dir, or set "
                "HVDKIT_CHECKPOINT_DIR, or give --checkpoint-dir before '--'")
    if Path(ckpt).is_dir() and any(Path(ckpt).iterdir()):
        return (f"{ckpt} is not empty: a chaos run starts the job afresh there (and would resume what it holds); "
                "name a new or empty directory")
    from hvdkit import checkpoint  # torch: not for the lines above

    if args.reference is not None and not checkpoint.existing(str(args.reference)):
        return f"--reference {args.reference}: no checkpoint there (an undisturbed run's --checkpoint-dir)"
    return None


def elastic(command: Sequence[str]) -> bool:
    """Whether the command runs an elastic job: an elastic flag anywhere in it, a shell's line too."""
    return any(token.split("=")[0] in ELASTIC for word in command for token in word.split())


def names(count: int) -> list[str]:
    return [f"node{i}" for i in range(count)]


def host_environment(hosts: Hosts, slots: int, hostfile: Path) -> dict:
    """What the command sees of the hosts (the documented variable names above). Open MPI binds
    ranks to cores by default, counting from core 0 on each host: on hosts that share this
    machine's cores every host's first rank would compute on the same core, at half speed or
    less, so binding is off unless each host has its own cores (--cpus) or the user chose it."""
    hostfile.write_text("".join(f"{name} slots={slots}\n" for name in hosts.names))
    seen = {"HVDKIT_HOSTS": ",".join(f"{name}:{slots}" for name in hosts.names), "HVDKIT_HOSTFILE": str(hostfile),
            "HVDKIT_HOSTS_FILE": str(hostfile), SNAPSHOT_TAG: hosts.prefix}
    if not hosts.cpus and BINDING not in os.environ:
        seen[BINDING] = "none"
    if hosts.rate:
        seen[LINK_RATE] = hosts.rate
    return seen


class Stopped(BaseException):
    """A second stop signal, or one before the command started: remove everything now."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
        self.code = job.stopped_by(signum)


def say(message: str) -> None:
    print(f"hvdkit rehearse: {message}", file=sys.stderr, flush=True)


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser().parse_args(argv[:split])
    command = argv[split + 1:]
    problem = check(args, command) or unavailable()
    if problem:
        say(problem)
        return job.BAD_INPUT
    running: dict = {}

    def on_stop(signum, frame) -> None:
        proc = running.get("proc")
        if proc is None or "signal" in running:
            raise Stopped(signum)
        running["signal"] = signum
        say(f"{signal.Signals(signum).name}: passed to the command, which has {args.grace:.0f} s to end")
        proc.send_signal(signum)

    handlers = sighandlers.Handlers(STOPS, on_stop).install()  # nohup's SIGHUP stays ignored
    if args.chaos is not None:
        try:
            return _chaos(args, command, running)
        finally:
            handlers.restore()
    try:
        with Hosts(args.hosts, rate=args.bandwidth, delay=args.delay, cpus=args.cpus, own_tmp=args.slurm,
                   names=names(args.hosts)) as hosts:
            return _rehearse(args, command, hosts, running)
    except HostsUnavailable as exc:
        say(str(exc))
        return job.BAD_INPUT
    except RuntimeError as exc:  # a host that did not start: sshd, ip, tc, Slurm
        say(f"the hosts did not start: {str(exc).splitlines()[0]}")
        return job.FAILED
    except Stopped as exc:
        say(f"stopped by {signal.Signals(exc.signum).name}; every host and process it made is removed")
        return exc.code
    finally:
        handlers.restore()


def _rehearse(args: argparse.Namespace, command: list[str], hosts: Hosts, running: dict) -> int:
    first = hosts.names[0]
    env = dict(hosts.env(), **host_environment(hosts, args.slots, hosts.dir / "hostfile"))
    cluster = None
    if args.slurm:
        from hvdkit.rehearse.slurm_cluster import SlurmCluster

        cluster = SlurmCluster(hosts)
        env.pop("HVDKIT_HOSTS")  # inside a job, the allocation lists the hosts
        env["SLURM_CONF"] = str(cluster.conf)
    try:
        if cluster:
            cluster.start()
        listed = ", ".join(f"{name} ({hosts.address(name)})" for name in hosts.names)
        say(f"{len(hosts.names)} hosts: {listed}, {args.slots} slot(s) each"
            f"{'; a Slurm cluster on them' if cluster else ''}; on {first}: {shlex.join(command)}")
        # Its own process group: a signal reaches it once, from here, not also from the terminal.
        running["proc"] = proc = subprocess.Popen(hosts.on(first, command), env=env, process_group=0)
        killer = _kill_later(hosts, args, running) if args.kill_host is not None else None
        code = _wait(proc, running, args.grace)
        if killer:
            killer.cancel()
        if cluster and "signal" not in running:
            code = _jobs_ended(cluster, code)
        return job.stopped_by(running["signal"]) if "signal" in running else code
    finally:
        if cluster:
            cluster.stop()


def _chaos(args: argparse.Namespace, command: list[str], running: dict) -> int:
    """--chaos: the undisturbed run, the faults, the checks; the report; 0 only if all held."""
    from hvdkit.rehearse import chaos, diagnosis, verdict  # torch: only once the arguments are good
    seed = args.chaos_seed if args.chaos_seed is not None else random.SystemRandom().randrange(1 << 31)
    faults = fault_menu.menu(args.faults, args.hosts, elastic(command))[0]
    ckpt = Path(args.checkpoint_dir or fault_menu.command_checkpoint_dir(command, dict(os.environ))).resolve()
    out = (args.out or Path("runs/rehearse") / f"chaos-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    report = verdict.Report(seed, faults, command, args.hosts, str(ckpt))
    began = time.monotonic()
    say(f"chaos: seed {seed}, {args.chaos} fault(s) from {', '.join(faults)}; the report in {out}")
    ckpt.mkdir(parents=True, exist_ok=True)
    # disk-full needs the directory on a filesystem of its own, made before the hosts so that it
    # is the one every host's namespace sees.
    small = "disk-full" in {s.fault for s in fault_menu.plan(seed, args.chaos, faults, [1])}
    prefix = None
    try:
        if small:
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "hvdkit-chaos", str(ckpt)], check=True,
                           capture_output=True)
        with Hosts(args.hosts, cpus=args.cpus, names=names(args.hosts)) as hosts:
            prefix = hosts.prefix
            env = dict(hosts.env(), **host_environment(hosts, args.slots, hosts.dir / "hostfile"))
            run = chaos.Chaos(command, hosts, env, ckpt, out, report, lambda m: say(f"chaos: {m}"), running,
                              elastic=elastic(command), tolerance=args.tolerance)
            final = run.reference(args.reference)
            log_dir = fault_menu.command_option(command, "--log-dir")
            if final is not None and "began_wall" in report.reference:  # its start-up and steady step
                report.reference.update(goodput.pace(goodput.records(log_dir, report.reference["began_wall"]),
                                                     report.reference["began_wall"]))
            if final is not None:
                if small:
                    room = 4 * sum(p.stat().st_size for p in final.parent.rglob("*") if p.is_file()) + (64 << 20)
                    subprocess.run(["mount", "-o", f"remount,size={room}", str(ckpt)], check=True,
                                   capture_output=True)
                strikes = fault_menu.plan(seed, args.chaos, faults, report.reference["steps"])
                say("chaos: the schedule: " + "; ".join(f"{s.number} {s.fault} at step {s.step}" for s in strikes)
                    + f" (again: --chaos-seed {seed})")
                began_storm, began_wall = time.monotonic(), time.time()
                run.run(strikes, final, limit=2 * args.chaos + 3)
                report.strikes = [dataclasses.asdict(s) for s in strikes]
                ends = set() if elastic(command) else {f for f, fault in fault_menu.FAULTS.items() if fault.ends}
                verdict.measure_goodput(report, log_dir, ends, began_wall,
                                        time.monotonic() - began_storm)
                report.diagnosis = diagnosis.score(report.strikes, out)
                report.problems += filter(None, [diagnosis.below(report.diagnosis, args.min_diagnosed)])
                verdict.judge(report, ckpt, final, run.elastic, run.tolerance)
    except Stopped as exc:
        say(f"stopped by {signal.Signals(exc.signum).name}; every host and process it made is removed")
        return exc.code
    finally:
        if small:
            _unmount_keeping(ckpt, out)
    if prefix:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
        kept = [line.split()[0] for line in listed if line.startswith(prefix)]
        if kept:
            report.left["namespaces"] = kept
            report.problems.append(f"namespaces left: {', '.join(kept)}")
    report.seconds = round(time.monotonic() - began, 1)
    verdict.write_report(report, out / "report.json")
    print(report.table(), file=sys.stderr, flush=True)
    for problem in report.problems:
        say(f"chaos: {problem}")
    struck = len(report.strikes) - len(report.not_struck)
    if "signal" in running:
        return job.stopped_by(running["signal"])
    if report.problems:
        say(f"chaos: FAILED ({len(report.problems)} problem(s)); replay: --chaos-seed {seed}; {out / 'report.json'}")
        return job.FAILED
    close = ("equals the undisturbed run's" if report.final.get("equal") else
             f"is {report.final['distance']:.2g} from the undisturbed run's (relative L2; an elastic job's "
             f"tolerance {report.final['tolerance']})")
    say(f"chaos: {struck} of {len(report.strikes)} faults struck and survived, the final checkpoint {close}, "
        f"nothing left ({report.seconds:.0f} s); {out / 'report.json'}")
    return job.OK


def _unmount_keeping(ckpt: Path, out: Path) -> None:
    """disk-full's filesystem away, what it held moved into the directory beneath."""
    from hvdkit.rehearse import chaos
    staging = out / "checkpoints-moving"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(ckpt, staging, ignore=shutil.ignore_patterns(chaos.BALLAST))
    subprocess.run(["umount", str(ckpt)], check=True, capture_output=True)
    for entry in staging.iterdir():
        shutil.move(str(entry), ckpt / entry.name)
    staging.rmdir()


def _wait(proc: subprocess.Popen, running: dict, grace: float) -> int:
    """The command's exit code; after a stop signal, at most ``grace`` seconds more."""
    while True:
        code = proctree.wait_child(proc, timeout=0.5)  # on_stop may raise: never inside Popen.wait
        if code is not None:
            return code
        if "signal" in running and time.monotonic() - running.setdefault("since", time.monotonic()) > grace:
            say(f"the command did not end within {grace:.0f} s of the signal; ending every process on the hosts")
            return job.stopped_by(running["signal"])


def _kill_later(hosts: Hosts, args: argparse.Namespace, running: dict) -> threading.Timer:
    """A timer that fails the host --after the start; under --after SIGUSR1 the signal starts it at once."""
    name = hosts.names[args.kill_host]
    hostfile = hosts.dir / "hostfile"
    started = time.monotonic()

    def lose() -> None:
        if running["proc"].poll() is not None:
            return
        hostfile.write_text("".join(line + "\n" for line in hostfile.read_text().splitlines()
                                    if line.split()[0] != name))
        hosts.lose(name)
        why = "on SIGUSR1, " if args.after == ON_SIGNAL else ""
        say(f"{name} lost {why}{time.monotonic() - started:.0f} s after the start: its processes killed, its link "
            f"down, and it left {hostfile}")

    timer = threading.Timer(0 if args.after == ON_SIGNAL else args.after, lose)
    timer.daemon = True
    if args.after == ON_SIGNAL:
        fail = sighandlers.Handlers((signal.SIGUSR1,), lambda signum, frame: timer.ident or timer.start())
        fail.install()  # the first SIGUSR1 fails the host; kept until the command ends
        say(f"{name} fails on SIGUSR1: kill -USR1 {os.getpid()}")
    else:
        timer.start()
    return timer


def _jobs_ended(cluster, code: int, timeout: float = 24 * 3600) -> int:
    """Wait until the cluster's queue is empty; say how each job ended. 1 if one did not complete."""
    deadline = time.monotonic() + timeout
    while cluster.run(["squeue", "-h", "-o", "%i"]).stdout.strip() and time.monotonic() < deadline:
        time.sleep(1)
    jobs = cluster.jobs()
    if not jobs:
        say("no Slurm job was submitted (the command under --slurm is an sbatch line)")
        return code or job.FAILED
    for entry in jobs:
        say(f"job {entry['JobId']} ({entry.get('JobName', '?')}) {entry.get('JobState')}, "
            f"exit {entry.get('ExitCode')}, on {entry.get('NodeList')}; output {entry.get('StdOut')}")
    return code or (job.OK if all(entry.get("JobState") == "COMPLETED" for entry in jobs) else job.FAILED)
