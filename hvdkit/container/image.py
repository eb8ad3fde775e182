"""Building hvdkit's image (the repository's Dockerfile) and the local Debian base it may start from.

The build is handed what this machine already has, so that a rebuild takes minutes, not the
compile: a copy of hvdkit's Horovod build cache (its wheels and sdist, build/hvdkit-cache in the
context), and the machine's pip settings (its indexes, local wheel folders and
certificate) as build arguments, local folders bind-mounted where the engine allows it. After a
build, a Horovod wheel the image compiled goes back into this machine's cache under its key, so
the next image build finds it.

A base made here (``--base local``) is a Debian rootfs written by mmdebstrap from this machine's
apt sources and imported as an image: for machines that reach Debian's mirror but no registry.
It is cached under a key of what goes into it, as the Horovod wheel is.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from hvdkit import __version__
from hvdkit.build.builder import cache_dir
from hvdkit.build.toolchain import HOROVOD_VERSION, last_line
from hvdkit.container.engine import Engine, EngineError, Mount

CPU_BASE = "debian:bookworm"
GPU_BASE = "nvidia/cuda:13.0.1-cudnn-devel-ubuntu24.04"  # torch 2.14's CUDA 13 wheels; nvcc for Horovod's NCCL ops
LOCAL_BASE = "local"
TARGETS = ("hvdkit", "jupyter")
CACHE_IN_CONTEXT = Path("build") / "hvdkit-cache"  # .dockerignore lets it through
CACHE_IN_IMAGE = "/opt/hvdkit/cache"

# pip's settings that the build inherits, by their names in `pip config list`.
PIP_SETTINGS = {"index-url": "PIP_INDEX_URL", "extra-index-url": "PIP_EXTRA_INDEX_URL",
                "find-links": "PIP_FIND_LINKS", "trusted-host": "PIP_TRUSTED_HOST",
                "default-timeout": "PIP_DEFAULT_TIMEOUT", "cert": "PIP_CERT"}
CERT_IN_BUILD = "/etc/hvdkit-pip-ca.crt"

BASE_SUITE = "bookworm"
BASE_PACKAGES = ("ca-certificates",)


def default_tag(gpu: bool, target: str = "hvdkit") -> str:
    flavour = "cuda13" if gpu else "cpu"
    return f"localhost/hvdkit:{__version__}-{flavour}" + ("" if target == "hvdkit" else f"-{target}")


# ---------------------------------------------------------------------------
# Pure decisions, tested without an engine.
# ---------------------------------------------------------------------------

def parse_pip_config(listing: str) -> dict[str, str]:
    """``pip config list`` lines (``global.find-links='/opt/wheels'``, ``:env:.cert='...'``) as
    {setting: value}; the environment's values win over the files', as in pip."""
    found: dict[str, tuple[int, str]] = {}
    for line in listing.splitlines():
        match = re.match(r"^(:env:|global|install|download)\.([\w-]+)='(.*)'$", line.strip())
        if not match or match.group(2) not in PIP_SETTINGS:
            continue
        rank = 1 if match.group(1) == ":env:" else 0
        if match.group(2) not in found or rank >= found[match.group(2)][0]:
            found[match.group(2)] = (rank, match.group(3))
    return {name: value for name, (_, value) in found.items()}


def _local_paths(value: str) -> list[str]:
    """The local folders a pip setting reads: a file:// index's whole tree (its pages link to
    files beside ``simple/``), a find-links folder."""
    paths = []
    for item in value.split():
        path = (item[len("file://"):] if item.startswith("file://") else item).rstrip("/")
        if path.startswith("/"):
            paths.append(str(Path(path).parent) if Path(path).name == "simple" else path)
    return paths


def pip_build_settings(settings: Mapping[str, str], engine: Engine,
                       exists: Callable[[str], bool] = os.path.exists) -> tuple[dict[str, str], list[Mount], list[str]]:
    """(build args, read-only mounts, notes) that give the build this machine's pip settings.

    Local folders (a file:// index, find-links) are mounted at the same path where the engine
    mounts during builds (podman); elsewhere (docker build) they are left out, said in a note.
    The certificate is mounted at CERT_IN_BUILD, beside the image's own bundle."""
    args: dict[str, str] = {}
    mounts: list[Mount] = []
    notes: list[str] = []
    for name, value in sorted(settings.items()):
        if name == "cert":
            if engine.bind_mounts_in_build and exists(value):
                mounts.append(Mount(value, CERT_IN_BUILD, read_only=True))
                args[PIP_SETTINGS[name]] = CERT_IN_BUILD
            continue
        local = [path for path in _local_paths(value) if exists(path)]
        if local and not engine.bind_mounts_in_build:
            kept = " ".join(item for item in value.split() if not any(path in item for path in local))
            notes.append(f"pip {name} {' '.join(local)}: local folders are not visible to {engine.name} build; "
                         f"the build uses the remaining settings")
            value = kept
        else:
            mounts += [Mount(path, path, read_only=True) for path in local]
        if value:
            args[PIP_SETTINGS[name]] = value
    return args, mounts, notes


@dataclass(frozen=True)
class BasePlan:
    """A Debian base made with mmdebstrap: what goes into it, its cache key and its tag."""

    suite: str
    sources: str  # the apt sources mmdebstrap reads (deb822 or one-line format), or a mirror URL
    packages: tuple[str, ...] = BASE_PACKAGES

    @property
    def key(self) -> str:
        identity = "\n".join([self.suite, "minbase", *self.packages, self.sources])
        return hashlib.sha256(identity.encode()).hexdigest()[:12]

    @property
    def tag(self) -> str:
        return f"localhost/hvdkit-base:{self.suite}-{self.key}"

    def mmdebstrap(self, tarball: Path, sources_file: Optional[Path]) -> list[str]:
        return ["mmdebstrap", "--variant=minbase", "--quiet", f"--include={','.join(self.packages)}", self.suite,
                str(tarball), str(sources_file) if sources_file else self.sources]


def plan_base(apt_dir: Path = Path("/etc/apt")) -> BasePlan:
    """This machine's apt sources when they are Debian's for the suite, else Debian's mirror."""
    for candidate in (apt_dir / "sources.list.d" / "debian.sources", apt_dir / "sources.list"):
        if candidate.is_file():
            text = candidate.read_text()
            if BASE_SUITE in text and "debian" in text:
                return BasePlan(BASE_SUITE, text)
    return BasePlan(BASE_SUITE, "http://deb.debian.org/debian")


# ---------------------------------------------------------------------------
# Doing it.
# ---------------------------------------------------------------------------

def _quiet(cmd: Sequence[str]) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True)


def image_exists(engine: Engine, image: str) -> bool:
    return _image_id(engine, image) is not None


def make_base(engine: Engine, plan: Optional[BasePlan] = None, cache: Optional[Path] = None,
              say: Callable[[str], None] = print) -> str:
    """The local base's tag, made (13-20 s) or re-imported from the cached rootfs only when missing."""
    plan = plan or plan_base()
    if image_exists(engine, plan.tag):
        return plan.tag
    tarball = (cache or cache_dir()) / "base" / f"{plan.tag.rsplit(':', 1)[1]}.tar"
    if not tarball.is_file():
        if shutil.which("mmdebstrap") is None:
            raise EngineError("mmdebstrap is not on PATH: install it (apt-get install mmdebstrap) to make a local "
                              "base, or pass --base IMAGE")
        tarball.parent.mkdir(parents=True, exist_ok=True)
        say(f"hvdkit image: writing a Debian {plan.suite} rootfs with mmdebstrap (key {plan.key})")
        with tempfile.TemporaryDirectory(prefix="hvdkit-base-") as tmp:
            sources = None
            if not plan.sources.startswith("http"):
                sources = Path(tmp) / ("debian.sources" if "Types:" in plan.sources else "sources.list")
                sources.write_text(plan.sources)
            partial = Path(tmp) / "base.tar"
            done = _quiet(plan.mmdebstrap(partial, sources))
            if done.returncode != 0:
                raise EngineError(f"mmdebstrap failed: {last_line(done.stderr + done.stdout)}")
            shutil.move(str(partial), tarball)  # whole or not at all: the cache holds only finished rootfs
    imported = _quiet(engine.image_import(tarball, plan.tag))
    if imported.returncode != 0:
        raise EngineError(f"{engine.name} import {tarball} failed: {last_line(imported.stderr)}")
    return plan.tag


def find_context(start: Optional[Path] = None) -> Path:
    """The checkout holding the Dockerfile: the given folder, or the one hvdkit runs from, or the cwd."""
    candidates = [start] if start else [Path(__file__).resolve().parents[2], Path.cwd()]
    for folder in candidates:
        if (folder / "Dockerfile").is_file() and (folder / "constraints.txt").is_file():
            return folder
    where = start or Path.cwd()
    raise EngineError(f"no hvdkit Dockerfile in {where}: run this in a checkout of hvdkit, or pass --context")


def fill_context_cache(context: Path, cache: Path) -> int:
    """Copy the Horovod build cache's wheels (under their keys) and sdist into the context, where
    the image's build looks first; how many files."""
    copied = 0
    for found in [*sorted((cache / "wheels").glob("*/horovod-*.whl")), *sorted((cache / "sdist").glob("horovod-*"))]:
        target = context / CACHE_IN_CONTEXT / found.relative_to(cache)
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists() or target.stat().st_size != found.stat().st_size:
            shutil.copy2(found, target)
        copied += 1
    (context / CACHE_IN_CONTEXT).mkdir(parents=True, exist_ok=True)
    return copied


def keep_built_wheels(engine: Engine, image: str, cache: Path) -> list[Path]:
    """Copy the Horovod wheels in the image's build cache into this machine's, under their keys."""
    name = f"hvdkit-wheels-{os.getpid()}"
    if _quiet(engine.create(image, name)).returncode != 0:
        return []
    kept = []
    try:
        with tempfile.TemporaryDirectory(prefix="hvdkit-wheels-") as tmp:
            if _quiet(engine.copy_out(name, f"{CACHE_IN_IMAGE}/wheels/.", Path(tmp))).returncode != 0:
                return []
            for wheel in sorted(Path(tmp).glob(f"*/horovod-{HOROVOD_VERSION}+hvdkit.*.whl")):
                target = cache / "wheels" / wheel.relative_to(tmp)
                if not target.exists():
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(wheel, target)
                    kept.append(target)
    finally:
        _quiet(engine.remove([name]))
    return kept


@dataclass
class BuildRequest:
    base: str
    tag: str
    target: str = "hvdkit"
    gpu: bool = False
    context: Optional[Path] = None


def build(engine: Engine, request: BuildRequest, say: Callable[[str], None] = print,
          pip_listing: Optional[str] = None) -> str:
    """Build the image and return its tag; one-line EngineError for what went wrong."""
    context = find_context(request.context)
    cache = cache_dir()
    base = make_base(engine, cache=cache, say=say) if request.base == LOCAL_BASE else request.base
    if not image_exists(engine, base):
        pulled = _quiet([engine.path, "pull", base])
        if pulled.returncode != 0:
            raise EngineError(f"the base image {base} does not exist here and could not be pulled: "
                              f"{last_line(pulled.stderr)}")
    files = fill_context_cache(context, cache)
    if pip_listing is None:
        pip_listing = _quiet([sys.executable, "-m", "pip", "config", "list"]).stdout
    build_args, mounts, notes = pip_build_settings(parse_pip_config(pip_listing), engine)
    for note in notes:
        say(f"hvdkit image: {note}")
    build_args = {"BASE": base, **({"HVDKIT_GPU": "1"} if request.gpu else {}), **build_args}
    cmd = engine.build(context, request.tag, dockerfile=context / "Dockerfile", target=request.target,
                       build_args=build_args, mounts=mounts)
    say(f"hvdkit image: building {request.tag} from {base} with {engine.name} ({files} files of Horovod's build "
        f"cache handed over)")
    replaced = _image_id(engine, request.tag)
    log = cache / "logs" / f"image-{request.tag.replace('/', '_').replace(':', '_')}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        done = subprocess.run(cmd, cwd=context, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise EngineError(f"the image build failed ({_failure(log.read_text())}); the whole log: {log}")
    for kept in keep_built_wheels(engine, request.tag, cache):
        say(f"hvdkit image: the Horovod wheel the image built is cached for the next build: {kept}")
    if replaced and replaced != _image_id(engine, request.tag):
        # The image this build replaced under its tag, now untagged: each rebuild would otherwise
        # leave one behind (a layer of hvdkit and Horovod each). Kept where it still has a tag.
        _quiet(engine.image_remove(replaced, only_untagged=True))
    return request.tag


def _image_id(engine: Engine, image: str) -> Optional[str]:
    done = _quiet(engine.image_exists(image))
    return done.stdout.strip() if done.returncode == 0 else None


def _failure(log_text: str) -> str:
    """The line of a build log that says why: hvdkit's own error lines first, else the last line."""
    for pattern in (r"hvdkit[\w. ]*: error: .*", r"hvdkit[\w. ]*: .*(failed|not|no ).*", r"Error: .*"):
        found = [match.group(0) for match in re.finditer(pattern, log_text)]
        if found:
            return found[-1].strip()
    return last_line(log_text)


def save(engine: Engine, name: str, output: Path) -> Path:
    """``name`` as an OCI archive at ``output``, written whole or not at all."""
    if not image_exists(engine, name):
        raise EngineError(f"no image {name} here: build it first (hvdkit image build)")
    if output.exists():
        raise EngineError(f"{output} exists: pick a new file name")
    partial = output.with_name(output.name + ".partial")
    done = _quiet(engine.save(name, partial))
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise EngineError(f"{engine.name} save failed: {last_line(done.stderr)}")
    partial.rename(output)
    return output
