"""Which MPI is here: found, named and told apart in one place.

Three readings answer three questions: `mpirun --version` (which MPI starts the ranks), the
compiler wrapper's ``-show`` (which MPI a build compiles against) and ``ldd`` of Horovod's
extension (which MPI it was built with). Each gives openmpi, mpich or intel; they must agree,
or mpirun starts N jobs of size 1 (hvdkit.checks.doctor says so).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

NAMES = {"openmpi": "Open MPI", "mpich": "MPICH", "intel": "Intel MPI"}


def find_program(name: str) -> Optional[str]:
    """This interpreter's environment first (the venv's horovodrun), then PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def mpirun_version(mpirun: str) -> str:
    out = subprocess.run([mpirun, "--version"], capture_output=True, text=True)
    return out.stdout + out.stderr


def mpi_flavor(version_text: str) -> str:
    """openmpi, mpich or intel, from `mpirun --version`."""
    if "Open MPI" in version_text or "OpenRTE" in version_text:
        return "openmpi"
    if "Intel" in version_text:
        return "intel"
    if "HYDRA" in version_text or "MPICH" in version_text:
        return "mpich"
    return "unknown"


def describe_mpi(version_text: str) -> str:
    """'Open MPI 4.1.4', 'MPICH 4.0.2' or Intel MPI's own first line."""
    first = version_text.strip().splitlines()[0] if version_text.strip() else ""
    flavor = mpi_flavor(version_text)
    if flavor == "openmpi":
        return f"Open MPI {first.split()[-1] if first else '?'}"
    if flavor == "intel":
        return "Intel MPI: " + first
    if flavor == "mpich":
        version = re.search(r"^\s*Version:\s*(\S+)", version_text, re.MULTILINE)
        return "MPICH " + version.group(1) if version else "MPICH/Hydra"
    return first or "unknown"


def wrapper_flavor(show: str) -> str:
    """openmpi, mpich or intel, from what the wrapper's ``-show`` prints (what it compiles with)."""
    lowered = show.lower()
    if "mpich" in lowered:
        return "mpich"
    if "intel" in lowered or "impi" in lowered:
        return "intel"
    if "openmpi" in lowered or "-lmpi" in show.split():
        return "openmpi"
    return "unknown"


def built_flavor(ldd_text: str) -> Optional[str]:
    """openmpi, mpich or intel: the MPI library Horovod's extension is linked to, from `ldd`."""
    for line in ldd_text.splitlines():
        name, _, path = line.strip().partition(" => ")
        if name.startswith("libmpich"):
            return "mpich"
        if name.startswith("libmpi.so"):
            return "intel" if "intel" in path.lower() else "openmpi"
    return None
