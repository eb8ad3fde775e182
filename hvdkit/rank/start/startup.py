"""Process setup: Horovod started for one training process, with its device, seeds, tuning and
the run's directories.

What happens before the first step, in order (``start``): hvdkit's measured Horovod and Open MPI
settings go into the environment (a variable the user exported wins), Horovod starts, the
launcher's view of the job is checked against Horovod's, and the process takes its device and
its seeds. Then the run gets a directory of its own (``run_dir``), which rank 0 later locks, with the
checkpoint directory, against a second run (hvdkit.rank.ending.lock.lock_directories).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import gc
import hashlib
import ipaddress
import itertools
import os
import random
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping, Optional

import numpy as np
import torch

from hvdkit import env
from hvdkit.config import ConfigError, TrainConfig, from_environ, from_mapping, validate
from hvdkit.models import seed_everything
from hvdkit.parallel.mesh import Mesh
from hvdkit.rank.ending import stops
from hvdkit.rank.liveness import link
from hvdkit.system import wholefiles


def read_config(config: Optional[TrainConfig], keys: Mapping[str, object]) -> TrainConfig:
    """A Session's configuration: ``config`` (else the HVDKIT_<KEY> variables) with ``keys`` over
    it, validated. Under a launcher a mistake in it is one line from rank 0 (known by the
    launcher's rank number: this is before hvd.init), as `hvdkit train`'s is, not a traceback on
    every rank; caught by the caller, it is the caller's."""
    launched = env.detect().rank
    undo = stops.exit_on_own_errors(launched, (ConfigError,), (ConfigError,)) if launched is not None else None
    if config is None:
        config = from_mapping(from_environ(os.environ))
    cfg = validate(from_mapping(dict(keys), base=config))
    if cfg.tp > 1 or cfg.pp > 1:  # a tp or pp that does not divide the job's ranks: said here, in one line
        mesh = Mesh(env.detect().size or 1, cfg.tp, cfg.pp)
        if mesh.dp == 1 and cfg.zero:
            axes = " x ".join(f"{name} {n}" for name, n in (("pp", cfg.pp), ("tp", cfg.tp)) if n > 1)
            raise ConfigError(f"config: zero shards within the data-parallel set, and at {axes} the job's "
                              f"{mesh.size} ranks are one replica; drop --zero, or run more ranks")
    if undo:
        undo()
    return cfg


def start(cfg: TrainConfig):
    """hvd.init() with hvdkit's settings, a crash's Python stacks on stderr (``faulthandler``),
    a warning where the launcher disagrees with Horovod, the line to `hvdkit launch
    --max-restarts` (hvdkit.rank.liveness.link; not elastic: Horovod goes on without a rank that
    died), this rank's device and seeds; (horovod.torch, device, the job's Mesh: with ``tp`` or ``pp``,
    its process sets made at hvd.init, from the launcher's world size)."""
    import horovod.torch as hvd

    spans_hosts = env.detect().spans_hosts
    settings = {**performance_settings(torch.cuda.is_available(), spans_hosts, gloo_built=hvd.gloo_built()),
                **stall_settings(cfg.stall_timeout), **reproducible_settings()}
    for name, value in ({} if cfg.elastic else settings).items():
        os.environ.setdefault(name, value)  # a variable the user exported wins
    link.wait_for_go(os.environ)  # a standby attempt's rank, until it is needed
    mesh = None
    if cfg.tp > 1 or cfg.pp > 1:  # Horovod's process sets are fixed at hvd.init: made from the launcher's size
        mesh = Mesh(env.detect().size or 1, cfg.tp, cfg.pp)
        hvd.init(process_sets=mesh.process_sets(hvd) or None)
        mesh.bind(hvd)
        spanning = groups_across_hosts(mesh, hvd.allgather_object(socket.gethostname(), name="hvdkit.tp.hosts"))
        if spanning and hvd.rank() == 0:
            print(f"hvdkit: warning: {spanning}", file=sys.stderr, flush=True)
    else:
        hvd.init()
        mesh = Mesh(hvd.size()).bind(hvd)
    if not faulthandler.is_enabled():  # after hvd.init: MPI's own handler for SIGSEGV still runs after it
        with contextlib.suppress(ValueError, OSError, AttributeError):  # a stderr with no file (a notebook's)
            faulthandler.enable(all_threads=True)
    hint = data_path_hint(spans_hosts and not cfg.elastic and not torch.cuda.is_available() and hvd.gloo_built()
                          and hvd.mpi_enabled(), os.environ)
    if hint and hvd.rank() == 0:
        print(f"hvdkit: note: {hint}", file=sys.stderr, flush=True)
    problem = env.disagreement(env.detect(), hvd.rank(), hvd.size(), hvd.local_rank())
    if problem:
        print(f"hvdkit: warning: {problem}", file=sys.stderr, flush=True)
    if not cfg.elastic:
        link.connect(os.environ, hvd.rank(), hvd.size())
    device = place_process(hvd.local_rank(), hvd.local_size())
    if device.type == "cuda":
        tune_gpu(cfg)
    seed_everything(cfg.seed + mesh.data_parallel(hvd)[0])  # a tensor-parallel group's ranks draw alike
    atexit.register(exit_quickly)
    return hvd, device, mesh


def groups_across_hosts(mesh: Mesh, hosts: list[str]) -> Optional[str]:
    """What to say where a tensor-parallel group's ranks run on several hosts (``hosts``: each rank's,
    in rank order), else None. `hvdkit launch` refuses such a placement before it starts
    (hvdkit.launch.hostfile.split_groups); srun and a plain mpirun are told here."""
    for ranks in mesh.tp_ranks():
        names = sorted({hosts[rank] for rank in ranks})
        if len(names) > 1:
            return (f"tp {mesh.tp}: the tensor-parallel group of ranks {ranks[0]}-{ranks[-1]} spans hosts "
                    f"{' and '.join(names)}: every layer's allreduces cross the network; run a multiple of "
                    f"{mesh.tp} ranks on each host")
    return None


def tune_gpu(cfg: TrainConfig) -> None:
    """cuDNN's autotuner (``cudnn_benchmark``: Horovod's own benchmark sets it too) and, asked for,
    TF32 for fp32 matmuls and convolutions (``tf32``); without it torch's defaults stand. What
    each adds: docs/performance.md."""
    torch.backends.cudnn.benchmark = cfg.cudnn_benchmark
    if cfg.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def exit_quickly() -> None:
    """Registered by ``start`` to run at exit, before Python's own teardown: ``gc.freeze``.

    Python's last garbage collections at exit walk every object the process holds, and torch
    with torch._dynamo (which torch.optim imports) holds millions: about 0.8 s of CPU per rank
    at every exit, measured with ``/usr/bin/time hvdkit train --max-steps 2``. Frozen objects
    are not walked. Their memory goes back with the process; Python promises no ``__del__`` for
    what is still alive at exit, and hvdkit closes its files and checkpoints before.
    """
    gc.freeze()


def place_process(local_rank: int, local_size: int) -> torch.device:
    """The GPU local_rank % GPUs when there are GPUs; else the CPU with OMP_NUM_THREADS threads,
    or a fair share of this node's cores."""
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # the job script's choice (Slurm: cpus-per-task)
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // local_size))
    return torch.device("cpu")


STALL_BACKSTOP_SECONDS = 5


def stall_settings(timeout: float) -> dict:
    """Horovod's stall inspector: warn about a collective some rank has not joined, naming the
    tensor and the missing ranks (MPI controller only). It checks every min(60 s, timeout/3)
    for tensors waiting longer than that, so the warning comes before the limit. The
    job is ended at ``timeout`` by hvdkit's Watchdog, under every controller and with a frozen
    rank too; the inspector's own shutdown comes STALL_BACKSTOP_SECONDS later, only where the
    watchdog could not act. Gloo's own limit on one operation (30 s unless set) moves there too:
    under it, a rank waiting longer than 30 s for a frozen or busy peer (rank 0 writing a large
    checkpoint) ended the job with a traceback and exit 1, and horovodrun waited 10 s more on
    the frozen rank (40 s at --stall-timeout 30, measured). 0 disables the inspector and the
    watchdog, and leaves Gloo its 30 s."""
    if timeout <= 0:
        return {"HOROVOD_STALL_CHECK_DISABLE": "1"}
    backstop = str(max(1, int(timeout)) + STALL_BACKSTOP_SECONDS)
    return {"HOROVOD_STALL_CHECK_TIME_SECONDS": str(max(1, int(min(60.0, timeout / 3)))),
            "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": backstop, "HOROVOD_GLOO_TIMEOUT_SECONDS": backstop}


def reproducible_settings() -> dict:
    """Horovod fuses each group of gradients (hvdkit.rank.step.buckets.gradient_buckets) alone, not with
    whatever else is ready in the same cycle: the same buffers every step, so the same sums."""
    return {"HOROVOD_DISABLE_GROUP_FUSION": "1"}


# Open MPI's tuned allreduce from 1 MiB up: the ring (algorithm 4); below, its own fixed
# decision (0). Format: collectives, collective id (2: allreduce), comm sizes, from comm size 1,
# message sizes, then "bytes algorithm fan-in/out segment-size" per message size.
ALLREDUCE_RULES = "1\n2\n1\n1\n2\n0 0 0 0\n1048576 4 0 0\n"


def performance_settings(on_gpu: bool, spans_hosts: bool = False,
                         environ: Optional[dict] = None, gloo_built: bool = False) -> dict:
    """Horovod and Open MPI knobs measured best for this loop (docs/performance.md).

    On CPUs the ranks' compute threads take every core, so a rank waiting in MPI must
    yield its core instead of spinning on it: Horovod's background thread waits in an MPI
    collective each cycle, and Open MPI busy-polls unless told it is oversubscribed. Once
    waiting yields, a 0.1 ms cycle costs training nothing measurable and cuts the latency
    of every allreduce, which waits for the next cycle, from ~1.2 ms to ~0.3 ms; hvdkit's
    Horovod build sleeps through the cycles in which nothing is outstanding (hvdkit.build.builder).
    On one host, that is: across hosts a bucket's allreduce lasts milliseconds, and a 5 ms cycle
    costs less CPU beside training and no speed (docs/performance.md).

    Across hosts, Open MPI's fixed choice for large allreduces is not the ring (whose bytes
    per rank do not grow with the ranks): at 3 hosts on 1 Gbit/s links, training ran at
    24.8 img/s with it and 47.8 with the ring. So the fused gradients go by the ring, while
    the small allreduces of Horovod's negotiation keep Open MPI's choice (log2 N hops, not
    2(N-1)); unless ``environ`` already sets a coll_tuned variable of its own. And two TCP
    connections per pair of ranks: with one, a 16 MiB allreduce between two hosts moved
    0.065-0.118 GB/s on a 1 Gbit/s link, from run to run; with two, 0.112-0.119. Where Horovod has
    Gloo, Gloo may move the tensors across hosts (``gloo_data_settings`` says when). On GPUs,
    asynchronous completion only.
    """
    if on_gpu:
        # Horovod's finalizer thread marks a GPU collective done once it is queued, and torch's
        # stream waits for it on the device: synchronize() returns without waiting for the GPU,
        # so the optimizer's kernels are queued while the allreduce runs (docs/performance.md).
        return {"HOROVOD_ENABLE_ASYNC_COMPLETION": "1"}
    settings = {"OMPI_MCA_mpi_yield_when_idle": "1", "HOROVOD_CYCLE_TIME": "0.1"}
    environ = os.environ if environ is None else environ
    if not spans_hosts:
        return settings
    settings["OMPI_MCA_btl_tcp_links"] = "2"
    # Across hosts a bucket takes milliseconds on the link, so negotiating every 5 ms delays none of
    # it noticeably, and the background thread, on a core that also computes, negotiates 50x less.
    settings["HOROVOD_CYCLE_TIME"] = "5"
    if not any(name.startswith("OMPI_MCA_coll_tuned_") for name in environ):
        settings.update(OMPI_MCA_coll_tuned_use_dynamic_rules="1",
                        OMPI_MCA_coll_tuned_dynamic_rules_filename=str(allreduce_rules_file()))
    if gloo_built:
        settings.update(gloo_data_settings(environ))
    return settings


def gloo_data_settings(environ: Mapping[str, str]) -> dict:
    """Across hosts on CPUs, Gloo moves the tensors under the MPI controller too, which keeps the
    negotiation, its stall inspector and Adasum (HOROVOD_CPU_OPERATIONS=gloo; hvdkit's Horovod
    build makes it work, hvdkit/build/patches/0011): Open MPI's TCP transport polls through every
    allreduce on the core that also computes, where Gloo waits in the kernel (docs/performance.md).

    Every rank must choose alike, so only from what the launcher gives all of them: the user's
    HOROVOD_GLOO_IFACE, or the network `hvdkit launch` pins Open MPI to (btl_tcp_if_include on
    mpirun's command line), whose interface on this host Gloo is given. Otherwise (srun, a plain
    mpirun) MPI keeps the data; `hvdkit launch` also leaves it to MPI on links of 10 Gbit/s and
    more (hvdkit.launch.planner), where MPI measured as fast or faster."""
    if "HOROVOD_CPU_OPERATIONS" in environ:  # the user's or the launcher's choice, or horovodrun --gloo's
        return {}
    if environ.get("HOROVOD_GLOO_IFACE"):
        return {"HOROVOD_CPU_OPERATIONS": "gloo"}
    interface = interface_on(environ.get("OMPI_MCA_btl_tcp_if_include", ""))
    if interface:
        return {"HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_IFACE": interface}
    return {}


def data_path_hint(cpu_job_across_hosts_on_mpi: bool, environ: Mapping[str, str]) -> Optional[str]:
    """What to pass where MPI moves a CPU job's tensors across hosts because nothing chose (srun,
    a plain mpirun: ``gloo_data_settings`` found no network all ranks were given)."""
    if not cpu_job_across_hosts_on_mpi or "HOROVOD_CPU_OPERATIONS" in environ:
        return None
    return ("Open MPI moves the tensors between hosts, polling through every allreduce on the cores that compute; "
            "on links under 10 Gbit/s Gloo is faster (docs/launching.md): give every rank "
            "HOROVOD_CPU_OPERATIONS=gloo (mpirun -x HOROVOD_CPU_OPERATIONS=gloo; srun passes your environment), "
            "or start the job with hvdkit launch")


def interface_on(networks: str) -> Optional[str]:
    """This host's interface with an address in ``networks`` (Open MPI's if_include: CIDRs,
    addresses or interface names, comma-separated; "^..." excludes and names none), not loopback."""
    if not networks or networks.startswith("^"):
        return None
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        for address in addresses:
            if address.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                ip = ipaddress.ip_address(address.address.split("%")[0])
            except ValueError:
                continue
            if ip.is_loopback:
                continue
            for wanted in networks.split(","):
                wanted = wanted.strip()
                if wanted == name:
                    return name
                try:
                    if ip in ipaddress.ip_network(wanted, strict=False):
                        return name
                except ValueError:
                    continue
    return None


def allreduce_rules_file() -> Path:
    """ALLREDUCE_RULES in a file on this host, which Open MPI reads in every rank; named by
    its content, so every rank and hvdkit version that writes it writes the same bytes."""
    digest = hashlib.sha256(ALLREDUCE_RULES.encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"hvdkit-allreduce-{digest}.rules"
    if not path.exists():
        wholefiles.write_whole(path, ALLREDUCE_RULES)  # ranks on one host may race: each replace is whole
    return path


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def new_run_dir(root: str = "runs") -> str:
    """runs/<date>-<time>[-N], made here: a directory no other run uses, so runs never share
    metrics, also two started in the same second from one directory (a Slurm job array)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        Path(root).mkdir(parents=True, exist_ok=True)
        for n in itertools.count(1):
            candidate = Path(root) / (stamp if n == 1 else f"{stamp}-{n}")
            try:
                candidate.mkdir()
            except FileExistsError:
                continue
            return str(candidate)
    except OSError as exc:  # e.g. a container's user in a folder it cannot write
        raise ConfigError(f"config: cannot make the run directory under {Path(root).resolve()}: {exc.strerror}; "
                          f"start where you can write, or pass --log-dir and --checkpoint-dir") from None


def run_dir(cfg: TrainConfig, hvd) -> str:
    """A new directory for this run's metrics, the same on every rank. Elastic workers may
    join while the others train, so there it comes from the job (no collective)."""
    if cfg.elastic:
        job = os.environ.get("SLURM_JOB_ID") or os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT", "job")
        return str(Path("runs") / f"elastic-{job}")
    return hvd.broadcast_object(new_run_dir() if hvd.rank() == 0 else None, root_rank=0, name="hvdkit.log_dir")
