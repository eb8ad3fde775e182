"""Resume and checkpoint state: what a Session saves, and the rules for taking it back.

A checkpoint holds the model, the optimizer, the scheduler, the GradScaler, ``extra``, the
epoch and step, the config, and how the data position is kept: each rank's RNG and the loaders'
batch sizes, or (elastic) the ElasticSampler's position. Rank 0 reads the newest valid file
(hvdkit.checkpoint verifies it) and sends it to every rank; a checkpoint this run cannot
continue (another config, another world size) is refused on every rank with the same line,
before anything is written (which one, and whether: hvdkit.rank.resume.reading). A sharded
run's checkpoint says nothing the world size decides: ZeRO's shards are re-sliced, a sharded
checkpoint is read whole. A tensor-parallel run's checkpoint holds the whole model and optimizer
state (hvdkit.parallel.whole: joined over each tensor-parallel group before rank 0 writes, each
rank's blocks taken on resume), so it resumes at any (dp, tp), and at tp 1 as any other; a pipelined
run's, its stages' states joined by name as well, at any (dp, pp, tp).
"""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from hvdkit import checkpoint
from hvdkit.config import ConfigError, to_dict
from hvdkit.parallel import whole
from hvdkit.parallel.plan import whole_state_dict
from hvdkit.rank.agree.consistency import Consistency
from hvdkit.rank.ending import stops
from hvdkit.rank.liveness.watchdog import Watchdog
from hvdkit.rank.resume import reading
from hvdkit.rank.resume.host_snapshots import HostSnapshots
from hvdkit.rank.resume.reading import CheckpointReader
from hvdkit.rank.start.loaders import Loaders
from hvdkit.rank.start.startup import rng_state, set_rng_state
from hvdkit.rank.state import RunState, say
from hvdkit.zero import shards


class RunCheckpoints:
    """The checkpoints of one run: they save and restore ``state``, with the loaders' data
    position, each written only of weights the consistency check passed (where it is on). Made once per
    Session on every rank; ``snapshots``: the host snapshots of hvdkit launch's restarts
    (HostSnapshots.of_run; None outside them), ``read_ahead``: rank 0's read before the parts were made
    (CheckpointReader.read_ahead's Ahead.state; None elsewhere), both stated by the caller; ``mesh``: the
    job's (dp, tp) groups."""

    def __init__(self, cfg, hvd, state: RunState, loaders: Loaders, consistency: Consistency, watchdog: Watchdog,
                 snapshots: Optional[HostSnapshots], read_ahead: Optional[dict], mesh) -> None:
        self.cfg, self.hvd, self.state, self.mesh = cfg, hvd, state, mesh
        self.tp_group = mesh.tp_group if mesh.tp > 1 else None  # the model's blocks are joined and split over it
        self.whole = mesh.tp > 1 or mesh.pp > 1  # the model's parts joined whole for rank 0 to write
        self.loaders, self.consistency, self.watchdog = loaders, consistency, watchdog
        self.elastic_state: Optional[dict] = None  # read in setup(), applied by load_elastic
        self.elastic_sampler = None  # given to load_elastic: a stop's checkpoint records its position
        self.ahead = read_ahead  # rank 0: Ahead.state (CheckpointReader.read_ahead), for restore()
        self.writer = checkpoint.Writer(background=cfg.async_checkpoint)
        self.snapshots = snapshots  # snapshot_steps: the state in host memory for hvdkit launch's restarts
        self.reader = CheckpointReader(cfg, hvd, snapshots, mesh)
        self.last_write = 0.0  # seconds the newest written checkpoint took to write (rank 0)
        self._warned = False

    def resume_or_broadcast(self, model: nn.Module) -> None:
        """setup()'s state: the newest valid checkpoint, else rank 0's initial weights. A fresh
        optimizer's state is empty, so only parameters are broadcast: Horovod's
        broadcast_optimizer_state would take a zero-gradient step to create state, which with
        AdamW's weight decay moves the weights. Elastic: read here, applied by load_elastic.
        Zero 3: with the weights final on every rank, each keeps its slices of them (shard_model). Tensor
        and pipeline parallelism: every replica's parts are of rank 0's weights already (Session.parallelize)."""
        if self.cfg.snapshot_steps and not self.snapshots:
            raise ConfigError("snapshot_steps: snapshots are kept for the restarts of hvdkit launch --max-restarts N "
                              "(which names where each host keeps them); run under it, or drop snapshot_steps")
        if self.cfg.elastic:
            self.read_elastic()
            return
        if self.cfg.zero and self.snapshots:
            self.snapshots.arrange(self.state.optimizer)
        state = self.restore()
        if state is not None:
            self.loaders.resumed_batches = state.get("loader_batches")
        elif not getattr(self.state.optimizer, "deferred", False) and not self.whole:  # deferred: made alike
            self.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        if self.cfg.zero == 3:
            self.state.optimizer.shard_model()

    def restore(self) -> Optional[dict]:
        """Load the newest valid checkpoint on every rank (read by rank 0, or by the rank whose host
        keeps the newest snapshot); None if there is none."""
        run = self.state
        cfg, hvd = self.cfg, self.hvd
        if not (cfg.checkpoint_dir and cfg.resume):
            return None
        if self.hvd.rank() == 0:
            checkpoint.clean_partials(cfg.checkpoint_dir)  # saves killed mid-write (no save runs now)
        state = self._from_shard_snapshots() if self.snapshots and self.snapshots.shards else None
        if state is None:
            reader = self.snapshots.reader() if self.snapshots else 0
            if self.hvd.rank() == reader:
                try:
                    state = self.reader.read() if self.ahead is None else (self.ahead or None)
                except (checkpoint.CheckpointError, ConfigError) as exc:
                    state = {"error": exc}
            state = hvd.broadcast_object(state, root_rank=reader, name="hvdkit.resume")
        self.ahead = None
        if state is None:
            return None
        if "error" in state:  # every rank stops with the same line
            raise state["error"]
        self.load_state(state)
        if (state["world_size"], state["config"].get("tp", 1), state["config"].get("pp", 1)) == (
                self.hvd.size(), self.mesh.tp, self.mesh.pp):
            set_rng_state(state["rng"][self.hvd.rank()])
            if self.state.rng_tracker is not None:
                self.state.rng_tracker.load_state_dict(state["rng"][self.hvd.rank()]["tp"])
        else:  # another mesh: each rank keeps the seeds it started with
            saved, replicas = reading.replicas(state), self.mesh.data_parallel(self.hvd)[1]
            state["loader_batches"] = [b * saved // replicas for b in state["loader_batches"]]
        say(self.hvd, f"hvdkit: resumed from {state['path']} (epoch {run.epoch + 1}, step {run.global_step})")
        return state

    def _from_shard_snapshots(self) -> Optional[dict]:
        """ZeRO: the state of the newest snapshot step, as new as the newest checkpoint or newer, whose
        shards are all kept somewhere (host memory is read faster than the checkpoint of its step,
        which a rank told to end finishes writing: hvdkit.rank.liveness.link); None where there is none."""
        newest = None
        if self.hvd.rank() == 0:
            newest = max(map(checkpoint.step_of, checkpoint.existing(self.cfg.checkpoint_dir)), default=-1)
        newest = self.hvd.broadcast_object(newest, root_rank=0, name="hvdkit.resume.newest")
        return self.snapshots.shards.resume(newest - 1, self.reader.accepted)

    def load_state(self, state: dict) -> None:
        """Model, optimizer, scheduler, GradScaler, epoch, step and ``extra`` from a checkpoint."""
        run = self.state
        upgrade = getattr(self.module(), "upgrade_checkpoint", None)
        if upgrade is not None:  # a built-in model's checkpoint of an earlier layout (hvdkit.models.TinyGPT)
            state = {**state}
            state["model"], state["optimizer"] = upgrade(state["model"], state.get("optimizer"))
        path, saved = Path(state["path"]), state["optimizer"]
        # A stage-3 checkpoint holds its sharded weights in its parts (hvdkit.zero.shards): a stage-3
        # run takes its slices from them, any other joins them whole.
        sliced = shards.holds_weights(saved)
        try:
            if self.cfg.zero == 3:  # each rank keeps its slices (shard_model, after this)
                run.optimizer.load_model_state(state["model"], sliced=sliced)
            else:
                model_state = shards.whole_model(path, state) if sliced else state["model"]
                if self.mesh.pp > 1:  # this rank's stage of the whole
                    model_state = whole.own_stage_state(self.module(), model_state)
                if self.tp_group is not None:  # this rank's blocks of the whole
                    model_state = whole.own_model_state(self.module(), model_state, self.tp_group)
                self.module().load_state_dict(model_state)
        except RuntimeError as exc:
            raise ConfigError(f"checkpoint {state['path']} does not fit this model: "
                              f"{str(exc).splitlines()[0]}") from None
        if "zero_shard" in state:  # from a snapshot: this rank's shard, as it was
            shards.load_own(run.optimizer, path, saved, state["zero_shard"])
        elif shards.is_manifest(saved) and self.cfg.zero and not self.whole:
            shards.load(run.optimizer, path, saved)
        elif self.cfg.zero:  # a whole state (a checkpoint of zero 0, or of tp or pp: this rank's part), sliced
            saved = shards.plain_optimizer_state(path, saved) if shards.is_manifest(saved) else saved
            run.optimizer.load_whole_state(self._own_optimizer_state(saved))
        else:
            saved = shards.plain_optimizer_state(path, saved) if shards.is_manifest(saved) else saved
            run.optimizer.load_state_dict(self._own_optimizer_state(saved))
            # That made new param-group dicts; a scheduler sets the rates in the dicts of the
            # optimizer you passed, so those must stay the ones Horovod's wrapper steps with.
            for mine, loaded in zip(run.inner.param_groups, run.optimizer.param_groups, strict=True):
                mine.update(loaded)
            run.optimizer.param_groups = run.inner.param_groups
        if run.scheduler is not None and state.get("scheduler") is not None:
            run.scheduler.load_state_dict(state["scheduler"])
        if run.scaler is not None and state.get("scaler") is not None:
            run.scaler.load_state_dict(state["scaler"])
        run.epoch, run.global_step = state["epoch"], state["step"]
        run.resumed_config = state["config"]
        run.extra.update(state.get("extra") or {})
        run.trackers.update(state.get("trackers") or {})

    @property
    def sharded(self) -> bool:
        """This run shards its checkpoints: it may resume one at another world size."""
        return self.reader.sharded

    def module(self) -> nn.Module:
        """The model without torch.compile's wrapper, so that a checkpoint's keys are the
        same whether the model was compiled or not."""
        return getattr(self.state.model, "_orig_mod", self.state.model)

    def due(self) -> bool:
        """A periodic checkpoint after this step: every ``checkpoint_steps``, except where epochs()
        saves anyway (an epoch's end) and after the last step. Elastic runs write theirs at a
        commit (save_elastic), with the sampler's position."""
        run = self.state
        cfg, step = self.cfg, run.global_step
        if not cfg.checkpoint_steps or step % cfg.checkpoint_steps or cfg.elastic:
            return False
        return not self.loaders.epoch_ended() and step < (run.total_steps or math.inf)

    def save(self, wait: bool = True) -> None:
        """Write a checkpoint of this step (all ranks call it; rank 0 writes); with ``wait``, it
        is written when this returns, else (async_checkpoint) a thread may still be writing it."""
        if not self.cfg.checkpoint_dir:
            return
        with self.state.peaks.phase("checkpoint save"):
            self._save()
            if wait:
                self.finish()

    def _save(self) -> None:
        run = self.state
        assert not run.unsettled, "hvdkit: the steps' non-finite flags are read (settle) before a checkpoint"
        if self.cfg.elastic:  # its collective could wait on a leaving worker; the file lacks the position
            raise RuntimeError("hvdkit: an elastic run writes its checkpoints with save_elastic(sampler), "
                               "where it commits its state; save() is for runs without --elastic")
        self.finish()  # first: its deleting of old shard folders must not meet this save's
        self.consistency.before_checkpoint()
        self.watchdog.beat(f"checkpoint of step {run.global_step}")
        if self.hvd.rank() == 0:  # what a save of this step killed before its main file left; before any rank writes
            shutil.rmtree(checkpoint.shard_folder(checkpoint.path_for(self.cfg.checkpoint_dir, run.global_step)),
                          ignore_errors=True)
        rng = self.hvd.allgather_object(self._own_rng())
        joined = self._joined() if self.whole else {}
        if self.hvd.rank() == 0 or self.writes_parts:
            self.write(shards.manifest(run.optimizer) if self.cfg.zero and not joined else joined.get("optimizer"),
                       rng=rng,
                       loader_batches=self.loaders.batch_sizes(), model_state=joined.get("model"))

    def _own_rng(self) -> dict:
        """This rank's generators' states, the RNG tracker's with them under tensor parallelism."""
        tracker = self.state.rng_tracker
        return {**rng_state(), **({"tp": tracker.state_dict()} if tracker else {})}

    def _joined(self) -> dict:
        """The whole model's state and its optimizer's, on the CPU: joined over the tensor-parallel group
        (ZeRO's slices over the data-parallel set first), then across the pipeline's stages by name, on
        rank 0's pipeline; every rank calls it alike (hvdkit.parallel.whole). {} where it is not whole here."""
        step, optimizer, module, group = self.state.global_step, self.state.optimizer, self.module(), self.mesh.tp_group
        own = (whole.whole_sharded_state(optimizer, self.mesh.dp_group, f"hvdkit.tp.save.{step}.zero")
               if self.cfg.zero else optimizer.state_dict())
        model_state = whole_state_dict(module, group, f"hvdkit.tp.save.{step}")
        optimizer_state = whole.whole_optimizer_state(own, self._params(), group, f"hvdkit.tp.save.{step}.optimizer")
        if self.mesh.pp > 1:
            if 0 not in self.mesh.pp_group.ranks:  # the other pipelines hold the same stages
                return {}
            joined = whole.joined_stages(model_state, optimizer_state, module, self._params(), self.mesh.pp_group,
                                         self.hvd, f"hvdkit.pp.save.{step}")
            if joined is None:
                return {}
            model_state, optimizer_state = joined
        return {"model": model_state, "optimizer": optimizer_state}

    def _own_optimizer_state(self, saved: dict) -> dict:
        """This rank's part of a whole optimizer state (hvdkit.parallel.whole): its stage's, then its blocks."""
        if self.mesh.pp > 1:
            own_groups = [{"params": list(range(first, first + count))} for first, count in self._group_spans()]
            saved = whole.own_stage_optimizer_state(saved, self._params(), self.module(), own_groups)
        return saved if self.tp_group is None else whole.own_optimizer_state(saved, self._params(), self.tp_group)

    def _group_spans(self) -> list[tuple[int, int]]:
        """(first number, count) of each param group's parameters, as the optimizer's state_dict numbers them."""
        sizes = self.state.optimizer.group_sizes if self.cfg.zero else [
            len(group["params"]) for group in self.state.optimizer.param_groups]
        return [(sum(sizes[:index]), size) for index, size in enumerate(sizes)]

    def _params(self) -> list:
        """The parameters in the order the optimizer's state_dict numbers them (ZeRO's: the model's,
        not the slices it steps)."""
        optimizer = self.state.optimizer
        return optimizer.params if self.cfg.zero else [p for g in optimizer.param_groups for p in g["params"]]

    @property
    def writes_parts(self) -> bool:
        """Every rank writes a part of this run's checkpoints (checkpoint.parts)."""
        if self.whole:  # joined over the mesh before rank 0 writes it
            return False
        return bool(self.cfg.zero) or (self.cfg.sharded_checkpoint and self.hvd.size() > 1)

    def after_step(self, checkpoint_due: bool) -> None:
        """The checkpoint due after this step, written in the background; else the snapshot due."""
        if checkpoint_due:
            self.save(wait=False)
        elif self.snapshots and self.state.global_step % self.cfg.snapshot_steps == 0:
            self.snapshot()

    def snapshot(self) -> None:
        """This step's state into host memory (all ranks call it; HostSnapshots.take)."""
        module = self.module()
        blocks = {"tp_block": whole.block_dims(module, self._params())} if self.tp_group is not None else {}
        self.snapshots.take(self.state.global_step,
                            lambda: sum(t.nbytes for t in [*module.buffers(), *self._changed_by_step(module)]),
                            lambda optimizer_state, **entries: self.write(
                                optimizer_state, loader_batches=self.loaders.batch_sizes(), **blocks, **entries),
                            self._own_rng)

    def drop_snapshots(self) -> None:
        """The run ended (finished or stopped): its snapshots go."""
        if self.snapshots:
            self.snapshots.drop()

    def write(self, optimizer_state: Optional[dict] = None, place: Optional[tuple] = None,
              model_state: Optional[dict] = None, **position) -> None:
        """This rank's state (the optimizer's, or ZeRO's manifest; ``model_state``: the model's, made
        whole by the caller), and ``position``: how the data
        position is kept (see save, save_elastic); ``place``: (directory, writer, keep) of a
        snapshot. In a save in parts (``writes_parts``) every rank calls it and writes its part: with
        ``sharded_checkpoint`` its share of what every rank holds (checkpoint.split), under ZeRO
        its optimizer shard; rank 0 writes the main file."""
        run, cfg = self.state, self.cfg
        module = self.module()
        shared = self._changed_by_step(module)
        # Copied by the writing thread until the next update; under Adasum the update begins in the
        # backward (Horovod's Adasum optimizer steps each parameter in its gradient hook): copied now.
        deferred = () if cfg.use_adasum else shared
        state = {
            "model": model_state if model_state is not None else
            run.optimizer.unsharded_state_dict() if cfg.zero == 3 else module.state_dict(),
            "optimizer": run.optimizer.state_dict() if optimizer_state is None else optimizer_state,
            "scheduler": run.scheduler.state_dict() if run.scheduler is not None else None,
            "scaler": run.scaler.state_dict() if run.scaler else None, "extra": run.extra, "trackers": run.trackers,
            "epoch": run.epoch, "step": run.global_step, "world_size": self.hvd.size(),
            "config": to_dict(self.cfg), **position,
        }
        rank, size = self.hvd.rank(), self.hvd.size()
        if not self.writes_parts or place is not None:
            directory, writer, keep = place or (cfg.checkpoint_dir, self.writer, cfg.keep_checkpoints)
            writer.save(directory, run.global_step, state, keep, deferred=deferred)
            return
        main, parts = checkpoint.split(state, shared, size) if cfg.sharded_checkpoint else (state, [{}] * size)
        if cfg.zero:
            parts = [{**part, "zero": run.optimizer.shard_state()} if r == rank else part
                     for r, part in enumerate(parts)]
        own = (checkpoint.part_name(rank, size), parts[rank]) if parts[rank] else None  # more ranks than tensors: none
        others = [checkpoint.part_name(r, size) for r in range(1, size) if parts[r] or cfg.zero] if not rank else []
        self.writer.save(cfg.checkpoint_dir, run.global_step, None if rank else main, cfg.keep_checkpoints,
                         deferred=deferred, part=own, parts=others)

    def _changed_by_step(self, module: nn.Module) -> list:
        """The tensors only the optimizer step changes: the weights (at zero 3 this rank's slices of
        them) and the optimizer's state (a background save copies them while the next forward and
        backward run)."""
        optimizer = self.state.optimizer
        state = getattr(optimizer, "state", {})
        slices = optimizer.slices if self.cfg.zero == 3 else []
        return [*module.parameters(), *slices, *(value for per_parameter in state.values()
                                                 for value in per_parameter.values() if torch.is_tensor(value))]

    def before_update(self) -> None:
        """Before the optimizer step: wait until the saves in flight have copied what it changes."""
        self.writer.before_update()
        if self.snapshots:
            self.snapshots.writer.before_update()

    def finish(self) -> None:
        """Wait for the save in flight, if any; CheckpointError if it failed. Before the job ends,
        a stop is concluded (a requeue reads the checkpoint), and after every checkpoint's step."""
        self._said_here(self.writer.finish)

    def check(self) -> None:
        """A background save's failure, raised at the step after it (no wait)."""
        self._said_here(self.writer.check)

    def _said_here(self, call) -> None:
        """``call()``; a save that failed on a rank other than 0 (its part of a sharded checkpoint)
        failed there alone, so that rank says so (stops.exit_on_own_errors)."""
        try:
            call()
        except checkpoint.CheckpointError as exc:
            exc.said_by_its_rank = self.hvd.rank() != 0
            raise

    def take_done(self, grace: float) -> list[dict]:
        """The saves written since the last call (Writer.take_done); the first that took longer
        to write than a stop's ``grace`` is warned about, once: a stop would lose its checkpoint."""
        done = self.writer.take_done()
        if not done:  # the step's path: nothing more to do
            return done
        self.last_write = done[-1]["write_seconds"]
        line = stops.save_outlasts_grace(self.last_write, grace)
        if line and not self._warned and self.hvd.rank() == 0:
            self._warned = True
            print(f"hvdkit: warning: {line}", file=sys.stderr, flush=True)
        return done

    def warn_if_late(self, grace: float, left: float) -> None:
        """At a stop, before its checkpoint: say if the last write took longer than the grace left."""
        line = stops.save_outlasts_grace(self.last_write, grace, left)
        if line and self.cfg.checkpoint_dir and self.hvd.rank() == 0:
            print(f"hvdkit: warning: stopping at step {self.state.global_step}: {line}", file=sys.stderr, flush=True)

    def timings(self) -> dict:
        """For the summary: what checkpoints held training, and what their writes took (seconds);
        the same of snapshots under ``snapshots``, where they are taken."""
        def of(writer: checkpoint.Writer) -> dict:
            return {"saves": writer.saves, "stall_seconds": round(writer.stall, 3),
                    "write_seconds": round(writer.writing, 3), "waited_for_previous": writer.waits,
                    "background": writer.background}

        return {**of(self.writer), **({"snapshots": of(self.snapshots.writer)} if self.snapshots else {})}

    def resume_location(self) -> dict:
        """Where a rerun looks for the checkpoint it resumes from: for a guard to find it once the
        rank is gone (hvdkit.launch.guard), without listing the directory every second."""
        directory = self.cfg.checkpoint_dir
        return {"checkpoints": [str(directory), checkpoint.PATTERN]} if directory else {}

    def checkpoint_left(self) -> str:
        """Which checkpoint a run that stops now leaves behind (after the save in flight ends)."""
        directory = self.cfg.checkpoint_dir
        if not directory:
            return "no checkpoint_dir"
        self.writer.wait()
        newest = checkpoint.existing(directory)
        return f"last good checkpoint {newest[-1]} kept" if newest else "no checkpoint written yet"

    # -- elastic ---------------------------------------------------------------------------
    def read_elastic(self) -> None:
        """Elastic: hvd.elastic.run syncs the state when it starts, and workers that join later
        must not wait here in a collective the others never enter; each process reads the
        checkpoint now, so that a conflict stops it before anything is written, and
        load_elastic applies it."""
        cfg = self.cfg
        self.elastic_state = self.reader.read() if cfg.checkpoint_dir and cfg.resume else None

    def save_elastic(self, sampler) -> None:
        """Elastic: rank 0 writes the state just committed. No collective, as save() has, since
        workers may be joining; the ElasticSampler's position stands in for the loaders' and
        each rank's RNG, and it fits any world size."""
        run = self.state
        if self.cfg.checkpoint_dir and self.hvd.rank() == 0:
            self.watchdog.beat(f"checkpoint of step {run.global_step}")
            self.write(sampler=sampler.state_dict())
            self.writer.finish()  # written when it returns: a reset may follow, and the loop may read it

    def require_elastic_sampler(self) -> None:
        """An elastic run stops with the sampler's position in its checkpoint: refuse to go on without it."""
        if self.cfg.elastic and self.elastic_sampler is None:
            raise RuntimeError("hvdkit: an elastic loop calls session.load_elastic(sampler) before its first step, "
                               "so that the checkpoint of a stop records the sampler's position")

    def load_elastic(self, sampler) -> bool:
        """Elastic: apply the checkpoint this process read in setup(); False if there is none."""
        run = self.state
        self.elastic_sampler = sampler
        state, self.elastic_state = self.elastic_state, None
        if state is None:
            return False
        self.load_state(state)
        sampler.load_state_dict(state["sampler"])
        say(self.hvd, f"hvdkit: resumed from {state['path']} (epoch {run.epoch + 1}, step {run.global_step}, "
                      f"written by {state['world_size']} ranks, now {self.hvd.size()})")
        return True
