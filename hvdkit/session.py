"""The own-loop API: the distributed parts of a training loop on Horovod, for your own loop.

A Horovod script keeps its loop and hands hvdkit the parts that are easy to get wrong::

    session = hvdkit.Session(batch_size=32, checkpoint_dir="ckpt")   # hvd.init(), device, seeds
    model, optimizer = session.setup(model, torch.optim.AdamW(model.parameters()))
    loader = session.loader(train_set)                  # sharded; a resume continues mid-epoch
    for epoch in session.epochs(10):                    # join, checkpoint at each epoch's end
        for batch in loader:
            optimizer.zero_grad()
            for x, y in session.micro_batches(batch):   # K micro-batches per allreduce
                with session.autocast():
                    loss = F.cross_entropy(model(x), y)
                session.backward(loss)
                session.log(len(y), loss=loss)
            session.step()                              # allreduce, unscale, clip, step
            if session.report_due():
                session.report("train")                 # every rank's sums in one allreduce
            if session.should_stop():                   # SIGUSR1: all ranks stop at one step
                break
    session.finish()

``Trainer`` is a loop over this class. Everything it reads is a ``TrainConfig`` key, so
``Session(**keys)`` and ``hvdkit train --key`` mean the same thing and are checked alike.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from hvdkit import checkpoint, data, env, network, preemption, supervise
from hvdkit.config import ConfigError, TrainConfig, from_environ, from_mapping, to_dict, validate
from hvdkit.config import resume_conflict as config_resume_conflict
from hvdkit.lock import DirectoryInUse, DirectoryLock
from hvdkit.metrics import Metrics, finite_or_none, world_size_changes
from hvdkit.preemption import StopSignal
from hvdkit.watchdog import Watchdog

MAX_SKIPS_IN_A_ROW = 10


class NonFiniteError(RuntimeError):
    """The loss or gradients of a step are NaN or infinite; the message names the step."""


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


def stall_settings(timeout: float) -> dict:
    """Horovod's stall inspector: warn about a collective some rank has not joined after
    min(60 s, timeout/2), naming the tensor and the missing ranks, and end the job after
    ``timeout`` seconds instead of hanging until the allocation's time limit. 0 disables it.
    It works under the MPI controller only; the Watchdog covers Gloo."""
    if timeout <= 0:
        return {"HOROVOD_STALL_CHECK_DISABLE": "1"}
    return {"HOROVOD_STALL_CHECK_TIME_SECONDS": str(max(1, int(min(60.0, timeout / 2)))),
            "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": str(max(1, int(timeout)))}


# Open MPI's tuned allreduce from 1 MiB up: the ring (algorithm 4); below, its own fixed
# decision (0). Format: collectives, collective id (2: allreduce), comm sizes, from comm size 1,
# message sizes, then "bytes algorithm fan-in/out segment-size" per message size.
ALLREDUCE_RULES = "1\n2\n1\n1\n2\n0 0 0 0\n1048576 4 0 0\n"


def performance_settings(on_gpu: bool, spans_hosts: bool = False,
                         environ: Optional[dict] = None) -> dict:
    """Horovod and Open MPI knobs measured best for this loop (docs/performance.md).

    On CPUs the ranks' compute threads take every core, so a rank waiting in MPI must
    yield its core instead of spinning on it: Horovod's background thread waits in an MPI
    collective each cycle, and Open MPI busy-polls unless told it is oversubscribed. Once
    waiting yields, a 0.1 ms cycle costs training nothing measurable and cuts the latency
    of every allreduce, which waits for the next cycle, from ~1.2 ms to ~0.3 ms; hvdkit's
    Horovod build sleeps through the cycles in which nothing is outstanding (hvdkit.build).

    Across hosts, Open MPI's fixed choice for large allreduces is not the ring (whose bytes
    per rank do not grow with the ranks): at 3 hosts on 1 Gbit/s links, training ran at
    24.8 img/s with it and 47.8 with the ring. So the fused gradients go by the ring, while
    the small allreduces of Horovod's negotiation keep Open MPI's choice (log2 N hops, not
    2(N-1)); unless ``environ`` already sets a coll_tuned variable of its own. And two TCP
    connections per pair of ranks: with one, a 16 MiB allreduce between two hosts moved
    0.065-0.118 GB/s on a 1 Gbit/s link, from run to run; with two, 0.112-0.119. GPUs are left at Horovod's
    defaults: no GPU was available to measure them.
    """
    if on_gpu:
        return {}
    settings = {"OMPI_MCA_mpi_yield_when_idle": "1", "HOROVOD_CYCLE_TIME": "0.1"}
    environ = os.environ if environ is None else environ
    if not spans_hosts:
        return settings
    settings["OMPI_MCA_btl_tcp_links"] = "2"
    if not any(name.startswith("OMPI_MCA_coll_tuned_") for name in environ):
        settings.update(OMPI_MCA_coll_tuned_use_dynamic_rules="1",
                        OMPI_MCA_coll_tuned_dynamic_rules_filename=str(allreduce_rules_file()))
    return settings


def allreduce_rules_file() -> Path:
    """ALLREDUCE_RULES in a file on this host, which Open MPI reads in every rank; named by
    its content, so every rank and hvdkit version that writes it writes the same bytes."""
    digest = hashlib.sha256(ALLREDUCE_RULES.encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"hvdkit-allreduce-{digest}.rules"
    if not path.exists():
        partial = path.with_name(f"{path.name}.{os.getpid()}")
        partial.write_text(ALLREDUCE_RULES)
        os.replace(partial, path)  # ranks on one host may race: each replace is whole
    return path


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def lr_multiplier(cfg: TrainConfig, size: int, local_size: int, on_gpu_with_nccl: bool) -> float:
    """How much larger than base_lr the peak learning rate is, by ``cfg.lr_scaling``.

    A step averages size x K micro-batches' gradients (linear: Goyal et al.; sqrt: Krizhevsky's
    rule, common for Adam). Adasum adapts to the gradients instead, so only K counts, and on
    GPUs the sum within a node (Horovod's rule)."""
    ranks = (local_size if on_gpu_with_nccl else 1) if cfg.use_adasum else size
    batches = ranks * cfg.batches_per_allreduce
    return {"linear": float(batches), "sqrt": math.sqrt(batches), "none": 1.0}[cfg.lr_scaling]


def split_batch(batch: Any, size: int) -> list:
    """``batch`` (tensors nested in tuples, lists and dicts) as chunks of at most ``size`` samples."""
    if isinstance(batch, torch.Tensor):
        return list(batch.split(size))
    if isinstance(batch, dict):
        parts = {key: split_batch(value, size) for key, value in batch.items()}
        count = _same_count(parts.values())
        return [{key: chunks[i] for key, chunks in parts.items()} for i in range(count)]
    if isinstance(batch, (tuple, list)):
        parts = [split_batch(value, size) for value in batch]
        count = _same_count(parts)
        return [type(batch)(chunks[i] for chunks in parts) if not _is_namedtuple(batch)
                else type(batch)(*(chunks[i] for chunks in parts)) for i in range(count)]
    raise TypeError(f"batch: cannot split a {type(batch).__name__}; batches are tensors nested in "
                    f"tuples, lists and dicts")


def _same_count(parts) -> int:
    counts = {len(chunks) for chunks in parts}
    if len(counts) != 1:
        raise ValueError("batch: its tensors hold different numbers of samples")
    return counts.pop()


def _is_namedtuple(value) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor moved to ``device`` (asynchronously from pinned memory)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    if _is_namedtuple(batch):
        return type(batch)(*(to_device(value, device) for value in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(value, device) for value in batch)
    return batch


def batch_len(batch: Any) -> int:
    """Samples in a batch: the leading size of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return len(batch)
    values = batch.values() if isinstance(batch, dict) else batch
    for value in values:
        with contextlib.suppress(TypeError):
            return batch_len(value)
    raise TypeError("batch: holds no tensor")


def sync_batch_norm(model: nn.Module) -> nn.Module:
    """``model`` with each BatchNorm layer replaced by ``hvd.SyncBatchNorm``, weights and
    running statistics kept. Call it before creating the optimizer: it makes new parameters.
    Horovod's SyncBatchNorm runs on GPUs only, so on a CPU-only host this is refused."""
    import horovod.torch as hvd

    if not torch.cuda.is_available():
        raise ConfigError("sync_batch_norm: Horovod's SyncBatchNorm runs on GPUs only and this host has none; "
                          "drop sync_batch_norm (--sync-batch-norm) on CPUs")

    if isinstance(model, nn.modules.batchnorm._BatchNorm) and not isinstance(model, hvd.SyncBatchNorm):
        synced = hvd.SyncBatchNorm(model.num_features, model.eps, model.momentum, model.affine,
                                   model.track_running_stats)
        state = model.state_dict()
        synced.load_state_dict(state)
        return synced.to(next(iter(state.values())).device) if state else synced
    for name, child in model.named_children():
        setattr(model, name, sync_batch_norm(child))
    return model


def new_run_dir(root: str = "runs") -> str:
    """runs/<date>-<time>[-N]: a directory no earlier run used, so runs never share metrics."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate, n = Path(root) / stamp, 1
    while candidate.exists():
        n += 1
        candidate = Path(root) / f"{stamp}-{n}"
    return str(candidate)


class Session:
    """Horovod started for one training process, and the distributed parts of its loop.

    Keyword arguments are ``TrainConfig`` keys (``batch_size``, ``batches_per_allreduce``,
    ``amp``, ``clip_grad_norm``, ``checkpoint_dir``, ``log_interval``, ...), validated as
    ``hvdkit train`` validates its flags; without a ``config``, ``HVDKIT_<KEY>`` environment
    variables set the keys your keywords leave out (``HVDKIT_CHECKPOINT_DIR=ckpt``). Every
    method that communicates must be called by every rank at the same point of the loop, as
    with Horovod itself.
    """

    def __init__(self, config: Optional[TrainConfig] = None, **keys) -> None:
        import horovod.torch as hvd

        if config is None:  # your own loop: HVDKIT_<KEY> variables, then your keywords
            config = from_mapping(from_environ(os.environ))
        self.cfg = cfg = validate(from_mapping(keys, base=config))
        env_settings = {**performance_settings(torch.cuda.is_available(), env.detect().spans_hosts),
                        **stall_settings(cfg.stall_timeout)}
        for name, value in ({} if cfg.elastic else env_settings).items():
            os.environ.setdefault(name, value)  # a variable the user exported wins
        hvd.init()
        self.hvd = hvd
        problem = env.disagreement(env.detect(), hvd.rank(), hvd.size(), hvd.local_rank())
        if problem:
            print(f"hvdkit: warning: {problem}", file=sys.stderr, flush=True)
        self.device = place_process(hvd.local_rank(), hvd.local_size())
        seed_everything(cfg.seed + hvd.rank())
        self.watchdog = Watchdog.after_stall_inspector(0 if cfg.elastic else cfg.stall_timeout, hvd.rank())
        self._lifeline = network.Lifeline.from_environ(os.environ, hvd.rank())  # horovodrun --gloo's ranks
        self.amp_dtype = torch.float16 if self.device.type == "cuda" else torch.bfloat16
        # fp16 needs loss scaling, bf16 does not.
        self.scaler = torch.amp.GradScaler("cuda") if cfg.amp and self.device.type == "cuda" else None
        self.global_step, self.epoch = 0, 0
        self.extra: dict = {}  # your own picklable state, saved in checkpoints and restored on resume
        self.model = self.optimizer = self.scheduler = None
        self._loaders: list[DataLoader] = []
        self._micro_size = cfg.batch_size
        self._micro_count = cfg.batches_per_allreduce
        self._sums: dict[str, torch.Tensor] = {}
        self._count = torch.zeros((), device=self.device)
        # Elastic: a stop signal on the driver's host ends the job (with a checkpoint); elsewhere
        # it ends that worker alone, as Horovod has it (a node drained or preempted), and the job goes on.
        self._signal = StopSignal(install=not cfg.elastic or supervise.started_by_horovodrun_here())
        self._stop_handle = None  # this step's allreduce of the ranks' stop signals
        self._stop_signum = 0  # the signal all ranks agreed to stop for
        self.skipped_steps, self._skips_in_a_row = 0, 0  # on_nonfinite: skip
        self._resumed_batches: Optional[list] = None  # the checkpoint's loader batch sizes
        self._elastic_checkpoint: Optional[dict] = None  # read in setup(), applied by load_elastic
        self._elastic_sampler = None  # given to load_elastic: a stop's checkpoint records its position
        self.resumed_config: Optional[dict] = None  # the config keys of the checkpoint resumed from
        self._last_count = 0.0
        self.stopped = False
        self.exit_code = 0
        self.log_dir = cfg.log_dir or self._run_dir()
        self._locks = self._lock_directories()
        self._metrics: Optional[Metrics] = None
        self.total_steps = 0  # for the progress bar; set it if you know it, epochs() does
        self._samples, self._seconds = 0.0, 0.0
        self._report_start = self._wall_start = time.perf_counter()

    def _run_dir(self) -> str:
        """A new directory for this run's metrics, the same on every rank. Elastic workers may
        join while the others train, so there it comes from the job (no collective)."""
        if self.cfg.elastic:
            job = os.environ.get("SLURM_JOB_ID") or os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT", "job")
            return str(Path("runs") / f"elastic-{job}")
        return self.hvd.broadcast_object(new_run_dir() if self.rank == 0 else None, root_rank=0,
                                         name="hvdkit.log_dir")

    def _lock_directories(self) -> list[DirectoryLock]:
        """Rank 0 locks the checkpoint and log directories for this run (see hvdkit.lock);
        every rank stops with the same line when another run holds one."""
        if self.cfg.elastic:  # rank 0 may leave and another process take its place
            return []
        locks, problem = [], None
        if self.rank == 0:
            places = {os.path.realpath(d): what for d, what in ((self.cfg.checkpoint_dir, "checkpoint_dir"),
                                                                 (self.log_dir, "log_dir")) if d}
            try:
                for directory, what in places.items():
                    locks.append(DirectoryLock(directory, what))
                    locks[-1].acquire()
            except DirectoryInUse as exc:
                locks.pop()
                for held in locks:
                    held.release()
                problem = exc
        problem = self.hvd.broadcast_object(problem, root_rank=0, name="hvdkit.lock")
        if problem is not None:
            raise problem
        return locks

    # -- who and where -------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.hvd.rank()

    @property
    def size(self) -> int:
        return self.hvd.size()

    @property
    def local_rank(self) -> int:
        return self.hvd.local_rank()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def print(self, *args, **kwargs) -> None:
        """print() on rank 0 only."""
        if self.rank == 0:
            print(*args, **kwargs, flush=True)

    # -- model, optimizer, resume -----------------------------------------------------------
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler=None):
        """(model, optimizer): the model on this rank's device, the optimizer wrapped in
        Horovod's DistributedOptimizer, and every rank holding the same state.

        That state is the newest valid checkpoint in ``checkpoint_dir`` when there is one
        (rank 0 reads it and sends it to all; model, optimizer, ``scheduler``, GradScaler,
        each rank's RNG, the data position and ``extra``), else rank 0's initial weights. On a
        fresh start every optimizer's state is empty, so only the parameters are broadcast:
        Horovod's broadcast_optimizer_state would take a zero-gradient step to create state,
        which with weight decay (AdamW) moves the weights and advances Adam's step count.
        A ``scheduler`` is stepped once per optimizer step by ``step()``.
        """
        cfg, hvd = self.cfg, self.hvd
        model = model.to(self.device)
        self.model, self.scheduler, self._inner = model, scheduler, optimizer
        self.optimizer = hvd.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(),
            compression=hvd.Compression.fp16 if cfg.fp16_allreduce else hvd.Compression.none,
            backward_passes_per_step=cfg.batches_per_allreduce,
            op=hvd.Adasum if cfg.use_adasum else hvd.Average,
            gradient_predivide_factor=cfg.gradient_predivide_factor)
        # A scheduler warns that it stepped before the optimizer when the step it wrapped (the
        # one you passed) was not called; Horovod's wrapper is called instead, and first.
        optimizer._opt_called = True
        # Elastic: hvd.elastic.run syncs the state when it starts, and workers that join later
        # must not wait here in a collective the others never enter; each process reads the
        # checkpoint now, so that a conflict stops it before anything is written, and
        # load_elastic applies it.
        if cfg.elastic:
            self._elastic_checkpoint = self._read_checkpoint() if cfg.checkpoint_dir and cfg.resume else None
        elif not self._resume():
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        # Heartbeats for naming a stalled rank, once the run is accepted: a refused resume
        # leaves the log directory as it was.
        job_dir = os.environ.get(supervise.JOB_DIR)
        self.watchdog.share(job_dir or str(Path(self.log_dir) / "ranks"), own=not job_dir)
        self._report_start = time.perf_counter()
        return model, self.optimizer

    def lr_multiplier(self) -> float:
        """Peak learning rate / base_lr for this world size, by ``lr_scaling``."""
        on_nccl = self.device.type == "cuda" and self.hvd.nccl_built()
        return lr_multiplier(self.cfg, self.size, self.hvd.local_size(), on_nccl)

    def _resume(self) -> bool:
        """Load the newest valid checkpoint on every rank (read by rank 0); False if none."""
        cfg, hvd = self.cfg, self.hvd
        if not (cfg.checkpoint_dir and cfg.resume):
            return False
        state = None
        if self.rank == 0:
            try:
                state = self._read_checkpoint()
            except (checkpoint.CheckpointError, ConfigError) as exc:
                state = {"error": exc}
        state = hvd.broadcast_object(state, root_rank=0, name="hvdkit.resume")
        if state is None:
            return False
        if "error" in state:  # every rank stops with the same line
            raise state["error"]
        self._load_training_state(state)
        set_rng_state(state["rng"][self.rank])
        self._signal.step = self.global_step
        self._resumed_batches = state.get("loader_batches")
        if self.rank == 0:
            print(f"hvdkit: resumed from {state['path']} (epoch {self.epoch + 1}, step {self.global_step})",
                  file=sys.stderr, flush=True)
        return True

    def _load_training_state(self, state: dict) -> None:
        """Model, optimizer, scheduler, GradScaler, epoch, step and ``extra`` from a checkpoint."""
        try:
            self._module().load_state_dict(state["model"])
        except RuntimeError as exc:
            raise ConfigError(f"checkpoint {state['path']} does not fit this model: "
                              f"{str(exc).splitlines()[0]}") from None
        self.optimizer.load_state_dict(state["optimizer"])
        # That made new param-group dicts; a scheduler sets the rates in the dicts of the
        # optimizer you passed, so those must stay the ones Horovod's wrapper steps with.
        for mine, loaded in zip(self._inner.param_groups, self.optimizer.param_groups, strict=True):
            mine.update(loaded)
        self.optimizer.param_groups = self._inner.param_groups
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.epoch, self.global_step = state["epoch"], state["step"]
        self.resumed_config = state["config"]
        self.extra.update(state.get("extra") or {})

    def _read_checkpoint(self) -> Optional[dict]:
        def warn(message: str) -> None:
            if self.rank == 0:  # elastic ranks each read the file
                print(f"hvdkit: warning: {message}", file=sys.stderr, flush=True)

        found = checkpoint.load_latest(self.cfg.checkpoint_dir, warn)
        if found is None:
            return None
        path, state = found
        conflict = config_resume_conflict(state["config"], self.cfg)
        if conflict:
            raise ConfigError(f"checkpoint {path} {conflict}")
        if state["world_size"] != self.size and not self.cfg.elastic:  # elastic positions fit any size
            raise ConfigError(f"checkpoint {path} was written by {state['world_size']} ranks, this job has "
                              f"{self.size}; resume with {state['world_size']} ranks (the data order and learning "
                              f"rate depend on it), or start afresh in another --checkpoint-dir")
        return {**state, "path": str(path)}

    def _module(self) -> nn.Module:
        """The model without torch.compile's wrapper, so that a checkpoint's keys are the
        same whether the model was compiled or not."""
        return getattr(self.model, "_orig_mod", self.model)

    def save(self) -> None:
        """Write a checkpoint of this step to ``checkpoint_dir`` (all ranks call it; rank 0 writes)."""
        if not self.cfg.checkpoint_dir:
            return
        if self.cfg.elastic:  # its collective could wait on a leaving worker; the file lacks the position
            raise RuntimeError("hvdkit: an elastic run writes its checkpoints with save_elastic(sampler), "
                               "where it commits its state; save() is for runs without --elastic")
        self.watchdog.beat(f"checkpoint of step {self.global_step}")
        rng = self.hvd.allgather_object(rng_state())
        if self.rank == 0:
            self._write_checkpoint(rng=rng, loader_batches=[loader.batch_size for loader in self._loaders])

    def _write_checkpoint(self, **position) -> None:
        """This rank's state, and ``position``: how the data position is kept (see save, save_elastic)."""
        checkpoint.save(self.cfg.checkpoint_dir, self.global_step, {
            "model": self._module().state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler else None, "extra": self.extra,
            "epoch": self.epoch, "step": self.global_step, "world_size": self.size, "config": to_dict(self.cfg),
            **position,
        }, keep=self.cfg.keep_checkpoints)

    # -- elastic ---------------------------------------------------------------------------
    def save_elastic(self, sampler) -> None:
        """Elastic: rank 0 writes the state just committed, so that the job itself can be
        resumed (a requeue, a restart of the whole job). No collective, as save() has, since
        workers may be joining; Horovod's ElasticSampler position stands in for the loaders'
        and each rank's RNG, and it fits any world size."""
        if self.cfg.checkpoint_dir and self.rank == 0:
            self.watchdog.beat(f"checkpoint of step {self.global_step}")
            self._write_checkpoint(sampler=sampler.state_dict())

    def load_elastic(self, sampler) -> bool:
        """Elastic: this process loads the newest checkpoint, read by itself in setup() (workers
        may be joining a running job, so no collective); False if there is none. hvd.elastic.run
        then gives every rank rank 0's state, so a worker joining a running job takes the job's
        state, not the file's. Every rank checks the file, so a conflict stops each with the
        same line. The sampler is kept: the checkpoint of a stop (should_stop) records its position."""
        self._elastic_sampler = sampler
        state, self._elastic_checkpoint = self._elastic_checkpoint, None
        if state is None:
            return False
        self._load_training_state(state)
        sampler.load_state_dict(state["sampler"])
        if self.rank == 0:
            print(f"hvdkit: resumed from {state['path']} (epoch {self.epoch + 1}, step {self.global_step}, "
                  f"written by {state['world_size']} ranks, now {self.size})", file=sys.stderr, flush=True)
        return True

    # -- data ------------------------------------------------------------------------------
    def loader(self, data_or_loader, batch_size: Optional[int] = None, shuffle: bool = True,
               **loader_args) -> DataLoader:
        """A training DataLoader over this rank's shard, whose batches hold K micro-batches.

        Give a Dataset, or a DataLoader whose dataset, collate_fn and drop_last are kept. The
        order is DistributedSampler's (seed + epoch); ``epochs()`` starts a resumed epoch at
        the sample where its checkpoint was taken.
        """
        dataset, batch_size, options = self._loader_parts(data_or_loader, batch_size, loader_args,
                                                          kept=("collate_fn", "drop_last"))
        if len(dataset) < self.size * batch_size:
            raise ConfigError(f"data: the training set has {len(dataset)} samples, fewer than "
                              f"world size x batch_size = {self.size} x {batch_size}")
        sampler = data.ResumableSampler(dataset, num_replicas=self.size, rank=self.rank, shuffle=shuffle,
                                        seed=self.cfg.seed)
        made = DataLoader(dataset, batch_size=batch_size * self.cfg.batches_per_allreduce, sampler=sampler,
                          **options)
        self._micro_size = batch_size
        self._loaders.append(made)
        return made

    def eval_loader(self, data_or_loader, batch_size: Optional[int] = None, **loader_args) -> DataLoader:
        """This rank's share of an evaluation set (a Dataset, or a DataLoader whose dataset and
        collate_fn are kept): every sample on exactly one rank, none twice."""
        dataset, batch_size, options = self._loader_parts(data_or_loader, batch_size, loader_args,
                                                          kept=("collate_fn",))
        return DataLoader(dataset, batch_size=batch_size,
                          sampler=data.ShardSampler(len(dataset), self.rank, self.size), **options)

    def _loader_parts(self, data_or_loader, batch_size: Optional[int], loader_args: dict, kept: tuple):
        """(dataset, batch size, DataLoader options) from a Dataset, or from a DataLoader whose
        ``kept`` settings and batch size carry over; hvdkit's shared loader settings underneath."""
        if isinstance(data_or_loader, DataLoader):
            batch_size = batch_size or data_or_loader.batch_size
            loader_args = {**{name: getattr(data_or_loader, name) for name in kept}, **loader_args}
            data_or_loader = data_or_loader.dataset
        loader_args = dict(loader_args)
        options = {**data.loader_options(self.cfg, self.rank, self.device.type == "cuda",
                                         loader_args.pop("worker_init_fn", None)), **loader_args}
        return data_or_loader, batch_size or self.cfg.batch_size, options

    def steps_per_epoch(self) -> int:
        """Optimizer steps in a whole epoch of the first loader()."""
        loader = self._loaders[0]
        return math.ceil(loader.sampler.num_samples / loader.batch_size) if not loader.drop_last \
            else loader.sampler.num_samples // loader.batch_size

    def epochs(self, count: int, max_steps: Optional[int] = None) -> Iterator[int]:
        """Epoch numbers from where a resume left off to ``count``; after each: join, checkpoint.

        What the loop body does after its batches (evaluation, say) comes before the checkpoint.

        A resumed epoch continues at the sample where its checkpoint was taken, in the same
        order. The loop ends early when ``should_stop()`` agreed to stop, or at ``max_steps``.
        """
        per_epoch = self.steps_per_epoch() if self._loaders else None
        self._check_data_position(per_epoch)
        if per_epoch:
            self.total_steps = min(count * per_epoch, max_steps or count * per_epoch)
        while self.epoch < count and not self.stopped and self.global_step < (max_steps or math.inf):
            for loader in self._loaders:
                done = self.global_step - self.epoch * per_epoch
                loader.sampler.set_epoch(self.epoch, start=done * loader.batch_size)
            yield self.epoch
            if self.stopped:
                return
            self.join()
            finished = per_epoch is None or self.global_step >= (self.epoch + 1) * per_epoch
            if finished:
                self.epoch += 1
            self.save()
            if not finished:  # max_steps ended it part-way
                return

    def _check_data_position(self, per_epoch: Optional[int]) -> None:
        """A resumed step counts batches of the checkpointed run's size: with other batch sizes
        it would point elsewhere in the data, or past the end of the epoch."""
        now = [loader.batch_size for loader in self._loaders]
        if self._resumed_batches not in (None, now):
            raise ConfigError(f"the checkpoint was taken with loader batches of {self._resumed_batches} samples per "
                              f"step and this run's are {now}; resume with the same batch size (and K), or start "
                              f"afresh in another checkpoint_dir")
        if per_epoch and not 0 <= self.global_step - self.epoch * per_epoch <= per_epoch:
            raise ConfigError(f"the checkpoint's step {self.global_step} is not in its epoch {self.epoch + 1} of "
                              f"{per_epoch} steps: the training set or batch size changed since it was taken")

    def join(self) -> None:
        """Wait for every rank to finish its batches: a rank with fewer waits here instead of
        hanging the others' allreduce."""
        self.watchdog.beat(f"join after step {self.global_step}")
        if self.device.type == "cuda":
            self.hvd.join(self.device.index)
        else:
            self.hvd.join()  # with a device argument, a GPU build of Horovod hangs on a CPU-only host

    # -- the step --------------------------------------------------------------------------
    def micro_batches(self, batch: Any) -> list:
        """``batch`` on this device, split into the micro-batches of one optimizer step."""
        chunks = split_batch(batch, self._micro_size) if self.cfg.batches_per_allreduce > 1 else [batch]
        self._micro_count = len(chunks)
        return [to_device(chunk, self.device) for chunk in chunks]

    def autocast(self):
        """Mixed precision when ``amp``: fp16 on GPUs, bf16 on CPUs."""
        return torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.cfg.amp)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss, averaged over the step's micro-batches and
        scaled for fp16. The last micro-batch's backward starts the allreduce."""
        loss = loss / self._micro_count
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self) -> None:
        """Wait for the averaged gradients, unscale and clip them, then step without a second
        synchronize. Adasum combines the ranks' updates inside step() instead, so there the
        local gradients are unscaled and clipped. Then the scheduler, and a checkpoint every
        ``checkpoint_steps``."""
        cfg, optimizer = self.cfg, self.optimizer
        self.watchdog.beat(f"training step {self.global_step + 1}")
        self._collect_stop()  # one left by a loop that did not ask should_stop()
        self._ask_stop()  # submitted before the gradients are awaited: it travels in their cycle
        if not cfg.use_adasum:
            optimizer.synchronize()
        if self.scaler:
            self.scaler.unscale_(optimizer)
        if self._gradients_finite():
            with contextlib.nullcontext() if cfg.use_adasum else optimizer.skip_synchronize():
                if self.scaler:
                    self.scaler.step(optimizer)
                else:
                    optimizer.step()
        if self.scaler:
            self.scaler.update()
        if self.scheduler is not None:
            self.scheduler.step()
        self.global_step += 1
        self._signal.step = self.global_step  # the steps done, for a second Ctrl-C's message
        self._micro_count = cfg.batches_per_allreduce
        # Elastic runs write their checkpoints at a commit (save_elastic), with the sampler's position.
        periodic = cfg.checkpoint_steps and self.global_step % cfg.checkpoint_steps == 0 and not cfg.elastic
        end_of_epoch = self._loaders and self.global_step % self.steps_per_epoch() == 0
        if periodic and not end_of_epoch and self.global_step < (self.total_steps or math.inf):
            self.save()

    def _gradients_finite(self) -> bool:
        """Clip the gradients and tell whether they are finite. Averaged gradients are the same
        on every rank, so every rank decides alike; Adasum's are local, so there the ranks agree
        in an allreduce. With fp16 loss scaling, GradScaler skips non-finite steps itself.

        on_nonfinite=stop raises NonFiniteError before the step, so the weights and the last
        checkpoint stay good; skip leaves the weights as they were and goes on, up to
        MAX_SKIPS_IN_A_ROW steps in a row."""
        cfg = self.cfg
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if cfg.clip_grad_norm:
            norm = nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip_grad_norm)
        elif self.scaler is None and grads:
            norm = nn.utils.get_total_norm(grads)
        else:
            return True
        if self.scaler is not None:
            return True
        finite = torch.isfinite(norm).float().cpu()
        if cfg.use_adasum:
            finite = self.hvd.allreduce(finite, op=self.hvd.Min, name="hvdkit.finite")
        if finite.item():
            self._skips_in_a_row = 0
            return True
        step = self.global_step + 1
        if cfg.on_nonfinite == "stop":
            raise NonFiniteError(f"the loss or gradients of step {step} (epoch {self.epoch + 1}) are not finite; "
                                 f"stopped before applying them, {self._kept()}; lower --base-lr, set "
                                 f"--clip-grad-norm, or pass --on-nonfinite skip")
        self.skipped_steps += 1
        self._skips_in_a_row += 1
        if self._skips_in_a_row >= MAX_SKIPS_IN_A_ROW:
            raise NonFiniteError(f"the loss or gradients were not finite for {self._skips_in_a_row} steps in a row "
                                 f"(the last, step {step}); stopped, {self._kept()}; lower --base-lr or set "
                                 f"--clip-grad-norm")
        self.print(f"hvdkit: warning: the loss or gradients of step {step} are not finite; step skipped "
                   f"({self.skipped_steps} so far)", file=sys.stderr)
        for grad in grads:
            grad.zero_()
        return False

    def _kept(self) -> str:
        """Which checkpoint a run that stops now leaves behind."""
        if not self.cfg.checkpoint_dir:
            return "no checkpoint_dir"
        newest = checkpoint.existing(self.cfg.checkpoint_dir)
        return f"last good checkpoint {newest[-1]} kept" if newest else "no checkpoint written yet"

    # -- metrics and stopping ------------------------------------------------------------------
    def log(self, samples: int, **means) -> None:
        """Add a micro-batch's metrics (each a mean over its ``samples``) to this report's sums.

        No communication: the sums stay on the device until ``report()``."""
        for name, value in means.items():
            value = value.detach().float() if isinstance(value, torch.Tensor) else torch.tensor(float(value))
            self._sums[name] = self._sums.get(name, 0) + value.to(self.device) * samples
        self._count += samples

    def report_due(self) -> bool:
        """True every ``log_interval`` steps and at the end of each epoch."""
        end_of_epoch = self._loaders and self.global_step % self.steps_per_epoch() == 0
        return self.global_step % self.cfg.log_interval == 0 or bool(end_of_epoch) or \
            self.global_step == self.total_steps

    def report(self, stage: str = "train", **extra) -> dict:
        """The sample-weighted means of everything log()ged since the last report, over all
        ranks, in one allreduce that also carries the stop flag; rank 0 shows and writes them
        with ``extra`` (e.g. lr) and the throughput."""
        names = sorted(self._sums)
        window = torch.stack([*(self._sums[n] for n in names), self._count.float()])
        *sums, count = self.hvd.allreduce(window, op=self.hvd.Sum, name=f"hvdkit.{stage}").tolist()
        self._last_count = count
        means = {name: total / count if count else float("nan") for name, total in zip(names, sums, strict=True)}
        values = {**extra, **means}
        if stage == "train":
            now = time.perf_counter()
            self._samples += count
            self._seconds += now - self._report_start
            values["samples_per_sec"] = count / max(now - self._report_start, 1e-9)
        self.metrics.record(stage, self.global_step, values, position=self.global_step)
        self._report_start = time.perf_counter()  # evaluation and writing are not training time
        self._sums, self._count = {}, torch.zeros((), device=self.device)
        return means

    def evaluate(self, eval_loader: DataLoader, metrics_of: Callable[[Any], tuple[int, dict]]) -> dict:
        """Means over the whole evaluation set, and its size: ``metrics_of(batch)`` gives
        (samples, means) for each batch of this rank's share; one allreduce sums them all.
        Training metrics logged since the last report are kept for the next one. Every rank
        needs at least one batch (an evaluation set of at least world size)."""
        training = self._sums, self._count
        self._sums, self._count = {}, torch.zeros((), device=self.device)
        self.model.eval()
        with torch.no_grad(), self.autocast():
            for batch in eval_loader:
                samples, means = metrics_of(to_device(batch, self.device))
                self.log(samples, **means)
        result = self.report("test")
        self.model.train()
        self._sums, self._count = training
        return {**result, "samples": int(self._last_count)}

    def should_stop(self) -> bool:
        """True on every rank at the same step once any rank got SIGTERM, SIGINT or SIGUSR1
        (see hvdkit.preemption); by then the checkpoint of that step is written. Call it after
        every step(): the agreement is the result of the small allreduce step() started, so it
        costs no extra wait. ``finish()`` then says what was saved and, after SIGUSR1, requeues
        the Slurm job: a requeue ends the job's processes, so it comes last. Elastic runs stop
        the same way on a signal to the workers on horovodrun's host (the allreduce tells the
        others), with the checkpoint of save_elastic, whose sampler position comes from
        load_elastic(sampler); elsewhere a signal ends that worker alone (see __init__)."""
        if self.stopped:
            return True
        if self.cfg.elastic and self._elastic_sampler is None:
            raise RuntimeError("hvdkit: an elastic loop calls session.load_elastic(sampler) before its first step, "
                               "so that the checkpoint of a stop records the sampler's position")
        if self._stop_handle is None:  # no step since the last call: ask now
            self._ask_stop()
        self._collect_stop()
        if not self._stop_signum:
            return False
        self.stopped = True
        if self.cfg.elastic:
            self.save_elastic(self._elastic_sampler)
        else:
            self.save()
        return True

    def _ask_stop(self) -> None:
        """Start the allreduce of the ranks' stop signals: the largest signal number wins."""
        self._stop_handle = self.hvd.allreduce_async(torch.tensor([float(self._signal.received or 0)]),
                                                     op=self.hvd.Max, name="hvdkit.stop")

    def _collect_stop(self) -> None:
        if self._stop_handle is not None:
            self._stop_signum = self._stop_signum or int(self.hvd.synchronize(self._stop_handle).item())
            self._stop_handle = None

    @property
    def metrics(self) -> Metrics:
        """Rank 0's sink (progress, metrics.jsonl, TensorBoard); other ranks' drops everything."""
        if self._metrics is None:
            self._metrics = Metrics(self.log_dir, self.total_steps, enabled=self.rank == 0)
            self._metrics.write({"event": "config", "world_size": self.size, **to_dict(self.cfg)})
        return self._metrics

    def throughput(self) -> float:
        """Training samples per second over all ranks, counted at reports."""
        return self._samples / self._seconds if self._seconds else 0.0

    def finish(self, summary: Optional[dict] = None) -> dict:
        """End the run: stop the watchdog; after a stop, requeue the Slurm job (rank 0); write
        and print (rank 0) the summary as one JSON line, and return it. Its exit_code is non-zero
        after a stop that was not requeued, so that a job script does not take the stop for
        success. The signal handlers go last: a requeue makes Slurm send SIGTERM to every task
        within milliseconds of scontrol's answer, and that must not cut the report short."""
        try:
            return self._report(summary)
        finally:
            self._signal.restore()

    def _report(self, summary: Optional[dict]) -> dict:
        self.watchdog.stop()
        if self._lifeline:
            self._lifeline.stop()
        for held in self._locks:
            held.release()
        if self.stopped:
            name = signal.Signals(self._stop_signum).name
            saved = (f"checkpoint of step {self.global_step} saved in {self.cfg.checkpoint_dir}"
                     if self.cfg.checkpoint_dir else "no checkpoint_dir, so progress since the start is lost")
            if self.rank == 0:
                outcome, self.exit_code = preemption.after_stop(self._stop_signum, os.environ, self.cfg.max_requeues)
                line = f"stopped by {name} at step {self.global_step}; {saved}; {outcome}"
                print(f"hvdkit: {line}", file=sys.stderr, flush=True)
                if self.exit_code:
                    supervise.record_exit(self.exit_code, line)
            elif not preemption.will_requeue(self._stop_signum, os.environ, self.cfg.max_requeues):
                self.exit_code = preemption.exit_code_for(self._stop_signum)
        summary = {"event": "summary", "epochs": self.epoch, "steps": self.global_step, "world_size": self.size,
                   **(summary or {}), "wall_seconds": time.perf_counter() - self._wall_start,
                   "stopped": self.stopped, "exit_code": self.exit_code, "skipped_steps": self.skipped_steps}
        self.metrics.write(summary)
        self.metrics.close()
        if self.rank == 0:
            print(json.dumps(finite_or_none(summary)), flush=True)
        return summary

    def elastic_reset(self, step: int) -> None:
        """Elastic: call it from a reset callback. Rank 0 may now be another process: it takes
        the sink and records the reset (the step training goes on from, the new world size).
        An allreduce of stop signals started before the reset belongs to the old set of ranks."""
        self._stop_handle = None
        if self._metrics is not None:
            self._metrics.close()
        self._metrics = None
        self.metrics.write({"event": "reset", "step": step, "world_size": self.size})

    def world_size_changes(self) -> list:
        """Elastic: each change of world size this run's metrics.jsonl records, with the seconds
        it lost (see metrics.world_size_changes); rank 0 prints a line for each."""
        path = Path(self.log_dir) / "metrics.jsonl"
        if self.rank != 0 or not path.exists():
            return []
        changes = world_size_changes([json.loads(line) for line in path.read_text().splitlines() if line.strip()])
        for change in changes:
            print(f"hvdkit: elastic: world size {change['from']} -> {change['to']}, going on from step "
                  f"{change['step']}; about {change['lost_seconds']:.1f} s lost", file=sys.stderr, flush=True)
        return changes
