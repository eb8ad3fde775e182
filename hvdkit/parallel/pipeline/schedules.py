"""Pipeline schedules as lists of actions, and the loop that runs one on a stage.

A schedule is, for each stage, the order of its forward (``F``) and backward (``B``) passes over
the step's micro-batches, as torch.distributed.pipelining's ``ScheduleGPipe`` and
``Schedule1F1B`` order them; a list one can print and test without a model:

- GPipe: every forward, then every backward. A stage holds all ``m`` micro-batches' activations;
  the bubble is (p - 1) / (m + p - 1) of the step.
- 1F1B: ``p - s - 1`` forwards to fill the pipeline (stage ``s`` of ``p``), then one forward and
  one backward in turn, then the backwards left. The same bubble; a stage holds at most ``p - s``
  micro-batches' activations. Needs ``m >= p``.

Deadlock-free by construction: a forward sends its activation on and a backward its input's
gradient back, each left in flight (hvdkit.parallel.pipeline.transport); only receives wait.
``check_schedule`` runs the stages' lists together so (a send never waits, a receive waits for
its send) and asserts that every list runs to its end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
from torch import nn

from hvdkit.config import ConfigError


class Action(NamedTuple):
    kind: str  # "F" or "B"
    micro_batch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.micro_batch}"


def gpipe(stage: int, stages: int, micro_batches: int) -> list[Action]:
    """GPipe's order on ``stage``: every forward, then every backward, in micro-batch order."""
    return [Action("F", i) for i in range(micro_batches)] + [Action("B", i) for i in range(micro_batches)]


def one_f_one_b(stage: int, stages: int, micro_batches: int) -> list[Action]:
    """1F1B's order on ``stage``: the warm-up forwards, one forward and one backward in turn, then the
    backwards left. ConfigError where there are fewer micro-batches than stages."""
    if micro_batches < stages:
        raise ConfigError(f"pp: 1F1B needs at least as many micro-batches as stages ({micro_batches} < {stages}); "
                          f"give more micro-batches, or GPipe")
    warmup = stages - stage - 1
    actions = [Action("F", i) for i in range(warmup)]
    for i in range(micro_batches - warmup):
        actions += [Action("F", warmup + i), Action("B", i)]
    return actions + [Action("B", i) for i in range(micro_batches - warmup, micro_batches)]


SCHEDULES: dict[str, Callable[[int, int, int], list[Action]]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def check_schedule(name: str, stages: int, micro_batches: int) -> None:
    """AssertionError unless every stage of schedule ``name`` runs each micro-batch's forward once
    and its backward once after it, and the stages' lists, run together with sends that never wait
    and receives that wait for their send, all run to their end (no deadlock)."""
    lists = [SCHEDULES[name](s, stages, micro_batches) for s in range(stages)]
    for actions in lists:
        for kind in "FB":
            assert sorted(a.micro_batch for a in actions if a.kind == kind) == list(range(micro_batches)), actions
        for i in range(micro_batches):
            assert actions.index(Action("F", i)) < actions.index(Action("B", i)), actions
    sent: set = set()  # ("activation" or "gradient", the boundary's first stage, micro-batch)
    done = [0] * stages
    moved = True
    while moved:
        moved = False
        for stage, actions in enumerate(lists):
            while done[stage] < len(actions):
                kind, i = actions[done[stage]]
                needs = (("activation", stage - 1, i) if kind == "F" and stage > 0 else
                         ("gradient", stage, i) if kind == "B" and stage < stages - 1 else None)
                if needs is not None and needs not in sent:
                    break
                if kind == "F" and stage < stages - 1:
                    sent.add(("activation", stage, i))
                if kind == "B" and stage > 0:
                    sent.add(("gradient", stage - 1, i))
                done[stage] += 1
                moved = True
    stuck = [f"stage {s} at {lists[s][done[s]]!r}" for s in range(stages) if done[s] < len(lists[s])]
    assert not stuck, f"{name} at {stages} stages and {micro_batches} micro-batches deadlocks: {', '.join(stuck)}"


@dataclass
class StageTimes:
    """Where one stage's step went, on the host's clock: ``span`` from its first action's start to
    its last send's end; ``waiting`` in receives (for a neighbour's compute, and the transfer
    itself) and for its own sends at the end; the rest computing (forward, loss, backward)."""

    span: float = 0.0
    waiting: float = 0.0

    @property
    def bubble(self) -> float:
        """The share of the step this stage idled: (p - 1) / (m + p - 1) for a balanced cut whose
        transfers take no time."""
        return self.waiting / self.span if self.span else 0.0


def run_schedule(module: nn.Module, actions: list[Action], inputs: list, targets: list,
                 loss_fn: Callable, previous, following, device: torch.device,
                 times: Optional[StageTimes] = None,
                 on_action: Optional[Callable[[Action], None]] = None) -> list[torch.Tensor]:
    """Run ``actions`` on this stage's ``module``. Every stage of the pipeline runs its own list of
    the same schedule, given the step's micro-batches alike (the ranks of a pipeline read the same
    batches): ``inputs``, which the first stage feeds its module (the others receive their inputs
    over ``previous``, a transport.Link, their shapes keyed by the inputs'), and ``targets``, which
    the last stage's ``loss_fn(output, target)`` takes (the others receive their outputs'
    gradients over ``following``). Each micro-batch's loss is divided by their number, so the
    gradients accumulated over the step are the whole batch's mean. Returns the last stage's losses
    (each undivided, detached, one per micro-batch); the others' are empty. ``times``: filled with
    this stage's span and waits; ``on_action(action)``: called as each action begins (the Session's
    watchdog notes where a stage is, to name where a stalled pipeline stopped)."""
    times = StageTimes() if times is None else times
    count = len(inputs)
    keys = [tuple(x.shape) for x in inputs]
    held: dict[int, tuple] = {}  # micro-batch -> (its input here, its output here) until its backward
    losses: list[torch.Tensor] = []
    for action in actions:  # every receive of the step started now: negotiated while this stage computes
        if action.kind == "F" and previous is not None:
            previous.post("activation", action.micro_batch, keys[action.micro_batch], device)
        if action.kind == "B" and following is not None:
            following.post("gradient", action.micro_batch, keys[action.micro_batch], device)
    start = time.perf_counter()
    waiting = 0.0

    def received(link, direction: str, i: int) -> torch.Tensor:
        nonlocal waiting
        began = time.perf_counter()
        tensor = link.receive(direction, i, keys[i], device)
        waiting += time.perf_counter() - began
        return tensor

    for action in actions:
        i = action.micro_batch
        if on_action is not None:
            on_action(action)
        if action.kind == "F":
            x = inputs[i] if previous is None else received(previous, "activation", i).requires_grad_()
            out = module(x)
            if following is None:
                loss = loss_fn(out, targets[i])
                losses.append(loss.detach())
                out = loss / count
            else:
                following.send(out, "activation", i, keys[i])
            held[i] = (x, out)
        else:
            x, out = held.pop(i)
            if following is None:
                out.backward()
            else:
                out.backward(received(following, "gradient", i))
            if previous is not None:
                previous.send(x.grad, "gradient", i, keys[i])
    began = time.perf_counter()
    for link in (previous, following):
        if link is not None:
            link.settle()
    end = time.perf_counter()
    times.span, times.waiting = end - start, waiting + end - began
    return losses
