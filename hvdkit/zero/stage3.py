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

import contextlib
import math
from typing import Optional

import torch
from torch import nn

from hvdkit.config import ConfigError
from hvdkit.zero.deferred import is_deferred, replay
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
                 in_flight: Optional[bool] = None, process_set=None, device: Optional[torch.device] = None) -> None:
        self.model = model
        # Built on the meta device: the slices are made on ``device`` by shard_model's replay (or a resume).
        self.deferred = is_deferred(model)
        self.device = device or torch.device("cpu")
        self._loaded = False
        self.group_names = group_names(model, groups)
        if groups and not self.group_names:
            raise ConfigError(f"zero: no module of {type(model).__name__} is named as zero_groups says "
                              f"({', '.join(groups)}); name its blocks, as blocks.*")
        self.owners: list[int] = []  # per unit: its group (0 the model's own, then group_names' order)
        self._index = {id(p): i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
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
            piece = torch.zeros(bucket.slice_length(self.size), dtype=first.dtype,
                                device=self.device if self.deferred else first.device)
            if not self.deferred:
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
        modules = self._places()
        with torch.no_grad():
            if self.deferred and not self._loaded:
                self._replay(modules)
            for piece, bucket in zip(self.slices, self.buckets, strict=True):
                if not (self.deferred or self._loaded):
                    self._read_slice(piece, bucket)
                piece.requires_grad_(True)  # the gathers' link in autograd (its backward hands on the gradient)
        units = [Unit(piece, bucket.slice_length(self.size) * self.size,
                      [Place(self.params[i], modules[id(self.params[i])], offset, shape)
                       for i, offset, shape in zip(bucket.params, bucket.offsets, bucket.shapes, strict=True)])
                 for piece, bucket in zip(self.slices, self.buckets, strict=True)]
        roots = [self.model, *(self.model.get_submodule(name) for name in self.group_names)]
        groups = [(module, [n for n, owner in enumerate(self.owners) if owner == g]) for g, module in enumerate(roots)]
        groups = [groups[0], *(group for group in groups[1:] if group[1])]
        self.gathering = Gathering(self.hvd, self.process_set, self.model, units, groups, self._send)
        self.gathering.attach()

    def _places(self) -> dict[int, list]:
        """Each parameter's (module, name) places, by id: two where it is tied."""
        modules: dict[int, list] = {}
        for module in self.model.modules():
            for name, param in module._parameters.items():
                if param is not None:
                    modules.setdefault(id(param), []).append((module, name))
        return modules

    def _replay(self, modules: dict[int, list]) -> None:
        """A deferred model's initial weights, made one module at a time (hvdkit.zero.deferred)
        from rank 0's generator state on every rank, as the eager build on rank 0 that stages 0-2
        broadcast; each rank keeps its slices. Every rank's generator is left as it was."""
        own = torch.get_rng_state()
        torch.set_rng_state(self.hvd.broadcast_object(own, root_rank=0, name="hvdkit.zero.rng",
                                                      process_set=self.process_set))
        try:
            replay(self.model, self.device, lambda param, value: self._keep(param, value, modules))
        finally:
            torch.set_rng_state(own)

    def _keep(self, param: nn.Parameter, value: torch.Tensor, modules: dict[int, list]) -> None:
        """``param``'s whole ``value``: this rank's part of it into its slice, or, for a weight the
        optimizer does not train, the whole value in its modules."""
        index = self._index.get(id(param))
        if index is None or index not in self._bucket_of:
            whole = nn.Parameter(value.clone(), requires_grad=param.requires_grad)
            for module, name in modules[id(param)]:
                module._parameters[name] = whole
            return
        n, k = self._bucket_of[index]
        piece, offset = self.slices[n], self.buckets[n].offsets[k]
        start = self.rank * len(piece)
        lo, hi = max(offset, start), min(offset + value.numel(), start + len(piece))
        if lo < hi:
            piece[lo - start:hi - start].copy_(value.reshape(-1)[lo - offset:hi - offset])

    def load_model_state(self, state: dict, sliced: bool = False) -> None:
        """The model's weights from a checkpoint's state_dict (a resume, before shard_model): each
        rank keeps its slices of the whole weights there. ``sliced``: a stage-3 checkpoint's, which
        holds the buffers and the weights not sharded only; the slices come from its parts
        (load_weight_slices). A deferred model's buffers and untrained weights are made whole."""
        modules, sharded = self._places(), self.sharded_names()
        state = {name: value for name, value in state.items() if value is not None}  # sliced: the weights' places
        if not self.deferred:
            missing, unexpected = self.model.load_state_dict(
                state, strict=False) if sliced else self.model.load_state_dict(state)
            wrong = unexpected + [name for name in missing if name not in sharded]
            if wrong:
                raise RuntimeError(f"the checkpoint's model entries and this model's differ: {', '.join(wrong[:3])}")
            self._loaded = sliced
            return
        with torch.no_grad():
            for qualified, module in self.model.named_modules():
                prefix = f"{qualified}." if qualified else ""
                for name, param in module._parameters.items():
                    if param is None or not param.is_meta or (module, name) != modules[id(param)][0]:
                        continue
                    if not (sliced and prefix + name in sharded):
                        self._keep(param, self._entry(state, prefix + name).to(self.device), modules)
                for name, buffer in module._buffers.items():
                    if buffer is not None and buffer.is_meta:
                        module._buffers[name] = self._entry(state, prefix + name).to(self.device).clone()
        self._loaded = True

    def load_weight_slices(self, weights: dict[int, torch.Tensor]) -> None:
        """This rank's slices of the weights, by unit (hvdkit.zero.shards re-slices a stage-3
        checkpoint's to this world size and these units); before shard_model, on every rank."""
        assert self.gathering is None, "hvdkit: zero 3's slices are loaded before shard_model()"
        missing = [n for n in range(len(self.slices)) if n not in weights]
        if missing:
            raise ConfigError(f"zero 3: the checkpoint holds no weights for {len(missing)} of this model's units")
        with torch.no_grad():
            for n, piece in enumerate(self.slices):
                piece.copy_(weights[n])
        self._loaded = True

    def weight_names(self) -> list[Optional[list[str]]]:
        """Per parameter index: the names of its sharded weight in the model's state_dict (two where
        tied), or None where it is not sharded (kept whole in the model's state_dict)."""
        names: dict[int, list[str]] = {}
        for name, param in self.model.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(name)
        return [names.get(id(param)) if i in self._bucket_of else None for i, param in enumerate(self.params)]

    def sharded_names(self) -> set[str]:
        """The state_dict names of the sharded weights (hvdkit.rank.agree.consistency leaves them out)."""
        return {name for names in self.weight_names() if names for name in names}

    def shard_state(self) -> dict:
        """This rank's share of the optimizer state (ShardedOptimizer's), and its slices of the
        weights under ``weights`` (per unit): a checkpoint's part, or a snapshot's shard."""
        return {**super().shard_state(), "weights": {n: piece.detach() for n, piece in enumerate(self.slices)}}

    @contextlib.contextmanager
    def _exported(self):
        """Inside, the model's state_dict may be taken, its sharded weights empty (an export's):
        ``_refuse_state_dict`` refuses it elsewhere."""
        self._exporting = True
        try:
            yield
        finally:
            self._exporting = False

    def unsharded_state_dict(self) -> dict:
        """The model's state_dict with None in place of each sharded weight (its order kept): the
        buffers and the weights kept whole, for a stage-3 checkpoint's main file (each rank's part
        holds its slices; hvdkit.zero.shards joins them). No collective."""
        sharded = self.sharded_names()
        with self._exported():
            state = self.model.state_dict()
        return {name: None if name in sharded else value for name, value in state.items()}

    @staticmethod
    def _entry(state: dict, name: str) -> torch.Tensor:
        if name not in state:
            raise ConfigError(f"zero 3: the checkpoint holds no {name}, which this model has")
        return state[name]

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
        with self._exported():
            state = module.state_dict()
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
