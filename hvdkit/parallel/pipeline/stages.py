"""A model cut into pipeline stages, and this rank's stage stepped by a schedule.

``gpt_stage(model, stage, stages, cuts=None)``: hvdkit's GPT (hvdkit.models.TinyGPT) cut between
its blocks, an equal number on each stage, or where ``cuts`` names (block names, as torch's
``split_spec``; or "parameters", balanced by parameter count): the first stage also holds the
embeddings, the last the final norm and the output layer (tied to the embedding, a copy on each,
kept in step by ``sum_tied_grads``). The stage keeps the whole model's modules under their names
(a block stays ``blocks.N``), so its parameters, its state_dict and a checkpoint's keys are the
whole model's, this stage's part of them; the rest is let go.

``sequential_stage(model, stage, stages, cuts=None)``: an nn.Sequential cut between its children
alike, each child under its name.

``Pipeline(module, mesh, schedule, micro_batches)``: this rank's stage over ``mesh``'s pipeline
(hvdkit.parallel.mesh: the stage is the rank's place in it); ``step(inputs, targets, loss_fn)``
runs one batch's forward and backward passes as micro-batches by the schedule
(hvdkit.parallel.pipeline.schedules), activations and gradients passed between neighbours
(hvdkit.parallel.pipeline.transport). The optimizer then steps each stage's own parameters.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from typing import Optional

import torch
from torch import nn

from hvdkit.config import ConfigError
from hvdkit.parallel.ops import all_reduce_
from hvdkit.parallel.pipeline.schedules import SCHEDULES, StageTimes, run_schedule
from hvdkit.parallel.pipeline.transport import Link, mpi_usable


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


def gpt_cuts(model: nn.Module, stages: int, cuts=None) -> list[int]:
    """The first block of each stage after the first: equal parts by default (ConfigError where the
    stages do not divide the blocks); ``cuts`` as torch's ``split_spec`` names them, the blocks
    where stages 1 to ``stages - 1`` begin (``["blocks.3"]``); or "parameters", the boundaries that
    give each stage about as many parameters (the embeddings count on the first stage, the final
    norm and the output layer on the last). ConfigError, in one line, for cuts that are not
    ``stages - 1`` increasing block names strictly inside the model."""
    layers = len(model.blocks)
    if cuts is None:
        if layers % stages:
            raise ConfigError(f"pp: {stages} stages do not divide the model's {layers} blocks; give a pp that "
                              f"divides them, or cuts (block names, or \"parameters\")")
        return [k * layers // stages for k in range(1, stages)]
    if cuts == "parameters":
        first = sum(p.numel() for m in (model.tokens, model.positions) for p in m.parameters())
        last = sum(p.numel() for m in (model.norm, model.head) for p in m.parameters())
        return balanced_cuts([first, *(sum(p.numel() for p in block.parameters()) for block in model.blocks), last],
                             stages)
    indices = [int(name.split(".")[1]) if name.startswith("blocks.") and name.split(".")[1].isdigit()
               and name.count(".") == 1 else -1 for name in cuts]
    if len(cuts) != stages - 1 or indices != sorted(set(indices)) or not all(0 < i < layers for i in indices):
        raise ConfigError(f"pp: the cuts {', '.join(cuts) or 'given'} are not {stages - 1} increasing block names "
                          f"of blocks.1 to blocks.{layers - 1}, where stages 1 to {stages - 1} begin")
    return indices


def balanced_cuts(costs: list[float], stages: int) -> list[int]:
    """The first block of each stage after the first, where the costliest stage costs the least
    (a pipeline's step goes at its slowest stage's pace; ties go to earlier cuts): ``costs`` are
    the first stage's own (the embeddings'), each block's, then the last stage's own (the final
    norm's and the output layer's), as parameters or measured seconds (``gpt_block_seconds``).
    Each stage holds a block at least; ConfigError where there are fewer blocks than stages."""
    layers = len(costs) - 2
    if stages > layers:
        raise ConfigError(f"pp: {stages} stages need at least as many blocks; the model has {layers}")
    before = [0.0]  # before[i]: blocks 0 to i - 1
    for cost in costs[1:-1]:
        before.append(before[-1] + cost)

    def stage_cost(first: int, end: int) -> float:  # blocks first to end - 1, with the ends' own
        return before[end] - before[first] + (costs[0] if first == 0 else 0) + (costs[-1] if end == layers else 0)

    # costliest[(k, end)]: the least costliest stage of blocks 0 to end - 1 in k stages; begins: its last stage's first
    costliest = {(1, end): stage_cost(0, end) for end in range(1, layers + 1)}
    begins: dict[tuple, int] = {}
    for k in range(2, stages + 1):
        for end in range(k, layers + 1):
            options = [(max(costliest[(k - 1, first)], stage_cost(first, end)), first) for first in range(k - 1, end)]
            costliest[(k, end)], begins[(k, end)] = min(options)
    cuts, end = [], layers
    for k in range(stages, 1, -1):
        end = begins[(k, end)]
        cuts.append(end)
    return cuts[::-1]


def gpt_block_seconds(model: nn.Module, batch: int, repeats: int = 5, clock=time.perf_counter) -> list[float]:
    """Seconds of a forward and backward pass of ``batch`` sequences of the model's length through each
    part of hvdkit's GPT, where it is: the embeddings, each block, then the final norm, the output layer
    and a cross-entropy over the logits (for ``balanced_cuts``: the time a stage takes, not its size),
    read by ``clock`` (the wall clock; on a GPU once the device is done). Each the least of ``repeats``
    after a warm-up, as a machine's other work only adds to a time, timed in rounds over every part (a
    pause spoils one round, not every try of one part). The same model measured on two ranks gives two
    answers: the caller measures on one rank and shares them."""
    length = model.positions.num_embeddings
    tokens = torch.randint(0, model.tokens.num_embeddings, (batch, length), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(model.tokens.weight.device)
    x = model.drop(model.tokens(tokens) + model.positions(torch.arange(length, device=tokens.device))).detach()
    parts = [lambda x: model.drop(model.tokens(tokens) + model.positions(torch.arange(length, device=tokens.device))),
             *[block for block in model.blocks],
             lambda x: nn.functional.cross_entropy(model.head(model.norm(x)).flatten(0, 1), tokens.flatten())]
    on_gpu = tokens.device.type == "cuda"  # kernels run after the host queues them: wait to read the clock

    def timed(part, given: torch.Tensor) -> tuple[float, torch.Tensor]:
        given = given.detach().requires_grad_()
        if on_gpu:
            torch.cuda.synchronize(tokens.device)
        began = clock()
        out = part(given)
        out.backward(torch.ones_like(out))
        if on_gpu:
            torch.cuda.synchronize(tokens.device)
        return clock() - began, out

    given = []  # each part's input, from the warm-up pass
    for part in parts:
        given.append(x)
        _, out = timed(part, x)
        if out.dim() == x.dim():
            x = out.detach()
    seconds = [math.inf] * len(parts)
    for _ in range(repeats):
        seconds = [min(least, timed(part, x)[0]) for least, part, x in zip(seconds, parts, given, strict=True)]
    model.zero_grad(set_to_none=True)
    return seconds


def gpt_stage(model: nn.Module, stage: int, stages: int, cuts=None) -> GPTStage:
    """Stage ``stage`` of ``stages`` of hvdkit's GPT, cut where ``gpt_cuts`` says (ConfigError, in
    one line, for cuts that do not fit). An output layer tied to the token embedding is held by the
    first stage and by the last, each a copy: their gradients are summed by ``sum_tied_grads``."""
    bounds = [0, *gpt_cuts(model, stages, cuts), len(model.blocks)]
    part = GPTStage(model, bounds[stage], bounds[stage + 1])
    if stages > 1 and model.head.weight is model.tokens.weight:  # held by the first stage and by the last
        model.tokens.weight.pipeline_tied = True
    return with_whole_names(part, model)


def with_whole_names(part: nn.Module, model: nn.Module) -> nn.Module:
    """``part``, a stage of ``model``, told its parameters' names in the whole model, for a checkpoint
    joined across stages (hvdkit.parallel.whole): ``whole_parameter_names``, every parameter of the
    whole model by its first name, in the model's order (the order an optimizer over
    ``model.parameters()`` numbers them); ``own_parameter_names``, this stage's, in its own order.
    A tied output layer's weight is the embedding's (``tokens.weight``) on the last stage too."""
    first_name = {id(param): name for name, param in reversed(list(model.named_parameters(remove_duplicate=False)))}
    part.whole_parameter_names = list(dict.fromkeys(first_name[id(param)] for param in model.parameters()))
    part.own_parameter_names = [first_name[id(param)] for param in part.parameters()]
    return part


def sequential_stage(model: nn.Sequential, stage: int, stages: int, cuts=None) -> nn.Sequential:
    """Stage ``stage`` of ``stages`` of an nn.Sequential: its children in equal parts, or cut where
    ``cuts`` names (the children where stages 1 to ``stages - 1`` begin, as torch's ``split_spec``),
    each child under its own name, so the stage's state_dict keys are the whole model's. ConfigError,
    in one line, for stages that do not divide the children (without cuts) or cuts that are not
    increasing names of children after the first."""
    names = [name for name, _ in model.named_children()]
    if cuts is None:
        if len(names) % stages:
            raise ConfigError(f"pp: {stages} stages do not divide the model's {len(names)} modules; give a pp that "
                              f"divides them, or cuts (the names of the modules where stages begin)")
        bounds = [k * len(names) // stages for k in range(stages + 1)]
    else:
        indices = [names.index(name) if name in names else -1 for name in cuts]
        if len(cuts) != stages - 1 or indices != sorted(set(indices)) or not all(i > 0 for i in indices):
            raise ConfigError(f"pp: the cuts {', '.join(map(str, cuts)) or 'given'} are not {stages - 1} increasing "
                              f"names of the model's modules after its first ({', '.join(names[1:4])}, ...)")
        bounds = [0, *indices, len(names)]
    part = nn.Sequential(OrderedDict((name, getattr(model, name)) for name in names[bounds[stage]:bounds[stage + 1]]))
    return with_whole_names(part, model)


def sum_tied_grads(module: nn.Module, mesh, name: str) -> None:
    """Sum the gradients of ``module``'s parameters tied across the pipeline (marked
    ``pipeline_tied``: an embedding the first stage holds and the last stage's output layer uses,
    as Megatron's embedding group keeps them) over the first and the last stage's ranks, in place:
    both then step the same weight alike. Those two ranks call it after the data-parallel average
    (a loop's ``optimizer.synchronize()``), before clipping and the step; on the others it does
    nothing."""
    if mesh.ends_group is None:
        return
    all_reduce_([p.grad for p in module.parameters() if getattr(p, "pipeline_tied", False) and p.grad is not None],
                mesh.ends_group, name)


TRANSPORTS = ("auto", "mpi", "horovod")  # hvdkit.parallel.pipeline.transport's; auto: MPI's where it applies


class Pipeline:
    """This rank's stage ``module`` of ``mesh``'s pipeline (bound after ``hvd.init``), stepped by
    ``schedule`` ("gpipe" or "1f1b") over ``micro_batches``, its tensors passed on by ``transport``
    (hvdkit.parallel.pipeline.transport: "auto" takes MPI's point-to-point where Horovod runs on MPI,
    the stage is on the CPU and each rank of the host has a core, else Horovod's broadcasts). Every rank
    of the pipeline makes it alike (under MPI, a pair's first Pipeline makes the pair's communicator,
    with the other rank)."""

    def __init__(self, module: nn.Module, mesh, schedule: str = "1f1b", micro_batches: int = 0,
                 transport: str = "auto") -> None:
        if schedule not in SCHEDULES:
            raise ConfigError(f"pp: the schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
        if transport not in TRANSPORTS:
            raise ConfigError(f"pp: the transport {transport!r} is not one of {', '.join(TRANSPORTS)}")
        self.module, self.schedule = module, schedule
        self.stage, self.stages = mesh.pp_group.rank, mesh.pp
        self.micro_batches = micro_batches or self.stages
        self.actions = SCHEDULES[schedule](self.stage, self.stages, self.micro_batches)
        if transport == "auto":
            transport = "mpi" if mpi_usable(next(module.parameters()).device) else "horovod"
        self.transport = transport
        self.previous = (Link(mesh.previous_pair, f"hvdkit.pp.{self.stage - 1}", transport)
                         if mesh.previous_pair else None)
        self.following = Link(mesh.next_pair, f"hvdkit.pp.{self.stage}", transport) if mesh.next_pair else None
        self.times = StageTimes()  # the last step's: its span and waits, its bubble

    @property
    def is_last(self) -> bool:
        return self.following is None

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn, on_action=None) -> list[torch.Tensor]:
        """Forward and backward of one batch (``inputs``, ``targets``: the same on every stage of the
        pipeline), split along its first dimension into the micro-batches: the gradients of this
        stage's parameters accumulate the batch's mean loss. Returns each micro-batch's loss on the
        last stage, nothing on the others; ``times`` then holds where the step went (its bubble).
        ConfigError for a batch the micro-batches do not divide. ``on_action``: as run_schedule's."""
        if len(inputs) % self.micro_batches:
            raise ConfigError(f"pp: {self.micro_batches} micro-batches do not divide the batch of {len(inputs)}; "
                              f"give a batch size they divide")
        size = len(inputs) // self.micro_batches
        device = next(self.module.parameters()).device
        return run_schedule(self.module, self.actions, list(inputs.split(size)), list(targets.split(size)),
                            loss_fn, self.previous, self.following, device, self.times, on_action)

    def forward(self, inputs: torch.Tensor) -> Optional[torch.Tensor]:
        """The whole model's output for ``inputs`` (the same on every stage of the pipeline), without a
        backward (evaluation: call it under ``torch.no_grad()``): split along its first dimension into
        up to ``micro_batches`` parts, each sent on as soon as this stage has it and every receive
        started first, so that the stages work on different parts at once (a pass a part, one after
        another, leaves all but one stage idle and pays a transfer's latency each). The last stage's
        output, its parts joined, there; None on the others. Every stage of the pipeline calls it alike."""
        device = next(self.module.parameters()).device
        parts = list(inputs.split(-(-len(inputs) // self.micro_batches)))
        keys = [tuple(part.shape) for part in parts]
        if self.previous is not None:
            for i, key in enumerate(keys):
                self.previous.post("forward", i, key, device)
        outputs = []
        for i, part in enumerate(parts):
            out = self.module(part if self.previous is None else self.previous.receive("forward", i, keys[i], device))
            if self.following is None:
                outputs.append(out)
            else:
                self.following.send(out, "forward", i, keys[i])
        if self.following is None:
            return torch.cat(outputs)
        self.following.settle()  # the next pass's sends have these names
        return None
