"""A real two-node Slurm cluster on this host, for the tests: one slurmctld, two slurmd.

Debian's slurm-wlm and munge; both nodes are 127.0.0.1 on their own ports with their own
spool and TmpFS directories. TmpFS=%n matters: srun --mpi=pmix puts its client directory
under TmpFS, and two nodes on one host would otherwise collide on it.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

BINARIES = ("munged", "munge", "slurmctld", "slurmd", "sbatch", "sinfo", "scontrol")
NODES = ("node1", "node2")


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if not shutil.which(b) and not Path("/usr/sbin", b).exists()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def ensure_munge() -> None:
    """munged runs as the munge user; start it unless a credential already round-trips."""
    if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0:
        return
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    if not Path("/etc/munge/munge.key").exists():
        subprocess.run(["mungekey", "--create"], check=True)
        shutil.chown("/etc/munge/munge.key", "munge", "munge")
    subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", _sbin("munged")], check=True)
    for _ in range(50):
        if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0:
            return
        time.sleep(0.1)
    raise RuntimeError("munged did not start")


class SlurmCluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.processes: list[subprocess.Popen] = []

    def write_config(self) -> None:
        for sub in ("state", "log", "run", *(f"spool/{n}" for n in NODES), *(f"tmp/{n}" for n in NODES)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        cpus = os.cpu_count() or 1
        nodes = "\n".join(f"NodeName={n} NodeAddr=127.0.0.1 NodeHostname=localhost Port={_free_port()} "
                          f"CPUs={cpus} State=UNKNOWN" for n in NODES)
        self.conf.write_text(f"""\
ClusterName=hvdkit-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={self.root}/state
SlurmdSpoolDir={self.root}/spool/%n
TmpFS={self.root}/tmp/%n
SlurmctldPidFile={self.root}/run/slurmctld.pid
SlurmdPidFile={self.root}/run/slurmd-%n.pid
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
PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
""")

    def start(self, timeout: float = 60) -> None:
        ensure_munge()
        self.write_config()
        self.processes.append(subprocess.Popen([_sbin("slurmctld"), "-D", "-f", str(self.conf)], env=self.env,
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for node in NODES:
            self.processes.append(subprocess.Popen([_sbin("slurmd"), "-D", "-N", node, "-f", str(self.conf)],
                                                   env=self.env, stdout=subprocess.DEVNULL,
                                                   stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True)
            states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
            if all(states.get(n) == "idle" for n in NODES):
                return
            time.sleep(0.5)
        raise RuntimeError(f"Slurm nodes not idle after {timeout:.0f} s: {out.stdout.strip() or out.stderr.strip()}\n"
                           + (self.root / "log" / "slurmctld.log").read_text()[-2000:])

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "--user", "root"], env=self.env, capture_output=True)
        for proc in reversed(self.processes):
            proc.terminate()
        for proc in self.processes:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()

    def sbatch(self, *args: str, env: dict | None = None) -> str:
        out = subprocess.run(["sbatch", "--parsable", *args], env=env or self.env, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"sbatch failed: {out.stderr.strip()}")
        return out.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict:
        out = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=self.env, capture_output=True, text=True)
        return dict(re.findall(r"(\w+)=(\S*)", out.stdout))

    def wait(self, job_id: str, timeout: float = 240, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                               "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.5)
        subprocess.run(["scancel", job_id], env=self.env)
        raise TimeoutError(f"job {job_id} still {self.job(job_id).get('JobState')} after {timeout:.0f} s")
