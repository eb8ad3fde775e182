"""Sharded optimizer state and gradients (ZeRO stages 1 and 2) on Horovod's collectives.

The trainable parameters are laid out in buckets: consecutive parameters of one param group,
last layer first (the order backward produces their gradients), up to BUCKET_BYTES. A bucket
is one flat vector, padded to a multiple of the world size N; rank r owns the r-th of its N
equal slices. The buckets do not depend on N, only the padding and slices do, so a sharded
checkpoint re-partitions to any world size (hvdkit.zero.shards).

A step, on every rank:
1. When a bucket's last gradient is ready, its flat gradient is reduce-scattered (averaged)
   asynchronously, overlapping the rest of the backward pass; each rank receives the averaged
   gradient of its slice. Each ``.grad`` is a view into its bucket's flat gradient. Stage 1
   keeps them all, reduces once after the K-th micro-batch, in place: the slice lands in this
   rank's own block of the flat gradient. Stage 2 takes a bucket's flat gradient from a few
   reused buffers when its first gradient arrives and gives it back once sent, so a rank holds
   only its gradient slices (in vectors kept from step to step), and with K micro-batches
   reduces each one and sums the slices (more traffic, less memory, as DeepSpeed's stage 2).
2. The wrapped optimizer steps on this rank's slices: its param groups keep their options (an
   LR scheduler built on it works as before) and hold one flat slice per bucket instead of the
   parameters. That is the same update as on the whole parameters for optimizers that work
   element by element, the only ones accepted (``check``).
3. The updated slices are allgathered in place (together on GPUs, one bucket at a time on CPUs:
   ``ShardedOptimizer._send`` says why): each bucket's weights are one flat vector from the start
   (the parameters are views of it) and this rank's slice is its part of that storage, so the
   weights are never held twice.

No collective allocates its output, and the buffers a step needs are made in the first step and
kept: buffers that Horovod's thread allocated and the training thread freed, every step, left
glibc's heaps in pieces, and the peak far above the bytes held (docs/zero.md). Under MPI the
in-place collectives need hvdkit's Horovod patch 0007 (``check_collectives``). The padding of
each bucket is zeros in the gradient, so it leaves norms and updates alone.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import math
import os
from typing import Optional

import torch
from torch import nn

from hvdkit.config import ConfigError
from hvdkit.zero.elementwise import ELEMENTWISE, elementwise
from hvdkit.zero.held import held_bytes
from hvdkit.zero.layout import BUCKET_BYTES, Bucket, layout

STAGE2_IN_FLIGHT = 2  # stage 2: buckets' reduce-scatters in flight at once, each holding a flat gradient
IN_FLIGHT_VARIABLE = "HVDKIT_ZERO_IN_FLIGHT"

def check(optimizer: torch.optim.Optimizer, model: nn.Module, stage: int, declared: bool = False) -> None:
    """ConfigError, in one line, for what a sharded optimizer cannot do; before any step.
    ``declared``: the config's ``elementwise_optimizer``."""
    name = type(optimizer).__name__
    if isinstance(optimizer, (torch.optim.LBFGS, torch.optim.SparseAdam)) or not elementwise(optimizer, declared):
        why = {"LBFGS": "it needs a closure that re-evaluates the loss on whole parameters",
               "SparseAdam": "it takes sparse gradients, which are not reduce-scattered"}.get(
            name, "it does not update each element on its own, so a slice of a parameter cannot be stepped alone")
        if isinstance(optimizer, ELEMENTWISE):
            why = (f"it subclasses {type(optimizer).__mro__[1].__name__}, and its step() may look at every parameter "
                   f"at once (a global-norm clip), which a slice stepped alone changes; if it updates each element on "
                   f"its own, say so with elementwise_optimizer")
        raise ConfigError(f"zero: stage {stage} cannot shard {name}: {why}; use SGD, Adam, AdamW (or another "
                          f"elementwise torch optimizer), or zero 0")
    sparse = next((n for n, m in model.named_modules() if getattr(m, "sparse", False) is True), None)
    if sparse is not None:
        raise ConfigError(f"zero: stage {stage} cannot shard the sparse gradients of {sparse} "
                          f"({type(model.get_submodule(sparse)).__name__} with sparse=True); set sparse=False, "
                          f"or zero 0")


def check_collectives(hvd, version: Optional[str]) -> None:
    """ConfigError, in one line, where Horovod's MPI operations would be handed aliased buffers:
    the in-place allgather and reduce-scatter need hvdkit's patch 0007 under MPI (Gloo takes them
    as they are; NCCL has in-place forms of both). ``version`` is the installed Horovod's,
    "+hvdkit." in an hvdkit build."""
    if hvd.mpi_enabled() and not hvd.gloo_enabled() and "+hvdkit." not in (version or ""):
        raise ConfigError(f"zero: this Horovod ({version}) was not built by hvdkit, and its MPI operations cannot "
                          f"gather and reduce in place; run `python -m hvdkit.build`, or launch with Gloo "
                          f"(horovodrun --gloo)")


def collectives_in_flight(device: torch.device, environ=os.environ) -> bool:
    """Whether the collectives stay in flight together (see ``ShardedOptimizer._send``): on GPUs,
    where a wait is a host sync; on CPUs one at a time keeps the peak down. HVDKIT_ZERO_IN_FLIGHT=1
    or 0 decides instead."""
    if environ.get(IN_FLIGHT_VARIABLE) in ("0", "1"):
        return environ[IN_FLIGHT_VARIABLE] == "1"
    return device.type == "cuda"


class ShardedOptimizer:
    """``optimizer`` stepping this rank's slices of the parameters (see the module docstring).

    Used as Horovod's DistributedOptimizer is: ``zero_grad()``, backward, ``step()``; or
    ``synchronize()`` then ``with skip_synchronize(): step()`` to look at the gradients between.
    ``param_groups`` and ``state`` are the wrapped optimizer's, over the slices. Every rank of
    ``process_set`` (the whole job by default) holds a slice and makes every call alike.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, hvd, stage: int, compression=None,
                 backward_passes_per_step: int = 1, gradient_predivide_factor: float = 1.0,
                 bucket_bytes: int = BUCKET_BYTES, in_flight: Optional[bool] = None, process_set=None) -> None:
        check_collectives(hvd, importlib.metadata.version("horovod"))
        self.inner, self.hvd, self.stage = optimizer, hvd, stage
        # The ranks that shard among themselves: the data-parallel set, the whole job by default
        # (a set made at hvd.init: sets added later turn off Horovod's idle sleep, patch 0003).
        self.process_set = hvd.global_process_set if process_set is None else process_set
        self.size, self.rank = self.process_set.size(), self.process_set.rank()
        self.compression = compression or hvd.Compression.none
        self.passes = backward_passes_per_step
        self.predivide = gradient_predivide_factor
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.group_sizes = [len(group["params"]) for group in optimizer.param_groups]  # frozen ones too
        self.buckets = self._layout(bucket_bytes)
        device = self.params[0].device if self.params else torch.device("cpu")
        self.in_flight = collectives_in_flight(device) if in_flight is None else in_flight
        self._whole, self.slices = self._hold_weights()
        for g, group in enumerate(optimizer.param_groups):
            group["params"] = [s for s, b in zip(self.slices, self.buckets, strict=True) if b.group == g]
        self._shard_state(dict(optimizer.state))  # state you loaded before setup(): this rank keeps its slices'
        self.reduced: list[Optional[torch.Tensor]] = [None] * len(self.buckets)  # this step's gradient slices
        self._bucket_of = {i: (n, k) for n, b in enumerate(self.buckets) for k, i in enumerate(b.params)}
        self._handles: dict[int, tuple] = {}  # bucket -> (handle, compression context, flat gradient, send number)
        self._sends = 0
        self._sent: set[int] = set()  # buckets sent this step: every rank sends each as often
        self._ready: list[set] = [set() for _ in self.buckets]
        self._counts = [0] * len(self.params)
        self._synchronized = False
        # Each .grad is a view into its bucket's flat gradient, which is reduce-scattered as it
        # is (no copy), as DDP's gradient_as_bucket_view. Stage 1 keeps them all; stage 2 takes a
        # bucket's from _spare when its first gradient arrives and gives it back once received.
        self._flat: list[Optional[torch.Tensor]] = [None] * len(self.buckets)
        self._spare: list[torch.Tensor] = []  # stage 2: flat gradients sent and received, for the next buckets
        self._received: list[Optional[torch.Tensor]] = [None] * len(self.buckets)  # stage 2: where slices land
        self._attach_gradients()
        self._hooks = self._gradient_hooks()

    def _layout(self, bucket_bytes: int) -> list[Bucket]:
        """The buckets of the trained parameters (hvdkit.zero.layout)."""
        return layout(self.inner.param_groups, bucket_bytes)

    def _hold_weights(self) -> tuple[list, list[torch.Tensor]]:
        """(each bucket's whole flat weights, this rank's slices of them): each bucket's weights
        live in one flat vector from the start, and this rank's slice of it is what the optimizer
        steps, so the weights are never held twice, not even at step 1."""
        whole = [self._flatten_weights(n) for n in range(len(self.buckets))]
        slices = [flat.new_empty(0) for flat in whole]
        for piece, flat in zip(slices, whole, strict=True):
            self._alias(piece, flat)
        return whole, slices

    def _gradient_hooks(self) -> list:
        """A hook on each trained parameter that counts its gradient in, sending its bucket once full."""
        return [self.params[i].register_post_accumulate_grad_hook(self._hook(i)) for i in self._bucket_of]

    def _new_flat(self, bucket: Bucket) -> torch.Tensor:
        """A zeroed flat vector of ``bucket``, padded to a multiple of the world size."""
        first = self.params[bucket.params[0]]
        return torch.zeros(bucket.slice_length(self.size) * self.size, dtype=first.dtype, device=first.device)

    def _spare_flat(self, n: int) -> torch.Tensor:
        """Stage 2: a zeroed flat gradient for bucket ``n``, the front of a buffer that a received
        bucket gave back (or a new one, as long as the longest bucket): a few such buffers serve
        every bucket of every step, rather than one allocation each."""
        length = self.buckets[n].slice_length(self.size) * self.size
        if not self._spare:
            longest = max(self.buckets, key=lambda b: b.length)
            return self._new_flat(longest)[:length]
        return self._spare.pop()[:length].zero_()

    def _own_part(self, whole: torch.Tensor) -> torch.Tensor:
        width = len(whole) // self.size
        return whole[self.rank * width:(self.rank + 1) * width]

    def _alias(self, piece: torch.Tensor, whole: torch.Tensor) -> None:
        """``piece`` becomes this rank's part of ``whole``'s storage, a tensor of its own (not a
        view) as the optimizer's parameters are."""
        width = len(whole) // self.size
        with torch.no_grad():
            piece.set_(whole.untyped_storage(), whole.storage_offset() + self.rank * width, (width,))

    def _flatten_weights(self, n: int) -> torch.Tensor:
        """Bucket ``n``'s weights moved into one flat vector, each parameter a view of it."""
        whole = self._new_flat(self.buckets[n])
        for param, lo, hi, shape in self._views(n):
            whole[lo:hi].copy_(param.detach().reshape(-1))
            param.data = whole[lo:hi].view(shape)
        return whole

    def _views(self, n: int):
        """(parameter, start, end, shape): where each parameter of bucket ``n`` lies in its flat vector."""
        bucket = self.buckets[n]
        for i, offset, shape in zip(bucket.params, bucket.offsets, bucket.shapes, strict=True):
            yield self.params[i], offset, offset + math.prod(shape), shape

    def _attach_gradients(self) -> None:
        """Stage 1: every .grad a zeroed view into its bucket's flat gradient."""
        if self.stage == 1:
            for n in range(len(self.buckets)):
                self._attach_bucket(n)

    def _attach_bucket(self, n: int) -> None:
        """Bucket ``n``'s .grads become views into its zeroed flat gradient (made if it has none:
        stage 2 reuses one whose bucket was sent); a gradient already there is copied in first."""
        if self._flat[n] is None and self.stage == 2:
            self._flat[n] = self._spare_flat(n)
        elif self._flat[n] is None:
            self._flat[n] = self._new_flat(self.buckets[n])
        else:
            self._flat[n].zero_()
        flat = self._flat[n]
        for param, lo, hi, shape in self._views(n):
            if param.grad is not None:
                flat[lo:hi].copy_(param.grad.reshape(-1))
            param.grad = flat[lo:hi].view(shape)

    def _overlaps(self, bucket: Bucket, length: int):
        """(parameter index, range in this rank's slice, range in the flat parameter) of each
        parameter that this rank's slice of ``bucket`` (``length`` long) covers."""
        start = self.rank * length
        for i, offset, shape in zip(bucket.params, bucket.offsets, bucket.shapes, strict=True):
            lo, hi = max(start, offset), min(start + length, offset + math.prod(shape))
            if lo < hi:
                yield i, slice(lo - start, hi - start), slice(lo - offset, hi - offset)

    def _shard_state(self, whole: dict) -> None:
        """Per-parameter state the wrapped optimizer held (loaded by you before setup()) as the
        state of this rank's slices; the rest is let go."""
        self.inner.state.clear()
        for piece, bucket in zip(self.slices, self.buckets, strict=True):
            states = [whole.get(self.params[i]) for i in bucket.params]
            if not any(states):
                continue
            if not all(states):
                raise ConfigError("zero: the optimizer given to setup() holds state for some of its trained "
                                  "parameters only; load a whole state_dict into it, or pass a fresh one")
            sliced = {k: v for k, v in states[0].items() if not (torch.is_tensor(v) and v.dim())}
            for key in set(states[0]) - set(sliced):
                flat = sliced[key] = torch.zeros_like(piece, dtype=states[0][key].dtype)
                for i, mine, theirs in self._overlaps(bucket, len(piece)):
                    flat[mine] = whole[self.params[i]][key].reshape(-1)[theirs]
            self.inner.state[piece] = sliced

    # -- what the wrapped optimizer shows -------------------------------------------------
    param_groups = property(lambda self: self.inner.param_groups)
    # GradScaler hands found_inf to an optimizer that says it takes it (a fused one) instead of reading it.
    _step_supports_amp_scaling = property(lambda self: getattr(self.inner, "_step_supports_amp_scaling", False))
    state = property(lambda self: self.inner.state)
    defaults = property(lambda self: self.inner.defaults)

    # -- gradients ------------------------------------------------------------------------
    def _hook(self, index: int):
        def ready(param: torch.Tensor) -> None:
            self._counts[index] += 1
            if self.stage == 1 and self._counts[index] < self.passes:
                return  # stage 1 sums the K micro-batches in .grad and reduces once
            n, _ = self._bucket_of[index]
            if self._flat[n] is None:  # stage 2: the bucket's first gradient of this pass
                self._attach_bucket(n)
            self._ready[n].add(index)
            if len(self._ready[n]) == len(self.buckets[n].params):
                self._send(n)
        return ready

    def _flat_gradient(self, n: int) -> torch.Tensor:
        """Bucket ``n``'s gradients as one flat vector: the one its .grads are views of."""
        if self._flat[n] is None:  # stage 2, a bucket none of whose parameters had a gradient
            self._attach_bucket(n)
        flat = self._flat[n]
        for param, lo, hi, _ in self._views(n):
            grad = param.grad
            if grad is None:  # set to None since: it sends zeros, as Horovod does for an unused one
                flat[lo:hi].zero_()
            elif grad.data_ptr() != flat[lo:].data_ptr():  # a .grad replaced since zero_grad()
                flat[lo:hi].copy_(grad.reshape(-1))
        return flat

    def _send(self, n: int, flat: Optional[torch.Tensor] = None) -> None:
        """Reduce-scatter bucket ``n`` (its gradients, or the ``flat`` one stage 3's gather hands
        over); stage 2 then lets go of its parameters' gradients.

        In flight (GPUs, ``in_flight``): stage 1 sends each bucket as its gradients are ready and
        waits for them all once, before the step: on a GPU every wait in the middle of backward is
        a host sync (stage 1 ran at 0.37x DistributedOptimizer's speed on an H200 when it waited
        for each bucket before sending the next). Stage 2 holds at most STAGE2_IN_FLIGHT buckets'
        flat gradients in flight, waiting for the oldest beyond that: more would hold the whole
        gradient, which stage 2 exists not to. One at a time (CPUs): each bucket waits for the one
        before, so that Horovod never fuses two through its fusion buffer (up to 64 MiB more
        resident; in flight, the peak's saving at GPT 38M fell by ~135 MB, docs/zero.md)."""
        if n in self._handles:  # stage 2 with K micro-batches: its last pass's slice lands where this one would
            self._receive(n)
        if not self.in_flight:
            for m in list(self._handles):
                self._receive(m)
        elif self.stage >= 2:  # stage 3 too: each in flight holds a gradient
            while len(self._handles) >= STAGE2_IN_FLIGHT:
                self._receive(min(self._handles, key=lambda m: self._handles[m][3]))
        flat = self._flat_gradient(n) if flat is None else flat
        compressed, context = self.compression.compress(flat)
        op, scales = self.hvd.Average, (1.0, 1.0)
        if self.predivide != 1.0:  # as Horovod's gradient_predivide_factor: divide before the sum, the rest after
            op, scales = self.hvd.Sum, (1.0 / self.predivide, self.predivide / self.size)
        handle = self.hvd.mpi_ops._reducescatter_async(compressed, self._output(n, compressed), f"hvdkit.zero.{n}", op,
                                                       self.process_set, *scales)
        self._sends += 1
        self._handles[n] = (handle, context, flat if self.stage >= 2 else None, self._sends)
        self._sent.add(n)
        self._ready[n].clear()
        if self.stage == 2:  # Horovod holds the flat gradient until it is received
            for i in self.buckets[n].params:
                self.params[i].grad = None
            self._flat[n] = None

    def _output(self, n: int, sent: torch.Tensor) -> torch.Tensor:
        """Where bucket ``n``'s reduced slice is to land, so that no collective allocates (and
        leaves the allocator's heaps in pieces): stage 1 reduces in place, into this rank's block
        of the flat gradient sent (Horovod patch 0007); stage 2 receives its first one of a step
        into a slice it keeps from step to step, the rest into a new tensor, added to it. A
        compressed gradient lands in a new tensor."""
        if self.stage == 1:  # its own block of the flat gradient, which nothing reads again
            return self._own_part(sent) if sent is self._flat[n] else sent.new_empty(0)
        if self.reduced[n] is not None:
            return sent.new_empty(0)
        out = self._received[n]
        if out is None or out.dtype != sent.dtype:
            out = self._received[n] = sent.new_empty(len(sent) // self.size)
        return out

    def _receive_all(self) -> None:
        """Wait for every reduce-scatter in flight, in one place, then take their slices."""
        done = {n: self.hvd.synchronize(handle) for n, (handle, *_) in sorted(self._handles.items())}
        for n, out in done.items():
            self._receive(n, out)

    def _receive(self, n: int, out: Optional[torch.Tensor] = None) -> None:
        handle, context, sent, _ = self._handles.pop(n)
        part = self.compression.decompress(self.hvd.synchronize(handle) if out is None else out, context)
        if sent is not None and self.stage == 2:  # the flat gradient's buffer is free again
            self._spare.append(sent if sent._base is None else sent._base)
        if self.stage == 1:  # in this rank's block of the flat gradient, where it landed unless compressed
            own = self._own_part(self._flat[n])
            self.reduced[n] = own if part.data_ptr() == own.data_ptr() else own.copy_(part)
        elif self.reduced[n] is None:
            self.reduced[n] = part
        else:
            self.reduced[n].add_(part)

    def synchronize(self) -> None:
        """Send the buckets still waiting (fewer micro-batches than K, unused parameters) and wait
        for all; each slice then holds its averaged gradient in ``.grad``."""
        for n in range(len(self.buckets)):
            if self._ready[n] or n not in self._sent:  # part of a bucket, or one not sent this step
                self._send(n)
        self._receive_all()
        for piece, grad in zip(self.slices, self.reduced, strict=True):
            piece.grad = grad
        self._counts = [0] * len(self.params)
        self._sent.clear()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``step()`` inside uses the gradients ``synchronize()`` received (Horovod's API)."""
        yield

    def grad_norm(self) -> torch.Tensor:
        """The 2-norm of the whole averaged gradient: every rank's slices, in one allreduce."""
        squares = sum((s.grad.float().pow(2).sum() for s in self.slices if s.grad is not None),
                      torch.zeros((), device=self.slices[0].device if self.slices else "cpu"))
        total = self.hvd.allreduce(squares.reshape(1), op=self.hvd.Sum, name="hvdkit.zero.norm",
                                   process_set=self.process_set)
        return total.sqrt()[0]

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the whole gradient; returns its norm before clipping."""
        norm = self.grad_norm()
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for piece in self.slices:
            if piece.grad is not None:
                piece.grad.mul_(coefficient.to(piece.grad.dtype))
        return norm

    def agree_on_overflow(self, scaler) -> None:
        """After ``scaler.unscale_(self)``: an inf in any rank's slices skips the step on every
        rank, since each rank saw only its own (GradScaler's fp16 loss scaling)."""
        found = scaler._per_optimizer_states[id(self)]["found_inf_per_device"]
        for device, flag in found.items():  # a sum of 0/1 flags, on the device: nothing is read here
            found[device] = self.hvd.allreduce(flag.reshape(1), op=self.hvd.Sum, name="hvdkit.zero.inf",
                                               process_set=self.process_set).clamp(max=1.0).reshape(flag.shape)

    # -- the step ---------------------------------------------------------------------------
    def step(self, closure=None):
        if closure is not None:
            raise ConfigError("zero: a sharded optimizer steps without a closure")
        if not self._synchronized:
            self.synchronize()
        moved = [n for n in range(len(self.buckets)) if not self._aliased(n)]
        for n in moved:  # the weights are the truth: loaded, broadcast or stepped
            self._read_slice(self.slices[n], self.buckets[n])
        # GradScaler (and hvdkit.rank.step.training) hand a fused optimizer found_inf and grad_scale as
        # attributes of the optimizer they step, this one: the inner one steps.
        handed = {name: getattr(self, name) for name in ("found_inf", "grad_scale") if hasattr(self, name)}
        for name, value in handed.items():
            setattr(self.inner, name, value)
        try:
            self.inner.step()
        finally:
            for name in handed:
                delattr(self.inner, name)
        self._gather(moved)
        self._synchronized = False

    def _aliased(self, n: int) -> bool:
        """This rank's slice of bucket ``n`` is still its part of the parameters' own storage: no
        parameter has been given another (a load_state_dict with assign=True, a .data set)."""
        whole = self._whole[n]
        return all(param.data_ptr() == whole[lo:].data_ptr() for param, lo, _, _ in self._views(n))

    def _read_slice(self, piece: torch.Tensor, bucket: Bucket) -> None:
        for i, mine, theirs in self._overlaps(bucket, len(piece)):
            piece[mine].copy_(self.params[i].detach().reshape(-1)[theirs])

    def _gather(self, moved: list[int]) -> None:
        """Every rank's updated slices into every rank's weights, in place: each bucket's slice is
        already its part of the flat weights, which are the allgather's output. In flight, all are
        submitted, then waited for once; else one at a time (``_send`` says why). The parameters
        of the ``moved`` buckets, given other storage since the last step, become views of the
        flat weights again."""
        handles = []
        for n, piece in enumerate(self.slices):
            handles.append(self.hvd.mpi_ops._allgather_async(piece.detach(), self._whole[n], f"hvdkit.zero.weights.{n}",
                                                             self.process_set))
            if not self.in_flight:
                self.hvd.synchronize(handles.pop())
        for handle in handles:
            self.hvd.synchronize(handle)
        for n in moved:
            for param, lo, hi, shape in self._views(n):
                param.data = self._whole[n][lo:hi].view(shape)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._receive_all()  # a step abandoned mid-way: let its collectives finish
        for p in self.params:
            p.grad = None
        self._flat = [None] * len(self.buckets) if self.stage == 2 else self._flat
        self._attach_gradients()
        for piece in self.slices:
            piece.grad = None
        self.reduced = [None] * len(self.buckets)
        self._ready = [set() for _ in self.buckets]
        self._counts = [0] * len(self.params)
        self._sent.clear()
        self._synchronized = False

    # -- state (hvdkit.zero.shards writes and reads it) -----------------------------------------------
    def shard_state(self) -> dict:
        """This rank's share of the optimizer state: per bucket, the state of its slice."""
        return {"rank": self.rank, "world_size": self.size,
                "state": {n: dict(self.inner.state[s]) for n, s in enumerate(self.slices) if s in self.inner.state}}

    def state_dict(self):
        """Refused in one line: no rank holds the whole state (see hvdkit.zero.shards)."""
        raise ConfigError("zero: the optimizer state is split across the ranks; session.save() writes it (each rank "
                          "its shard), session.setup() reads it back, and `hvdkit checkpoint export` makes one plain "
                          "state_dict of it")

    def load_state_dict(self, state_dict) -> None:
        self.state_dict()

    def load_whole_state(self, state_dict: dict) -> None:
        """A whole optimizer's torch state_dict (a checkpoint of zero 0; its parameters numbered in
        the param groups' order): this rank keeps its slices' state, and the groups' options."""
        groups, sizes = state_dict["param_groups"], [len(group["params"]) for group in state_dict["param_groups"]]
        if sizes != self.group_sizes:
            raise ConfigError(f"zero: the checkpoint's param groups hold {sizes} parameters, this optimizer's "
                              f"{self.group_sizes}; start afresh in another checkpoint_dir")
        self._shard_state({self.params[i]: values for i, values in state_dict["state"].items()})
        for group, saved in zip(self.inner.param_groups, groups, strict=True):
            group.update({key: value for key, value in saved.items() if key != "params"})

    def group_options(self) -> list[dict]:
        """Each param group's options (lr, weight decay, a scheduler's initial_lr, ...)."""
        return [{k: v for k, v in group.items() if k != "params"} for group in self.inner.param_groups]

    def load_shard_state(self, state: dict, groups: list[dict]) -> None:
        """The state of this rank's slices (bucket number -> state), and the groups' options."""
        for n, values in state.items():
            piece = self.slices[n]
            self.inner.state[piece] = {k: v.to(piece.device) if torch.is_tensor(v) and v.dim() else v
                                       for k, v in values.items()}
        for group, options in zip(self.inner.param_groups, groups, strict=True):
            group.update(options)

    def memory(self) -> dict:
        """Bytes this rank holds, measured from the tensors: weights, gradients, optimizer state."""
        return held_bytes(self.params, [*self.params, *self.slices], self.inner.state.values())

