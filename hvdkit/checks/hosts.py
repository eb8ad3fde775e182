"""`hvdkit doctor --hosts`: the job's hosts compared before a multi-host job starts.

The multi-host failures users meet most show only once the job runs, or never: a host with
another torch or MPI, interfaces named differently on each host, a checkpoint directory that is
not shared, ssh asking for a password. Each host is reached the way the launcher will reach it
(ssh, or srun inside a Slurm allocation) and runs `hvdkit.checks.host_facts`; its facts are
compared with this host's. One row per host, then one `doctor: HOST: problem; fix` line per
problem and exit 1, or exit 0: in seconds, the hosts probed at once.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, NamedTuple, Optional, Sequence

from hvdkit import job
from hvdkit.launch.hostfile import Host
from hvdkit.launch.network import Network, NetworkError, remote_hosts, routable_network

CLOCK_LIMIT = 1.0  # seconds: logs, checkpoints' times and timeouts stop lining up beyond this
CLOCK_PROBES = 3  # the least round trip of these gives the offset
CONNECT_SECONDS = 10
SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", "ConnectTimeout=5")  # a prompt is a failure, not a wait
NAMES = {"python": "Python", "torch": "torch", "torchvision": "torchvision", "horovod": "Horovod",
         "hvdkit": "hvdkit", "mpi4py": "mpi4py"}


def facts_command(python: str, seen: str) -> list[str]:
    return [python, "-m", "hvdkit.checks.host_facts", "--seen", seen]


def ssh_command(host: str, remote: Sequence[str]) -> list[str]:
    """horovodrun's and mpirun's way in: ssh from PATH, never a prompt."""
    return ["ssh", *SSH_OPTIONS, host, shlex.join(remote)]


def srun_command(host: str, remote: Sequence[str]) -> list[str]:
    """Inside an allocation: one task on that node, as the job's own steps start there."""
    return ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={host}", "--overlap", "--quiet", *remote]


@dataclass
class Probe:
    """One host's facts and clock offset, or why it could not be reached."""
    host: str
    facts: Optional[dict] = None
    offset: Optional[float] = None  # its clock minus this host's, seconds
    error: Optional[str] = None


def probe(host: str, command: Sequence[str]) -> Probe:
    """Run the facts command; read its JSON line, then time CLOCK_PROBES echoes of its clock."""
    try:
        proc = subprocess.Popen(list(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, bufsize=1)
    except OSError as exc:
        return Probe(host, error=f"{command[0]}: {exc.strerror}")
    timer = threading.Timer(CONNECT_SECONDS * 3, proc.kill)  # a host that takes the connection and hangs
    timer.start()
    try:
        line = proc.stdout.readline()
        try:
            facts = json.loads(line)
        except ValueError:
            proc.stdin.close()
            proc.wait()
            said = [s for s in proc.stderr.read().splitlines() if s.strip()]
            return Probe(host, error=said[-1].strip() if said else f"exit {proc.returncode}, no answer")
        best = None
        for _ in range(CLOCK_PROBES):
            sent = time.time()
            try:
                proc.stdin.write("t\n")
                answer = float(proc.stdout.readline())
            except (OSError, ValueError):  # it stopped answering: no offset, the facts stand
                return Probe(host, facts)
            back = time.time()
            if best is None or back - sent < best[0]:
                best = (back - sent, answer - (sent + back) / 2)
        proc.stdin.close()
        proc.wait()
        return Probe(host, facts, best[1])
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@dataclass
class Finding:
    host: str
    problem: str
    fix: str
    kind: str = ""  # "slots": more ranks than cores, which `hvdkit launch --oversubscribe` accepts

    def line(self) -> str:
        return f"doctor: {self.host}: {self.problem}; {self.fix}"


@dataclass
class Comparison:
    here: Probe
    hosts: list  # [Host]
    probes: dict  # name -> Probe
    network: Optional[Network] = None  # this host's route to the others
    dir: Optional[str] = None
    srun: bool = False  # reached by srun in an allocation, not ssh
    findings: list = field(default_factory=list)
    notes: list = field(default_factory=list)  # differences hvdkit takes care of

    def add(self, host: str, problem: str, fix: str, kind: str = "") -> None:
        self.findings.append(Finding(host, problem, fix, kind))


def compare(c: Comparison) -> list[Finding]:
    """Every host's facts against this host's: one Finding per problem."""
    ours = c.here.facts
    for host in c.hosts:
        got = c.probes[host.name]
        if got.facts is None:
            c.add(host.name, f"not reachable {'by srun' if c.srun else 'without a prompt'} ({got.error})",
                  "check the node (scontrol show node)" if c.srun else
                  "the launcher reaches it the same way: set up passwordless ssh to it (ssh-copy-id), "
                  "and check that it is up")
            continue
        theirs = got.facts
        _versions(c, host.name, ours, theirs)
        _network(c, host.name, theirs)
        if c.dir and not theirs["seen"]:
            c.add(host.name, f"{c.dir} is not shared: a file written there on this host is not there",
                  "ranks there would save and resume from another directory: put the run and checkpoint "
                  "directory on a filesystem every host mounts (HVDKIT_LOG_DIR, HVDKIT_CHECKPOINT_DIR)")
        if got.offset is not None and abs(got.offset) > CLOCK_LIMIT:
            c.add(host.name, f"its clock is {abs(got.offset):.1f} s {'ahead of' if got.offset > 0 else 'behind'} "
                             f"this host's", "synchronise the clocks (chrony or systemd-timesyncd)")
        _slots(c, host, theirs)
    return c.findings


def _versions(c: Comparison, name: str, ours: dict, theirs: dict) -> None:
    pairs = [("python", ours["python"], theirs["python"])]
    pairs += [(key, ours["packages"][key], theirs["packages"][key]) for key in NAMES if key != "python"]
    for key, here, there in pairs:
        if here != there:
            c.add(name, f"{NAMES[key]} {there or 'not installed'}, this host {here or 'not installed'}",
                  "every rank must run the same build: install the same versions on every host (a shared "
                  "environment, or one image)")
    if _build(ours) != _build(theirs) and ours["packages"]["horovod"] == theirs["packages"]["horovod"]:
        c.add(name, f"Horovod built with {_build(theirs)}, this host {_build(ours)}",
              "rebuild it the same way on every host (python -m hvdkit.build --force)")
    if ours["mpi"] != theirs["mpi"]:
        c.add(name, f"MPI {theirs['mpi'] or 'not found'}, this host {ours['mpi'] or 'not found'}",
              "mpirun starts every rank with the same MPI: install the same one, or put it first on PATH there")
    if ours["gpus"] and theirs["gpus"] and ours["gpus"][0]["driver"] != theirs["gpus"][0]["driver"]:
        c.add(name, f"GPU driver {theirs['gpus'][0]['driver']}, this host {ours['gpus'][0]['driver']}",
              "install the same driver on every host")
    if ours["nccl"] != theirs["nccl"] and (ours["gpus"] or theirs["gpus"]):
        c.add(name, f"NCCL {theirs['nccl']}, this host {ours['nccl']}", "install the same torch (it brings NCCL)")


def _build(facts: dict) -> str:
    build = facts["horovod_build"] or {}
    return "+".join(build.get("controllers", [])) + (" and NCCL" if build.get("nccl") else "")


def interface_in(facts: dict, cidr: str) -> Optional[str]:
    """The host's name for its interface on the network ``cidr``."""
    network = ipaddress.ip_network(cidr)
    for interface, addresses in facts["interfaces"].items():
        if any(ipaddress.ip_address(address) in network for address, _ in addresses):
            return interface
    return None


def _network(c: Comparison, name: str, theirs: dict) -> None:
    if c.network is None:
        return
    there = interface_in(theirs, c.network.cidr)
    if there is None:
        c.add(name, f"no interface on {c.network.cidr}, the network this host reaches the others by",
              "give it an address on that network, or launch from a host that shares one with every host")
        return
    if there != c.network.interface:
        theirs_adapt = (theirs["horovod_build"] or {}).get("own_interface")
        ours_adapt = (c.here.facts["horovod_build"] or {}).get("own_interface")
        if theirs_adapt and ours_adapt:
            c.notes.append(f"{name} names the job's network {c.network.cidr} {there} ({c.network.interface} here): "
                           f"its ranks take their own name (hvdkit's Horovod); a name you set yourself "
                           f"(NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME) must list both")
        else:
            whose = "its" if not theirs_adapt else "this host's"
            c.add(name, f"the job's network {c.network.cidr} is {there} there, {c.network.interface} here, and "
                        f"{whose} Horovod gives every rank one name",
                  "build Horovod with hvdkit on every host (python -m hvdkit.build), whose ranks take their own "
                  "name, or give the interface the same name on every host")


def _slots(c: Comparison, host: Host, theirs: dict) -> None:
    if not host.slots:  # named without slots: compared, not counted
        return
    if host.slots > theirs["cores"]:
        c.add(host.name, f"{host.slots} slots but {theirs['cores']} cores",
              f"ranks would share cores and every step waits for the slowest: give it at most "
              f"{theirs['cores']} slots ({host.name}:{theirs['cores']})", kind="slots")
    gpus = len(theirs["gpus"])
    if gpus and host.slots > gpus:
        c.add(host.name, f"{host.slots} slots but {gpus} GPUs", f"one rank per GPU: {host.name}:{gpus}")


def row(host: str, slots: Optional[int], got: Probe, c: Comparison) -> list[str]:
    if got.facts is None:
        return [host, "unreachable", *[""] * (len(HEADER) - 2)]
    f = got.facts
    net = ""
    if c is not None and c.network is not None:
        net = f"{interface_in(f, c.network.cidr) or 'none'} {c.network.cidr}"
    gpus = f"{len(f['gpus'])} {f['gpus'][0]['name']} ({f['gpus'][0]['driver']})" if f["gpus"] else "none"
    return [host, "ok", f["python"], f["packages"]["torch"] or "-", f["packages"]["horovod"] or "-",
            f["mpi"] or "-", net or "-",
            "-" if f["seen"] is None else ("shared" if f["seen"] else "NOT shared"),
            f"{got.offset:+.3f} s" if got.offset is not None else "-",
            f"{slots if slots is not None else '-'}/{f['cores']}", gpus]


HEADER = ["HOST", "REACH", "PYTHON", "TORCH", "HOROVOD", "MPI", "NETWORK", "DIR", "CLOCK", "SLOTS/CORES", "GPUS"]


def table(rows: Sequence[Sequence[str]]) -> str:
    rows = [HEADER, *rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(r, widths, strict=True)).rstrip() for r in rows)


def default_directory(environ: Mapping[str, str]) -> str:
    """The directory a job's ranks write to, which every host must see: hvdkit's checkpoint or
    log directory, else ./runs."""
    return environ.get("HVDKIT_CHECKPOINT_DIR") or environ.get("HVDKIT_LOG_DIR") or "runs"


def marker_directory(directory: str) -> Path:
    """Where the shared-directory test file goes: the directory, or its nearest existing parent
    (a run directory is made by the first run)."""
    path = Path(directory).resolve()
    while not path.exists():
        path = path.parent
    return path


class Checked(NamedTuple):
    table: str
    findings: list  # [Finding]: problems, each with its fix
    notes: list  # [str]: differences hvdkit takes care of


def probe_all(hosts: Sequence[Host], seen: str, in_allocation: bool,
              python: str) -> tuple[Probe, dict[str, Probe], list[Finding]]:
    """This host's probe, each resolvable host's (at once, in threads), and a finding for each
    host that does not resolve."""
    reach = srun_command if in_allocation else ssh_command
    commands, unresolved = {"(this host)": facts_command(python, seen)}, []
    for h in hosts:
        try:
            remote = bool(remote_hosts([h.name]))
        except NetworkError as exc:
            unresolved.append(Finding(h.name, str(exc), "fix the name or the route before launching"))
            continue
        # The launcher starts a local host's ranks without ssh (srun: on a node of the allocation).
        commands[h.name] = reach(h.name, facts_command(python, seen)) if remote or in_allocation \
            else facts_command(python, seen)
    results: dict[str, Probe] = {}
    threads = [threading.Thread(target=lambda n=n, cmd=cmd: results.__setitem__(n, probe(n, cmd)))
               for n, cmd in commands.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    here = results.pop("(this host)")
    if here.facts is None:
        raise RuntimeError(f"this host's own facts could not be read: {here.error}")
    return here, results, unresolved


def check(hosts: Sequence[Host], *, directory: Optional[str], in_allocation: bool = False,
          python: str = sys.executable) -> Checked:
    """Probe this host and ``hosts`` and compare them; ``directory`` must be shared."""
    marker = None
    if directory:
        marker = tempfile.NamedTemporaryFile(prefix=".hvdkit-doctor-", dir=marker_directory(directory))
    try:
        here, results, unresolved = probe_all(hosts, marker.name if marker else os.devnull, in_allocation, python)
    finally:
        if marker:
            marker.close()
    alone = table([row(f"{here.facts['host']} (here)", None, here, None)])
    if unresolved:
        return Checked(alone, unresolved, [])
    try:
        network = routable_network([h.name for h in hosts])
    except NetworkError as exc:  # no route to one of them
        return Checked(alone, [Finding("(this host)", str(exc), "fix the route before launching")], [])
    comparison = Comparison(here, list(hosts), results, network, directory if marker else None, in_allocation)
    findings = compare(comparison)
    rows = [row(f"{here.facts['host']} (here)", None, here, comparison)]
    rows += [row(h.name, h.slots or None, results[h.name], comparison) for h in hosts]
    return Checked(table(rows), findings, comparison.notes)


def main(hosts: Sequence[Host], directory: Optional[str], in_allocation: bool) -> int:
    started = time.monotonic()
    checked = check(hosts, directory=directory, in_allocation=in_allocation)
    print(checked.table, flush=True)
    for note in checked.notes:
        print(f"doctor: note: {note}", flush=True)
    for finding in checked.findings:
        print(finding.line(), file=sys.stderr)
    count = len(checked.findings)
    verdict = f"{count} problem{'s' if count != 1 else ''}" if count else "all hosts agree"
    print(f"doctor: {len(hosts)} host{'s' if len(hosts) != 1 else ''} checked in "
          f"{time.monotonic() - started:.1f} s: {verdict}", flush=True)
    return job.FAILED if checked.findings else job.OK
