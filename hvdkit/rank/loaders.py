"""Loaders and the data position: each rank's shard, and where a resumed epoch goes on.

A training loader's batches hold K micro-batches of ``batch_size`` (one optimizer step); its
sampler shards the data as DistributedSampler does (seed + epoch) and can start an epoch part
way, so ``epochs()`` continues a resumed epoch at the sample where its checkpoint was taken, in
the same order. An evaluation loader gives every sample to exactly one rank.
"""

from __future__ import annotations

import math
import weakref
from typing import Callable, Iterator, Optional

from torch.utils.data import DataLoader

from hvdkit import data
from hvdkit.config import ConfigError


class Loaders:
    """The loaders of one Session, whose step and epoch they follow."""

    def __init__(self, session) -> None:
        self.session = weakref.proxy(session)  # the Session owns this; no cycle keeps either alive
        self.made: list[DataLoader] = []  # training loaders, in the order made
        self.micro_size = session.cfg.batch_size  # samples per micro-batch, from the last loader made
        self.resumed_batches: Optional[list] = None  # the checkpoint's loader batch sizes

    def train(self, data_or_loader, batch_size: Optional[int], shuffle: bool, loader_args: dict) -> DataLoader:
        session = self.session
        dataset, batch_size, options = self._parts(data_or_loader, batch_size, loader_args,
                                                   kept=("collate_fn", "drop_last"))
        if len(dataset) < session.size * batch_size:
            raise ConfigError(f"data: the training set has {len(dataset)} samples, fewer than "
                              f"world size x batch_size = {session.size} x {batch_size}")
        sampler = data.ResumableSampler(dataset, num_replicas=session.size, rank=session.rank, shuffle=shuffle,
                                        seed=session.cfg.seed)
        made = DataLoader(dataset, batch_size=batch_size * session.cfg.batches_per_allreduce, sampler=sampler,
                          **options)
        self.micro_size = batch_size
        self.made.append(made)
        return made

    def evaluation(self, data_or_loader, batch_size: Optional[int], loader_args: dict) -> DataLoader:
        session = self.session
        dataset, batch_size, options = self._parts(data_or_loader, batch_size, loader_args, kept=("collate_fn",))
        return DataLoader(dataset, batch_size=batch_size,
                          sampler=data.ShardSampler(len(dataset), session.rank, session.size), **options)

    def _parts(self, data_or_loader, batch_size: Optional[int], loader_args: dict, kept: tuple):
        """(dataset, batch size, DataLoader options) from a Dataset, or from a DataLoader whose
        ``kept`` settings and batch size carry over; hvdkit's shared loader settings underneath."""
        session = self.session
        if isinstance(data_or_loader, DataLoader):
            batch_size = batch_size or data_or_loader.batch_size
            loader_args = {**{name: getattr(data_or_loader, name) for name in kept}, **loader_args}
            data_or_loader = data_or_loader.dataset
        loader_args = dict(loader_args)
        options = {**data.loader_options(session.cfg, session.rank, session.device.type == "cuda",
                                         loader_args.pop("worker_init_fn", None)), **loader_args}
        return data_or_loader, batch_size or session.cfg.batch_size, options

    def batch_sizes(self) -> list[int]:
        """Each training loader's samples per step: a checkpoint's data position counts in them."""
        return [loader.batch_size for loader in self.made]

    def steps_per_epoch(self) -> int:
        loader = self.made[0]
        return math.ceil(loader.sampler.num_samples / loader.batch_size) if not loader.drop_last \
            else loader.sampler.num_samples // loader.batch_size

    def epoch_ended(self) -> bool:
        """This step ends an epoch of the training loaders (False before any is made)."""
        return bool(self.made) and self.session.global_step % self.steps_per_epoch() == 0

    def epochs(self, count: int, max_steps: Optional[int], epoch_ended: Callable[[], bool]) -> Iterator[int]:
        """``epoch_ended()``: every rank at the end of its batches; True where the run stopped there."""
        session = self.session
        per_epoch = self.steps_per_epoch() if self.made else None
        self._check_position(per_epoch)
        if per_epoch:
            session.total_steps = min(count * per_epoch, max_steps or count * per_epoch)
        while session.epoch < count and not session.stopped and session.global_step < (max_steps or math.inf):
            for loader in self.made:
                done = session.global_step - session.epoch * per_epoch
                loader.sampler.set_epoch(session.epoch, start=done * loader.batch_size)
            yield session.epoch
            if session.stopped or epoch_ended():
                return
            finished = per_epoch is None or session.global_step >= (session.epoch + 1) * per_epoch
            if finished:
                session.epoch += 1
            session.save()
            if not finished:  # max_steps ended it part-way
                return

    def _check_position(self, per_epoch: Optional[int]) -> None:
        """A resumed step counts batches of the checkpointed run's size: with other batch sizes
        it would point elsewhere in the data, or past the end of the epoch."""
        session, now = self.session, self.batch_sizes()
        if self.resumed_batches not in (None, now):
            raise ConfigError(f"the checkpoint was taken with loader batches of {self.resumed_batches} samples per "
                              f"step and this run's are {now}; resume with the same batch size (and K), or start "
                              f"afresh in another checkpoint_dir")
        if per_epoch and not 0 <= session.global_step - session.epoch * per_epoch <= per_epoch:
            raise ConfigError(f"the checkpoint's step {session.global_step} is not in its epoch {session.epoch + 1} "
                              f"of {per_epoch} steps: the training set or batch size changed since it was taken")
