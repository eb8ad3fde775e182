"""The optimizer made distributed: Horovod's DistributedOptimizer over gradient buckets whose
gradients live in them, or hvdkit.zero's sharded optimizer.

The buckets are DDP's: the trained parameters in reverse order (about the order backward makes
their gradients), the first closed at 1 MiB, the others at their cap. Each bucket's gradients are
views of one flat tensor, as DDP's ``gradient_as_bucket_view``: the bucket goes to Horovod as one
tensor, reduced in place, so Horovod copies nothing into its fusion buffer and nothing back out.
It is averaged as Horovod's DistributedOptimizer averages every gradient (its Average op: the sum,
then 1/size on Horovod's thread), so that a tensor hook and the gradients after ``synchronize()``
see what they see under Horovod at every world size, whatever the loop divides its loss by
(tests/programs/differential.py).
A gradient that is not its view (after ``zero_grad()`` set it to None, backward made a new one)
is copied into it once, when its bucket goes. Every rank reduces the same flat tensors every step,
none fused with another (with group fusion off, Horovod makes each allreduce a group of its own:
hvdkit.rank.start.startup.reproducible_settings), so a run stays bitwise reproducible at any world size.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Callable, Optional

import torch
from torch import nn

from hvdkit.config import ConfigError, TrainConfig
from hvdkit.parallel.grads import has_sequence_parallel, sum_sequence_parallel_grads
from hvdkit.parallel.pipeline.stages import sum_tied_grads
from hvdkit.zero import optimizer as zero
from hvdkit.zero import stage3
from hvdkit.zero.deferred import is_deferred

# The first bucket is DDP's 1 MiB (_DEFAULT_FIRST_BUCKET_BYTES), so that the link starts with the
# first gradients backward makes. The others: DDP's 25 MiB (bucket_cap_mb) on GPUs; 4 MiB on CPUs,
# where a bucket goes sooner and the link idles less while backward still computes
# (docs/performance.md#gradient-buckets).
FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20
CPU_BUCKET_BYTES = 4 << 20


def bucket_bytes(device: torch.device) -> int:
    return CPU_BUCKET_BYTES if device.type == "cpu" else BUCKET_BYTES


def gradient_buckets(model: nn.Module, cap: int = BUCKET_BYTES,
                     first_cap: int = FIRST_BUCKET_BYTES) -> list[list[nn.Parameter]]:
    """The buckets: the trained parameters in reverse order, a bucket closed once it holds
    ``first_cap`` bytes (the first) or ``cap`` (the others). Each goes as soon as its last gradient
    is there. Left to fuse whatever each cycle found ready, the same elements would be summed in
    different orders from run to run (hvdkit.rank.start.startup.reproducible_settings). Sparse gradients
    (an embedding's ``sparse=True``) cannot be grouped: they go alone."""
    sparse = {id(p) for m in model.modules() if getattr(m, "sparse", False) is True for p in m.parameters()}
    buckets: list[list[nn.Parameter]] = [[]]
    size = 0
    for parameter in reversed([p for p in model.parameters() if p.requires_grad and id(p) not in sparse]):
        buckets[-1].append(parameter)
        size += parameter.numel() * parameter.element_size()
        if size >= (first_cap if len(buckets) == 1 else cap):
            buckets.append([])
            size = 0
    return [bucket for bucket in buckets if bucket]


def gradient_path(cfg: TrainConfig, ranks: int) -> str:
    """How a run's gradients are averaged (``distributed_optimizer``): "sharded" (``zero``);
    "bucket views" (Horovod's grouped allreduce of hvdkit's buckets, at two ranks and more); else
    "tensor by tensor" (Horovod's own: Adasum and pre/post-scaling, which its grouped allreduce
    lacks; elastic runs, whose groups Horovod agrees on in a collective a joining worker makes
    alone, which hung the rejoin; one rank, with nothing to reduce)."""
    if cfg.zero:
        return "sharded"
    grouped = not (cfg.elastic or cfg.use_adasum) and cfg.gradient_predivide_factor == 1.0
    return "bucket views" if grouped and ranks > 1 else "tensor by tensor"


def distributed_optimizer(cfg: TrainConfig, hvd, optimizer: torch.optim.Optimizer, model: nn.Module,
                          device: torch.device, mesh):
    """``optimizer`` made distributed as ``cfg`` says: with ``zero``, hvdkit.zero's ShardedOptimizer;
    else Horovod's DistributedOptimizer, with bucket views where Horovod's grouped allreduce
    applies (``gradient_path``). Its gradients are averaged over ``mesh``'s data-parallel group:
    the whole job without tensor or pipeline parallelism; with them, the ranks holding the same
    blocks of the same stage, and where that is this rank alone (pp x tp the whole job) nothing is
    reduced (``unreduced``). Then, in its ``synchronize()``, the sums across the model's parts
    (``summing_across_parts``)."""
    compression = hvd.Compression.fp16 if cfg.fp16_allreduce else hvd.Compression.none
    if cfg.zero != 3 and is_deferred(model):
        raise ConfigError("the model is on the meta device: zero 3 builds it one module at a time into each "
                          "rank's slices; set zero 3, or build the model on the CPU")
    if mesh.tp > 1 and not any(getattr(p, "tp_dim", None) is not None for p in model.parameters()):
        raise ConfigError("tp: split the model with session.parallelize(model) before making its optimizer")
    if mesh.pp > 1 and not hasattr(model, "own_parameter_names"):
        raise ConfigError("pp: cut the model with session.parallelize(model) before making its optimizer")
    split = mesh.tp > 1 or mesh.pp > 1
    process_set = mesh.dp_group.process_set if split else hvd.global_process_set
    path = gradient_path(cfg, mesh.dp if split else hvd.size())
    if path == "sharded":
        zero.check(optimizer, model, cfg.zero, cfg.elementwise_optimizer)
        if cfg.zero == 3:
            return stage3.WeightShardedOptimizer(optimizer, hvd, model, cfg.zero_groups, compression,
                                                 cfg.batches_per_allreduce, cfg.gradient_predivide_factor,
                                                 device=device)
        sharded = zero.ShardedOptimizer(optimizer, hvd, cfg.zero, compression, cfg.batches_per_allreduce,
                                        cfg.gradient_predivide_factor, process_set=process_set)
        return summing_across_parts(sharded, model, mesh)
    if split and mesh.dp == 1:
        wrapped = unreduced(optimizer)
    elif path == "bucket views":
        wrapped = with_bucket_views(optimizer, model.named_parameters(), compression, cfg.batches_per_allreduce,
                                    gradient_buckets(model, bucket_bytes(device)), process_set)
    else:
        wrapped = hvd.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(), compression=compression,
            backward_passes_per_step=cfg.batches_per_allreduce, op=hvd.Adasum if cfg.use_adasum else hvd.Average,
            gradient_predivide_factor=cfg.gradient_predivide_factor, process_set=process_set)
    # Horovod's wrapper is a new optimizer over the same param groups: it keeps the state you may
    # have loaded into yours. A scheduler warns that it stepped before the optimizer when the step
    # it wrapped (yours) was not called; Horovod's is instead.
    wrapped.state = optimizer.state
    optimizer._opt_called = True
    return summing_across_parts(wrapped, model, mesh)


def summing_across_parts(optimizer, model: nn.Module, mesh):
    """``optimizer`` (a distributed one) whose ``synchronize()`` then sums the gradients of the
    sequence-parallel parameters over ``mesh``'s tensor-parallel group (hvdkit.parallel.grads) and
    those of an embedding tied to the output layer over its pipeline's ends (the first and last
    stage: hvdkit.parallel.pipeline.stages): after the data-parallel average and before anything
    reads them, in the step's synchronize, in a loop's own (Horovod's clipping pattern) and in the
    one ``step()`` makes. ``optimizer`` itself where ``model`` has neither."""
    sequence_parallel = has_sequence_parallel(model)
    tied = mesh.pp > 1 and any(getattr(param, "pipeline_tied", False) for param in model.parameters())
    if not (sequence_parallel or tied):
        return optimizer
    averaged = optimizer.synchronize

    def synchronize() -> None:
        averaged()
        if sequence_parallel:
            sum_sequence_parallel_grads(optimizer, mesh.tp_group, "hvdkit.tp.sequence")
        if tied:
            sum_tied_grads(model, mesh, "hvdkit.pp.tied")

    optimizer.synchronize = synchronize
    return optimizer


def with_bucket_views(optimizer, named_parameters, compression, backward_passes_per_step: int,
                       buckets: list[list[nn.Parameter]], process_set=None):
    """As hvd.DistributedOptimizer makes its class (the user's optimizer class with Horovod's
    methods), with ``_BucketViews``' methods over Horovod's; averaged over ``process_set`` (None:
    the whole job)."""
    from horovod.torch.mpi_ops import global_process_set
    from horovod.torch.optimizer import _DistributedOptimizer

    methods = dict(_DistributedOptimizer.__dict__)
    methods.update((name, value) for name, value in _BucketViews.__dict__.items() if callable(value))
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, buckets,
               process_set or global_process_set)


def unreduced(optimizer: torch.optim.Optimizer):
    """``optimizer``'s class with the methods of Horovod's that the step calls, doing nothing: the
    optimizer of a rank that is its own data-parallel group (tensor parallelism over the whole
    job), whose gradients are its blocks' own, already whole. Over the same param groups and state."""
    methods = {name: value for name, value in _Unreduced.__dict__.items() if callable(value)}
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
    wrapped = copy.copy(optimizer)
    wrapped.__class__ = cls
    wrapped._synchronized = False
    return wrapped


class _Unreduced:
    """Horovod's optimizer methods that hvdkit's step calls, for ``unreduced``."""

    def synchronize(self) -> None:
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        yield


class _BucketViews:
    """The methods that replace Horovod's for buckets whose gradients are views of one tensor.
    Never instantiated: ``with_bucket_views`` copies them into the optimizer's class, so they
    name Horovod's methods explicitly instead of through ``super()``."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, buckets,
                 process_set) -> None:
        from horovod.torch.optimizer import _DistributedOptimizer

        _DistributedOptimizer.__init__(self, params, named_parameters, compression, backward_passes_per_step,
                                       process_set=process_set)
        self._groups = buckets
        if self._grad_accs:  # its hooks are registered (more than one rank): its groups, formed as it forms them
            self._form_groups(buckets)
        self._outside: Optional[list] = None  # the trained parameters in no bucket (gradient_tensors)
        self._with_last: Optional[Callable[[], None]] = None  # sent just before this step's last bucket
        self._sent = 0  # buckets sent this step
        self._by_group: Optional[dict] = None  # a bucket (None: the rest) -> its parameters in each param group
        self._flat: dict[tuple, torch.Tensor] = {}  # a bucket (Horovod's group) -> the tensor its gradients view
        self._views: dict[nn.Parameter, torch.Tensor] = {}
        ours = {frozenset(map(id, bucket)) for bucket in buckets}
        for group in self._group_counts:  # Horovod's groups: ours, and one per parameter left out of them
            kinds = {(p.dtype, p.device) for p in group}
            if frozenset(map(id, group)) not in ours or len(kinds) != 1:
                continue
            dtype, device = kinds.pop()
            flat = torch.zeros(sum(p.numel() for p in group), dtype=dtype, device=device)
            offset = 0
            for p in group:
                self._views[p] = flat[offset:offset + p.numel()].view(p.shape)
                offset += p.numel()
                if p.grad is not None:
                    self._views[p].copy_(p.grad)
                    p.grad = self._views[p]
            self._flat[group] = flat
            self._requires_update.difference_update(group)  # Horovod's synchronize leaves them to ours

    def _form_groups(self, buckets: list[list[nn.Parameter]]) -> None:
        """Horovod's groups of ``groups=buckets``: each bucket's trained parameters, then one group per
        trained parameter left out. Formed here, not by Horovod: its hooks' registration broadcasts
        the parameters' order from global rank 0 over the process set, which a data-parallel set
        without rank 0 (tensor parallelism's) refuses; here every rank lists them alike."""
        trained = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        ids = {id(p) for p in trained}
        groups = [tuple(p for p in bucket if id(p) in ids) for bucket in buckets]
        grouped = {id(p) for group in groups for p in group}
        for group in [*groups, *((p,) for p in trained if id(p) not in grouped)]:
            self._group_counts[group] = 0
            for p in group:
                self._p_to_group[p] = group

    def with_last_bucket(self, send: Optional[Callable[[], None]]) -> Optional[Callable[[], None]]:
        """``send()`` is called once, just before this step's last bucket goes to Horovod, from the
        thread that sends it (the step's meeting: one Horovod cycle then carries both); None takes
        back what was held and returns it, if it was not called."""
        held, self._with_last = self._with_last, send
        return held

    def _make_hook(self, p):
        """Horovod's hook, but a sparse gradient (an embedding's ``sparse=True``, in a group of its
        own: ``gradient_buckets``) goes alone, as Horovod sends it without groups (its allgather),
        since its grouped allreduce takes no sparse tensor."""
        from horovod.torch.optimizer import _DistributedOptimizer

        grouped = _DistributedOptimizer._make_hook(self, p)

        def hook(*ignore):
            if p.grad is None or not p.grad.is_sparse:
                return grouped(*ignore)
            if self._allreduce_delay[p] <= 0:  # Horovod's own check, as its hook makes it
                raise AssertionError("Gradients were computed more than backward_passes_per_step times before call "
                                     "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
            self._allreduce_delay[p] -= 1
            self._handles[p] = self._allreduce_grad_async(p) if self._allreduce_delay[p] == 0 else (None, None)
        return hook

    def gradient_tensors(self) -> list[torch.Tensor]:
        """Every trained gradient once: the buckets' flat tensors (which their parameters' gradients
        view), then the gradients outside them; for a pass over all of them in a few kernels."""
        if self._outside is None:
            self._outside = [p for group in self.param_groups for p in group["params"] if p not in self._views]
        return [*self._flat.values(), *(p.grad for p in self._outside if p.grad is not None)]

    def _grouped_allreduce_grad_async(self, ps):
        from horovod.torch.mpi_ops import Average, allreduce_async_
        from horovod.torch.optimizer import _DistributedOptimizer

        flat = self._flat.get(ps)
        if flat is None:
            return _DistributedOptimizer._grouped_allreduce_grad_async(self, ps)
        views, grads = [], []  # the gradients backward made anew (after zero_grad() set them to None)
        for p in ps:
            view = self._views[p]
            if p.grad is None:  # not used this step, on this rank: Horovod's zero gradient
                view.zero_()
                p.grad = view
            elif p.grad.data_ptr() != view.data_ptr():
                views.append(view)
                grads.append(p.grad)
                p.grad = view
        if views:  # into the bucket in one call, not one a parameter (on a GPU, one kernel launch each)
            torch._foreach_copy_(views, grads)
        self._sent += 1
        if self._sent == len(self._flat) and self._with_last is not None:
            send, self._with_last = self._with_last, None
            send()
        compressed, ctx = self._compression.compress(flat)
        handle = allreduce_async_(compressed, name=f"bucket.{self._parameter_names.get(ps[0])}", op=Average,
                                  process_set=self.process_set)
        return handle, (compressed, ctx)

    def synchronize(self):
        for _ in self.landed():
            pass

    def bucket_count(self) -> int:
        return len(self._flat)

    def landed(self):
        """Wait for each bucket's averaged gradients in the order the buckets went, yielding each as
        it lands: (its parameters, by param group, for ``step_parameters``; its flat tensor in a
        list); then Horovod's own synchronize of the gradients outside the buckets, yielded last
        where there are any. ``synchronize()`` is this, run to its end; a caller that stops early
        leaves the step's allreduces in flight."""
        from horovod.torch.mpi_ops import synchronize
        from horovod.torch.optimizer import _DistributedOptimizer

        if self._by_group is None:  # each bucket's parameters in each param group, made once
            members = {bucket: set(bucket) for bucket in self._flat}
            self._by_group = {bucket: [[p for p in group["params"] if p in members[bucket]]
                                       for group in self.param_groups] for bucket in self._flat}
            self._by_group[None] = [[p for p in group["params"] if p not in self._views and p.requires_grad]
                                    for group in self.param_groups]
        if self.process_set.included():
            for group in self._flat:
                if group not in self._handles:  # a parameter's gradient did not come on this rank this step
                    for p in group:
                        self._handles.pop(p, None)
                    self._handles[group] = self._grouped_allreduce_grad_async(group)
            for group, flat in self._flat.items():
                handle, (compressed, ctx) = self._handles.pop(group)
                output = synchronize(handle)
                if compressed is not flat:
                    flat.copy_(self._compression.decompress(output, ctx))
                for p in group:
                    self._allreduce_delay[p] = self.backward_passes_per_step
                self._group_counts[group] = 0
                yield self._by_group[group], [flat]
        self._sent = 0
        _DistributedOptimizer.synchronize(self)
        rest = self._by_group[None]
        gradients = [p.grad for params in rest for p in params if p.grad is not None]
        if gradients:
            yield rest, gradients

    def step_parameters(self, parameters_by_group: list[list[nn.Parameter]]) -> None:
        """The optimizer's own step, over these parameters of each param group only (those of one
        bucket, from ``landed``): an optimizer that updates each element on its own (hvdkit.zero's
        list) makes each parameter's update as its whole step would, bit for bit."""
        from horovod.torch.optimizer import _DistributedOptimizer

        kept = [group["params"] for group in self.param_groups]
        try:
            for group, parameters in zip(self.param_groups, parameters_by_group, strict=True):
                group["params"] = parameters
            self._should_synchronize = False  # as skip_synchronize(): the gradients are the averaged ones
            _DistributedOptimizer.step(self)
        finally:
            self._should_synchronize = True
            for group, parameters in zip(self.param_groups, kept, strict=True):
                group["params"] = parameters
