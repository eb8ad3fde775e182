"""Hosts for a launch: horovodrun's -H lists, hostfiles in three formats, Slurm allocations.

A host is a name and its slots; every way of giving them is read into the same list, checked
(each host has a name and a slot count >= 1) before anything starts, and written back in the
format a launcher reads (``format_hostfile``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from hvdkit import slurm

HOSTFILE_FORMATS = ("horovodrun", "openmpi", "mpich")


class LaunchError(ValueError):
    """Bad launch input; printed as one line before anything starts."""


@dataclass(frozen=True)
class Host:
    name: str
    slots: int  # 0: not given (`hvdkit doctor -H node0,node1` compares hosts and needs none)


def _host(text: str, where: str, bare: bool = False) -> Host:
    match = re.fullmatch(r"([A-Za-z0-9_.\-]+)(?::(\S*))?", text.strip())
    if not match:
        raise LaunchError(f"{where}: cannot read host {text.strip()!r} (expected host:slots)")
    name, slots = match.group(1), match.group(2)
    if slots is None and bare:
        return Host(name, 0)
    if slots is None or slots == "":
        raise LaunchError(f"{where}: host {name!r} has no slot count (write {name}:N)")
    if not slots.isdigit() or int(slots) < 1:
        raise LaunchError(f"{where}: host {name!r} has slot count {slots!r}, expected a number >= 1")
    return Host(name, int(slots))


def parse_hosts(spec: str, bare: bool = False) -> list[Host]:
    """``host1:4,host2:4`` (horovodrun's -H); with ``bare``, also ``host1,host2`` as mpirun's -H
    takes them (slots 0: not given)."""
    if not spec.strip():
        raise LaunchError("-H: no hosts given")
    return [_host(part, "-H", bare) for part in spec.split(",")]


def read_hostfile(path: str, bare: bool = False) -> list[Host]:
    """A hostfile in any of the three formats: ``host:N``, ``host slots=N`` (Open MPI); with
    ``bare``, also a line with a name alone (slots 0: not given)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise LaunchError(f"hostfile {path}: {exc.strerror}") from None
    hosts = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"hostfile {path} line {number}"
        openmpi = re.fullmatch(r"(\S+)\s+slots\s*=\s*(\S+)(?:\s+max[-_]slots\s*=\s*\d+)?", line)
        if openmpi:
            hosts.append(_host(f"{openmpi.group(1)}:{openmpi.group(2)}", where))
        elif " " in line or "\t" in line:
            raise LaunchError(f"{where}: cannot read {line!r} (expected 'host slots=N' or 'host:N')")
        else:
            hosts.append(_host(line, where, bare))
    if not hosts:
        raise LaunchError(f"hostfile {path} lists no hosts")
    return hosts


def format_hostfile(hosts: Sequence[Host], fmt: str) -> str:
    """The hosts as a hostfile for horovodrun (host:slots), Open MPI (host slots=N) or MPICH (host:N)."""
    if fmt == "openmpi":
        return "".join(f"{h.name} slots={h.slots}\n" for h in hosts)
    if fmt in HOSTFILE_FORMATS:  # horovodrun's and MPICH's: host:N
        return "".join(f"{h.name}:{h.slots}\n" for h in hosts)
    raise LaunchError(f"unknown hostfile format {fmt!r}; choose one of: {', '.join(HOSTFILE_FORMATS)}")


def slurm_hosts(environ: Mapping[str, str]) -> list[Host]:
    try:
        return [Host(name, tasks) for name, tasks in slurm.allocation(environ)]
    except slurm.SlurmFormatError as exc:
        raise LaunchError(f"Slurm: {exc}") from None


def host_list(hosts: Sequence[Host]) -> str:
    return ",".join(f"{h.name}:{h.slots}" for h in hosts)


def several(hosts: Optional[Sequence[Host]]) -> bool:
    """Whether the hosts are more than one machine (one listed twice is one)."""
    return hosts is not None and len({h.name for h in hosts}) > 1


def needed(hosts: Sequence[Host], np: int) -> tuple[list[Host], list[Host]]:
    """(the hosts whose slots, filled in order, take ``np`` ranks; the rest: spares, which a
    restart takes in place of a lost host). All are needed where their slots are too few."""
    used, slots = [], 0
    for host in hosts:
        if slots >= np:
            break
        used.append(host)
        slots += host.slots
    return used, list(hosts[len(used):])


def split_groups(placed: Mapping[str, Sequence[int]], tp: int) -> Optional[str]:
    """Where a tensor-parallel group of ``tp`` consecutive ranks would span hosts under ``placed``
    (ranks_by_host), what to say; None where each group is on one host."""
    host_of = {rank: host for host, ranks in placed.items() for rank in ranks}
    for first in range(0, len(host_of), tp):
        hosts = sorted({host_of[rank] for rank in range(first, first + tp) if rank in host_of})
        if len(hosts) > 1:
            slots = ", ".join(f"{host} {len(ranks)}" for host, ranks in placed.items())
            return (f"tp {tp}: the tensor-parallel group of ranks {first}-{first + tp - 1} would span hosts "
                    f"{' and '.join(hosts)} (ranks per host: {slots}), and every layer's allreduces would cross "
                    f"the network; give each host a multiple of {tp} slots")
    return None


def ranks_by_host(hosts: Sequence[Host], np: int) -> dict[str, list[int]]:
    """The ranks each host runs when the launcher fills the hosts' slots in order (mpirun's
    default by-slot mapping, and horovodrun's): to name the ranks a lost host took with it."""
    placed: dict[str, list[int]] = {}
    rank = 0
    for host in hosts:
        take = min(host.slots, np - rank)
        placed.setdefault(host.name, []).extend(range(rank, rank + take))
        rank += take
    return placed
