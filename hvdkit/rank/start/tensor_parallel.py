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
    """``model`` on ``device``, split by ``plan`` (hvdkit.parallel.plan; None: the built-in GPT's)
    over this rank's tensor-parallel group, with an RNG tracker for the dropout inside its regions
    (kept in ``state`` for the checkpoints). Every rank calls it with its whole model: rank 0's
    weights go to every rank first, so that each takes its block of the same model. Without tensor
    parallelism (``tp`` 1) the model as it is. ConfigError, in one line, for a model with no plan."""
    if mesh.tp == 1:
        return model
    if plan is None and not isinstance(model, TinyGPT):
        raise ConfigError(f"tp: hvdkit has no plan for a {type(model).__name__}: give session.parallelize(model, "
                          f"plan) one, module names to ColwiseParallel and RowwiseParallel (docs/model-parallelism.md)")
    model = model.to(device)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    state.rng_tracker = RNGTracker(cfg.seed, mesh.tp_group, device)
    return parallelize(model, mesh, gpt_plan(model) if plan is None else plan, state.rng_tracker)
