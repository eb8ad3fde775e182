"""The network between a job's hosts: which interface reaches them, and whether they still answer.

Two multi-node failures Horovod users meet most are network ones. A node with several
interfaces (docker0 with the same address on every node, ib0, a management NIC) makes an MPI
that tries them all hang at its first message; hvdkit launch pins MPI to the interface of
this host's route to the others. A host whose link goes down leaves the other ranks blocked
in a collective for as long as TCP retries (many minutes); hvdkit launch watches the hosts and
ends the job, naming the host, within seconds.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from hvdkit.job import LOST_SECONDS, PROBE_SECONDS
from hvdkit.system import probes

PROBE_PORT = 22  # ssh, which horovodrun and mpirun use to start the ranks; a refusal is an answer too


class NetworkError(ValueError):
    """A host that does not resolve or has no route: one line, before anything starts."""


@dataclass(frozen=True)
class Network:
    interface: str  # its name on this host: eth0
    cidr: str  # 10.1.0.0/24: what Open MPI takes, whatever the interface is called elsewhere
    peers: tuple = ()  # the hosts reached through it


def source_address(address: str) -> str:
    """The address this host sends from to ``address``: the kernel's route, no packet sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))
        return probe.getsockname()[0]


def ipv4_interfaces() -> dict[str, list[tuple[str, str]]]:
    """{interface: [(address, netmask)]} of this host."""
    import psutil

    return {name: [(a.address, a.netmask) for a in addrs if a.family == socket.AF_INET and a.netmask]
            for name, addrs in psutil.net_if_addrs().items()}


def remote_hosts(names: Sequence[str], resolve: Callable[[str], str] = socket.gethostbyname,
                 interfaces: Callable[[], dict] = ipv4_interfaces) -> dict[str, str]:
    """{name: address} of the hosts that are not this one."""
    local = {address for addresses in interfaces().values() for address, _ in addresses}
    found = {}
    for name in names:
        try:
            address = resolve(name)
        except OSError:
            raise NetworkError(f"host {name} does not resolve on this host (check /etc/hosts or DNS)") from None
        if address not in local and not address.startswith("127."):
            found[name] = address
    return found


def routable_network(names: Sequence[str], resolve: Callable[[str], str] = socket.gethostbyname,
                     source_for: Callable[[str], str] = source_address,
                     interfaces: Callable[[], dict] = ipv4_interfaces) -> Optional[Network]:
    """The interface through which this host reaches the job's other hosts; None when every
    host is this one, or they are reached through different interfaces.

    Measured on namespace hosts with a docker0 on each (tests/hosts.py): Open MPI's mpirun
    hangs at the first message sent to a peer's docker0 address; pinned to the route's
    interface, the same job completes.
    """
    via = {}
    for name, address in remote_hosts(names, resolve, interfaces).items():
        try:
            via[name] = source_for(address)
        except OSError as exc:
            raise NetworkError(f"no route from this host to {name} ({address}): {exc.strerror or exc}") from None
    if len(set(via.values())) != 1:
        return None
    source = next(iter(via.values()))
    for interface, addresses in interfaces().items():
        for address, netmask in addresses:
            if address == source:
                return Network(interface, str(ipaddress.ip_network(f"{address}/{netmask}", strict=False)), tuple(via))
    return None


def probe_host(address: str, port: int = PROBE_PORT, timeout: float = PROBE_SECONDS) -> Optional[bool]:
    """The host's sshd, probed: True if it accepts, False if it refuses (the host answers: a
    refusal is an answer), None if nothing answers."""
    return probes.probe(address, port, timeout)


class HostWatch:
    """Probes each remote host every ``every`` seconds from a thread; ``lost`` holds the first
    line naming a host that has not answered for ``lost_after`` seconds, ``lost_host`` its name.
    ``probe`` as probe_host; ``with_sshd``: the hosts whose sshd accepted as the watch began."""

    def __init__(self, hosts: dict[str, str], lost_after: float = LOST_SECONDS,
                 probe: Callable[[str], Optional[bool]] = probe_host, every: float = PROBE_SECONDS,
                 ranks: Optional[dict[str, list[int]]] = None) -> None:
        self.hosts, self.lost_after, self.probe, self.every = hosts, lost_after, probe, every
        self.with_sshd: set[str] = set()
        self.ranks = ranks or {}
        self.lost: Optional[str] = None
        self.lost_host = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hvdkit-hostwatch", daemon=True)
        if hosts:
            self._thread.start()

    def _watch(self) -> None:
        self.with_sshd.update(name for name, address in self.hosts.items() if self.probe(address))
        last_answer = {name: time.monotonic() for name in self.hosts}
        while not self._stop.wait(self.every):
            for name, address in self.hosts.items():
                if self.probe(address) is not None:
                    last_answer[name] = time.monotonic()
                elif time.monotonic() - last_answer[name] >= self.lost_after:
                    self.lost_host = name
                    self.lost = (f"host {name} ({self._where(name)}) has not answered on the network for "
                                 f"{time.monotonic() - last_answer[name]:.0f} s; ending the job")
                    return

    def _where(self, name: str) -> str:
        ranks = self.ranks.get(name)
        if not ranks:
            return self.hosts[name]
        return f"{self.hosts[name]}, rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"

    def confirm(self) -> Optional[str]:
        """Probe every host once, now: after the launcher failed sooner than ``lost_after`` (Open
        MPI ends a job within a second of losing a host's daemon), whether a host went with it:
        it does not answer, or answers but its sshd, there when the watch began, is gone (a restart
        there would fail at once; a host reached otherwise, as containers are, never had one)."""
        if self.lost or not self.hosts:
            return self.lost
        self.stop()
        for name, address in self.hosts.items():
            answer = self.probe(address)
            why = ("does not answer on the network" if answer is None else
                   f"refuses ssh (port {PROBE_PORT}) since the job began: no rank starts there"
                   if answer is False and name in self.with_sshd else "")
            if why:
                self.lost_host = name
                self.lost = f"host {name} ({self._where(name)}) {why}; the job ended without it"
                break
        return self.lost

    def stop(self) -> None:
        self._stop.set()
