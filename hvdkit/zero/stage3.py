"""ZeRO stage 3 (``zero: 3``): the weights sharded too, beside the optimizer state and gradients.

Every rank holds a slice of each weight, not the weights: 16/N bytes a parameter with fp32
weights and Adam, where stage 2 holds 4 + 12/N. The model is split into groups
(hvdkit.zero.gathering.group_names: each block, by default, as torch's ``fully_shard`` is applied
per block); a group's trained parameters of one optimizer param group and dtype are one unit, a
flat vector padded to a multiple of the ranks, of which each rank holds one slice. The units are
this optimizer's buckets (hvdkit.zero.layout's Bucket), so stage 2's step, norm, overflow check
and checkpoints (hvdkit.zero.shards, re-sliced to any world size and to stages 1 and 2) are
theirs as they are.

A step, on every rank: each group's units gathered for its forward and again for its backward,
and let go after (hvdkit.zero.gathering); a unit's gradient, once whole, reduce-scattered
(averaged) into this rank's slice, at most STAGE2_IN_FLIGHT in flight as stage 2's buckets; the
wrapped optimizer steps the slices; nothing is gathered after the step: the next forward gathers.

Parameters the optimizer does not train (frozen, or outside it) stay whole on every rank.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from hvdkit.config import ConfigError
from hvdkit.zero.gathering import Gathering, Place, Unit, group_names
from hvdkit.zero.held import held_bytes
from hvdkit.zero.layout import Bucket
from hvdkit.zero.optimizer import ShardedOptimizer


class WeightShardedOptimizer(ShardedOptimizer):
    """``optimizer`` stepping this rank's slices of the weights of ``model``, whose weights it
    shards once ``shard_model()`` is called (after the weights are final: loaded or broadcast).
    ``groups``: the config's ``zero_groups`` (group_names' patterns), else the default rule.
    Used as stage 2's ShardedOptimizer is; its ``model_state_dict`` gathers the whole weights.
    ``process_set``: the ranks that shard the weights among themselves (every rank of it calls
    alike), the whole job by default."""

    def __init__(self, optimizer: torch.optim.Optimizer, hvd, model: nn.Module, groups: Optional[list[str]] = None,
                 compression=None, backward_passes_per_step: int = 1, gradient_predivide_factor: float = 1.0,
                 in_flight: Optional[bool] = None, process_set=None) -> None:
        self.model = model
        self.group_names = group_names(model, groups)
        if groups and not self.group_names:
            raise ConfigError(f"zero: no module of {type(model).__name__} is named as zero_groups says "
                              f"({', '.join(groups)}); name its blocks, as blocks.*")
        self.owners: list[int] = []  # per unit: its group (0 the model's own, then group_names' order)
        super().__init__(optimizer, hvd, 3, compression, backward_passes_per_step, gradient_predivide_factor,
                         in_flight=in_flight, process_set=process_set)
        self.gathering: Optional[Gathering] = None
        self._refusal = model.register_state_dict_pre_hook(self._refuse_state_dict)
        self._exporting = False

    def _layout(self, bucket_bytes: int) -> list[Bucket]:
        """One bucket (a unit) per group, optimizer param group, dtype and device, the model's own
        group first; a parameter held by two groups (tied across them) is the model's own."""
        owner: dict[int, int] = {}
        for g, name in enumerate(self.group_names, start=1):
            for param in self.model.get_submodule(name).parameters():
                owner[id(param)] = g if owner.get(id(param), g) == g else 0
        units: dict[tuple, Bucket] = {}
        index = 0
        for g, group in enumerate(self.inner.param_groups):
            for param in group["params"]:
                if param.requires_grad:
                    key = (owner.get(id(param), 0), g, param.dtype, param.device)
                    unit = units.setdefault(key, Bucket(g, [], [], [], 0))
                    unit.params.append(index)
                    unit.shapes.append(tuple(param.shape))
                    unit.offsets.append(unit.length)
                    unit.length += param.numel()
                index += 1
        ordered = sorted(units.items(), key=lambda item: item[0][0])  # stable: by group, then as met
        self.owners = [key[0] for key, _ in ordered]
        return [unit for _, unit in ordered]

    def _hold_weights(self) -> tuple[list, list[torch.Tensor]]:
        """No whole weights kept: each slice a copy of this rank's part of its unit."""
        slices = []
        for bucket in self.buckets:
            first = self.params[bucket.params[0]]
            piece = torch.zeros(bucket.slice_length(self.size), dtype=first.dtype, device=first.device)
            self._read_slice(piece, bucket)
            slices.append(piece)
        return [None] * len(self.buckets), slices

    def _gradient_hooks(self) -> list:
        return []  # each unit's gradient comes whole from its gather's backward (Gathering.gradient)

    def _flat_gradient(self, n: int) -> torch.Tensor:
        """Zeros: unit ``n`` had no gradient this step (its weights unused), as Horovod sends them."""
        bucket, first = self.buckets[n], self.slices[n]
        return first.new_zeros(bucket.slice_length(self.size) * self.size)

    def shard_model(self) -> None:
        """Take this rank's slices of the weights as they are now (loaded or broadcast: every rank
        alike), then empty the parameters and hook the model (hvdkit.zero.gathering). All ranks, once."""
        hooked = next((name for name, param in self.model.named_parameters() if param.requires_grad and (
            param._backward_hooks or getattr(param, "_post_accumulate_grad_hooks", None))), None)
        if hooked is not None:
            raise ConfigError(f"zero 3: {hooked} has a gradient hook, which would never be called: the weights are "
                              f"gathered copies, and their gradients are reduced by unit; drop the hook, or use zero 2")
        with torch.no_grad():
            for piece, bucket in zip(self.slices, self.buckets, strict=True):
                self._read_slice(piece, bucket)
                piece.requires_grad_(True)  # the gathers' link in autograd (its backward hands on the gradient)
        modules: dict[int, list] = {}
        for module in self.model.modules():
            for name, param in module._parameters.items():
                if param is not None:
                    modules.setdefault(id(param), []).append((module, name))
        units = [Unit(piece, bucket.slice_length(self.size) * self.size,
                      [Place(self.params[i], modules[id(self.params[i])], offset, shape)
                       for i, offset, shape in zip(bucket.params, bucket.offsets, bucket.shapes, strict=True)])
                 for piece, bucket in zip(self.slices, self.buckets, strict=True)]
        roots = [self.model, *(self.model.get_submodule(name) for name in self.group_names)]
        groups = [(module, [n for n, owner in enumerate(self.owners) if owner == g]) for g, module in enumerate(roots)]
        groups = [groups[0], *(group for group in groups[1:] if group[1])]
        self.gathering = Gathering(self.hvd, self.process_set, self.model, units, groups, self._send)
        self.gathering.attach()

    def _aliased(self, n: int) -> bool:
        return True  # the slices are the weights: nothing to read back before a step

    def _gather(self, moved: list[int]) -> None:
        pass  # the next forward gathers the stepped slices

    def step(self, closure=None):
        assert self.gathering is not None, "hvdkit: zero 3 steps after shard_model() (Session.setup calls it)"
        super().step(closure)

    def synchronize(self) -> None:
        if self.gathering is not None:  # no gather left in flight: the step changes the slices they read
            self.gathering.release_all()
        super().synchronize()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.gathering is not None:
            self.gathering.release_all()
        super().zero_grad(set_to_none)

    def model_state_dict(self, module: Optional[nn.Module] = None) -> dict:
        """The model's state_dict with whole weights, on the CPU: every rank calls it (each unit is
        gathered in turn, one at a time); ``module``: the model, or the module torch.compile wraps."""
        module = self.model if module is None else module
        self._exporting = True
        try:
            state = module.state_dict()
        finally:
            self._exporting = False
        names: dict[int, list[str]] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(name)
        for n, unit in enumerate(self.gathering.units):
            vector = self.gathering.whole(n, f"hvdkit.zero.export.{n}")
            for place in unit.places:
                value = vector[place.offset:place.offset + math.prod(place.shape)].view(place.shape)
                for name in names.get(id(place.param), []):
                    state[name] = value.to("cpu", copy=True)
            del vector
        return state

    def _refuse_state_dict(self, module, prefix, keep_vars) -> None:
        if self.gathering is not None and not self._exporting:
            raise ConfigError("zero 3: the weights are split across the ranks, and model.state_dict() would hold "
                              "none of them; session.save() writes them whole, and "
                              "session.optimizer.model_state_dict(), called on every rank, gathers them")

    def memory(self) -> dict:
        """Bytes this rank holds: its slices of the weights (and the weights not sharded), their
        gradients, the optimizer state; and ``gathered``: the whole units' weights and gradients
        it keeps for reuse, as many as it used at once (at the step's peak)."""
        whole = [p for p in self.model.parameters() if p.numel()]
        held = held_bytes([*self.slices, *whole], [*self.slices, *whole], self.inner.state.values())
        return {**held, "gathered": self.gathering.pooled_bytes() if self.gathering else 0}
