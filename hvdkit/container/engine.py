"""Container engines: which one is here, and every argument list hvdkit hands it.

docker and podman (with buildah behind `podman build`) take the same words for what hvdkit asks
of them; the lists are built here only, and tests compare them with golden files.

Both are given the caller's own resource limits. Podman as root otherwise raises the open-files
limit to 1,048,576, which a host that caps its own limits refuses ("error setting rlimit type 7:
operation not permitted", seen on this project's machines); a container inheriting the limits of
whoever starts it starts everywhere. The process limit is also held under the kernel's pid_max,
above which the same refusal comes.
"""

from __future__ import annotations

import os
import resource
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

ENGINES = ("podman", "docker")  # the order they are looked for: podman needs no daemon


class EngineError(Exception):
    """No usable container engine, or an engine command that failed: one line for the user."""


@dataclass(frozen=True)
class Limits:
    nofile: tuple[int, int]
    nproc: tuple[int, int]

    @classmethod
    def of_this_process(cls) -> "Limits":
        def capped(which: int, cap: int) -> tuple[int, int]:
            soft, hard = resource.getrlimit(which)
            hard = cap if hard == resource.RLIM_INFINITY else min(hard, cap)
            return (hard if soft == resource.RLIM_INFINITY else min(soft, hard)), hard

        try:
            pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
        except (OSError, ValueError):
            pid_max = 32768
        return cls(nofile=capped(resource.RLIMIT_NOFILE, 1 << 20), nproc=capped(resource.RLIMIT_NPROC, pid_max))

    def args(self) -> list[str]:
        return ["--ulimit", f"nofile={self.nofile[0]}:{self.nofile[1]}",
                "--ulimit", f"nproc={self.nproc[0]}:{self.nproc[1]}"]


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool = False

    def arg(self) -> str:
        return f"{self.source}:{self.target}" + (":ro" if self.read_only else "")


@dataclass(frozen=True)
class Engine:
    """A container engine: ``docker`` or ``podman``, where it is, and the limits it hands on."""

    name: str
    path: str
    limits: Limits = field(default_factory=Limits.of_this_process)
    runtime: Optional[str] = None  # podman --runtime (HVDKIT_CONTAINER_RUNTIME), for a host where the default fails

    @property
    def bind_mounts_in_build(self) -> bool:
        """podman build takes -v for its RUN steps; docker build does not."""
        return self.name == "podman"

    def _global(self) -> list[str]:
        return [self.path, *(["--runtime", self.runtime] if self.runtime and self.name == "podman" else [])]

    def build(self, context: Path, tag: str, *, dockerfile: Path, target: Optional[str] = None,
              build_args: Mapping[str, str] = {}, mounts: Sequence[Mount] = (), shm_size: str = "1g") -> list[str]:
        cmd = [*self._global(), "build", "-f", str(dockerfile), "-t", tag, *self.limits.args(), "--shm-size", shm_size]
        if target:
            cmd += ["--target", target]
        for key, value in build_args.items():
            cmd += ["--build-arg", f"{key}={value}"]
        if self.bind_mounts_in_build:
            for mount in mounts:
                cmd += ["-v", mount.arg()]
        return [*cmd, str(context)]

    def run(self, image: str, command: Sequence[str], *, name: Optional[str] = None, detach: bool = False,
            network: Optional[str] = None, hostname: Optional[str] = None, mounts: Sequence[Mount] = (),
            env: Mapping[str, str] = {}, user: Optional[str] = None, shm_size: str = "1g",
            stop_timeout: Optional[int] = None, remove: bool = True, labels: Mapping[str, str] = {}) -> list[str]:
        cmd = [*self._global(), "run", *(["--rm"] if remove else []), *(["-d"] if detach else []),
               *self.limits.args(), "--shm-size", shm_size]
        for flag, value in (("--name", name), ("--network", network), ("--hostname", hostname), ("--user", user)):
            if value:
                cmd += [flag, value]
        if stop_timeout is not None:
            cmd += ["--stop-timeout", str(stop_timeout)]
        for key, value in labels.items():
            cmd += ["--label", f"{key}={value}"]
        for mount in mounts:
            cmd += ["-v", mount.arg()]
        for key, value in env.items():
            cmd += ["-e", f"{key}={value}"]
        return [*cmd, image, *command]

    def exec(self, container: str, command: Sequence[str], user: Optional[str] = None) -> list[str]:
        return [*self._global(), "exec", *(["--user", user] if user else []), container, *command]

    def stop(self, containers: Sequence[str], timeout: int) -> list[str]:
        """SIGTERM, ``timeout`` seconds, then SIGKILL: what a pod's deletion does with its grace period."""
        return [*self._global(), "stop", "-t", str(timeout), *containers]

    def kill(self, container: str, signal: str = "KILL") -> list[str]:
        return [*self._global(), "kill", "-s", signal, container]

    def remove(self, containers: Sequence[str]) -> list[str]:
        return [*self._global(), "rm", "-f", *containers]

    def network_create(self, name: str, subnet: Optional[str] = None) -> list[str]:
        return [*self._global(), "network", "create", *(["--subnet", subnet] if subnet else []), name]

    def network_remove(self, name: str) -> list[str]:
        return [*self._global(), "network", "rm", "-f", name]

    def image_exists(self, image: str) -> list[str]:
        return [*self._global(), "image", "inspect", "--format", "{{.Id}}", image]

    def image_remove(self, image: str, only_untagged: bool = False) -> list[str]:
        """Without -f when ``only_untagged``: the engine refuses an image that still has a tag or a container."""
        return [*self._global(), "rmi", *([] if only_untagged else ["-f"]), image]

    def image_import(self, tarball: Path, tag: str) -> list[str]:
        return [*self._global(), "import", str(tarball), tag]

    def create(self, image: str, name: str) -> list[str]:
        return [*self._global(), "create", "--name", name, image, "true"]

    def copy_out(self, container: str, source: str, destination: Path) -> list[str]:
        return [*self._global(), "cp", f"{container}:{source}", str(destination)]

    def save(self, image: str, output: Path) -> list[str]:
        """An OCI archive: what `apptainer build IMG.sif oci-archive://FILE` reads."""
        fmt = ["--format", "oci-archive"] if self.name == "podman" else []
        return [*self._global(), "save", *fmt, "-o", str(output), image]


def find_engine(wanted: Optional[str] = None, environ: Mapping[str, str] = os.environ) -> Engine:
    """The engine named by ``wanted`` (or HVDKIT_CONTAINER_ENGINE), else podman, else docker."""
    wanted = wanted or environ.get("HVDKIT_CONTAINER_ENGINE") or None
    if wanted is not None and wanted not in ENGINES:
        raise EngineError(f"unknown container engine {wanted!r}: use podman or docker")
    for name in [wanted] if wanted else ENGINES:
        path = shutil.which(name, path=environ.get("PATH"))
        if path:
            return Engine(name=name, path=path, runtime=environ.get("HVDKIT_CONTAINER_RUNTIME") or None)
    if wanted:
        raise EngineError(f"{wanted} is not on PATH: install it, or pick "
                          f"the other engine with --engine")
    raise EngineError("no container engine on PATH: install podman (Debian: apt-get install podman runc) or docker")
