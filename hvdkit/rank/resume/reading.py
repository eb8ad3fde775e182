"""Which checkpoint a run takes back, and whether it may: the newest valid state (a checkpoint,
or this host's snapshot where newer), refused with one line where this run cannot continue it.

A sharded run (``zero``, or ``sharded_checkpoint``) may resume at another world size, and a
tensor-parallel or pipelined run's checkpoint (whole: hvdkit.parallel.whole) at another mesh and
number of data-parallel replicas (world size / (pp x tp)): its accumulation steps K (a pipeline's
micro-batches) adapt so that the global batch, and with it
the data position and the learning rate schedule, stay as they were; where K cannot, it is
refused. That K is decided by ``read_ahead`` before the Session makes its parts, which are then
made with it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from hvdkit import checkpoint
from hvdkit.config import ConfigError, TrainConfig
from hvdkit.config import resume_conflict as config_resume_conflict
from hvdkit.rank.resume.host_snapshots import HostSnapshots


@dataclass(frozen=True)
class Ahead:
    """What read_ahead found: ``cfg``, the config the run goes on with (every rank: the resumed
    K in it), and ``state``, rank 0's read for RunCheckpoints.restore (None: not read ahead; {}:
    no checkpoint; {"error": ...}: refused, raised on every rank by restore)."""

    cfg: TrainConfig
    state: Optional[dict] = None


class CheckpointReader:
    """Reads the state a run resumes from (on the rank that calls read: rank 0, the rank whose
    host keeps the newest snapshot, or every rank of an elastic run). Starts nothing."""

    def __init__(self, cfg, hvd, snapshots: Optional[HostSnapshots], mesh) -> None:
        self.cfg, self.hvd, self.snapshots, self.mesh = cfg, hvd, snapshots, mesh

    @property
    def sharded(self) -> bool:
        """This run shards its checkpoints: it may resume one at another world size."""
        return bool(self.cfg.zero or self.cfg.sharded_checkpoint)

    def read_ahead(self) -> Ahead:
        """A run resuming (all ranks call it, before the Session's parts are made): rank 0 reads the
        checkpoint now, and every rank learns the K it resumes with (the config is not changed:
        Ahead.cfg is a copy). Not resuming, elastic, or restarted from the snapshots of a run that is
        not sharded (its world size is the checkpoint's; the snapshot's rank reads it): the config,
        without a collective."""
        cfg = self.cfg
        if not (cfg.checkpoint_dir and cfg.resume) or cfg.elastic or (self.snapshots and not self.sharded):
            return Ahead(cfg)
        state, k = None, None
        if self.hvd.rank() == 0:
            try:
                state = self.read() or {}
            except (checkpoint.CheckpointError, ConfigError) as exc:
                state = {"error": exc}
            k = state.get("batches_per_allreduce")
        k = self.hvd.broadcast_object(k, root_rank=0, name="hvdkit.resume.k")
        return Ahead(cfg if k in (None, cfg.batches_per_allreduce) else replace(cfg, batches_per_allreduce=k), state)

    def read(self) -> Optional[dict]:
        """The newest valid checkpoint, if this run may continue it; ConfigError if not."""

        def warn(message: str) -> None:
            if self.hvd.rank() == 0:  # elastic ranks each read the file
                print(f"hvdkit: warning: {message}", file=sys.stderr, flush=True)

        found = self._newest(warn)
        return None if found is None else self.accepted(*found)

    def accepted(self, path: Path, state: dict) -> dict:
        """The checkpoint ``path``'s ``state`` with its path, if this run may continue it; ConfigError if not."""
        saved_config = state["config"]
        other_mesh = (saved_config.get("tp", 1), saved_config.get("pp", 1)) != (self.cfg.tp, self.cfg.pp)
        other_size = replicas(state) != self.mesh.data_parallel(self.hvd)[1]
        sharded = self.sharded and bool(saved_config.get("zero") or saved_config.get("sharded_checkpoint"))
        adaptable = sharded or model_parallel(saved_config, self.cfg)  # a tp or pp run's checkpoint is whole
        adapted = ("batches_per_allreduce",) * (adaptable and (other_size or other_mesh))
        conflict = config_resume_conflict(state["config"], self.cfg, adapted)
        if conflict:
            raise ConfigError(f"checkpoint {path} {conflict}")
        saved = state["world_size"]
        if (other_size or other_mesh) and adaptable:
            return {**state, "path": str(path), "batches_per_allreduce": self._adapted_k(path, state)}
        if other_size and not self.cfg.elastic:  # elastic positions fit any size
            raise ConfigError(f"checkpoint {path} was written by {saved} ranks, this job has "
                              f"{self.hvd.size()}; resume with {saved} ranks (the data order and learning "
                              f"rate depend on it), or start afresh in another --checkpoint-dir")
        return {**state, "path": str(path)}

    def _newest(self, warn) -> Optional[tuple]:
        """(path, state) of the newest valid state: this host's snapshot where it is newer than the
        newest checkpoint (a snapshot that does not verify is passed over, with a warning)."""
        # (its newest step, how to read it, whether it is the checkpoint_dir); ZeRO's snapshots are read
        # by RunCheckpoints._from_shard_snapshots
        places = []
        if self.snapshots and not self.snapshots.shards:
            places.append((self.snapshots.newest(), self.snapshots.load_latest, False))
        if self.cfg.checkpoint_dir:
            directory = self.cfg.checkpoint_dir
            places.append((max(map(checkpoint.step_of, checkpoint.existing(directory)), default=-1),
                           lambda said: checkpoint.load_latest(directory, said), True))
        for _, load, is_checkpoint_dir in sorted(places, key=lambda place: place[0], reverse=True):
            try:
                found = load(warn)
            except checkpoint.CheckpointError as exc:
                if is_checkpoint_dir:
                    raise
                warn(f"{exc}; using the newest checkpoint instead")
                continue
            if found is not None:
                return found
        return None

    def _adapted_k(self, path, state: dict) -> int:
        """K for this number of data-parallel replicas (the world size over pp x tp) that
        keeps the checkpoint's global batch (replicas x batch x K); ConfigError if none does. Said in one line."""
        saved, size, k = replicas(state), self.mesh.data_parallel(self.hvd)[1], state["config"]["batches_per_allreduce"]
        what = "data-parallel replicas" if model_parallel(state["config"], self.cfg) else "ranks"
        if (saved * k) % size:
            raise ConfigError(f"checkpoint {path} was written by {saved} {what} with batches_per_allreduce {k}; "
                              f"{size} {what} cannot keep its global batch of {saved} x {k} batches (the data "
                              f"position and learning rate depend on it): resume with a number that divides "
                              f"{saved * k}, or start afresh in another --checkpoint-dir")
        adapted, asked, samples = saved * k // size, self.cfg.batches_per_allreduce, saved * k * self.cfg.batch_size
        if saved != size:
            print(f"hvdkit: checkpoint {path} was written by {saved} {what}, this job has {size}: "
                  f"batches_per_allreduce {k} -> {adapted} keeps the global batch of {samples} samples and the "
                  f"learning rate schedule", file=sys.stderr, flush=True)
        elif adapted != asked:  # another mesh of as many replicas: a pipeline's micro-batches, say
            print(f"hvdkit: checkpoint {path} was written with batches_per_allreduce {k}, which this run keeps (it "
                  f"asked for {asked}): the global batch of {samples} samples and the learning rate schedule stay",
                  file=sys.stderr, flush=True)
        return adapted


def replicas(state: dict) -> int:
    """The data-parallel replicas of the run that wrote a checkpoint: its world size over its pp x tp."""
    return state["world_size"] // (state["config"].get("tp", 1) * state["config"].get("pp", 1))


def model_parallel(saved: dict, cfg: TrainConfig) -> bool:
    """The checkpoint's run (its ``saved`` config) or this one splits or cuts the model (tp, pp)."""
    return max(saved.get("tp", 1), saved.get("pp", 1), cfg.tp, cfg.pp) > 1
