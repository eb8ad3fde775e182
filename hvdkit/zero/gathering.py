"""ZeRO stage 3's model side: a group's weights gathered just before its forward and again before
its backward, and let go after each (hvdkit.zero.stage3 holds the slices and steps them).

A unit is one flat vector of weights, padded to a multiple of the ranks, of which this rank holds
one slice. Before a group's forward its units are allgathered and its parameters become views of
the gathered vectors; after the forward they are the (emptied) parameters again. What autograd
saves of the weights for the backward is kept as the place it lies in its unit, not as a tensor
(``torch.autograd.graph.saved_tensors_hooks``), so the gathered vector is freed once the group's
forward is done; the backward's first read of a saved weight gathers its unit again. A unit's
gradient reaches its gather's backward once every use of its weights has been differentiated:
there the vector is let go and the gradient handed on, to be reduce-scattered into the slice.

One gather runs ahead of the one in use: the next unit the pass will want, in the order the
last forward asked for them (reversed for the backward). Every rank gathers the same units in
the same order, each collective named by its unit: the ranks must run the same modules, as
under torch's ``fully_shard``.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn


def group_names(model: nn.Module, patterns: Optional[list[str]] = None) -> list[str]:
    """The modules whose parameters are gathered together, outermost first, none inside another;
    whatever parameters none of them holds are the model's own group (gathered for the whole
    forward). ``patterns`` (fnmatch, as ``blocks.*``) names them; by default each child of the
    model's ModuleLists and Sequentials that holds parameters, as torch's ``fully_shard`` is
    applied to each block of a transformer."""
    chosen: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(outer + ".") for outer in chosen) or name in chosen:
            continue
        if patterns:
            if name and any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
                chosen.append(name)
        elif isinstance(module, (nn.ModuleList, nn.Sequential)):
            chosen += [f"{name}.{child}" if name else child for child, sub in module.named_children()
                       if next(sub.parameters(), None) is not None]
    return chosen


@dataclass
class Place:
    """Where a unit's parameter lies: registered as ``name`` in each of ``modules`` (two where it
    is tied), its elements ``offset`` to ``offset + numel`` of the unit's flat vector."""

    param: nn.Parameter
    modules: list[tuple[nn.Module, str]]
    offset: int
    shape: tuple


@dataclass
class Unit:
    """One flat vector of weights: this rank's ``piece`` of it, its padded ``length``, and the
    parameters laid out in it."""

    piece: torch.Tensor
    length: int
    places: list[Place]


@dataclass
class _Saved:
    """A weight autograd saved for the backward, kept as where it lies in its unit."""

    unit: int
    offset: int
    size: tuple
    stride: tuple


class _Gathered(torch.autograd.Function):
    """The link from a unit's slice to its parameters' gathered weights: the forward returns each
    parameter's view of the vector already gathered, the backward hands their gradients to
    ``Gathering.gradient`` (which puts them in one flat vector, to be reduce-scattered into the
    slice) and returns none to autograd."""

    @staticmethod
    def forward(ctx, piece: torch.Tensor, gathering: "Gathering", n: int) -> tuple:
        ctx.gathering, ctx.unit = gathering, n
        return gathering.views(n)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.gathering.gradient(ctx.unit, grads)
        return None, None, None


class Gathering:
    """The gathers of one sharded model, on every rank of ``process_set`` alike.

    Made by hvdkit.zero.stage3's optimizer once the model's weights are final (after a resume or
    the broadcast); ``attach`` empties the parameters and hooks the modules, ``send(n, gradient)``
    is called with each unit's whole gradient. ``groups``: (module, unit numbers) per group, the
    model itself first."""

    def __init__(self, hvd, process_set, model: nn.Module, units: list[Unit],
                 groups: list[tuple[nn.Module, list[int]]], send: Callable[[int, torch.Tensor], None]) -> None:
        self.hvd, self.process_set, self.model, self.units, self.groups = hvd, process_set, model, units, groups
        self.send = send
        self._pending: dict[int, tuple] = {}  # unit -> (handle, vector): gathers in flight
        self._ready: dict[int, torch.Tensor] = {}  # unit -> its gathered vector
        self._storage: dict[int, int] = {}  # address of a gathered vector's storage -> its unit
        self._order: list[int] = []  # the units this pass is expected to ask for, in order
        self._asked: dict[int, None] = {}  # the units this pass asked for, in order
        self._forward_order: list[int] = [n for _, numbers in groups for n in numbers]
        self._saving: Optional[torch.autograd.graph.saved_tensors_hooks] = None
        self._hooks: list = []
        self._pool = Pool()

    # -- the parameters ----------------------------------------------------------------------
    def attach(self) -> None:
        """Empty every unit's parameters (its slice holds this rank's part) and hook the groups'
        forwards: before each, its units are gathered; after, let go."""
        for unit in self.units:
            for place in unit.places:
                place.param.data = place.param.data.new_empty(0)
        for g, (module, numbers) in enumerate(self.groups):
            root = g == 0
            self._hooks.append(module.register_forward_pre_hook(
                lambda m, args, numbers=numbers, root=root: self._before(numbers, root)))
            self._hooks.append(module.register_forward_hook(
                lambda m, args, out, numbers=numbers, root=root: self._after(numbers, root), always_call=True))

    def _before(self, numbers: list[int], root: bool) -> None:
        if root:  # a forward begins: the units are asked for in the last forward's order
            self._begin(self._forward_order)
            if torch.is_grad_enabled():
                self._saving = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
                self._saving.__enter__()
        for n in numbers:
            self._install(n)

    def _after(self, numbers: list[int], root: bool) -> None:
        for n in numbers:
            self._uninstall(n)
        if root:
            if self._saving is not None:
                self._saving.__exit__(None, None, None)
                self._saving = None
            self._forward_order = list(self._asked)
            self.release_all()
            # The backward (or a checkpointed group's forward run again in it) asks for the units
            # in about the reverse order: first the model's own (its output layer), then the last block.
            self._begin(list(reversed(self._forward_order)))

    def _install(self, n: int) -> None:
        """Unit ``n``'s parameters as views of its gathered vector, linked to its slice in autograd
        where a backward may follow."""
        unit = self.units[n]
        self.ask(n)
        views = _Gathered.apply(unit.piece, self, n) if torch.is_grad_enabled() else self.views(n)
        for place, view in zip(unit.places, views, strict=True):
            for module, name in place.modules:
                module._parameters[name] = view  # not setattr: a module takes only a Parameter there

    def views(self, n: int) -> tuple:
        """Each parameter of unit ``n`` as a view of its gathered vector."""
        vector = self._ready[n]
        return tuple(vector[place.offset:place.offset + math.prod(place.shape)].view(place.shape)
                     for place in self.units[n].places)

    def _uninstall(self, n: int) -> None:
        for place in self.units[n].places:
            for module, name in place.modules:
                module._parameters[name] = place.param
        self._release(n)

    # -- gathers ---------------------------------------------------------------------------------
    def _begin(self, order: list[int]) -> None:
        self._order, self._asked = order, {}

    def _start(self, n: int) -> None:
        if n in self._pending or n in self._ready:
            return
        from horovod.torch import mpi_ops

        unit = self.units[n]
        vector = self._pool.take(unit.length, unit.piece)
        handle = mpi_ops._allgather_async(unit.piece.detach(), vector, f"hvdkit.zero.weights.{n}", self.process_set)
        self._pending[n] = (handle, vector)

    def ask(self, n: int) -> torch.Tensor:
        """Unit ``n``'s gathered vector (gathered now unless it ran ahead); the next unit this pass
        is expected to ask for starts gathering."""
        if n not in self._ready:
            self._start(n)
            handle, vector = self._pending.pop(n)
            self.hvd.synchronize(handle)
            self._ready[n] = vector
            self._storage[vector.untyped_storage().data_ptr()] = n
        self._asked[n] = None
        ahead = next((m for m in self._order if m not in self._asked and m not in self._ready), None)
        if ahead is not None:
            self._start(ahead)
        return self._ready[n]

    def _release(self, n: int) -> None:
        vector = self._ready.pop(n, None)
        if vector is not None:
            self._storage.pop(vector.untyped_storage().data_ptr(), None)

    def release_all(self) -> None:
        """Let go of every gathered vector, waiting for the gathers in flight (none is left to the
        optimizer step, which changes the slices they read)."""
        for n, (handle, _) in list(self._pending.items()):
            self.hvd.synchronize(handle)
            del self._pending[n]
        for n in list(self._ready):
            self._release(n)

    def pooled_bytes(self) -> int:
        """Bytes of the gathered weights and gradient vectors kept for reuse (``Pool``)."""
        return self._pool.nbytes()

    def gradient(self, n: int, grads: tuple) -> None:
        """Unit ``n``'s parameters' gradients of this backward (every use of its weights is
        behind): let go of its weights, send the gradients as one flat vector."""
        self._release(n)
        unit = self.units[n]
        flat = self._pool.take(unit.length, unit.piece)
        end = 0
        for place, grad in zip(unit.places, grads, strict=True):
            end = place.offset + math.prod(place.shape)
            flat[place.offset:end].copy_(grad.reshape(-1))
        flat[end:].zero_()  # the padding
        self.send(n, flat)

    # -- what autograd saves -----------------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor):
        if tensor.layout != torch.strided or tensor.device.type == "meta":
            return tensor
        n = self._storage.get(tensor.untyped_storage().data_ptr())
        if n is None or tensor.dtype != self._ready[n].dtype:
            return tensor
        return _Saved(n, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        return self.ask(saved.unit).detach().as_strided(saved.size, saved.stride, saved.offset)

    def whole(self, n: int, name: str) -> torch.Tensor:
        """Unit ``n`` gathered now, under collective ``name``, outside any pass (a checkpoint's)."""
        from horovod.torch import mpi_ops

        unit = self.units[n]
        vector = unit.piece.new_empty(unit.length)
        self.hvd.synchronize(mpi_ops._allgather_async(unit.piece.detach(), vector, name, self.process_set))
        return vector


class Pool:
    """Vectors the gathers and gradients reuse from step to step: a storage is handed out again
    only once no tensor uses it (its users' views, Horovod's thread, autograd). Allocating a
    block's vector anew at every gather, and letting it go, left glibc's heaps in pieces: a rank's
    resident memory at stage 3 grew past stage 2's, though it holds half the weights."""

    def __init__(self) -> None:
        self._storages: dict[tuple, list] = {}  # (length, dtype, device) -> storages handed out

    def take(self, length: int, like: torch.Tensor) -> torch.Tensor:
        """A vector of ``length`` elements of ``like``'s dtype and device, its values undefined."""
        kept = self._storages.setdefault((length, like.dtype, like.device), [])
        for storage in kept if _USE_COUNT is not None else ():
            if _USE_COUNT(storage._cdata) == 1:  # only this list holds it
                return like.new_empty(0).set_(storage, 0, (length,))
        vector = like.new_empty(length)
        if _USE_COUNT is not None:
            kept.append(vector.untyped_storage())
        return vector

    def nbytes(self) -> int:
        """Bytes of the vectors kept: as many as were in use at once, at the step's peak."""
        return sum(storage.nbytes() for kept in self._storages.values() for storage in kept)


# How many holders a storage has; where torch lacks it, vectors are made anew each time.
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)
