"""The model split across its tensor-parallel group at a run's start (``Session.parallelize``)."""

from __future__ import annotations

from typing import Optional

from torch import nn

from hvdkit.config import ConfigError
from hvdkit.models import TinyGPT
from hvdkit.parallel.mesh import Mesh
from hvdkit.parallel.plan import gpt_plan, parallelize
from hvdkit.parallel.rng import RNGTracker
from hvdkit.rank.state import RunState


def split_model(cfg, hvd, device, mesh: Mesh, state: RunState, model: nn.Module,
                plan: Optional[dict] = None) -> nn.Module:
    """``model`` split by ``plan`` (hvdkit.parallel.plan; None: the built-in GPT's, sequence-parallel
    where ``cfg.sequence_parallel``) over this rank's tensor-parallel group, then on ``device``,
    with an RNG tracker for the dropout inside its regions (kept in ``state`` for the checkpoints).
    Every rank calls it with its whole model: rank 0's weights go to every rank first, so that each
    takes its block of the same model. The model is split where it is (the CPU, for one built
    there), so that only this rank's blocks reach the device: a model larger than one device's
    memory splits. Without tensor parallelism (``tp`` 1) the model as it is. ConfigError, in one
    line, for a model with no plan or a sequence the group does not divide."""
    if mesh.tp == 1:
        return model
    if plan is None and not isinstance(model, TinyGPT):
        raise ConfigError(f"tp: hvdkit has no plan for a {type(model).__name__}: give session.parallelize(model, "
                          f"plan) one, module names to ColwiseParallel and RowwiseParallel (docs/model-parallelism.md)")
    if plan is None and cfg.sequence_parallel and model.positions.num_embeddings % mesh.tp:
        raise ConfigError(f"tp: {mesh.tp} does not divide the GPT's sequence of {model.positions.num_embeddings} "
                          f"tokens, which sequence parallelism splits in equal parts; give a seq_len that tp divides")
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    state.rng_tracker = RNGTracker(cfg.seed, mesh.tp_group, device)
    if plan is None:
        plan = gpt_plan(model, sequence_parallel=cfg.sequence_parallel)
    return parallelize(model, mesh, plan, state.rng_tracker).to(device)
