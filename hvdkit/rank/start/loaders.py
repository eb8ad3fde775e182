"""Loaders and the data position: each rank's shard, and where a resumed epoch goes on.

A training loader's batches hold K micro-batches of ``batch_size`` (one optimizer step); its
sampler shards the data as DistributedSampler does (seed + epoch) and can start an epoch part
way, so ``epochs()`` continues a resumed epoch at the sample where its checkpoint was taken, in
the same order. An evaluation loader gives every sample to exactly one rank.
"""

from __future__ import annotations

import atexit
import itertools
import math
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import signal
import weakref
from typing import Callable, Iterator, Optional

import torch
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from hvdkit import data
from hvdkit.config import ConfigError, TrainConfig
from hvdkit.rank.ending import stops
from hvdkit.rank.state import RunState

_WITH_WORKERS: "weakref.WeakSet[DataLoader]" = weakref.WeakSet()  # made here with workers: ended at exit


def _workers_end_at_exit(loader: DataLoader) -> DataLoader:
    """``loader``, whose persistent workers are shut down at the interpreter's exit (end_workers),
    and are started by a fork server that outlives the stop signals (fork_server_spares_stops)."""
    if loader.num_workers > 0:
        fork_server_spares_stops(loader.multiprocessing_context)
        if not _WITH_WORKERS:  # once a process (again after every loader went: atexit runs each once per entry)
            atexit.unregister(end_workers)
            atexit.register(end_workers)  # after multiprocessing's own, so that it runs before it
        _WITH_WORKERS.add(loader)
    return loader


def fork_server_spares_stops(context) -> None:
    """Start multiprocessing's fork server, which starts the loader workers, with the stop signals
    blocked: it keeps them blocked, and so do the workers it forks until WorkerInit ignores them.
    Slurm's SIGTERM reaches every process of a task (a terminal's a whole process group) and would
    end the fork server, which ignores only SIGINT; torch's workers end themselves once their
    parent, that server, is gone, and the rank then fails before it saves. The resource tracker
    goes first: starting it unblocks SIGTERM in the calling thread. Where a fork server runs
    already, or ``context`` (a loader's multiprocessing context) is not one, nothing changes."""
    if getattr(context, "get_start_method", lambda: None)() != "forkserver":
        return
    multiprocessing.resource_tracker.ensure_running()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, stops.SIGNALS)  # one sent meanwhile: another thread's, or pending
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def end_workers() -> None:
    """At the interpreter's exit: the workers of the loaders still referenced (a script's globals)
    are shut down as their iterator would. They ignore SIGTERM (WorkerInit), which multiprocessing's
    own end of its children sends before waiting for them: without this the process would not end."""
    for loader in list(_WITH_WORKERS):
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()


class Loaders:
    """The loaders of one run, whose step and epoch (in ``state``) they follow; ``epochs()`` moves
    the epoch on. Each data-parallel replica of ``mesh`` reads its shard (every rank without tensor
    parallelism; with it, a tensor-parallel group's ranks read the same batches)."""

    def __init__(self, cfg, hvd, device, state: RunState, mesh) -> None:
        self.cfg, self.hvd, self.device, self.state, self.mesh = cfg, hvd, device, state, mesh
        self.made: list[DataLoader] = []  # training loaders, in the order made
        self.micro_size = cfg.batch_size  # samples per micro-batch, from the last loader made
        self.resumed_batches: Optional[list] = None  # the checkpoint's loader batch sizes

    def train(self, data_or_loader, batch_size: Optional[int], shuffle: bool, loader_args: dict) -> DataLoader:
        if self.cfg.elastic:  # the ranks change: Horovod's sampler shares out what is left of the epoch
            self.made.append(self.elastic(data_or_loader, batch_size, loader_args))
            return self.made[-1]
        rank, size = self.mesh.data_parallel(self.hvd)
        dataset, batch_size, options = self._parts(data_or_loader, batch_size, loader_args,
                                                   kept=("collate_fn", "drop_last"))
        if len(dataset) < size * batch_size:
            raise ConfigError(f"data: the training set has {len(dataset)} samples, fewer than "
                              f"{'world size' if self.mesh.tp == 1 else 'data-parallel replicas'} x batch_size = "
                              f"{size} x {batch_size}")
        sampler = ResumableSampler(dataset, num_replicas=size, rank=rank, shuffle=shuffle, seed=self.cfg.seed)
        made = _workers_end_at_exit(DataLoader(dataset, batch_size=batch_size * self.cfg.batches_per_allreduce,
                                               sampler=sampler, **options))
        self.micro_size = batch_size
        self.made.append(made)
        return made

    def elastic(self, dataset, batch_size: Optional[int], loader_args: dict) -> DataLoader:
        """Over Horovod's ElasticSampler, whose position Horovod's state and the checkpoints keep."""
        dataset, batch_size, options = self._parts(dataset, batch_size, loader_args, kept=("collate_fn",))
        sampler = self.hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=self.cfg.seed)
        self.micro_size = batch_size
        return _workers_end_at_exit(DataLoader(dataset, batch_size=batch_size * self.cfg.batches_per_allreduce,
                                               sampler=sampler, **options))

    def evaluation(self, data_or_loader, batch_size: Optional[int], loader_args: dict) -> DataLoader:
        """This replica's share. In a pipeline, where neither the call nor a loader gives a batch size,
        batches of a step's samples (batch_size x micro-batches), which the stages pass on in
        micro-batches as they train: a batch of one micro-batch would keep all but one stage idle."""
        if batch_size is None and not isinstance(data_or_loader, DataLoader) and self.mesh.pp > 1:
            batch_size = self.cfg.batch_size * self.cfg.batches_per_allreduce
        dataset, batch_size, options = self._parts(data_or_loader, batch_size, loader_args, kept=("collate_fn",))
        return _workers_end_at_exit(DataLoader(dataset, batch_size=batch_size,
                                               sampler=ShardSampler(len(dataset), self._replica, self._replicas),
                                               **options))

    def _replica(self) -> int:
        return self.mesh.data_parallel(self.hvd)[0]

    def _replicas(self) -> int:
        return self.mesh.data_parallel(self.hvd)[1]

    def _parts(self, data_or_loader, batch_size: Optional[int], loader_args: dict, kept: tuple):
        """(dataset, batch size, DataLoader options) from a Dataset, or from a DataLoader whose
        ``kept`` settings and batch size carry over; hvdkit's shared loader settings underneath."""
        if isinstance(data_or_loader, DataLoader):
            batch_size = batch_size or data_or_loader.batch_size
            loader_args = {**{name: getattr(data_or_loader, name) for name in kept}, **loader_args}
            data_or_loader = data_or_loader.dataset
        loader_args = dict(loader_args)
        options = {**loader_options(self.cfg, self._replica(), self.device.type == "cuda",  # a tp group alike
                                         loader_args.pop("worker_init_fn", None)), **loader_args}
        return data_or_loader, batch_size or self.cfg.batch_size, options

    def batch_sizes(self) -> list[int]:
        """Each training loader's samples per step: a checkpoint's data position counts in them."""
        return [loader.batch_size for loader in self.made]

    def steps_per_epoch(self) -> int:
        loader = self.made[0]
        return math.ceil(loader.sampler.num_samples / loader.batch_size) if not loader.drop_last \
            else loader.sampler.num_samples // loader.batch_size

    def epoch_ended(self) -> bool:
        """This step ends an epoch of the training loaders (False before any is made)."""
        if self.cfg.elastic and self.made:  # its steps per epoch change with the world size
            sampler = self.elastic_sampler()
            return sampler.processed_num >= len(sampler.dataset)
        return bool(self.made) and self.state.global_step % self.steps_per_epoch() == 0

    def progress(self) -> Callable[[int], float]:
        """The epochs done at an optimizer step, with the share of the next; in an elastic run the
        samples processed of the epoch, whichever the ranks were that took them. (A function of
        the sampler or the steps per epoch alone: see rank.step.training.lr_lambda.)"""
        if self.cfg.elastic:
            sampler = self.elastic_sampler()
            return lambda step: sampler.epoch + min(1.0, sampler.processed_num / len(sampler.dataset))
        per_epoch = self.steps_per_epoch()
        return lambda step: step / per_epoch

    def elastic_sampler(self):
        """The elastic training loader's ElasticSampler."""
        if not self.made:
            raise RuntimeError("hvdkit: an elastic run makes its training loader with session.loader() before "
                               "session.run()")
        return self.made[0].sampler

    def epochs(self, count: int, max_steps: Optional[int], epoch_ended: Callable[[], bool],
               save: Callable[[], None]) -> Iterator[int]:
        """``epoch_ended()``: every rank at the end of its batches; True where the run stopped there.
        ``save()``: the checkpoint after each epoch."""
        state = self.state
        per_epoch = self.steps_per_epoch() if self.made else None
        self._check_position(per_epoch)
        if per_epoch:
            state.total_steps = min(count * per_epoch, max_steps or count * per_epoch)
        while state.epoch < count and not state.stopped and state.global_step < (max_steps or math.inf):
            for loader in self.made:
                done = state.global_step - state.epoch * per_epoch
                loader.sampler.set_epoch(state.epoch, start=done * loader.batch_size)
            yield state.epoch
            if state.stopped or epoch_ended():
                return
            finished = per_epoch is None or state.global_step >= (state.epoch + 1) * per_epoch
            if finished:
                state.epoch += 1
            save()
            if not finished:  # max_steps ended it part-way
                return

    def _check_position(self, per_epoch: Optional[int]) -> None:
        """A resumed step counts batches of the checkpointed run's size: with other batch sizes
        it would point elsewhere in the data, or past the end of the epoch."""
        state, now = self.state, self.batch_sizes()
        if self.resumed_batches not in (None, now):
            raise ConfigError(f"the checkpoint was taken with loader batches of {self.resumed_batches} samples per "
                              f"step and this run's are {now}; resume with the same batch size (and K), or start "
                              f"afresh in another checkpoint_dir")
        if per_epoch and not 0 <= state.global_step - state.epoch * per_epoch <= per_epoch:
            raise ConfigError(f"the checkpoint's step {state.global_step} is not in its epoch {state.epoch + 1} "
                              f"of {per_epoch} steps: the training set or batch size changed since it was taken")


class ShardSampler(Sampler):
    """Every sample exactly once across ranks (rank r takes r, r+size, ...): no padding.

    DistributedSampler pads the last round with repeated samples so that all ranks take the
    same number of steps; for validation that would count those samples twice. ``rank`` and
    ``size`` may be functions, read at each pass: an elastic run's change with its hosts.
    """

    def __init__(self, length: int, rank: int | Callable[[], int], size: int | Callable[[], int]) -> None:
        self.length, self.rank, self.size = length, rank, size

    @property
    def indices(self) -> range:
        rank, size = (value() if callable(value) else value for value in (self.rank, self.size))
        return range(rank, self.length, size)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start an epoch part-way, for an exact mid-epoch resume.

    The order is DistributedSampler's (seed + epoch), so skipping the first samples of an
    epoch gives the rest of that epoch's order, not a new one.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Start ``epoch`` at its ``start``-th sample of this rank."""
        super().set_epoch(epoch)
        self.start = start

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.start, None)

    def __len__(self) -> int:
        return self.num_samples - self.start


class WorkerInit:
    """A loader worker's start: it ignores the stop signals, then runs your worker_init_fn.

    Ctrl-C reaches the terminal's whole process group, and Slurm's SIGTERM every process of
    a task, loader workers included. A worker that dies of it makes the rank fail with
    "DataLoader worker exited unexpectedly" before it can save; the rank stops them itself."""

    def __init__(self, then: Optional[Callable[[int], None]] = None) -> None:
        self.then = then

    def __call__(self, worker_id: int) -> None:
        for signum in stops.SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        if self.then is not None:
            self.then(worker_id)


def loader_options(cfg: TrainConfig, rank: int, pin_memory: bool, worker_init_fn=None) -> dict:
    """DataLoader settings every hvdkit loader shares, the elastic one included."""
    context = data.WORKER_START_METHOD if cfg.num_workers > 0 else None
    # A generator of its own: creating an iterator must not draw from the global RNG, which
    # checkpoints restore, or a resumed run would diverge from an uninterrupted one.
    return dict(num_workers=cfg.num_workers, pin_memory=pin_memory, multiprocessing_context=context,
                persistent_workers=cfg.num_workers > 0, generator=torch.Generator().manual_seed(cfg.seed + rank),
                worker_init_fn=WorkerInit(worker_init_fn))
