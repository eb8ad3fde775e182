"""Build Horovod from its PyPI source distribution against the torch that is installed.

Horovod 0.28.1, its last release, pins C++14 in its CMake files while torch >= 2.1 headers
need C++17 and torch >= 2.14 headers need C++20, so ``pip install horovod`` fails on any
current torch. This builder raises the standard to what torch needs and applies hvdkit's fixes
to Horovod's C++ (the patches in hvdkit/build/patches/), turns on NCCL when the machine can build it,
and caches the wheel under a key of everything that changes the binary, the patches included,
so only a new torch, Python, patch or set of flags rebuilds.

It must run before Horovod exists, so it imports neither horovod nor anything of hvdkit that
does. Run it as ``python -m hvdkit.build`` (``--help`` lists the options).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

from hvdkit import job
from hvdkit.build import patches
from hvdkit.build.toolchain import (
    HOROVOD_VERSION,
    MPI_CHOICES,
    BuildError,
    Toolchain,
    check_build_tools,
    detect_toolchain,
    last_line,
    parse_version,
)
from hvdkit.launch.mpi import NAMES

# setup.py of Horovod imports these at build time (setup_requires); with
# --no-build-isolation they must already be in the environment.
BUILD_REQUIRES = ("cloudpickle", "psutil", "pyyaml", "packaging", "cffi", "setuptools", "wheel")

HEARTBEAT_SECONDS = 60


# ---------------------------------------------------------------------------
# Pure decisions: what to build. Tested without building.
# ---------------------------------------------------------------------------

def cxx_standard_for_torch(torch_version: str) -> int:
    """The C++ standard torch's headers need: 14 before 2.1, 17 for 2.1-2.13, 20 from 2.14."""
    version = parse_version(torch_version)
    if version >= (2, 14):
        return 20
    if version >= (2, 1):
        return 17
    return 14


@dataclass(frozen=True)
class BuildPlan:
    """What to build: the flags that change the binary, and where the build finds its parts."""

    horovod_version: str
    torch_version: str
    python_tag: str
    cxx_standard: int
    gpu_operations: Optional[str]
    gpu_reason: str
    flags: dict = field(default_factory=dict)  # HOROVOD_* variables that change the binary
    paths: dict = field(default_factory=dict)  # where CUDA and NCCL are; not part of the key
    cuda_version: Optional[str] = None
    nccl_version: Optional[str] = None
    mpi: str = "openmpi"

    @property
    def digest(self) -> str:
        identity = {
            "horovod": self.horovod_version,
            "torch": self.torch_version,
            "python": self.python_tag,
            "cxx": self.cxx_standard,
            "flags": self.flags,
            "cuda": self.cuda_version,
            "nccl": self.nccl_version,
            "patches": patches.digest(self.cxx_standard),
        }
        if self.mpi != "openmpi":  # Open MPI builds keep the keys they had before MPICH was an option
            identity["mpi"] = self.mpi
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]

    @property
    def key(self) -> str:
        """The wheel cache's key: Horovod, torch, Python and a digest of the flags."""
        torch = self.torch_version.replace("+", "_")
        return f"horovod{self.horovod_version}-torch{torch}-{self.python_tag}-{self.digest}"

    @property
    def local_version(self) -> str:
        """The wheel's version, so ``pip show horovod`` tells which build is installed."""
        return f"{self.horovod_version}+hvdkit.{self.digest}"

    def describe(self) -> list[str]:
        gpu = self.gpu_operations or "none (CPU-only build)"
        lines = [
            f"Horovod {self.horovod_version} for torch {self.torch_version} ({self.python_tag}), "
            f"C++{self.cxx_standard}",
            "controllers: Gloo (no MPI: --mpi none)" if self.mpi == "none" else
            f"controllers: MPI ({NAMES.get(self.mpi, self.mpi)}), Gloo",
            f"GPU operations: {gpu} ({self.gpu_reason})",
            "build flags: " + " ".join(f"{k}={v}" for k, v in sorted(self.flags.items())),
        ]
        if self.paths:
            lines.append("build paths: " + " ".join(f"{k}={v}" for k, v in sorted(self.paths.items())))
        lines.append(f"cache key: {self.key}")
        return lines


def plan_build(tc: Toolchain, cpu_only: bool = False) -> BuildPlan:
    """Decide the flags: MPI and Gloo always, NCCL when torch, the toolkit and NCCL allow it."""
    flags = {
        "HOROVOD_WITH_PYTORCH": "1",
        "HOROVOD_WITHOUT_TENSORFLOW": "1",
        "HOROVOD_WITHOUT_MXNET": "1",
        "HOROVOD_WITH_GLOO": "1",
    }
    # Without MPI (a GPU node with none installed) Horovod runs under horovodrun --gloo only.
    flags["HOROVOD_WITHOUT_MPI" if tc.mpi == "none" else "HOROVOD_WITH_MPI"] = "1"
    paths: dict = {"MPICXX": tc.mpicxx} if tc.mpicxx else {}
    gpu_operations = None
    if cpu_only:
        reason = "CPU-only build requested"
        if tc.torch_cuda and tc.cuda_home:
            # torch's CUDA build makes Horovod's torch extension compile its CUDA support anyway
            # (Horovod's CMake: add_cuda() where torch has CUDA); without the toolkit's home it
            # failed, cudart NOTFOUND. No NCCL: no GPU collectives.
            reason += f" (no NCCL; torch's CUDA {tc.torch_cuda} still needs the toolkit at {tc.cuda_home})"
            paths.update({"CUDA_HOME": str(tc.cuda_home), "HOROVOD_CUDA_HOME": str(tc.cuda_home)})
            if tc.cuda_archs:
                flags["HOROVOD_BUILD_CUDA_CC_LIST"] = tc.cuda_archs
    elif tc.torch_cuda is None:
        reason = "torch is a CPU-only build"
    elif tc.cuda_home is None:
        reason = "no CUDA toolkit: nvcc with include/cuda_runtime.h not found; set CUDA_HOME"
    elif tc.nccl_include is None or tc.nccl_library is None:
        reason = "no NCCL headers found: install torch's nvidia-nccl wheel or set HOROVOD_NCCL_HOME"
    elif tc.cuda_version and parse_version(tc.cuda_version)[0] != parse_version(tc.torch_cuda)[0]:
        reason = (f"CUDA toolkit {tc.cuda_version} does not match torch's CUDA {tc.torch_cuda}; "
                  f"point CUDA_HOME at a {parse_version(tc.torch_cuda)[0]}.x toolkit")
    else:
        gpu_operations = "NCCL"
        reason = f"CUDA {tc.cuda_version} at {tc.cuda_home}, NCCL {tc.nccl_version or '?'}"
        flags["HOROVOD_GPU_OPERATIONS"] = "NCCL"
        if tc.cuda_archs:  # a flag, not a path: it changes the binary, so the cache key
            flags["HOROVOD_BUILD_CUDA_CC_LIST"] = tc.cuda_archs
        # CUDA_HOME too: torch's cpp_extension, which Horovod's CMake asks for torch's CUDA
        # libraries, otherwise guesses a wrong home from nvcc on PATH and cudart is NOTFOUND.
        paths.update({
            "CUDA_HOME": str(tc.cuda_home),
            "HOROVOD_CUDA_HOME": str(tc.cuda_home),
            "HOROVOD_NCCL_INCLUDE": str(tc.nccl_include),
            "HOROVOD_NCCL_LIB": str(tc.nccl_library.parent),
        })
    return BuildPlan(
        horovod_version=HOROVOD_VERSION,
        torch_version=tc.torch_version,
        python_tag=tc.python_tag,
        cxx_standard=cxx_standard_for_torch(tc.torch_version),
        gpu_operations=gpu_operations,
        gpu_reason=reason,
        flags=flags,
        paths=paths,
        cuda_version=tc.cuda_version if gpu_operations else None,
        nccl_version=tc.nccl_version if gpu_operations else None,
        mpi=tc.mpi,
    )


_ERROR_RE = re.compile(r"(\berror\b|CMake Error|fatal error|Error \d+|undefined reference|"
                       r"\b[A-Z]\w*Error: |NOTFOUND)", re.IGNORECASE)
_NOT_ERROR_RE = re.compile(r"(-Werror|error_code|errors?\.(h|hpp|cc|cpp)\b|\berror:?\s*$)", re.IGNORECASE)


def first_errors(log_text: str, limit: int = 12) -> list[str]:
    """The first compiler/CMake error lines of a build log, each with the line after it.

    pip's own wrapper text after the failure repeats the word error; it is cut off.
    """
    lines = log_text.splitlines()
    for end, line in enumerate(lines):
        if "subprocess-exited-with-error" in line or "Failed building wheel" in line:
            lines = lines[:end]
            break
    picked: list[int] = []
    for i, line in enumerate(lines):
        if _ERROR_RE.search(line) and not _NOT_ERROR_RE.search(line):
            picked += [j for j in (i, i + 1) if j < len(lines) and lines[j].strip() and j not in picked]
        if len(picked) >= limit:
            break
    return [lines[i].rstrip() for i in picked[:limit]]


# ---------------------------------------------------------------------------
# Probing the machine and running the build.
# ---------------------------------------------------------------------------

def cache_dir() -> Path:
    if os.environ.get("HVDKIT_CACHE_DIR"):
        return Path(os.environ["HVDKIT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hvdkit"


def installed_horovod_version() -> Optional[str]:
    try:
        return importlib.metadata.version("horovod")
    except importlib.metadata.PackageNotFoundError:
        return None


def _pip(*args: str, quiet: bool = True) -> None:
    """pip, its output kept: a failure is told in one line by the caller, from ``stderr`` of the
    CalledProcessError (offline, pip warns once per retry of each package)."""
    cmd = [sys.executable, "-m", "pip", *args]
    if quiet:
        cmd.insert(4, "-q")
    subprocess.run(cmd, check=True, capture_output=True, text=True, env={"PIP_RETRIES": "1", **os.environ})


OFFLINE_HINT = ("on a machine without internet, pass --sdist horovod-{v}.tar.gz or --find-links DIR (a folder "
                "holding it and the build requirements: `pip download --no-deps --no-binary :all: horovod=={v}` "
                "and `pip download {reqs}` where there is internet)")


def _offline_hint() -> str:
    return OFFLINE_HINT.format(v=HOROVOD_VERSION, reqs=" ".join(BUILD_REQUIRES))


def ensure_build_requires(find_links: Optional[Path] = None) -> None:
    missing = []
    for name in BUILD_REQUIRES:
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    if missing:
        print(f"hvdkit.build: installing Horovod's build requirements: {' '.join(missing)}", flush=True)
        where = ["--no-index", "--find-links", str(find_links)] if find_links else []
        try:
            _pip("install", *where, *missing)
        except subprocess.CalledProcessError as exc:
            raise BuildError(f"pip could not install {' '.join(missing)} (pip: {last_line(exc.stderr)}); "
                             f"{_offline_hint()}") from None


def find_sdist(cache: Path, sdist: Optional[Path] = None, find_links: Optional[Path] = None) -> Path:
    """The source distribution: --sdist, else the one in --find-links, else the cache, else PyPI."""
    name = f"horovod-{HOROVOD_VERSION}.tar.gz"
    if sdist is not None:
        if not sdist.is_file():
            raise BuildError(f"--sdist {sdist}: no such file")
        if sdist.name != name:
            raise BuildError(f"--sdist {sdist}: hvdkit builds Horovod {HOROVOD_VERSION}; expected a file named {name}")
        return sdist
    if find_links is not None and (find_links / name).is_file():
        return find_links / name
    cached = cache / "sdist" / name
    if cached.exists():
        return cached
    print(f"hvdkit.build: downloading the Horovod {HOROVOD_VERSION} source distribution", flush=True)
    cached.parent.mkdir(parents=True, exist_ok=True)
    download = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                               f"horovod=={HOROVOD_VERSION}", "-d", str(cached.parent)],
                              capture_output=True, text=True, env={"PIP_RETRIES": "1", **os.environ})
    if download.returncode != 0:
        raise BuildError(f"cannot download the Horovod {HOROVOD_VERSION} source distribution (pip: "
                         f"{last_line(download.stderr)}); {_offline_hint()}")
    if not cached.exists():
        raise BuildError(f"pip did not produce {cached}")
    return cached


def _mpi_wrappers(mpicxx: str, into: Path) -> Optional[Path]:
    """A folder to put first on PATH where ``mpicxx`` (and mpicc, mpiexec of the same MPI) is the
    wrapper chosen, for CMake's FindMPI, which takes the first mpicxx on PATH; None if it already is."""
    if Path(mpicxx).name == "mpicxx" and shutil.which("mpicxx") == mpicxx:
        return None
    into.mkdir()
    suffix = Path(mpicxx).name[len("mpicxx"):]  # ".mpich" for Debian's alternatives
    for tool in ("mpicxx", "mpicc", "mpiexec", "mpirun"):
        found = Path(mpicxx).with_name(tool + suffix)
        if found.exists():
            (into / tool).symlink_to(found)
    return into


def _run_logged(cmd: Sequence[str], env: Mapping[str, str], cwd: Path, log: Path) -> int:
    """Run the build with its output in ``log``; print a line a minute so CI sees progress."""
    start = time.monotonic()
    with open(log, "w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, env=dict(env), stdout=out, stderr=subprocess.STDOUT)
        next_beat = start + HEARTBEAT_SECONDS
        while proc.poll() is None:
            time.sleep(1)
            if time.monotonic() >= next_beat:
                minutes = (time.monotonic() - start) / 60
                print(f"hvdkit.build: still building ({minutes:.0f} min)", flush=True)
                next_beat += HEARTBEAT_SECONDS
    return proc.returncode


def build_wheel(plan: BuildPlan, cache: Path, sdist: Path) -> Path:
    wheel_dir = cache / "wheels" / plan.key
    log = cache / "logs" / f"{plan.key}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hvdkit-build-") as tmp:
        tmp_path = Path(tmp)
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp_path)
        src = tmp_path / f"horovod-{HOROVOD_VERSION}"
        patches.apply(src, patches.for_standard(plan.cxx_standard))
        env = dict(os.environ)
        env.update(plan.flags)
        env.update(plan.paths)
        env["HOROVOD_LOCAL_VERSION"] = plan.local_version.split("+", 1)[1]
        wrappers = _mpi_wrappers(plan.paths["MPICXX"], tmp_path / "mpi-bin") if "MPICXX" in plan.paths else None
        if wrappers:
            env["PATH"] = f"{wrappers}{os.pathsep}{env.get('PATH', '')}"
        env.setdefault("MAKEFLAGS", f"-j{os.cpu_count() or 1}")
        # CMake 4 refuses the cmake_minimum_required(< 3.5) of Horovod's third-party Gloo and others.
        env.setdefault("CMAKE_POLICY_VERSION_MINIMUM", "3.5")
        if "HOROVOD_NCCL_LIB" in env:
            # CMake's find_library wants libnccl.so; torch's wheel ships only libnccl.so.2.
            libdir = tmp_path / "nccl-lib"
            libdir.mkdir()
            nccl_lib = Path(plan.paths["HOROVOD_NCCL_LIB"])
            target = sorted(nccl_lib.glob("libnccl.so*"))[0]
            (libdir / "libnccl.so").symlink_to(target)
            env["HOROVOD_NCCL_LIB"] = str(libdir)
        build_out = tmp_path / "wheel"
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-v",
               "-w", str(build_out), str(src)]
        print(f"hvdkit.build: building (about 5 min on 2 cores; log: {log})", flush=True)
        started = time.monotonic()
        if _run_logged(cmd, env, tmp_path, log) != 0:
            errors = first_errors(log.read_text(errors="replace"))
            detail = "\n".join("  " + line for line in errors) or "  (no error line recognised)"
            raise BuildError(f"Horovod build failed; first errors:\n{detail}\nfull log: {log}")
        wheels = list(build_out.glob("horovod-*.whl"))
        if len(wheels) != 1:
            raise BuildError(f"expected one Horovod wheel, found {wheels}; full log: {log}")
        wheel_dir.mkdir(parents=True, exist_ok=True)
        final = wheel_dir / wheels[0].name
        shutil.move(str(wheels[0]), final)
    print(f"hvdkit.build: built {final.name} in {time.monotonic() - started:.0f} s", flush=True)
    return final


def prebuilt_wheel(plan: BuildPlan, folders: Sequence[Path]) -> Optional[Path]:
    """A wheel of exactly this plan (its local version names the build) in the first folder holding one."""
    for folder in folders:
        wheels = sorted(folder.glob(f"horovod-{plan.local_version}-*.whl"))
        if wheels:
            return wheels[0]
    return None


def verify_install(plan: BuildPlan) -> list[str]:
    """Import the installed Horovod in a fresh interpreter and report what it was built with."""
    probe = ("import json, horovod.torch as h; print(json.dumps({'mpi': h.mpi_built(), "
             "'gloo': h.gloo_built(), 'nccl': h.nccl_built()}))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise BuildError(f"the installed Horovod does not import: {tail}")
    built = json.loads(result.stdout.strip().splitlines()[-1])
    missing = [name for name in ("mpi", "gloo") if not built[name] and not (name == "mpi" and plan.mpi == "none")]
    if plan.gpu_operations == "NCCL" and not built["nccl"]:
        missing.append("nccl")
    if missing:
        raise BuildError(f"the installed Horovod lacks {', '.join(missing)}; rebuild with --force")
    return [name.upper() if name != "gloo" else "Gloo" for name, ok in built.items() if ok]


@dataclass
class Sources:
    """Where the build may take its inputs, and what to do with the wheel."""

    sdist: Optional[Path] = None  # --sdist
    find_links: Optional[Path] = None  # --find-links: prebuilt wheels, the sdist, build requirements
    wheel_dir: Optional[Path] = None  # --wheel-dir: also put the wheel here
    install: bool = True  # --no-install: build or find the wheel, export it, install nothing


@contextlib.contextmanager
def _key_lock(cache: Path, key: str):
    """Held while a cache key's wheel is looked for and built: two builds of one key at once (two
    test workers, two shells) build it once."""
    folder = cache / "locks"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def ensure_horovod(plan: BuildPlan, cache: Path, force: bool = False, sources: Optional[Sources] = None) -> str:
    """Install (and export) the planned Horovod, from a wheelhouse or the cache when possible.
    Returns what happened."""
    sources = sources or Sources()
    installed = sources.install and not force and installed_horovod_version() == plan.local_version
    if installed and sources.wheel_dir is None:
        return "already installed"
    folders = [sources.find_links] if sources.find_links else []
    with _key_lock(cache, plan.key):  # a second build of this key waits for the first, then finds its wheel
        wheel = None if force else prebuilt_wheel(plan, [*folders, cache / "wheels" / plan.key])
        how = f"found {wheel}" if wheel else ""
        if wheel is None:
            check_build_tools()
            ensure_build_requires(sources.find_links)
            wheel = build_wheel(plan, cache, find_sdist(cache, sources.sdist, sources.find_links))
            how = f"built {wheel}"
    if sources.wheel_dir is not None:
        sources.wheel_dir.mkdir(parents=True, exist_ok=True)
        if wheel.parent.resolve() != sources.wheel_dir.resolve():
            shutil.copy2(wheel, sources.wheel_dir / wheel.name)
        how += f"; exported to {sources.wheel_dir}"
    if sources.install and not installed:
        _pip("install", "--no-deps", "--force-reinstall", str(wheel))
        how += "; installed"
    return how


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hvdkit.build",
        description=f"Build Horovod {HOROVOD_VERSION} against the installed torch and install it (cached).")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    parser.add_argument("--force", action="store_true", help="rebuild even if a cached wheel exists")
    parser.add_argument("--cpu-only", action="store_true", help="build without NCCL even if CUDA is found")
    parser.add_argument("--gpu", action="store_true",
                        help="require NCCL: stop with the reason when the machine cannot build it (a GPU image)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="wheel cache (default: $HVDKIT_CACHE_DIR or ~/.cache/hvdkit)")
    parser.add_argument("--mpi", choices=MPI_CHOICES, default="auto",
                        help="the MPI to build against: auto (the mpicxx on PATH), openmpi or mpich (mpicxx or "
                             "Debian's mpicxx.mpich), or none (Gloo only, for horovodrun --gloo); each is "
                             "cached apart (default: auto)")
    parser.add_argument("--sdist", type=Path, help=f"build from this horovod-{HOROVOD_VERSION}.tar.gz (no download)")
    parser.add_argument("--find-links", type=Path, metavar="DIR",
                        help="a local folder to take a prebuilt wheel of this build, the sdist and the build "
                             "requirements from, instead of PyPI")
    parser.add_argument("--wheel-dir", type=Path, metavar="DIR",
                        help="also copy the wheel here (a shared folder: other machines then use --find-links DIR)")
    parser.add_argument("--no-install", dest="install", action="store_false",
                        help="build (or find) and export the wheel only; install nothing")
    args = parser.parse_args(argv)
    cache = args.cache_dir or cache_dir()
    sources = Sources(sdist=args.sdist, find_links=args.find_links, wheel_dir=args.wheel_dir, install=args.install)
    try:
        if args.find_links is not None and not args.find_links.is_dir():
            raise BuildError(f"--find-links {args.find_links}: no such folder")
        plan = plan_build(detect_toolchain(mpi=args.mpi), cpu_only=args.cpu_only)
        for line in plan.describe():
            print(f"hvdkit.build: {line}", flush=True)
        if args.gpu and plan.gpu_operations is None:
            raise BuildError(f"--gpu: Horovod cannot be built with NCCL here: {plan.gpu_reason}")
        if args.dry_run:
            return 0
        started = time.monotonic()
        outcome = ensure_horovod(plan, cache, force=args.force, sources=sources)
        built = verify_install(plan) if args.install else ["not installed"]
    except BuildError as exc:
        print(f"hvdkit.build: error: {exc}", file=sys.stderr)
        return job.FAILED
    except subprocess.CalledProcessError as exc:
        said = f" ({last_line(exc.stderr)})" if exc.stderr else ""
        print(f"hvdkit.build: error: command failed ({exc.returncode}): {' '.join(map(str, exc.cmd))}{said}",
              file=sys.stderr)
        return job.FAILED
    print(f"hvdkit.build: Horovod {plan.local_version} {outcome} "
          f"[{', '.join(built)}] ({time.monotonic() - started:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
