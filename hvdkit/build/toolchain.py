"""The machine's toolchain for building Horovod: torch, CUDA, NCCL, the MPI compiler wrapper,
CMake, a compiler and GNU patch. Probing only; hvdkit.build.builder decides and builds.

Like hvdkit.build.builder, it runs before Horovod exists: it imports neither horovod nor torch until
``detect_toolchain`` asks torch for its version.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional

from hvdkit.launch.mpi import NAMES, wrapper_flavor

HOROVOD_VERSION = "0.28.1"  # its last release, which hvdkit builds and patches
MPI_CHOICES = ("auto", "openmpi", "mpich", "none")


class BuildError(Exception):
    """A problem the user can fix; ``main`` prints it as one line."""


def parse_version(version: str) -> tuple[int, int]:
    """(major, minor) of a version such as '2.14.1+cu130' or '13.0'."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if not match:
        raise BuildError(f"cannot read a version number from {version!r}")
    return int(match.group(1)), int(match.group(2))


def nccl_version_from_header(text: str) -> Optional[str]:
    """NCCL's version from the NCCL_MAJOR/MINOR/PATCH defines of nccl.h."""
    parts = []
    for name in ("NCCL_MAJOR", "NCCL_MINOR", "NCCL_PATCH"):
        match = re.search(rf"#define\s+{name}\s+(\d+)", text)
        if not match:
            return None
        parts.append(match.group(1))
    return ".".join(parts)


def find_mpicxx(requested: str, which: Callable[[str], Optional[str]], show: Callable[[str], str]) -> tuple:
    """(flavour, wrapper): ``mpicxx`` on PATH for auto, else the first of ``mpicxx`` and Debian's
    ``mpicxx.<flavour>`` that compiles against the MPI asked for; none: no MPI (Gloo only)."""
    if requested == "none":
        return "none", None
    names = ["mpicxx"] if requested == "auto" else ["mpicxx", f"mpicxx.{requested}"]
    for name in names:
        path = which(name)
        if path:
            flavor = wrapper_flavor(show(path))
            if requested in ("auto", flavor):
                return flavor, path
    if requested == "auto":
        raise BuildError("mpicxx not found on PATH; needed to build Horovod: apt-get install libopenmpi-dev "
                         "(or libmpich-dev), or 'module load' your cluster's MPI")
    package = {"openmpi": "libopenmpi-dev", "mpich": "libmpich-dev"}[requested]
    raise BuildError(f"no {NAMES[requested]} compiler wrapper (mpicxx or mpicxx.{requested}) found; "
                     f"apt-get install {package}, or 'module load' it")


def _wrapper_show(path: str) -> str:
    out = subprocess.run([path, "-show"], capture_output=True, text=True)
    return out.stdout + out.stderr


def find_cuda_home(environ: Mapping[str, str], nvcc: Optional[str]) -> Optional[Path]:
    """The CUDA toolkit to build with: the first candidate holding both nvcc and the headers.

    On some machines the unversioned /usr/local/cuda holds only bin/, so a directory counts
    only when it has include/cuda_runtime.h as well.
    """
    candidates: list[Path] = []
    for var in ("HOROVOD_CUDA_HOME", "CUDA_HOME", "CUDA_PATH"):
        if environ.get(var):
            candidates.append(Path(environ[var]))
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent)
    candidates.append(Path("/usr/local/cuda"))
    candidates.extend(sorted(Path("/usr/local").glob("cuda-*"), reverse=True))
    for home in candidates:
        if (home / "bin" / "nvcc").exists() and (home / "include" / "cuda_runtime.h").exists():
            return home
    return None


def find_nccl(roots: Iterable[Path]) -> Optional[tuple[Path, Path]]:
    """(include dir, library file) of the first NCCL found under ``roots``.

    A root is a directory laid out as NCCL installs itself: include/nccl.h beside
    lib/libnccl.so* (torch's nvidia-nccl wheel, a CUDA toolkit, /usr).
    """
    for root in roots:
        header = root / "include" / "nccl.h"
        if not header.exists():
            continue
        for libdir in (root / "lib", root / "lib64", root / "lib" / "x86_64-linux-gnu"):
            libs = sorted(libdir.glob("libnccl.so*")) if libdir.is_dir() else []
            if libs:
                return header.parent, libs[0]
    return None


@dataclass(frozen=True)
class Toolchain:
    """What the machine offers the build."""

    torch_version: str
    torch_cuda: Optional[str]  # torch.version.cuda: None for a CPU-only torch
    python_tag: str  # e.g. cp311
    cuda_home: Optional[Path] = None
    cuda_version: Optional[str] = None
    nccl_include: Optional[Path] = None
    nccl_library: Optional[Path] = None
    nccl_version: Optional[str] = None
    mpi: str = "openmpi"  # the flavour of the MPI compiler wrapper the build uses
    mpicxx: Optional[str] = None  # that wrapper
    cuda_archs: str = ""  # compute capabilities for Horovod's CUDA kernels, as HOROVOD_BUILD_CUDA_CC_LIST: "75,80"


def cuda_archs(environ: Mapping[str, str], torch_arch_flags: str) -> str:
    """The compute capabilities to compile Horovod's CUDA kernels for: HOROVOD_BUILD_CUDA_CC_LIST
    where set, else those this torch was built for (its ``sm_XX`` flags). Left to itself Horovod
    compiles for every architecture nvcc knows (twelve with CUDA 13, against torch's six): its
    kernels could never run where torch's do not."""
    if environ.get("HOROVOD_BUILD_CUDA_CC_LIST"):
        return environ["HOROVOD_BUILD_CUDA_CC_LIST"]
    return ",".join(sorted(set(re.findall(r"sm_(\d+)", torch_arch_flags)), key=int))


def detect_toolchain(environ: Mapping[str, str] = os.environ, mpi: str = "auto") -> Toolchain:
    try:
        import torch
    except ImportError:
        raise BuildError(f"torch is not installed for {sys.executable}; install it first "
                         f"(make setup installs the pinned torch)") from None
    python_tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    cuda_home = find_cuda_home(environ, shutil.which("nvcc"))
    cuda_version = None
    if cuda_home:
        out = subprocess.run([str(cuda_home / "bin" / "nvcc"), "--version"],
                             capture_output=True, text=True).stdout
        match = re.search(r"release (\d+\.\d+)", out)
        cuda_version = match.group(1) if match else None
    roots = []
    if environ.get("HOROVOD_NCCL_HOME"):
        roots.append(Path(environ["HOROVOD_NCCL_HOME"]))
    roots += [Path(p) / "nvidia" / "nccl" for p in sys.path if p]
    if cuda_home:
        roots.append(cuda_home)
    roots.append(Path("/usr"))
    nccl = find_nccl(roots)
    nccl_version = nccl_version_from_header((nccl[0] / "nccl.h").read_text()) if nccl else None
    mpi_flavor, mpicxx = find_mpicxx(mpi, shutil.which, _wrapper_show)
    arch_flags = torch._C._cuda_getArchFlags() if torch.version.cuda and hasattr(torch._C, "_cuda_getArchFlags") else ""
    return Toolchain(
        torch_version=torch.__version__,
        torch_cuda=torch.version.cuda,
        python_tag=python_tag,
        cuda_home=cuda_home,
        cuda_version=cuda_version,
        nccl_include=nccl[0] if nccl else None,
        nccl_library=nccl[1] if nccl else None,
        nccl_version=nccl_version,
        mpi=mpi_flavor,
        mpicxx=mpicxx,
        cuda_archs=cuda_archs(environ, arch_flags or ""),
    )


def check_build_tools(which: Callable[[str], Optional[str]] = shutil.which) -> None:
    """Fail early, in one line, on a missing compiler, CMake or MPI."""
    needs = [
        ("cmake", "CMake >= 3.13: apt-get install cmake (or pip install cmake)"),
        ("g++", "a C++20 compiler: apt-get install g++"),
        ("patch", "GNU patch, which applies hvdkit's fixes to Horovod's source: apt-get install patch"),
    ]
    for tool, fix in needs:
        if not which(tool):
            raise BuildError(f"{tool} not found on PATH; needed to build Horovod: {fix}")


def last_line(text: str) -> str:
    """The last non-empty line of a tool's output, for a one-line error."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"
