"""Hosts on one machine: network namespaces on a private switch, each with its own address,
host name, sshd and, if asked, a shaped link and a docker0 that routes nowhere. `hvdkit
rehearse` runs a user's job on them (hvdkit.rehearse.cli); the multi-host tests use them too.

    with Hosts(3) as hosts:
        subprocess.run(hosts.on("h1", ["horovodrun", "-np", "3", "-H", "h1:1,h2:1,h3:1", ...]),
                       env=hosts.env())

Every name carries this process's PID and a count, so two runs, or two sets of hosts in one
run, never share anything. The hosts' links meet on a bridge inside a switch namespace: the
machine's own network and the root namespace see none of their traffic. Addresses are
10.231.0.11.. (eth0, routed between hosts) and, with docker0, 10.231.1.1 on every host
(routed nowhere, as Docker's bridge is), both inside the namespaces only. Each host's name
resolves from every host (/etc/netns/<ns>/hosts); commands run there see that host's name (a
UTS namespace of their own). The filesystem is shared, as a cluster's home is; with
``own_tmp`` each host has a /tmp of its own, as a node's local disk (the working directory,
hvdkit and its Python, should they be under /tmp, stay shared). With ``cpus`` each host runs
on its own share of this machine's cores (CPU affinity, inherited by everything its sshd
starts), as a real host computes on its own cores; with more hosts than cores, hosts share.
Removing the hosts ends every process still in their namespaces first.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from hvdkit.args import bits_per_second
from hvdkit.system import proctree

SUBNET = "10.231.0"  # the hosts' routed network, /24
FIRST_HOST = 11  # the hosts' addresses: SUBNET.11, .12, ... up to .254
MAX_HOSTS = 254 - FIRST_HOST + 1
DOCKER0 = "10.231.1.1/24"  # the same address on every host, as Docker's bridge has
SSHD = "/usr/sbin/sshd"
_made = itertools.count()  # sets of hosts this process has made: part of every name


def seconds(delay: str) -> float:
    """tc's time words: '1ms' -> 0.001, '250us' -> 0.00025, '0.5s' -> 0.5."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(us|ms|s)", delay)
    if not match:
        raise ValueError(f"delay {delay!r}: expected a number and us, ms or s, like 1ms")
    return float(match[1]) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[match[2]]


class HostsUnavailable(Exception):
    """This machine cannot build namespace hosts (not root, no iproute2 or sshd)."""


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


def unavailable() -> Optional[str]:
    """Why namespace hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "namespace hosts need root (ip netns add)"
    for tool in ("ip", "nsenter", "unshare", "tc", SSHD, "ssh", "ssh-keygen"):
        if not shutil.which(tool):
            return f"{tool} not found: apt-get install iproute2 openssh-server openssh-client"
    return None


class Hosts:
    def __init__(self, count: int, docker0: bool = False, rate: Optional[str] = None, own_tmp: bool = False,
                 cpus: bool = False, delay: Optional[str] = None, names: Optional[Sequence[str]] = None,
                 interfaces: Optional[dict] = None) -> None:
        """``count`` hosts named h1..hN, or ``names``; ``rate`` and ``delay`` shape what each sends;
        ``interfaces`` names a host's link other than eth0 ({"h2": "ens5"}), as hosts of another
        make name the same network differently."""
        self.names = list(names) if names else [f"h{i}" for i in range(1, count + 1)]
        if len(self.names) > MAX_HOSTS:
            raise ValueError(f"{len(self.names)} hosts: at most {MAX_HOSTS} fit the hosts' network "
                             f"({SUBNET}.{FIRST_HOST} to {SUBNET}.254)")
        self.interfaces = dict(interfaces or {})
        self.prefix = f"hvdk{os.getpid()}x{next(_made)}"
        self.docker0, self.rate, self.delay, self.own_tmp, self.cpus = docker0, rate, delay, own_tmp, cpus
        self.dir: Optional[Path] = None
        self.sshd: dict[str, subprocess.Popen] = {}

    # -- names -------------------------------------------------------------------------------
    def ns(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def interface(self, name: str) -> str:
        """Host ``name``'s name for the hosts' network."""
        return self.interfaces.get(name, "eth0")

    def address(self, name: str) -> str:
        return f"{SUBNET}.{FIRST_HOST + self.names.index(name)}"

    def on(self, name: str, command: Sequence[str]) -> list[str]:
        """``command`` as if typed on host ``name``: its network, its /etc/hosts, its host name
        and, with ``own_tmp``, its own /tmp (a node-local disk; everything else is shared).
        nsenter rather than `ip netns exec`, which mounts a sysfs of its own over /sys and so
        hides the cgroup tree that slurmd needs; the hosts file is bound here instead."""
        ns = self.ns(name)
        mounts = [f"--bind /etc/netns/{ns}/hosts /etc/hosts"]
        if self.own_tmp:  # what must stay shared goes into the host's /tmp first, then that over /tmp
            mounts += [f"--bind /tmp/{kept} {self.tmp(name) / kept}" for kept in self.kept_in_tmp()]
            mounts.append(f"--rbind {self.tmp(name)} /tmp")
        setup = "".join(f"mount {mount} && " for mount in mounts)
        pin = ["taskset", "--cpu-list", self.host_cpus(name)] if self.cpus else []
        return [*pin, "nsenter", f"--net=/run/netns/{ns}", "unshare", "--uts", "--mount", "sh", "-c",
                f'{setup}hostname {name} && exec "$@"', name, *command]

    def host_cpus(self, name: str) -> str:
        """Host ``name``'s cores ('0' or '0,2'): this machine's cores dealt out in turn."""
        cores = sorted(os.sched_getaffinity(0))
        index, count = self.names.index(name), len(self.names)
        mine = cores[index::count] if len(cores) >= count else [cores[index % len(cores)]]
        return ",".join(map(str, mine))

    @staticmethod
    def kept_in_tmp() -> list[str]:
        """The working directory, hvdkit's checkout and the Python running it, relative to /tmp,
        where they are under /tmp (a CI clone): own_tmp must not hide them from the hosts."""
        paths = [Path.cwd().resolve(), Path(__file__).resolve().parents[2], Path(sys.prefix).resolve()]
        under = {p.relative_to("/tmp") for p in paths if p.is_relative_to("/tmp") and p != Path("/tmp")}
        return sorted(str(p) for p in under if not any(p != q and p.is_relative_to(q) for q in under))

    def tmp(self, name: str) -> Path:
        """Host ``name``'s /tmp, as this machine sees it (with ``own_tmp``)."""
        return self.dir / "tmp" / name

    def env(self, base: Optional[dict] = None) -> dict:
        """An environment whose ``ssh`` reaches the hosts with the fixture's key (as a user's
        ~/.ssh/config would), for horovodrun and mpirun, which call ``ssh`` from PATH."""
        env = dict(os.environ if base is None else base)
        env["PATH"] = f"{self.dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        return env

    # -- life --------------------------------------------------------------------------------
    def __enter__(self) -> "Hosts":
        problem = unavailable()
        if problem:
            raise HostsUnavailable(problem)
        # Not in /tmp, which own_tmp hides on the hosts: the ssh wrapper and keys live here.
        self.dir = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-", dir="/var/tmp"))
        for name in self.names:
            self.tmp(name).mkdir(parents=True)
            self.tmp(name).chmod(0o1777)
            for kept in self.kept_in_tmp() if self.own_tmp else []:
                (self.tmp(name) / kept).mkdir(parents=True)
        try:
            self._network()
            self._ssh()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def _network(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        table = "127.0.0.1 localhost\n" + "".join(f"{self.address(n)} {n}\n" for n in self.names)
        for name in self.names:
            ns = self.ns(name)
            _ip("netns", "add", ns)
            Path(f"/etc/netns/{ns}").mkdir(parents=True, exist_ok=True)
            Path(f"/etc/netns/{ns}/hosts").write_text(table)
            _ip("-n", ns, "link", "set", "lo", "up")
            link = self.interface(name)
            _ip("-n", self.switch, "link", "add", name, "type", "veth", "peer", "name", link, "netns", ns)
            _ip("-n", self.switch, "link", "set", name, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.address(name)}/24", "dev", link)
            _ip("-n", ns, "link", "set", link, "up")
            if self.docker0:  # up, with carrier (a container's veth attached), routing nowhere
                _ip("-n", ns, "link", "add", "docker0", "type", "veth", "peer", "name", "vethc0")
                _ip("-n", ns, "addr", "add", DOCKER0, "dev", "docker0")
                _ip("-n", ns, "link", "set", "vethc0", "up")
                _ip("-n", ns, "link", "set", "docker0", "up")
            if self.rate or self.delay:
                self.shape(name, self.rate, self.delay)

    def shape(self, name: str, rate: Optional[str], delay: Optional[str] = None) -> None:
        """Limit what host ``name`` sends to ``rate`` (tc tbf) and, with ``delay``, hold each packet
        that long (tc netem, which also takes the rate). tbf's bucket holds 4 ms of the rate (at
        least 256 KiB): tbf refills once per timer tick, and a smaller bucket caps a 10gbit link
        well below its rate."""
        if delay:
            qdisc = ["netem", "delay", delay, *(["rate", rate] if rate else [])]
        else:
            qdisc = ["tbf", "rate", rate, "burst", str(max(256 * 1024, int(bits_per_second(rate) / 8 * 0.004))),
                     "latency", "50ms"]
        proc = subprocess.run(["ip", "netns", "exec", self.ns(name), "tc", "qdisc", "replace", "dev",
                               self.interface(name), "root", *qdisc], capture_output=True, text=True)
        if proc.returncode != 0 and delay and "unknown" in proc.stderr:
            raise HostsUnavailable(f"a delay of {delay} needs tc's netem queue (kernel module sch_netem), "
                                   "which this machine's kernel lacks")
        if proc.returncode != 0:
            raise RuntimeError(f"tc {' '.join(qdisc)} on {name}: {proc.stderr.strip()}")

    def unshape(self, name: str) -> None:
        """Host ``name``'s link at full speed again (nothing to do if it is not shaped)."""
        subprocess.run(["ip", "netns", "exec", self.ns(name), "tc", "qdisc", "del", "dev", self.interface(name),
                        "root"], capture_output=True)

    def rename(self, name: str, interface: str) -> None:
        """Host ``name``'s link renamed, its address kept (a host of another make, or another
        udev naming scheme)."""
        old, ns = self.interface(name), self.ns(name)
        _ip("-n", ns, "link", "set", old, "down")
        _ip("-n", ns, "link", "set", old, "name", interface)
        _ip("-n", ns, "link", "set", interface, "up")
        self.interfaces[name] = interface

    def link(self, name: str, up: bool) -> None:
        """Take host ``name``'s link down (a pulled cable, a dead switch port) or up again."""
        _ip("-n", self.ns(name), "link", "set", self.interface(name), "up" if up else "down")

    def _ssh(self) -> None:
        d = self.dir
        for key in ("client", "host"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True)
        (d / "authorized_keys").write_text((d / "client.pub").read_text())
        (d / "ssh_config").write_text(
            f"Host {' '.join(self.names)}\n  User root\n  IdentityFile {d / 'client'}\n  IdentitiesOnly yes\n"
            "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n  BatchMode yes\n"
            "  ConnectTimeout 5\n")
        (d / "bin").mkdir()
        wrapper = d / "bin" / "ssh"
        wrapper.write_text(f'#!/bin/sh\nexec /usr/bin/ssh -F {d / "ssh_config"} "$@"\n')
        wrapper.chmod(0o755)
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
        for name in self.names:
            self._start_sshd(name)
        self._await_sshd(self.names)

    def _start_sshd(self, name: str, env: Optional[dict] = None) -> None:
        """Host ``name``'s sshd; ``env``: variables every session there gets (sshd's SetEnv), as a
        host's own profile would set them."""
        d = self.dir
        config = d / f"sshd_{name}"
        config.write_text(
            f"ListenAddress {self.address(name)}\nHostKey {d / 'host'}\n"
            f"AuthorizedKeysFile {d / 'authorized_keys'}\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            f"UsePAM no\nStrictModes no\nPidFile {d / f'sshd_{name}.pid'}\nMaxStartups 200\nMaxSessions 200\n"
            # One SetEnv line: sshd obeys the first of several.
            + ("SetEnv " + " ".join(f'{key}="{value}"' for key, value in env.items()) + "\n" if env else ""))
        with open(d / f"sshd_{name}.log", "w") as log:
            self.sshd[name] = subprocess.Popen(self.on(name, [SSHD, "-D", "-e", "-f", str(config)]),
                                               stdout=log, stderr=subprocess.STDOUT)

    def _await_sshd(self, names: Sequence[str]) -> None:
        deadline = time.monotonic() + 20
        for name in names:
            while subprocess.run(self.on(self.names[0], ["ssh", name, "true"]), env=self.env(),
                                 capture_output=True).returncode != 0:
                if self.sshd[name].poll() is not None or time.monotonic() > deadline:
                    log = (self.dir / f"sshd_{name}.log").read_text()[-1000:]
                    raise RuntimeError(f"sshd on {name} is not reachable: {log}")
                time.sleep(0.2)

    def stop_sshd(self, name: str) -> None:
        """Host ``name`` refuses ssh (its sshd ended; the host stays up)."""
        self.sshd[name].terminate()
        self.sshd[name].wait(timeout=10)

    def restart_sshd(self, name: str, env: Optional[dict] = None) -> None:
        """Host ``name``'s sshd anew, with ``env`` for its sessions (or none)."""
        if self.sshd[name].poll() is None:
            self.stop_sshd(name)
        self._start_sshd(name, env)
        self._await_sshd([name])

    def bind(self, name: str, source: str, target: str) -> None:
        """Host ``name`` sees the file ``source`` at ``target`` (another version installed there):
        a bind mount in its sshd's mount namespace, which every session there inherits."""
        subprocess.run(["nsenter", f"--target={self.sshd[name].pid}", "--mount", "mount", "--bind", source, target],
                       check=True, capture_output=True)

    def unbind(self, name: str, target: str) -> None:
        subprocess.run(["nsenter", f"--target={self.sshd[name].pid}", "--mount", "umount", target],
                       check=True, capture_output=True)

    def lose(self, name: str) -> None:
        """Host ``name`` fails: every process on it is killed, its sshd too, and once they are gone
        and their connections' last packets have left (a shaped link queues them), its link goes
        down, so that nothing reaches it any more. The other hosts see their connections to it
        closed, as when a node's processes die; a link cut first would leave them waiting for
        their collectives' timeouts (Gloo's: 30 s)."""
        deadline = time.monotonic() + 10
        while self.pids(name) and time.monotonic() < deadline:  # sshd may fork a session as we go
            proctree.end_processes(proctree.processes(self.pids(name)), grace=0)
        time.sleep(1.0)
        self.link(name, up=False)

    def end_jobs(self, name: str) -> None:
        """End every process on host ``name`` but its sshd (what a lost host left behind)."""
        keep = self.sshd[name].pid
        proctree.end_processes(proctree.processes([pid for pid in self.pids(name) if pid != keep]), grace=0)

    def commands(self, name: str) -> list[str]:
        """The names of the processes on host ``name``, its sshd and ssh sessions included."""
        names = []
        for pid in self.pids(name):
            try:
                names.append(Path(f"/proc/{pid}/comm").read_text().strip())
            except OSError:
                pass
        return names

    def pids(self, name: Optional[str] = None) -> list[int]:
        """Every process in host ``name``'s namespace, or in all of the hosts' namespaces: ours,
        since we made the namespaces."""
        found = []
        for ns in [self.ns(name)] if name else [self.ns(n) for n in self.names] + [self.switch]:
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
            found += [int(pid) for pid in out.split()]
        return found

    def remove(self) -> None:
        """End every process on the hosts, then remove namespaces, their files and keys."""
        proctree.end_processes(proctree.processes(self.pids()), grace=5)
        proctree.end_processes(proctree.processes(self.pids()), grace=0)  # any started while they ended
        for proc in self.sshd.values():
            proc.wait(timeout=10)
        for ns in [self.ns(n) for n in self.names] + [self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
