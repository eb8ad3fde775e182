"""The model cut into this rank's pipeline stage and split across its tensor-parallel group at a run's
start (``Session.parallelize``)."""

from __future__ import annotations

import sys
from typing import Optional

from torch import nn

from hvdkit.config import ConfigError
from hvdkit.models import TinyGPT
from hvdkit.parallel.mesh import Mesh
from hvdkit.parallel.pipeline.stages import balanced_cuts, gpt_block_seconds, gpt_stage, sequential_stage
from hvdkit.parallel.plan import gpt_plan, parallelize
from hvdkit.parallel.rng import RNGTracker
from hvdkit.rank.state import RunState


def split_model(cfg, hvd, device, mesh: Mesh, state: RunState, model: nn.Module,
                plan: Optional[dict] = None) -> nn.Module:
    """``model`` cut into this rank's pipeline stage (``cut_stage``, where ``pp`` > 1), then split by
    ``plan`` (hvdkit.parallel.plan; None: the built-in GPT's, sequence-parallel where
    ``cfg.sequence_parallel``) over this rank's tensor-parallel group, then on ``device``, with an RNG
    tracker for the dropout inside its regions (kept in ``state`` for the checkpoints). Every rank calls
    it with its whole model: rank 0's weights go to every rank first, so that each takes its part of
    the same model. The model is cut and split where it is (the CPU, for one built there), so that
    only this rank's part reaches the device: a model larger than one device's memory splits. Without
    tensor nor pipeline parallelism the model as it is. ConfigError, in one line, for a model with no
    plan or cut, or a sequence the group does not divide."""
    if mesh.tp == 1 and mesh.pp == 1:
        return model
    if mesh.tp > 1 and plan is None and not isinstance(model, TinyGPT):
        raise ConfigError(f"tp: hvdkit has no plan for a {type(model).__name__}: give session.parallelize(model, "
                          f"plan) one, module names to ColwiseParallel and RowwiseParallel (docs/model-parallelism.md)")
    if mesh.tp > 1 and plan is None and cfg.sequence_parallel and model.positions.num_embeddings % mesh.tp:
        raise ConfigError(f"tp: {mesh.tp} does not divide the GPT's sequence of {model.positions.num_embeddings} "
                          f"tokens, which sequence parallelism splits in equal parts; give a seq_len that tp divides")
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if mesh.pp > 1:
        model = cut_stage(cfg, hvd, mesh, model)
    if mesh.tp > 1:
        state.rng_tracker = RNGTracker(cfg.seed, mesh.tp_group, device)
        if plan is None:
            plan = gpt_plan(model, sequence_parallel=cfg.sequence_parallel)
        model = parallelize(model, mesh, plan, state.rng_tracker)
    return model.to(device)


def cut_stage(cfg, hvd, mesh: Mesh, model: nn.Module) -> nn.Module:
    """This rank's stage of ``model`` (its place in its pipeline: hvdkit.parallel.mesh), cut where
    ``cfg.pp_cuts`` says (block or module names; ["parameters"]: balanced by parameter count;
    ["time"]: by the seconds of each part's forward and backward, measured on rank 0 and shared, the
    cuts said in one line) or in equal parts: hvdkit's GPT between its blocks, an nn.Sequential
    between its children. Every rank calls it alike. ConfigError, in one line, for another model,
    cuts that do not fit, or a tied GPT under ZeRO."""
    cuts = cfg.pp_cuts or None
    if isinstance(model, TinyGPT):
        if cfg.zero and model.head.weight is model.tokens.weight:
            raise ConfigError("pp: a GPT whose output layer is tied to its embedding is not yet for zero (the two "
                              "copies' gradients are summed across the pipeline's ends); drop --zero")
        if cuts == ["time"]:
            seconds = gpt_block_seconds(model, cfg.batch_size) if hvd.rank() == 0 else None
            seconds = hvd.broadcast_object(seconds, root_rank=0, name="hvdkit.pp.block_seconds")
            cuts = [f"blocks.{index}" for index in balanced_cuts(seconds, mesh.pp)]
            if hvd.rank() == 0:
                print(f"hvdkit: pp cuts by measured time: stages 1 to {mesh.pp - 1} begin at {', '.join(cuts)} (ms a "
                      f"forward and backward of {cfg.batch_size} sequences: embeddings {1e3 * seconds[0]:.2f}, "
                      f"blocks {' '.join(f'{1e3 * t:.2f}' for t in seconds[1:-1])}, output {1e3 * seconds[-1]:.2f})",
                      file=sys.stderr, flush=True)
        return gpt_stage(model, mesh.pp_group.rank, mesh.pp, "parameters" if cuts == ["parameters"] else cuts)
    if isinstance(model, nn.Sequential):
        return sequential_stage(model, mesh.pp_group.rank, mesh.pp, cuts)
    raise ConfigError(f"pp: hvdkit cuts its GPT and an nn.Sequential into stages, not a {type(model).__name__}: "
                      f"make it an nn.Sequential of its layers (docs/model-parallelism.md)")

