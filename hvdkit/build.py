"""Build Horovod from its PyPI source distribution against the torch that is installed.

Horovod 0.28.1, its last release, pins C++14 in its CMake files while torch >= 2.1 headers
need C++17 and torch >= 2.14 headers need C++20, so ``pip install horovod`` fails on any
current torch. This builder raises the standard to what torch needs, turns on NCCL when the
machine can build it, and caches the wheel under a key of everything that changes the binary,
so only a new torch, Python or set of flags rebuilds.

It must run before Horovod exists, so it imports neither horovod nor anything of hvdkit that
does. Run it as ``python -m hvdkit.build`` (``--help`` lists the options).
"""

from __future__ import annotations

import argparse
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
from typing import Callable, Iterable, Mapping, Optional, Sequence

HOROVOD_VERSION = "0.28.1"

# setup.py of Horovod imports these at build time (setup_requires); with
# --no-build-isolation they must already be in the environment.
BUILD_REQUIRES = ("cloudpickle", "psutil", "pyyaml", "packaging", "cffi", "setuptools", "wheel")

HEARTBEAT_SECONDS = 60
MPI_CHOICES = ("auto", "openmpi", "mpich", "none")
MPI_NAMES = {"openmpi": "Open MPI", "mpich": "MPICH", "intel": "Intel MPI"}


class BuildError(Exception):
    """A problem the user can fix; ``main`` prints it as one line."""


# ---------------------------------------------------------------------------
# Pure decisions: what to build. Tested without building.
# ---------------------------------------------------------------------------

def parse_version(version: str) -> tuple[int, int]:
    """(major, minor) of a version such as '2.14.1+cu130' or '13.0'."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if not match:
        raise BuildError(f"cannot read a version number from {version!r}")
    return int(match.group(1)), int(match.group(2))


def cxx_standard_for_torch(torch_version: str) -> int:
    """The C++ standard torch's headers need: 14 before 2.1, 17 for 2.1-2.13, 20 from 2.14."""
    version = parse_version(torch_version)
    if version >= (2, 14):
        return 20
    if version >= (2, 1):
        return 17
    return 14


def nccl_version_from_header(text: str) -> Optional[str]:
    """NCCL's version from the NCCL_MAJOR/MINOR/PATCH defines of nccl.h."""
    parts = []
    for name in ("NCCL_MAJOR", "NCCL_MINOR", "NCCL_PATCH"):
        match = re.search(rf"#define\s+{name}\s+(\d+)", text)
        if not match:
            return None
        parts.append(match.group(1))
    return ".".join(parts)


def mpi_flavor_of_wrapper(show: str) -> str:
    """openmpi, mpich or intel, from what the wrapper's ``-show`` prints (what it compiles with)."""
    lowered = show.lower()
    if "mpich" in lowered:
        return "mpich"
    if "intel" in lowered or "impi" in lowered:
        return "intel"
    if "openmpi" in lowered or "-lmpi" in show.split():
        return "openmpi"
    return "unknown"


def find_mpicxx(requested: str, which: Callable[[str], Optional[str]], show: Callable[[str], str]) -> tuple:
    """(flavour, wrapper): ``mpicxx`` on PATH for auto, else the first of ``mpicxx`` and Debian's
    ``mpicxx.<flavour>`` that compiles against the MPI asked for; none: no MPI (Gloo only)."""
    if requested == "none":
        return "none", None
    names = ["mpicxx"] if requested == "auto" else ["mpicxx", f"mpicxx.{requested}"]
    for name in names:
        path = which(name)
        if path:
            flavor = mpi_flavor_of_wrapper(show(path))
            if requested in ("auto", flavor):
                return flavor, path
    if requested == "auto":
        raise BuildError("mpicxx not found on PATH; needed to build Horovod: apt-get install libopenmpi-dev "
                         "(or libmpich-dev), or 'module load' your cluster's MPI")
    package = {"openmpi": "libopenmpi-dev", "mpich": "libmpich-dev"}[requested]
    raise BuildError(f"no {MPI_NAMES[requested]} compiler wrapper (mpicxx or mpicxx.{requested}) found; "
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
            "source_fixes": source_fixes_digest(),
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
            f"controllers: MPI ({MPI_NAMES.get(self.mpi, self.mpi)}), Gloo",
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


@dataclass(frozen=True)
class SourceFix:
    """One exact edit to Horovod's source: ``old`` must occur once in ``path``, or the build stops."""

    path: str
    old: str
    new: str


# Horovod pins C++14 (and C++17 for the Gloo it may build); torch's headers need a newer one.
_PINNED_STANDARDS = (
    ("CMakeLists.txt", "set(CMAKE_CXX_STANDARD 14)\n", "14"),
    ("CMakeLists.txt", 'string(PREPEND GLOO_CMAKE "set(CMAKE_CXX_STANDARD 17)\\n")', "17"),
    ("horovod/torch/CMakeLists.txt", "set(CMAKE_CXX_STANDARD 14)\n", "14"),
)


def cxx_standard_fixes(standard: int) -> tuple[SourceFix, ...]:
    """The edits that set every pinned C++ standard to ``standard`` (see cxx_standard_for_torch)."""
    return tuple(SourceFix(path, old, old.replace(pinned, str(standard))) for path, old, pinned in _PINNED_STANDARDS)


# Horovod's CPU paths cost a busy core work that DDP's do not (docs/performance.md, "Where
# Horovod's CPU time went, and fixes to its source", and the section after it); each fix was
# measured across two hosts.
#
# 1. synchronize() waited by calling sched_yield in a loop: the training thread spun on its core,
#    at the expense of the threads that move the data, for as long as an allreduce took. It now
#    sleeps on a condition variable that MarkDone signals.
_WAIT_FIXES = (
    SourceFix("horovod/torch/handle_manager.h", old="""\
#include <atomic>
""", new="""\
#include <atomic>
#include <condition_variable>
"""),
    SourceFix("horovod/torch/handle_manager.h", old="""\
  bool PollHandle(int handle);
""", new="""\
  bool PollHandle(int handle);
  void WaitHandle(int handle);
"""),
    SourceFix("horovod/torch/handle_manager.h", old="""\
  std::mutex mutex_;
""", new="""\
  std::mutex mutex_;
  std::condition_variable done_;
"""),
    SourceFix("horovod/torch/handle_manager.cc", old="""\
  std::lock_guard<std::mutex> guard(mutex_);
  results_[handle] = std::make_shared<Status>(status);
}
""", new="""\
  {
    std::lock_guard<std::mutex> guard(mutex_);
    results_[handle] = std::make_shared<Status>(status);
  }
  done_.notify_all();
}

void HandleManager::WaitHandle(int handle) {
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [&] {
    auto it = results_.find(handle);
    if (it == results_.end()) {
      throw std::invalid_argument("Handle " + std::to_string(handle) +
                                  " was not created or has been cleared.");
    }
    return it->second != nullptr;
  });
}
"""),
    SourceFix("horovod/torch/handle_manager.cc", old="""\
void HandleManager::Reset() {
  std::lock_guard<std::mutex> guard(mutex_);
  results_.clear();
  last_handle_ = 0;
}
""", new="""\
void HandleManager::Reset() {
  {
    std::lock_guard<std::mutex> guard(mutex_);
    results_.clear();
    last_handle_ = 0;
  }
  done_.notify_all();  // a waiter on a cleared handle raises, as a poll of it does
}
"""),
    SourceFix("horovod/torch/mpi_ops_v2.cc", old="""\
  while (true) {
    if (handle_manager.PollHandle(handle)) break;
    {
      py::gil_scoped_release release_python_gil;
      std::this_thread::yield();
    }
  }
""", new="""\
  {
    py::gil_scoped_release release_python_gil;
    handle_manager.WaitHandle(handle);
  }
"""),
)

# 2. Gloo summed float16 one element at a time in software, and its float16 assignment converts
#    once more (operator!= compares against the raw bits taken as an int): under --gloo with
#    --fp16-allreduce, ~95 ms of CPU in a 540 ms step. Gloo's F16C version is compiled only where
#    config.h is included, which its math.h is not. Horovod's Gloo allreduce now sums float16 as
#    Horovod's MPI path does: eight at a time with F16C where the CPU has it, in float32, rounded
#    to nearest even once.
_GLOO_FP16_FIXES = (
    SourceFix("horovod/common/ops/gloo_operations.cc", old="""\
#include "../common.h"
#include "../global_state.h"
""", new="""\
#include "../common.h"
#include "../global_state.h"
#include "../half.h"

#include <type_traits>
#if __AVX__ && __F16C__
#include <immintrin.h>
#endif
"""),
    SourceFix("horovod/common/ops/gloo_operations.cc", old="""\
template <typename T>
GlooAlgorithms<T>::GlooAlgorithms(GlooContext* gloo_context)
""", new="""\
static void Float16Sum(void* c_, const void* a_, const void* b_, size_t n) {
  auto* c = static_cast<unsigned short*>(c_);
  auto* a = static_cast<const unsigned short*>(a_);
  auto* b = static_cast<const unsigned short*>(b_);
  size_t i = 0;
#if __AVX__ && __F16C__
  if (is_avx_and_f16c()) {
    for (; i + 8 <= n; i += 8) {
      __m256 sum = _mm256_add_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(a + i))),
                                 _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(b + i))));
      _mm_storeu_si128((__m128i*)(c + i), _mm256_cvtps_ph(sum, 0));
    }
  }
#endif
  for (; i < n; ++i) {
    float x, y;
    HalfBits2Float(a + i, &x);
    HalfBits2Float(b + i, &y);
    x += y;
    Float2HalfBits(&x, c + i);
  }
}

template <typename T>
GlooAlgorithms<T>::GlooAlgorithms(GlooContext* gloo_context)
"""),
    SourceFix("horovod/common/ops/gloo_operations.cc", old="""\
    void (*func)(void*, const void*, const void*, size_t) = &::gloo::sum<T>;
""", new="""\
    void (*func)(void*, const void*, const void*, size_t) = &::gloo::sum<T>;
    if (std::is_same<T, gloo::float16>::value) {
      func = &Float16Sum;  // hvdkit: see Float16Sum
    }
"""),
)

# 3. The background thread ran a negotiation collective every cycle (0.1 ms under hvdkit's
#    settings) even with nothing to send: an idle Horovod took half a core, and on a host whose
#    one core also computes, 48-83 ms of each resnet18 step's compute went to empty cycles under
#    Gloo (12-22 under Open MPI). With nothing enqueued or in flight, the thread now sleeps until the
#    next enqueue (or shutdown, or 100 ms, so stall checks still run); while anything is
#    outstanding it cycles as before. Only with the global process set alone: another set's
#    negotiation would wait on a sleeping rank.
_IDLE_FIXES = (
    SourceFix("horovod/common/tensor_queue.h", old="""\
#include <iostream>
#include <mutex>
""", new="""\
#include <chrono>
#include <condition_variable>
#include <iostream>
#include <mutex>
"""),
    SourceFix("horovod/common/tensor_queue.h", old="""\
  void RemoveJoinTensor();

""", new="""\
  void RemoveJoinTensor();

  // hvdkit: nothing waits to be sent or to complete here.
  bool Idle() const;

  // hvdkit: a count of enqueues into any queue, and a wait until it passes `seen`.
  static uint64_t Enqueues();
  static void WaitForEnqueue(uint64_t seen, std::chrono::steady_clock::time_point deadline);
  static void Wake();

"""),
    SourceFix("horovod/common/tensor_queue.cc", old="""\
namespace horovod {
namespace common {

""", new="""\
namespace horovod {
namespace common {

namespace {
std::mutex enqueue_mutex;
std::condition_variable enqueue_cv;
uint64_t enqueues = 0;
} // namespace

uint64_t TensorQueue::Enqueues() {
  std::lock_guard<std::mutex> guard(enqueue_mutex);
  return enqueues;
}

void TensorQueue::WaitForEnqueue(uint64_t seen, std::chrono::steady_clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(enqueue_mutex);
  enqueue_cv.wait_until(lock, deadline, [&] { return enqueues != seen; });
}

void TensorQueue::Wake() {
  {
    std::lock_guard<std::mutex> guard(enqueue_mutex);
    ++enqueues;
  }
  enqueue_cv.notify_all();
}

bool TensorQueue::Idle() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return tensor_table_.empty() && message_queue_.empty();
}

"""),
    SourceFix("horovod/common/tensor_queue.cc", old="""\
  tensor_table_.emplace(e.tensor_name, std::move(e));
  message_queue_.push(std::move(message));
  return Status::OK();
}
""", new="""\
  tensor_table_.emplace(e.tensor_name, std::move(e));
  message_queue_.push(std::move(message));
  Wake();
  return Status::OK();
}
"""),
    SourceFix("horovod/common/tensor_queue.cc", old="""\
    tensor_table_.emplace(entries[i].tensor_name, std::move(entries[i]));
    message_queue_.push(std::move(messages[i]));
  }
  return Status::OK();
}
""", new="""\
    tensor_table_.emplace(entries[i].tensor_name, std::move(entries[i]));
    message_queue_.push(std::move(messages[i]));
  }
  Wake();
  return Status::OK();
}
"""),
    SourceFix("horovod/common/operations.cc", old="""\
    std::this_thread::sleep_for(sleep_duration);
  }
  state.last_cycle_start = std::chrono::steady_clock::now();
""", new="""\
    std::this_thread::sleep_for(sleep_duration);
  }
  // hvdkit: with nothing to negotiate, sleep until there is (see hvdkit.build, _IDLE_FIXES).
  auto enqueues = TensorQueue::Enqueues();
  auto set_ids = state.process_set_table.Ids();
  if (!state.shut_down && !state.dynamic_process_sets && set_ids.size() == 1 &&
      state.process_set_table.Get(set_ids[0]).tensor_queue.Idle()) {
    TensorQueue::WaitForEnqueue(enqueues, std::chrono::steady_clock::now() +
                                              std::chrono::milliseconds(100));
  }
  state.last_cycle_start = std::chrono::steady_clock::now();
"""),
    SourceFix("horovod/common/operations.cc", old="""\
    horovod_global.shut_down = true;
    horovod_global.background_thread.join();
""", new="""\
    horovod_global.shut_down = true;
    TensorQueue::Wake();  // hvdkit: a sleeping background thread sees the shutdown now
    horovod_global.background_thread.join();
"""),
)

SOURCE_FIXES = (*_WAIT_FIXES, *_GLOO_FP16_FIXES, *_IDLE_FIXES)


def build_fixes(standard: int) -> tuple[SourceFix, ...]:
    """Every edit a build makes to Horovod's source, in order, for torch's C++ ``standard``."""
    return (*cxx_standard_fixes(standard), *SOURCE_FIXES)


def apply_source_fixes(src_dir: Path, fixes: Sequence[SourceFix]) -> None:
    """Apply each fix in order; one that does not match exactly once stops the build."""
    for fix in fixes:
        path = src_dir / fix.path
        text = path.read_text()
        if text.count(fix.old) != 1:
            first = fix.old.strip().splitlines()[0]
            raise BuildError(f"{path}: expected one {first!r} to fix, found {text.count(fix.old)}; "
                             f"is this Horovod {HOROVOD_VERSION}?")
        path.write_text(text.replace(fix.old, fix.new))


def source_fixes_digest() -> str:
    """Part of the cache key: a wheel built without today's fixes is not reused."""
    edits = [[fix.path, fix.old, fix.new] for fix in SOURCE_FIXES]
    return hashlib.sha256(json.dumps(edits).encode()).hexdigest()[:12]


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
    )


def check_build_tools(which: Callable[[str], Optional[str]] = shutil.which) -> None:
    """Fail early, in one line, on a missing compiler, CMake or MPI."""
    needs = [
        ("cmake", "CMake >= 3.13: apt-get install cmake (or pip install cmake)"),
        ("g++", "a C++20 compiler: apt-get install g++"),
    ]
    for tool, fix in needs:
        if not which(tool):
            raise BuildError(f"{tool} not found on PATH; needed to build Horovod: {fix}")


def installed_horovod_version() -> Optional[str]:
    try:
        return importlib.metadata.version("horovod")
    except importlib.metadata.PackageNotFoundError:
        return None


def _pip(*args: str, quiet: bool = True) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    if quiet:
        cmd.insert(4, "-q")
    subprocess.run(cmd, check=True)


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
        except subprocess.CalledProcessError:
            raise BuildError(f"pip could not install {' '.join(missing)}; {_offline_hint()}") from None


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


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
                         f"{_last_line(download.stderr)}); {_offline_hint()}")
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
        apply_source_fixes(src, build_fixes(plan.cxx_standard))
        env = dict(os.environ)
        env.update(plan.flags)
        env.update(plan.paths)
        env["HOROVOD_LOCAL_VERSION"] = plan.local_version.split("+", 1)[1]
        wrappers = _mpi_wrappers(plan.paths["MPICXX"], tmp_path / "mpi-bin") if "MPICXX" in plan.paths else None
        if wrappers:
            env["PATH"] = f"{wrappers}{os.pathsep}{env.get('PATH', '')}"
        env.setdefault("MAKEFLAGS", f"-j{os.cpu_count() or 1}")
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


def ensure_horovod(plan: BuildPlan, cache: Path, force: bool = False, sources: Optional[Sources] = None) -> str:
    """Install (and export) the planned Horovod, from a wheelhouse or the cache when possible.
    Returns what happened."""
    sources = sources or Sources()
    installed = sources.install and not force and installed_horovod_version() == plan.local_version
    if installed and sources.wheel_dir is None:
        return "already installed"
    folders = [sources.find_links] if sources.find_links else []
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
        if args.dry_run:
            return 0
        started = time.monotonic()
        outcome = ensure_horovod(plan, cache, force=args.force, sources=sources)
        built = verify_install(plan) if args.install else ["not installed"]
    except BuildError as exc:
        print(f"hvdkit.build: error: {exc}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as exc:
        print(f"hvdkit.build: error: command failed ({exc.returncode}): {' '.join(map(str, exc.cmd))}",
              file=sys.stderr)
        return 1
    print(f"hvdkit.build: Horovod {plan.local_version} {outcome} "
          f"[{', '.join(built)}] ({time.monotonic() - started:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
