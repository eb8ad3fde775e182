"""The ranks' copies of the model, checked to be the same while training.

Data parallelism keeps every rank's weights identical: each applies the same averaged gradients.
When they drift apart (an op applied on one rank only, a buffer updated outside the optimizer, a
flipped bit on a bad node, rank-dependent code), training goes on and the result is quietly
wrong; no launcher or framework notices. So every ``check_consistency_steps`` steps, and before
every checkpoint, each rank reduces each tensor that should be identical to a 64-bit digest: the
sum of its bits read as integers (exact, so order-free and the same on every rank for the same
bits; any one changed value changes it). One allreduce of the digests and their negations with
Min gives every rank the smallest and largest digest of each tensor: equal everywhere, or not.

What is compared (``scope`` says it in words, and the divergence file holds it): what every rank
holds alike. The parameters, the buffers, and the optimizer's state where every rank holds the
same (not under ``zero``, whose ranks hold slices, nor under Adasum, whose ranks step their
optimizers on their own gradients and combine the updates). Under ``zero 3`` the sharded weights
are slices too, each held by one rank only, so there is no second copy to compare: the check
covers the buffers and the weights kept whole (the gathers give every rank the same whole
weights by construction). Under tensor parallelism (``tp``) a split weight's block, and its
optimizer state, is compared with the ranks of its data-parallel group, which hold the same block,
never with the other blocks of its tensor-parallel group; what every rank holds whole (the norms,
the position embedding) with every rank. Under pipeline parallelism (``pp``) every stage's tensors
with its data-parallel group only: the other stages hold other parts of the model. Not compared: the
running statistics of batch norms that are not synchronized (each rank's own batches, by design in
Horovod), which a checkpoint takes from rank 0.

On a mismatch every rank stops at that step (they all read the same allreduce): the digests
are gathered once to name the ranks that differ from the largest group, their hosts and the
first tensor that differs; rank 0 writes them per tensor and rank to ``divergence-step-N.json``
in the run directory, sets aside checkpoints newer than the last check that passed (their
weights may already differ) so that a resume starts from one taken before, and the job ends
with job.DIVERGED (77) and one line.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from hvdkit import checkpoint, job
from hvdkit.rank.state import RunState
from hvdkit.system import wholefiles

SET_ASIDE = ".diverged"  # suffix of a checkpoint written after the last check that passed
_INTEGER_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DivergenceError(RuntimeError):
    """The ranks' weights (or buffers, or optimizer state) are no longer the same."""

    exit_code = job.DIVERGED


def digest(tensor: torch.Tensor) -> torch.Tensor:
    """A 64-bit integer that any change of one value of ``tensor`` changes: the sum of its bits
    read as integers of its element size, on its device."""
    values = tensor.detach()
    if values.is_complex():
        values = torch.view_as_real(values)
    if values.dtype == torch.bool:
        values = values.to(torch.uint8)
    bits = values.contiguous().view(-1).view(_INTEGER_VIEW[values.element_size()])
    return bits.sum(dtype=torch.int64)


def local_statistics(model: nn.Module) -> set:
    """The names of the running statistics that each rank keeps from its own batches: those of
    batch, instance and group norms that are not synchronized across ranks."""
    synced = tuple(kind for kind in (nn.SyncBatchNorm, _horovod_sync_batch_norm()) if kind is not None)
    names = set()
    for prefix, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._NormBase) and not isinstance(module, synced):
            names |= {f"{prefix}.{name}".lstrip(".") for name in ("running_mean", "running_var")}
    return names


def _horovod_sync_batch_norm():
    try:
        import horovod.torch as hvd
    except ImportError:
        return None
    return hvd.SyncBatchNorm


def scope(zero: int, adasum: bool, tp: int = 1, pp: int = 1) -> str:
    """What the check compares under ``zero`` (its stage), Adasum, tensor and pipeline parallelism, in words."""
    if pp > 1:
        state = "not the optimizer's state, whose slices each rank holds alone" if zero else "the optimizer's state"
        return f"each stage's weights, buffers and {state} with its data-parallel group, which holds the same stage"
    if tp > 1 and zero:
        return ("the weights kept whole and the buffers with every rank; each block of a split weight with its "
                "data-parallel group, which holds the same block; not the optimizer's state, whose slices each "
                "rank holds alone")
    if tp > 1:
        return ("the weights kept whole, the buffers and the optimizer's state with every rank; each block of a "
                "split weight and its state with its data-parallel group, which holds the same block")
    if zero == 3:
        return ("the buffers and the weights kept whole; not the sharded weights nor the optimizer's state, "
                "whose slices each rank holds alone")
    if zero or adasum:
        alone = "whose slices each rank holds alone" if zero else "each rank's own under Adasum"
        return f"the weights and the buffers; not the optimizer's state, {alone}"
    return "the weights, the buffers and the optimizer's state"


def compared(model: nn.Module, optimizer, replicated_optimizer: bool) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of everything that every rank should hold alike, in the model's order; the
    optimizer's state only where ``replicated_optimizer`` (not under zero, whose ranks hold slices,
    nor Adasum, whose ranks step on their own gradients and combine the updates); not zero 3's
    sharded weights (its optimizer's ``sharded_names``), slices too."""
    local = local_statistics(model)
    sharded = optimizer.sharded_names() if hasattr(optimizer, "sharded_names") else set()
    tensors = [(name, p) for name, p in model.named_parameters() if name not in sharded]
    tensors += [(name, b) for name, b in model.named_buffers() if name not in local]
    if optimizer is not None and replicated_optimizer:
        names = {id(p): name for name, p in model.named_parameters()}
        for param, state in optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    tensors.append((f"optimizer.{names.get(id(param), '?')}.{key}", value))
    return tensors


class Consistency:
    """The check of one run: it compares the state's model and optimizer across ranks."""

    def __init__(self, cfg, hvd, device, state: RunState, mesh) -> None:
        self.cfg, self.hvd, self.device, self.state, self.mesh = cfg, hvd, device, state, mesh
        self.last_good: Optional[int] = None  # the last step whose check passed
        self.checked_at: Optional[int] = None

    def due(self) -> bool:
        """After this step: every ``check_consistency_steps`` (0: never, and not before checkpoints)."""
        every = self.cfg.check_consistency_steps
        return bool(every) and self.state.global_step % every == 0

    def before_checkpoint(self) -> None:
        """A checkpoint is written only of weights checked equal on every rank."""
        if self.cfg.check_consistency_steps:
            self.check()

    def check(self) -> None:
        """Compare every rank's tensors (all ranks call it at the same step); DivergenceError if
        they differ. Once per step: the periodic check and a checkpoint's share it."""
        state, cfg, hvd = self.state, self.cfg, self.hvd
        step = state.global_step
        if self.checked_at == step or state.model is None:
            return
        assert not state.unsettled, "hvdkit: the steps' non-finite flags are read (settle) before a consistency check"
        self.checked_at = step
        tensors = compared(state.model, state.optimizer, not (cfg.zero or cfg.use_adasum))
        names = {name for name, _ in tensors}
        blocks = names if self.mesh.pp > 1 else self._blocks(state.model) & names  # a stage: with its replicas only
        tensors = [*(t for t in tensors if t[0] not in blocks), *(t for t in tensors if t[0] in blocks)]
        if not tensors:
            return
        digests = torch.stack([digest(t).to(self.device) for _, t in tensors]).cpu()
        whole = len(tensors) - len(blocks)  # compared with every rank; the blocks within the data-parallel group
        agree = True
        if whole:
            extremes = hvd.allreduce(torch.cat([digests[:whole], -digests[:whole]]), op=hvd.Min,
                                     name="hvdkit.consistency")
            agree = torch.equal(extremes[:whole], -extremes[whole:])
        if blocks and self.mesh.dp > 1:
            group = self.mesh.dp_group.process_set
            extremes = hvd.allreduce(torch.cat([digests[whole:], -digests[whole:]]), op=hvd.Min,
                                     name="hvdkit.consistency.blocks", process_set=group)
            agree = hvd.allreduce(torch.tensor([float(agree and torch.equal(extremes[:len(blocks)],
                                                                             -extremes[len(blocks):]))]),
                                  op=hvd.Min, name="hvdkit.consistency.agree").item() == 1.0
        if agree:
            self.last_good = step
            return
        self._stop([name for name, _ in tensors], digests.tolist(), whole)

    def _blocks(self, model: nn.Module) -> set[str]:
        """The names ``compared`` gives the blocks of split weights and their optimizer state: each rank of
        a tensor-parallel group holds another block (none without tensor parallelism)."""
        if self.mesh.tp == 1:
            return set()
        split = [name for name, p in model.named_parameters() if getattr(p, "tp_dim", None) is not None]
        state = getattr(self.state.optimizer, "state", {})
        keys = {key for per_parameter in state.values() for key in per_parameter}
        return {*split, *(f"optimizer.{name}.{key}" for name in split for key in keys)}

    def _stop(self, names: list[str], digests: list[int], whole: int) -> None:
        """Name what differs, keep the evidence and the last good checkpoint, end every rank. The first
        ``whole`` digests are compared across every rank, the rest (blocks) within data-parallel groups."""
        ranks = self.hvd.allgather_object((socket.gethostname(), digests), name="hvdkit.consistency.detail")
        every = list(range(len(ranks)))
        # (ranks that should agree, which digests): every rank's whole tensors, each data-parallel group's blocks
        comparisons = [(every, slice(0, whole))]
        if whole < len(names):
            comparisons += [(members, slice(whole, len(names))) for members in self.mesh.dp_ranks()]
        differing: set[int] = set()
        for members, part in comparisons:
            groups: dict = {}
            for rank in members:
                groups.setdefault(tuple(ranks[rank][1][part]), []).append(rank)
            largest = max(groups.values(), key=lambda agreeing: (len(agreeing), min(agreeing) == min(members)))
            differing |= set(members) - set(largest)
        differing, reference = sorted(differing), [rank for rank in every if rank not in differing]
        first = next(names[i] for members, part in comparisons for i in range(len(names))[part]
                     if len({ranks[rank][1][i] for rank in members}) > 1)
        step = self.state.global_step
        report = Path(self.state.log_dir) / f"divergence-step-{step}.json"

        def who(members: list[int]) -> str:
            return ", ".join(f"{rank} ({ranks[rank][0]})" for rank in members)

        many = len(differing) > 1
        line = (f"the ranks' copies of the model differ at step {step}: rank{'s' * many} {who(differing)} "
                f"differ{'s' * (not many)} from rank{'s' * (len(reference) > 1)} {who(reference)}, first in "
                f"{first!r}; digests per tensor and rank in {report}; {self._kept()}")
        if self.hvd.rank() == 0:
            _write_json(report, {"step": step, "last_good_step": self.last_good, "first": first,
                                 "compared": scope(self.cfg.zero, self.cfg.use_adasum, self.mesh.tp,
                                                   self.mesh.pp),
                                 "differing_ranks": differing, "reference_ranks": reference,
                                 "hosts": [host for host, _ in ranks], "tensors": names,
                                 "digests": {name: [values[i] for _, values in ranks] for i, name in enumerate(names)}})
            self._set_aside_unchecked()
            job.record_exit(job.DIVERGED, line)
        raise DivergenceError(line)

    def _set_aside_unchecked(self) -> None:
        """Checkpoints newer than the last check that passed may hold diverged weights: renamed,
        not deleted, so that a resume starts from the newest one taken before."""
        directory = self.cfg.checkpoint_dir
        if not directory:
            return
        for path in checkpoint.existing(directory):
            if self.last_good is None or checkpoint.step_of(path) > self.last_good:
                os.replace(path, f"{path}{SET_ASIDE}")
                if checkpoint.shard_folder(path).exists():
                    os.replace(checkpoint.shard_folder(path), f"{checkpoint.shard_folder(path)}{SET_ASIDE}")

    def _kept(self) -> str:
        directory = self.cfg.checkpoint_dir
        if not directory:
            return "no checkpoint_dir to resume from"
        good = [p for p in checkpoint.existing(directory)
                if self.last_good is not None and checkpoint.step_of(p) <= self.last_good]
        if not good:
            return "no checkpoint taken before it to resume from"
        return f"a rerun resumes from {good[-1]}, the newest taken before (checked equal at step {self.last_good})"


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    wholefiles.write_whole(path, json.dumps(data, indent=1) + "\n")
