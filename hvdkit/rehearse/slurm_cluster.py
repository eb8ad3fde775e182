"""A real Slurm cluster on namespace hosts (hvdkit.rehearse.namespaces): for `hvdkit rehearse --slurm` and the tests.

slurmctld and a slurmd on the first host, a slurmd on each of the others; each node is its
host's name and address (NodeAddr 10.231.0.11, .12, ...) with a /tmp of its own, as real nodes
have, so srun --mpi=pmix uses the default TmpFS. Commands a user would type (sbatch, scancel,
salloc) run on the first host, the login node. Debian's slurm-wlm and munge; munged's socket
is shared by the hosts.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Optional, Sequence

from hvdkit.system import proctree

BINARIES = ("munged", "munge", "slurmctld", "slurmd", "sbatch", "sinfo", "scontrol")


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if not shutil.which(b) and not Path("/usr/sbin", b).exists()]


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


MUNGED_PID = Path("/run/munge/munged.pid")


def ensure_munge() -> Optional[int]:
    """munged runs as the munge user; start it unless a credential already round-trips. The PID
    of the munged started here (for whoever started it to end it), None if one was running."""
    if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0:
        return None
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    if not Path("/etc/munge/munge.key").exists():
        subprocess.run(["mungekey", "--create"], check=True)
        shutil.chown("/etc/munge/munge.key", "munge", "munge")
    subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", _sbin("munged")], check=True)
    for _ in range(50):
        if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0:
            return int(MUNGED_PID.read_text())
        time.sleep(0.1)
    raise RuntimeError("munged did not start")


def end_munge(pid: Optional[int]) -> None:
    """End the munged that ensure_munge started (``pid``), by its PID; nothing if it started none."""
    if pid is None:
        return
    proctree.end_processes(proctree.processes([pid]), grace=10)


class SlurmCluster:
    def __init__(self, hosts) -> None:
        """On ``hosts`` (made with own_tmp), every one a node; its files in their shared directory."""
        self.hosts, self.nodes = hosts, list(hosts.names)
        self.root = hosts.dir / "slurm"
        self.home = hosts.dir / "home"  # the users' shared directory: the nodes' /tmp is their own
        self.conf = self.root / "slurm.conf"
        self.env = dict(hosts.env(), SLURM_CONF=str(self.conf))
        self.processes: list[subprocess.Popen] = []
        self.munged: Optional[int] = None  # the munged this cluster started, if it did

    def on(self, command: Sequence[str]) -> list[str]:
        """``command`` as typed on the login node."""
        return self.hosts.on(self.nodes[0], command)

    def run(self, command: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.on(command), env=kwargs.pop("env", self.env), capture_output=True, text=True,
                              **kwargs)

    def write_config(self) -> None:
        for sub in ("state", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.home.mkdir(exist_ok=True)
        cpus = os.cpu_count() or 1
        nodes = "\n".join(f"NodeName={n} NodeAddr={self.hosts.address(n)} CPUs={cpus} State=UNKNOWN"
                          for n in self.nodes)
        head = self.nodes[0]
        self.conf.write_text(f"""\
ClusterName=hvdkit-test
SlurmctldHost={head}({self.hosts.address(head)})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={self.root}/state
SlurmdSpoolDir=/tmp/slurmd
SlurmctldPidFile=/tmp/slurmctld.pid
SlurmdPidFile=/tmp/slurmd.pid
SlurmctldLogFile={self.root}/log/slurmctld.log
SlurmdLogFile={self.root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=5
MinJobAge=3600
InactiveLimit=0
{nodes}
PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
""")

    def start(self, timeout: float = 60) -> None:
        self.munged = ensure_munge()
        self.write_config()
        self.processes.append(subprocess.Popen(self.on([_sbin("slurmctld"), "-D", "-f", str(self.conf)]),
                                               env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for node in self.nodes:
            (self.hosts.tmp(node) / "slurmd").mkdir()  # SlurmdSpoolDir, on the node's own disk
            self.processes.append(subprocess.Popen(self.hosts.on(node, [_sbin("slurmd"), "-D", "-N", node, "-f",
                                                                        str(self.conf)]),
                                                   env=self.env, stdout=subprocess.DEVNULL,
                                                   stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"])
            states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
            if all(states.get(n) == "idle" for n in self.nodes):
                return
            time.sleep(0.5)
        raise RuntimeError(f"Slurm nodes not idle after {timeout:.0f} s: {out.stdout.strip() or out.stderr.strip()}\n"
                           + (self.root / "log" / "slurmctld.log").read_text()[-2000:])

    def stop(self) -> None:
        self.run(["scancel", "--full", "--user", "root"])
        proctree.end_processes(proctree.processes([proc.pid for proc in reversed(self.processes)]), grace=20)
        for proc in self.processes:
            proc.wait()  # collected (end_processes waited for them to end)
        end_munge(self.munged)

    def sbatch(self, *args: str, env: dict | None = None) -> str:
        out = self.run(["sbatch", "--parsable", *args], env=env or self.env)
        if out.returncode != 0:
            raise RuntimeError(f"sbatch failed: {out.stderr.strip()}")
        return out.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict:
        return next(iter(self.jobs(job_id)), {})

    def jobs(self, job_id: str = "") -> list[dict]:
        """The controller's record of each job (of ``job_id`` alone, if given), as KEY=VALUE pairs."""
        out = self.run(["scontrol", "-o", "show", "job", *([job_id] if job_id else [])])
        return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in out.stdout.splitlines() if line.startswith("JobId=")]

    def release_requeued(self, job_id: str, timeout: float = 120, exclude: Optional[str] = None) -> dict:
        """Once a requeued job waits for its begin time (Slurm holds a requeued batch job back about
        2 minutes), let it start now, as an administrator may: its requeue and restart are real,
        only the wait is cut. ``exclude``: nodes the restart may not use (slurmd 22.05 took a job
        relaunched on its node within a second of the requeue for one it had killed, and reported
        it complete without running it). The job's record when it was released (or ended)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") == "PENDING" and info.get("Reason") == "BeginTime":
                self.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now",
                          *([f"ExcNodeList={exclude}"] if exclude else [])])
                return info
            if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
                return info
            time.sleep(0.2)
        raise TimeoutError(f"job {job_id} was not requeued within {timeout:.0f} s: {self.job(job_id)}")

    def wait(self, job_id: str, timeout: float = 240, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                               "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.5)
        self.run(["scancel", job_id])
        raise TimeoutError(f"job {job_id} still {self.job(job_id).get('JobState')} after {timeout:.0f} s")
