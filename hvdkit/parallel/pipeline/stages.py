"""A model cut into pipeline stages, and this rank's stage stepped by a schedule.

``gpt_stage(model, stage, stages)``: hvdkit's GPT (hvdkit.models.TinyGPT) cut between its blocks,
an equal number on each stage: the first stage also holds the embeddings, the last the final norm
and the output layer. The stage keeps the whole model's modules under their names (a block stays
``blocks.N``), so its parameters, its state_dict and a checkpoint's keys are the whole model's,
this stage's part of them; the rest is let go.

``Pipeline(module, mesh, schedule, micro_batches)``: this rank's stage over ``mesh``'s pipeline
(hvdkit.parallel.mesh: the stage is the rank's place in it); ``step(inputs, targets, loss_fn)``
runs one batch's forward and backward passes as micro-batches by the schedule
(hvdkit.parallel.pipeline.schedules), activations and gradients passed between neighbours
(hvdkit.parallel.pipeline.transport). The optimizer then steps each stage's own parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from hvdkit.config import ConfigError
from hvdkit.parallel.pipeline.schedules import SCHEDULES, StageTimes, run_schedule
from hvdkit.parallel.pipeline.transport import Link


class GPTStage(nn.Module):
    """Blocks ``first`` to ``last`` (exclusive) of a TinyGPT, with its embeddings where ``first`` is
    0 and its final norm and output layer where ``last`` is its number of blocks. In: token ids
    (the first stage) or the previous stage's activations; out: activations, or the logits."""

    def __init__(self, model: nn.Module, first: int, last: int) -> None:
        super().__init__()
        self.embeds, self.outputs = first == 0, last == len(model.blocks)
        if self.embeds:
            self.tokens, self.positions, self.drop = model.tokens, model.positions, model.drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(first, last)})
        if self.outputs:
            self.norm, self.head = model.norm, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embeds:
            x = self.drop(self.tokens(x) + self.positions(torch.arange(x.shape[1], device=x.device)))
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.norm(x)) if self.outputs else x


def gpt_stage(model: nn.Module, stage: int, stages: int) -> GPTStage:
    """Stage ``stage`` of ``stages`` of hvdkit's GPT, its blocks in equal parts. ConfigError, in one
    line, for blocks the stages do not divide, or an output layer tied to the token embedding
    (on the first stage and the last: not yet kept in step across them)."""
    layers = len(model.blocks)
    if layers % stages:
        raise ConfigError(f"pp: {stages} stages do not divide the model's {layers} blocks; give a pp that divides "
                          f"them")
    if stages > 1 and model.head.weight is model.tokens.weight:
        raise ConfigError("pp: the model's output layer is tied to its token embedding, which the first and the "
                          "last stage would each hold; untie them (tie_output off) to pipeline it")
    per = layers // stages
    return GPTStage(model, stage * per, (stage + 1) * per)


class Pipeline:
    """This rank's stage ``module`` of ``mesh``'s pipeline (bound after ``hvd.init``), stepped by
    ``schedule`` ("gpipe" or "1f1b") over ``micro_batches``. Starts nothing when made."""

    def __init__(self, module: nn.Module, mesh, schedule: str = "1f1b", micro_batches: int = 0) -> None:
        if schedule not in SCHEDULES:
            raise ConfigError(f"pp: the schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
        self.module, self.schedule = module, schedule
        self.stage, self.stages = mesh.pp_group.rank, mesh.pp
        self.micro_batches = micro_batches or self.stages
        self.actions = SCHEDULES[schedule](self.stage, self.stages, self.micro_batches)
        self.previous = Link(mesh.previous_pair, f"hvdkit.pp.{self.stage - 1}") if mesh.previous_pair else None
        self.following = Link(mesh.next_pair, f"hvdkit.pp.{self.stage}") if mesh.next_pair else None
        self.times = StageTimes()  # the last step's: its span and waits, its bubble

    @property
    def is_last(self) -> bool:
        return self.following is None

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn) -> list[torch.Tensor]:
        """Forward and backward of one batch (``inputs``, ``targets``: the same on every stage of the
        pipeline), split along its first dimension into the micro-batches: the gradients of this
        stage's parameters accumulate the batch's mean loss. Returns each micro-batch's loss on the
        last stage, nothing on the others; ``times`` then holds where the step went (its bubble).
        ConfigError for a batch the micro-batches do not divide."""
        if len(inputs) % self.micro_batches:
            raise ConfigError(f"pp: {self.micro_batches} micro-batches do not divide the batch of {len(inputs)}; "
                              f"give a batch size they divide")
        size = len(inputs) // self.micro_batches
        device = next(self.module.parameters()).device
        return run_schedule(self.module, self.actions, list(inputs.split(size)), list(targets.split(size)),
                            loss_fn, self.previous, self.following, device, self.times)
