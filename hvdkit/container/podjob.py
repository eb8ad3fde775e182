"""The MPIJob run on this machine: containers from hvdkit's image as the MPI operator's pods.

    hvdkit mpijob --run --workers 2 --image localhost/hvdkit:0.1.0-cpu --workspace DIR -- hvdkit train

What the operator does, done with podman or docker: one network; a key pair mounted in every
container at sshAuthMountPath; N workers, each running the image's sshd as the non-root user
(pods.worker_command); once every worker's sshd answers (WaitForWorkersReady), the launcher,
with the hostfile at /etc/mpi/hostfile, running pods.launcher_command (mpirun over ssh into the
workers); DIR mounted at /workspace everywhere, as a ReadWriteMany claim is. A stop signal to this
command does what deleting the launcher's pod does: SIGTERM, the grace period, then SIGKILL
(``engine stop -t GRACE``). When the launcher ends, the workers, the network and the keys go
(cleanPodPolicy: Running); the exit code is the launcher's.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from hvdkit import job
from hvdkit.build.toolchain import last_line
from hvdkit.container import pods
from hvdkit.container.engine import Engine, EngineError, Mount
from hvdkit.system import proctree, sighandlers

READY_SECONDS = 60.0


class PodJobError(EngineError):
    """The job could not be set up: one line."""


def check_workspace(workspace: Path) -> None:
    """The claim's stand-in must be a folder the image's user (uid 1000) can write."""
    if not workspace.is_dir():
        raise PodJobError(f"--workspace {workspace}: no such folder")
    info = workspace.stat()
    if info.st_uid != pods.USER_ID and not info.st_mode & 0o002:
        raise PodJobError(f"--workspace {workspace} is not writable by the image's user (uid {pods.USER_ID}): "
                          f"chown {pods.USER_ID} {workspace}")


@dataclass
class PodJob:
    """The containers of one MPIJob and everything made for them; all removed on leaving."""

    engine: Engine
    image: str
    name: str
    workers: int
    command: Sequence[str]
    workspace: Path
    slots: int = 1
    grace: int = pods.DEFAULT_GRACE
    suffix: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    made: list = field(default_factory=list)  # containers started, by name
    network: Optional[str] = None
    secrets: Optional[Path] = None

    def worker_name(self, index: int) -> str:
        return f"{self.name}-{self.suffix}-worker-{index}"

    @property
    def launcher_name(self) -> str:
        return f"{self.name}-{self.suffix}-launcher"

    def hostfile(self) -> str:
        return "".join(f"{self.worker_name(i)} slots={self.slots}\n" for i in range(self.workers))

    def _mounts(self, launcher: bool) -> list[Mount]:
        mounts = [Mount(str(self.secrets / "ssh"), pods.SSH_AUTH, read_only=True),
                  Mount(str(self.workspace), pods.WORKSPACE)]
        if launcher:
            mounts.append(Mount(str(self.secrets / "hostfile"), pods.HOSTFILE, read_only=True))
        return mounts

    def worker_command(self, index: int) -> list[str]:
        return self.engine.run(self.image, pods.worker_command(), name=self.worker_name(index), detach=True,
                               network=self.network, hostname=self.worker_name(index), mounts=self._mounts(False),
                               user=str(pods.USER_ID), stop_timeout=self.grace, labels={"hvdkit.mpijob": self.suffix})

    def launcher_command(self) -> list[str]:
        ranks = self.workers * self.slots
        return self.engine.run(self.image, pods.launcher_command(ranks, self.command), name=self.launcher_name,
                               network=self.network, hostname=self.launcher_name, mounts=self._mounts(True),
                               env=pods.run_env(self.name), user=str(pods.USER_ID), stop_timeout=self.grace,
                               labels={"hvdkit.mpijob": self.suffix})

    def __enter__(self) -> "PodJob":
        check_workspace(self.workspace)
        try:
            self._make_secrets()
            self.network = f"{self.name}-{self.suffix}"
            _checked(self.engine.network_create(self.network), "network create")
            for index in range(self.workers):
                self.made.append(self.worker_name(index))
                _checked(self.worker_command(index), f"starting {self.worker_name(index)}")
            self._wait_for_workers()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _make_secrets(self) -> None:
        """The operator's Secret (a key pair, the public key as authorized_keys) and ConfigMap (the
        hostfile), as files owned by the image's user."""
        self.secrets = Path(tempfile.mkdtemp(prefix=f"hvdkit-{self.name}-"))
        ssh = self.secrets / "ssh"
        ssh.mkdir(mode=0o700)
        _checked(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{self.name} launcher",
                  "-f", str(ssh / "id_ed25519")], "ssh-keygen")
        shutil.copy(ssh / "id_ed25519.pub", ssh / "authorized_keys")
        (self.secrets / "hostfile").write_text(self.hostfile())
        if os.geteuid() == 0:
            for path in (ssh, *ssh.iterdir()):
                os.chown(path, pods.USER_ID, pods.USER_ID)

    def _wait_for_workers(self) -> None:
        deadline = time.monotonic() + READY_SECONDS
        waiting = list(range(self.workers))
        while waiting:
            listening = ["bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{pods.SSH_PORT}"]
            waiting = [i for i in waiting if subprocess.run(self.engine.exec(self.worker_name(i), listening),
                                                            capture_output=True).returncode]
            if waiting and time.monotonic() > deadline:
                raise PodJobError(f"{self.worker_name(waiting[0])}: sshd did not answer within {READY_SECONDS:.0f} s")
            if waiting:
                time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        for name in [*self.made, self.launcher_name] if self.made else []:  # one by one: one already gone
            subprocess.run(self.engine.remove([name]), capture_output=True)  # must not keep the rest
        if self.network:
            subprocess.run(self.engine.network_remove(self.network), capture_output=True)
        if self.secrets:
            shutil.rmtree(self.secrets, ignore_errors=True)


def _checked(cmd: Sequence[str], what: str) -> None:
    done = subprocess.run(list(cmd), capture_output=True, text=True)
    if done.returncode != 0:
        raise PodJobError(f"{what} failed: {last_line(done.stderr)}")


def run(pods: PodJob) -> int:
    """Start the job, relay the launcher's output, and end it as a pod's deletion would on a stop
    signal; the launcher's exit code. The handlers come first: a stop while the workers start
    still removes them, and starts no launcher."""
    stopping: list = []

    def delete_the_launcher(signum, frame) -> None:
        if not stopping:
            stopping.append(signum)
            subprocess.Popen(pods.engine.stop([pods.launcher_name], timeout=pods.grace),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    with sighandlers.Handlers((signal.SIGINT, signal.SIGTERM, signal.SIGHUP), delete_the_launcher), pods:
        if stopping:
            return job.stopped_by(stopping[0])
        # Its own session: a Ctrl-C reaches the launcher as the pod's deletion, not also by podman's proxy.
        launcher = subprocess.Popen(pods.launcher_command(), stdin=subprocess.DEVNULL, start_new_session=True)
        code = proctree.wait_child(launcher)
    print(f"hvdkit mpijob: launcher exited {code}" + (f" after {signal.Signals(stopping[0]).name}" if stopping else ""),
          file=sys.stderr, flush=True)
    return job.shell_code(code)
