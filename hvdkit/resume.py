"""Resume and checkpoint state: what a Session saves, and the rules for taking it back.

A checkpoint holds the model, the optimizer, the scheduler, the GradScaler, ``extra``, the
epoch and step, the config, and how the data position is kept: each rank's RNG and the loaders'
batch sizes, or (elastic) the ElasticSampler's position. Rank 0 reads the newest valid file
(hvdkit.checkpoint verifies it) and sends it to every rank; a checkpoint this run cannot
continue (another config, another world size) is refused on every rank with the same line,
before anything is written.
"""

from __future__ import annotations

import math
import sys
import weakref
from typing import Optional

from torch import nn

from hvdkit import checkpoint
from hvdkit.config import ConfigError, to_dict
from hvdkit.config import resume_conflict as config_resume_conflict
from hvdkit.process import rng_state, set_rng_state


class Checkpoints:
    """The checkpoints of one Session, which holds the state they save and restore."""

    def __init__(self, session) -> None:
        self.session = weakref.proxy(session)  # the Session owns this; no cycle keeps either alive
        self.elastic_state: Optional[dict] = None  # read in setup(), applied by load_elastic
        self.elastic_sampler = None  # given to load_elastic: a stop's checkpoint records its position

    def restore(self) -> Optional[dict]:
        """Load the newest valid checkpoint on every rank (read by rank 0); None if there is none."""
        session = self.session
        cfg, hvd = session.cfg, session.hvd
        if not (cfg.checkpoint_dir and cfg.resume):
            return None
        state = None
        if session.rank == 0:
            try:
                state = self.read()
            except (checkpoint.CheckpointError, ConfigError) as exc:
                state = {"error": exc}
        state = hvd.broadcast_object(state, root_rank=0, name="hvdkit.resume")
        if state is None:
            return None
        if "error" in state:  # every rank stops with the same line
            raise state["error"]
        self.load_state(state)
        set_rng_state(state["rng"][session.rank])
        session.print(f"hvdkit: resumed from {state['path']} (epoch {session.epoch + 1}, step {session.global_step})",
                      file=sys.stderr)
        return state

    def load_state(self, state: dict) -> None:
        """Model, optimizer, scheduler, GradScaler, epoch, step and ``extra`` from a checkpoint."""
        session = self.session
        try:
            self.module().load_state_dict(state["model"])
        except RuntimeError as exc:
            raise ConfigError(f"checkpoint {state['path']} does not fit this model: "
                              f"{str(exc).splitlines()[0]}") from None
        session.optimizer.load_state_dict(state["optimizer"])
        # That made new param-group dicts; a scheduler sets the rates in the dicts of the
        # optimizer you passed, so those must stay the ones Horovod's wrapper steps with.
        for mine, loaded in zip(session._inner.param_groups, session.optimizer.param_groups, strict=True):
            mine.update(loaded)
        session.optimizer.param_groups = session._inner.param_groups
        if session.scheduler is not None and state.get("scheduler") is not None:
            session.scheduler.load_state_dict(state["scheduler"])
        if session.scaler is not None and state.get("scaler") is not None:
            session.scaler.load_state_dict(state["scaler"])
        session.epoch, session.global_step = state["epoch"], state["step"]
        session.resumed_config = state["config"]
        session.extra.update(state.get("extra") or {})

    def read(self) -> Optional[dict]:
        """The newest valid checkpoint, if this run may continue it; ConfigError if not."""
        session = self.session

        def warn(message: str) -> None:
            if session.rank == 0:  # elastic ranks each read the file
                print(f"hvdkit: warning: {message}", file=sys.stderr, flush=True)

        found = checkpoint.load_latest(session.cfg.checkpoint_dir, warn)
        if found is None:
            return None
        path, state = found
        conflict = config_resume_conflict(state["config"], session.cfg)
        if conflict:
            raise ConfigError(f"checkpoint {path} {conflict}")
        if state["world_size"] != session.size and not session.cfg.elastic:  # elastic positions fit any size
            raise ConfigError(f"checkpoint {path} was written by {state['world_size']} ranks, this job has "
                              f"{session.size}; resume with {state['world_size']} ranks (the data order and learning "
                              f"rate depend on it), or start afresh in another --checkpoint-dir")
        return {**state, "path": str(path)}

    def module(self) -> nn.Module:
        """The model without torch.compile's wrapper, so that a checkpoint's keys are the
        same whether the model was compiled or not."""
        return getattr(self.session.model, "_orig_mod", self.session.model)

    def due(self) -> bool:
        """A periodic checkpoint after this step: every ``checkpoint_steps``, except where epochs()
        saves anyway (an epoch's end) and after the last step. Elastic runs write theirs at a
        commit (save_elastic), with the sampler's position."""
        session = self.session
        cfg, step = session.cfg, session.global_step
        if not cfg.checkpoint_steps or step % cfg.checkpoint_steps or cfg.elastic:
            return False
        return not session._loaders.epoch_ended() and step < (session.total_steps or math.inf)

    def save(self) -> None:
        """Write a checkpoint of this step (all ranks call it; rank 0 writes)."""
        session = self.session
        if not session.cfg.checkpoint_dir:
            return
        if session.cfg.elastic:  # its collective could wait on a leaving worker; the file lacks the position
            raise RuntimeError("hvdkit: an elastic run writes its checkpoints with save_elastic(sampler), "
                               "where it commits its state; save() is for runs without --elastic")
        session.watchdog.beat(f"checkpoint of step {session.global_step}")
        rng = session.hvd.allgather_object(rng_state())
        if session.rank == 0:
            self.write(rng=rng, loader_batches=session._loaders.batch_sizes())

    def write(self, **position) -> None:
        """This rank's state, and ``position``: how the data position is kept (see save, save_elastic)."""
        session = self.session
        checkpoint.save(session.cfg.checkpoint_dir, session.global_step, {
            "model": self.module().state_dict(), "optimizer": session.optimizer.state_dict(),
            "scheduler": session.scheduler.state_dict() if session.scheduler is not None else None,
            "scaler": session.scaler.state_dict() if session.scaler else None, "extra": session.extra,
            "epoch": session.epoch, "step": session.global_step, "world_size": session.size,
            "config": to_dict(session.cfg), **position,
        }, keep=session.cfg.keep_checkpoints)

    def kept(self) -> str:
        """Which checkpoint a run that stops now leaves behind."""
        directory = self.session.cfg.checkpoint_dir
        if not directory:
            return "no checkpoint_dir"
        newest = checkpoint.existing(directory)
        return f"last good checkpoint {newest[-1]} kept" if newest else "no checkpoint written yet"

    # -- elastic ---------------------------------------------------------------------------
    def read_elastic(self) -> None:
        """Elastic: hvd.elastic.run syncs the state when it starts, and workers that join later
        must not wait here in a collective the others never enter; each process reads the
        checkpoint now, so that a conflict stops it before anything is written, and
        load_elastic applies it."""
        cfg = self.session.cfg
        self.elastic_state = self.read() if cfg.checkpoint_dir and cfg.resume else None

    def save_elastic(self, sampler) -> None:
        """Elastic: rank 0 writes the state just committed. No collective, as save() has, since
        workers may be joining; the ElasticSampler's position stands in for the loaders' and
        each rank's RNG, and it fits any world size."""
        session = self.session
        if session.cfg.checkpoint_dir and session.rank == 0:
            session.watchdog.beat(f"checkpoint of step {session.global_step}")
            self.write(sampler=sampler.state_dict())

    def load_elastic(self, sampler) -> bool:
        """Elastic: apply the checkpoint this process read in setup(); False if there is none."""
        session = self.session
        self.elastic_sampler = sampler
        state, self.elastic_state = self.elastic_state, None
        if state is None:
            return False
        self.load_state(state)
        sampler.load_state_dict(state["sampler"])
        session.print(f"hvdkit: resumed from {state['path']} (epoch {session.epoch + 1}, step {session.global_step}, "
                      f"written by {state['world_size']} ranks, now {session.size})", file=sys.stderr)
        return True
