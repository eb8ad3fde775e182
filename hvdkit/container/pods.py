"""The pods of an MPIJob as hvdkit's image runs them: its user, paths and port, and each pod's command.

Built once, for both the manifest Kubernetes runs (hvdkit.container.mpijob) and the same job run
as containers on this machine (hvdkit.container.podjob).
"""

from __future__ import annotations

from typing import Sequence

USER_ID = 1000  # the image's user `hvdkit`
HOME = "/home/hvdkit"
SSH_AUTH = f"{HOME}/.ssh"  # sshAuthMountPath: the operator's keys; the image's sshd reads authorized_keys here
HOSTFILE = "/etc/mpi/hostfile"
WORKSPACE = "/workspace"  # the image's working directory: runs and checkpoints
SSH_PORT = 2222  # the image's sshd and ssh client (no root: no port below 1024)
DEFAULT_GRACE = 120  # seconds: a pod's termination grace period, longer than a checkpoint takes


def worker_command() -> list[str]:
    """What each worker runs: the image's own sshd, in the foreground, logging to stderr."""
    return ["/usr/sbin/sshd", "-D", "-e", "-f", f"{HOME}/.sshd/sshd_config"]


def launcher_command(ranks: int, command: Sequence[str]) -> list[str]:
    """What the launcher runs: the ranks, over ssh, on the hosts of the operator's hostfile."""
    return ["hvdkit", "launch", "--launcher", "mpirun", "--hostfile", HOSTFILE, "-np", str(ranks), "--", *command]


def run_env(name: str) -> dict[str, str]:
    """Where the job's logs and checkpoints go on the claim: the same on every restart, so a
    restarted launcher resumes (hvdkit reads these; `hvdkit launch` hands them to each rank)."""
    run_dir = f"{WORKSPACE}/runs/{name}"
    return {"HVDKIT_LOG_DIR": run_dir, "HVDKIT_CHECKPOINT_DIR": f"{run_dir}/checkpoints"}
