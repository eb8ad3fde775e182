"""What one host offers a multi-host job, as one JSON line: `hvdkit doctor --hosts` runs this on
every host the way the launcher reaches it (ssh, or srun in an allocation) and compares.

It must answer in well under a second, so nothing here imports torch or Horovod: versions come
from the installed packages' metadata, Horovod's controllers from the metadata.json its build
writes, its GPU operations from the libraries its extension links. After the JSON line it
answers each line read on stdin with this host's clock, so the caller can measure the offset
against its own over the same connection.

    python -m hvdkit.checks.host_facts [--seen PATH]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import mmap
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from hvdkit.launch.mpi import describe_mpi, find_program, mpirun_version

PACKAGES = ("torch", "torchvision", "horovod", "hvdkit", "mpi4py")


def package_version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def horovod_build() -> Optional[dict]:
    """{"controllers": [...], "nccl": bool, "own_interface": bool} of the installed Horovod,
    without importing it."""
    spec = importlib.util.find_spec("horovod")
    if spec is None or not spec.submodule_search_locations:
        return None
    package = Path(next(iter(spec.submodule_search_locations)))
    try:
        built = json.loads((package / "metadata.json").read_text())
    except (OSError, ValueError):
        built = {}
    controllers = [name for name in ("mpi", "gloo") if built.get(f"{name}_built")]
    return {"controllers": controllers,
            "nccl": any(_has(lib, b"NCCLAllreduce") for lib in (package / "torch").glob("mpi_lib_v2*.so")),
            # hvdkit/build/patches/0006: each rank takes its own name for the job's network
            "own_interface": _has(package / "common" / "basics.py", b"_interfaces_of_this_host")}


def _has(path: Path, name: bytes) -> bool:
    """Whether a file holds a name: Horovod's NCCL operations exist only in an NCCL build's library
    (its dependencies, which torch's CUDA wheels bring, would say nothing)."""
    try:
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return data.find(name) >= 0
    except (OSError, ValueError):  # missing, or empty
        return False


def mpi() -> Optional[str]:
    mpirun = find_program("mpirun")
    return describe_mpi(mpirun_version(mpirun)) if mpirun else None


def interfaces() -> dict[str, list[list[str]]]:
    from hvdkit.launch.network import ipv4_interfaces

    return {name: [list(pair) for pair in pairs] for name, pairs in ipv4_interfaces().items() if pairs}


def gpus() -> list[dict]:
    """The GPUs nvidia-smi lists (name, driver); none without it."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    out = subprocess.run([smi, "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=30)
    rows = [line.rsplit(",", 1) for line in out.stdout.splitlines() if "," in line]
    return [{"name": name.strip(), "driver": driver.strip()} for name, driver in rows]


def nccl() -> Optional[str]:
    """The NCCL torch brings (the nvidia-nccl-cuXX wheel)."""
    found = [d.version for d in importlib.metadata.distributions()
             if (d.metadata["Name"] or "").lower().startswith("nvidia-nccl")]
    return found[0] if found else None


def facts(seen: Optional[str]) -> dict:
    return {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "executable": sys.executable,
        "packages": {name: package_version(name) for name in PACKAGES},
        "horovod_build": horovod_build(),
        "mpi": mpi(),
        "interfaces": interfaces(),
        "cores": len(os.sched_getaffinity(0)),
        "gpus": gpus(),
        "nccl": nccl(),
        "seen": os.path.exists(seen) if seen else None,
        "env": {name: os.environ[name] for name in ("NCCL_SOCKET_IFNAME", "HOROVOD_GLOO_IFACE")
                if name in os.environ},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hvdkit.checks.host_facts")
    parser.add_argument("--seen", help="a file the caller wrote: whether this host sees it (a shared directory)")
    args = parser.parse_args(argv)
    print(json.dumps(facts(args.seen)), flush=True)
    for _ in sys.stdin:  # the caller's clock probes: one answer each, until it closes the connection
        print(repr(time.time()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
