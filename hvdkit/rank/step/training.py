"""The training step: micro-batches, mixed precision, backward, and the optimizer step with its
finiteness check.

A step is K micro-batches (``batches_per_allreduce``) whose backward passes accumulate locally;
the last one's backward starts Horovod's allreduce. ``TrainingStep.apply`` then waits for the
averaged gradients once, unscales (fp16) and clips them, checks that they are finite, and steps
the optimizer without a second wait, then the GradScaler and the scheduler; or, where that gives
the same bits (``_overlaps``), checks and steps each gradient bucket as it lands, while the
buckets after it are still reduced.

Nothing in a steady step reads the device: on a GPU such a read blocks the host until the GPU has
finished, so the next step's kernels could not be queued meanwhile (measured on an H200: 20% of a
resnet50 step). A non-finite step is skipped on the device instead: the fused optimizers take a
``found_inf`` flag, as GradScaler hands it. The flags are read in one go where the loop reads
anyway (``settle``: at a report, a consistency check, a checkpoint, the end), so a bad step is
never applied and is named there, with what ``on_nonfinite`` says. An optimizer without a fused
kernel reads its flag at every step (docs/own-loop.md).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Optional

import torch
from torch import nn

from hvdkit import nested
from hvdkit.config import TrainConfig
from hvdkit.parallel import norms
from hvdkit.parallel.ops import all_reduce
from hvdkit.rank.agree.stragglers import StepTimes
from hvdkit.rank.state import RunState, say
from hvdkit.zero.deferred import is_deferred
from hvdkit.zero.elementwise import elementwise

MAX_SKIPS_IN_A_ROW = 10
SETTLE_AT_MOST_EVERY = 1000  # steps: a loop that never reports still reads its flags now and then


class NonFiniteError(RuntimeError):
    """The loss or gradients of a step are NaN or infinite; the message names the step."""


def lr_multiplier(cfg: TrainConfig, size: int, local_size: int, on_gpu_with_nccl: bool) -> float:
    """How much larger than base_lr the peak learning rate is, by ``cfg.lr_scaling``.

    A step averages size x K micro-batches' gradients (linear: Goyal et al.; sqrt: Krizhevsky's
    rule, common for Adam). Adasum adapts to the gradients instead, so only K counts, and on
    GPUs the sum within a node (Horovod's rule)."""
    ranks = (local_size if on_gpu_with_nccl else 1) if cfg.use_adasum else size
    batches = ranks * cfg.batches_per_allreduce
    return {"linear": float(batches), "sqrt": math.sqrt(batches), "none": 1.0}[cfg.lr_scaling]


def lr_lambda(cfg: TrainConfig, hvd, mesh, on_gpu_with_nccl: bool, progress: Callable[[int], float],
              factor: Callable[[float, float], float]) -> Callable[[int], float]:
    """A LambdaLR function: ``factor(epochs done at the step, lr_multiplier at the number of
    data-parallel replicas of the moment)`` (``mesh.data_parallel``: the world size without tensor
    parallelism). It holds no Session nor loader: in the scheduler that would make a reference
    cycle, which keeps the loaders' workers alive past the run's end."""
    def multiplier() -> float:
        return lr_multiplier(cfg, mesh.data_parallel(hvd)[1], hvd.local_size(), on_gpu_with_nccl)

    if not cfg.elastic:  # the world size is the job's: the multiplier is worked out once
        fixed = multiplier()
        return lambda step: factor(progress(step), fixed)
    return lambda step: factor(progress(step), multiplier())


def split_batch(batch: Any, size: int) -> list:
    """``batch`` (tensors nested in tuples, lists and dicts) as chunks of at most ``size`` samples."""
    chunks: dict[tuple, tuple] = {}

    def split(tensor: torch.Tensor, place: tuple) -> torch.Tensor:
        chunks[place] = tensor.split(size)
        return tensor

    def refuse(leaf: Any, place: tuple) -> Any:
        raise TypeError(f"batch: cannot split a {type(leaf).__name__}; batches are tensors nested in "
                        f"tuples, lists and dicts")

    nested.rebuild(batch, split, refuse)
    counts = {len(parts) for parts in chunks.values()}
    if len(counts) != 1:
        raise ValueError("batch: its tensors hold different numbers of samples")
    return [nested.rebuild(batch, lambda tensor, place, i=i: chunks[place][i], refuse) for i in range(counts.pop())]


def to_device(batch: Any, device: torch.device, memory_format: torch.memory_format = torch.preserve_format) -> Any:
    """``batch`` with every tensor moved to ``device`` (asynchronously from pinned memory), its
    4-D floating-point tensors in ``memory_format``."""
    def move(tensor: torch.Tensor, place: tuple) -> torch.Tensor:
        if tensor.dim() == 4 and tensor.is_floating_point():
            return tensor.to(device, non_blocking=True, memory_format=memory_format)
        return tensor.to(device, non_blocking=True)

    return nested.rebuild(batch, move)


def on_device(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` on ``device``; one built on the meta device stays there: zero 3 makes its weights,
    one module at a time, into each rank's slices (hvdkit.zero.deferred)."""
    return model if is_deferred(model) else model.to(device)


def input_format(cfg: TrainConfig, model: nn.Module, device: torch.device) -> torch.memory_format:
    """The images' memory format: channels_last for a model with 2-D convolutions on a GPU
    (``channels_last``), so that cuDNN runs them in NHWC, as tensor cores take it. The weights
    stay contiguous: Horovod's collectives refuse a channels-last tensor (and a weight's
    gradient follows its weight's layout)."""
    convolutional = any(isinstance(m, nn.Conv2d) for m in model.modules())
    if cfg.channels_last and convolutional and device.type == "cuda":
        return torch.channels_last
    return torch.preserve_format


class TrainingStep:
    """The step of one run: it steps the state's model, optimizer, scaler and scheduler, timed by
    ``times``; ``checkpoint_left()`` says which checkpoint a run stopped by a non-finite step leaves;
    ``mesh``: the job's (pp, dp, tp) groups, whose tensor-parallel group and pipeline norm and check the
    gradients."""

    def __init__(self, cfg, hvd, device, state: RunState, times: StepTimes,
                 checkpoint_left: Callable[[], str], mesh) -> None:
        self.cfg, self.hvd, self.device, self.state, self.times = cfg, hvd, device, state, times
        self.tp_group = mesh.tp_group if mesh.tp > 1 else None  # a model split across it: norms and checks span it
        self.stages = mesh.pp_group if mesh.pp > 1 else None  # a model cut across it: so does the pipeline
        if self.stages is not None and self.tp_group is None:
            self.tp_group = mesh.tp_group  # a group of one: the norms' arithmetic the same
        self.dp_group = mesh.dp_group  # where ZeRO's slices are, under tensor parallelism
        self.checkpoint_left = checkpoint_left  # RunCheckpoints.checkpoint_left
        self.micro_count = cfg.batches_per_allreduce  # of the step under way
        self.skipped, self.skips_in_a_row = 0, 0  # on_nonfinite: skip
        self.pending: list[tuple] = state.unsettled  # (flag on the device, step, epoch) of the steps not yet settled
        self.momentum_ready = False  # fused SGD's buffers made (prepare_momentum)
        self._listed: Optional[tuple] = None  # (model, its parameters)
        self._overlap: Optional[tuple] = None  # (optimizer, whether its buckets are stepped as they land)
        # A fused optimizer's flag of the overlapped steps since the last settle, on the device: once
        # one bucket was not finite, every bucket after it skips, in that step and in every later one.
        self.stepped_in_part: Optional[torch.Tensor] = None

    def micro_batches(self, batch: Any, micro_size: int,
                      memory_format: torch.memory_format = torch.preserve_format) -> list:
        """``batch`` on this device, split into the micro-batches of one optimizer step; 4-D
        floating-point tensors (images) in ``memory_format`` (the Session's channels_last)."""
        chunks = split_batch(batch, micro_size) if self.cfg.batches_per_allreduce > 1 else [batch]
        self.micro_count = len(chunks)
        if self.device.type == "cpu" and memory_format == torch.preserve_format:
            return chunks  # a CPU run's batches are on the CPU: moving them would return each tensor itself
        return [to_device(chunk, self.device, memory_format) for chunk in chunks]

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss, divided by the step's micro-batches (as Horovod's
        examples divide it) and scaled for fp16. Never by the ranks: the allreduce averages, as
        Horovod's does, so a tensor hook sees this rank's own gradient at every world size."""
        scaler = self.state.scaler
        loss = loss / self.micro_count
        (scaler.scale(loss) if scaler else loss).backward()

    def apply(self) -> None:
        """Wait for the averaged gradients, unscale and clip them, then step without a second
        synchronize, skipping a non-finite step (see the module docstring). Adasum combines the
        ranks' updates inside step() instead, so there the local gradients are unscaled and
        clipped. Then the GradScaler and the scheduler."""
        cfg, optimizer, scaler = self.cfg, self.state.optimizer, self.state.scaler
        # The loop's own synchronize() this step (Horovod's clipping pattern: synchronize, clip,
        # then step under skip_synchronize): its gradients are the averaged ones, to be stepped as
        # they are, not reduced again (cleared below once they are spent).
        synchronized = getattr(optimizer, "_synchronized", False)
        if not synchronized and self._overlaps(optimizer):
            self._apply_as_buckets_land(optimizer)
        else:
            self._apply_at_once(optimizer, scaler, synchronized)
        if hasattr(optimizer, "_synchronized"):  # Horovod's optimizers (ZeRO's has none)
            # This step's gradients are spent, stepped or skipped: the next step's are new, to be
            # reduced (a skipped step, GradScaler's or on_nonfinite's, calls no step() to clear it;
            # landed()'s last synchronize sets it after the buckets' steps).
            optimizer._synchronized = False
        if scaler:
            scaler.update()
        if self.state.scheduler is not None:
            self.state.scheduler.step()
        self.micro_count = cfg.batches_per_allreduce

    def _apply_at_once(self, optimizer, scaler, synchronized: bool = False) -> None:
        """Every averaged gradient awaited (unless the loop did: ``synchronized``), then unscaled,
        clipped and checked, then one step."""
        cfg = self.cfg
        if not cfg.use_adasum and not synchronized:
            self.times.waiting()
            optimizer.synchronize()
            self.times.waited()
        if scaler:
            scaler.unscale_(optimizer)
            if cfg.zero:  # each rank checked only its own slices for an overflow
                optimizer.agree_on_overflow(scaler)
            if self.tp_group is not None:  # and only its own blocks
                found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
                for device, flag in found.items():  # a sum of 0/1 flags, on the device: nothing is read here
                    found[device] = all_reduce(flag.reshape(1), self.tp_group, "hvdkit.tp.inf").clamp(
                        max=1.0).reshape(flag.shape)
        checked = self._clip_and_check()
        with contextlib.nullcontext() if cfg.use_adasum else optimizer.skip_synchronize():
            if scaler:  # GradScaler skips an overflow: on the device where the optimizer takes found_inf
                scaler.step(optimizer)
            elif checked is None:
                optimizer.step()
            else:
                self._step_unless(optimizer, checked)

    def _overlaps(self, optimizer) -> bool:
        """Whether each bucket is stepped as it lands (``_apply_as_buckets_land``), decided once per
        optimizer: where the update is the one the step at once makes, bit for bit, and needs
        nothing of the other buckets. So: bucket views with several buckets; an optimizer that
        updates each element on its own (``elementwise``: one of torch's classes in hvdkit.zero.elementwise's
        list, not a subclass, or one the user declares so); no clipping (its global norm needs
        every bucket first); no tensor parallelism (a bucket's check is agreed across the
        tensor-parallel group, whose ranks hold other blocks, before any steps); no fp16
        GradScaler (its unscale and skip need every gradient);
        ``on_nonfinite: stop`` (a skip would have to take back buckets already stepped: the
        stop ends the run instead, and no checkpoint holds what it stepped); and either an
        optimizer whose bucket checks are read as each lands, on a CPU only (on a GPU, a host sync
        per bucket), or a fused one, which skips a bad bucket on the device and whose flags are
        read at the next settle, without snapshots (a snapshot is taken without that read, and a
        step stepped in part would be restored from it)."""
        if self._overlap is not None and self._overlap[0] is optimizer:
            return self._overlap[1]
        cfg = self.cfg
        overlaps = (hasattr(optimizer, "landed") and optimizer.bucket_count() > 1
                    and elementwise(self.state.inner, cfg.elementwise_optimizer) and not cfg.clip_grad_norm
                    and self.tp_group is None and self.stages is None
                    and self.state.scaler is None and cfg.on_nonfinite == "stop" and not cfg.use_adasum
                    and not any(group.get("differentiable") for group in optimizer.param_groups)
                    and (not cfg.snapshot_steps if skips_on_device(optimizer) else self.device.type == "cpu"))
        self._overlap = (optimizer, overlaps)
        return overlaps

    def _apply_as_buckets_land(self, optimizer) -> None:
        """Each bucket's parameters stepped as soon as its averaged gradients land, while the
        buckets after it are still being reduced (DDP's optimizer in backward does the same);
        each bucket checked for finiteness first, as the step at once checks them all: a
        non-finite bucket is not stepped, nor any after it, and the run stops (``_overlaps``).
        A fused optimizer skips on the device and the flag is read at the next settle: until then
        every later bucket, of this step and of the steps after it, skips too (``stepped_in_part``),
        so the model stepped in part is never trained further before the run stops."""
        fused = skips_on_device(optimizer)
        if fused and not self.momentum_ready:
            prepare_momentum(optimizer)
            self.momentum_ready = True
        landed, step, epoch = optimizer.landed(), self.state.global_step + 1, self.state.epoch + 1
        bad = self.stepped_in_part
        while True:
            self.times.waiting()
            bucket = next(landed, None)
            self.times.waited()
            if bucket is None:
                break
            parameters, gradients = bucket
            total = torch.stack([g.sum(dtype=torch.float32) for g in gradients]).sum()
            if not fused:  # read now, a plain read on a CPU
                if not math.isfinite(total.item()):
                    for _ in landed:  # the rest awaited, so that nothing is left in flight
                        pass
                    self._nonfinite(step, epoch, partly=True)
                optimizer.step_parameters(parameters)
                continue
            flag = self._flag(total)  # on the device: the bucket skips itself there, and the ones after it
            bad = flag if bad is None else torch.maximum(bad, flag)
            optimizer.found_inf = bad
            try:
                optimizer.step_parameters(parameters)
            finally:
                del optimizer.found_inf
        if fused and bad is not None:
            self.stepped_in_part = bad
            self.pending.append((bad, step, epoch))
            if len(self.pending) >= SETTLE_AT_MOST_EVERY:
                self.settle()
        else:
            self.skips_in_a_row = 0

    def _clip_and_check(self) -> Optional[torch.Tensor]:
        """Clip the gradients; a value on the device whose finiteness decides the step (the
        clipping's norm where it clips; else, over bucket views, the sum of the buckets' flat
        tensors, one pass in a few kernels, half a norm's time on a CPU, and finite exactly where
        every element is, short of a sum past 3e38; else the gradients' norm), or None where
        nothing is to check (fp16 loss scaling: GradScaler checks them itself). Averaged gradients
        are the same on every rank, and ZeRO's norm sums every rank's slices, so every rank decides
        alike; Adasum's gradients are local, so there the ranks add their flags (``_flag``). A model
        split for tensor parallelism is clipped by the whole model's norm (hvdkit.parallel.norms), and
        its unclipped check summed over the tensor-parallel group: each rank holds other blocks."""
        cfg, state = self.cfg, self.state
        optimizer = state.optimizer
        if cfg.zero and self.tp_group is not None and (cfg.clip_grad_norm or state.scaler is None):
            norm = norms.sharded_clip_grad_norm_(optimizer, cfg.clip_grad_norm, self.tp_group, self.dp_group,
                                                 "hvdkit.tp.norm", self.stages)  # every block's slices
        elif cfg.zero:  # the norm of the whole gradient, from every rank's slices
            if cfg.clip_grad_norm:
                norm = optimizer.clip_grad_norm_(cfg.clip_grad_norm)
            elif state.scaler is None:
                norm = optimizer.grad_norm()
            else:
                return None
        elif cfg.clip_grad_norm:
            norm = (nn.utils.clip_grad_norm_(self._parameters(), cfg.clip_grad_norm) if self.tp_group is None else
                    norms.clip_grad_norm_(self._parameters(), cfg.clip_grad_norm, self.tp_group, "hvdkit.tp.norm",
                                          self.stages))
        elif state.scaler is None:
            gradients = getattr(optimizer, "gradient_tensors", None)
            if gradients:  # a few flat tensors: their sum is non-finite where any element is (NaN, ±inf)
                norm = torch.stack([g.sum(dtype=torch.float32) for g in gradients()]).sum()
            else:
                grads = [p.grad for p in self._parameters() if p.grad is not None]
                if not grads:
                    return None
                norm = nn.utils.get_total_norm(grads)
            if self.tp_group is not None:  # non-finite where any rank's blocks are
                norm = all_reduce(norm.double().reshape(1), self.tp_group, "hvdkit.tp.finite").reshape(())
            if self.stages is not None:  # or any stage's
                norm = all_reduce(norm.double().reshape(1), self.stages, "hvdkit.pp.finite").reshape(())
        else:
            return None
        return None if state.scaler is not None else norm

    def _flag(self, checked: torch.Tensor) -> torch.Tensor:
        """1.0 on the device where ``checked`` is not finite on some rank, else 0.0; 0-d, as
        GradScaler's found_inf: the fused kernels take no other."""
        bad = torch.logical_not(torch.isfinite(checked)).float().reshape(1)
        if self.cfg.use_adasum:
            bad = self.hvd.allreduce(bad, op=self.hvd.Sum, name="hvdkit.finite").clamp(max=1.0)
        return bad.reshape(())

    def _parameters(self) -> list:
        """The model's parameters, listed once per model: walking the modules every step takes host
        time that a fast GPU's next kernels may wait for (docs/performance-notes.md#figures-behind-the-code)."""
        model = self.state.model
        if self._listed is None or self._listed[0] is not model:
            self._listed = (model, list(model.parameters()))
        return self._listed[1]

    def _step_unless(self, optimizer, checked: torch.Tensor) -> None:
        """Step unless ``checked`` (``_clip_and_check``'s value) is not finite. A fused optimizer is
        handed the flag as GradScaler hands it ``found_inf``, and skips on the device: nothing is
        read, and the flag is kept for ``settle()``. Any other optimizer is told by reading the
        value now: a host sync on a GPU, a plain read on a CPU."""
        target = getattr(optimizer, "inner", optimizer)  # hvdkit.zero's ShardedOptimizer steps its inner one
        if not skips_on_device(target):
            self.settle()  # flags of steps a fused optimizer took before (one changed by a resume)
            finite = not self._flag(checked).item() if self.cfg.use_adasum else math.isfinite(checked.item())
            if finite:
                self.skips_in_a_row = 0
                optimizer.step()
            else:
                self._nonfinite(self.state.global_step + 1, self.state.epoch + 1)
            return
        bad = self._flag(checked)
        self.pending.append((bad, self.state.global_step + 1, self.state.epoch + 1))
        if not self.momentum_ready:  # once: every parameter has its buffer from then on
            prepare_momentum(target)
            self.momentum_ready = True
        target.found_inf = bad
        try:
            optimizer.step()
        finally:
            del target.found_inf
        if len(self.pending) >= SETTLE_AT_MOST_EVERY:
            self.settle()

    def settle(self) -> bool:
        """Read the flags of the steps taken since the last call, in one read, and act on each
        non-finite one as ``on_nonfinite`` says: stop raises NonFiniteError naming the first
        (none of them was applied, nor any checkpoint written after it: the Session settles
        before it reports, checks consistency or checkpoints); skip counts and warns, up to
        MAX_SKIPS_IN_A_ROW in a row. True if the last step read was skipped."""
        if not self.pending:
            return False
        flags, steps = torch.stack([bad for bad, _, _ in self.pending]).tolist(), list(self.pending)
        self.pending.clear()
        self.stepped_in_part = None  # read: a bad one stops the run below (the overlap is on_nonfinite: stop's)
        for flag, (_, step, epoch) in zip(flags, steps, strict=True):
            if flag:
                self._nonfinite(step, epoch)
            else:
                self.skips_in_a_row = 0
        return bool(flags[-1])

    def _nonfinite(self, step: int, epoch: int, partly: bool = False) -> None:
        """Act on a non-finite step as ``on_nonfinite`` says; ``partly``: the buckets before the
        bad one were stepped (as they landed), in this process's memory only."""
        kept = self.checkpoint_left()
        if self.cfg.on_nonfinite == "stop":
            applied = ("stopped, no checkpoint holding it" if partly or self._overlap and self._overlap[1]
                       else "stopped before applying them")
            raise NonFiniteError(f"the loss or gradients of step {step} (epoch {epoch}) are not finite; {applied}, "
                                 f"{kept}; lower --base-lr, set --clip-grad-norm, or pass --on-nonfinite skip")
        self.skipped += 1
        self.skips_in_a_row += 1
        if self.skips_in_a_row >= MAX_SKIPS_IN_A_ROW:
            raise NonFiniteError(f"the loss or gradients were not finite for {self.skips_in_a_row} steps in a row "
                                 f"(the last, step {step}); stopped, {kept}; lower --base-lr or set "
                                 f"--clip-grad-norm")
        say(self.hvd, f"hvdkit: warning: the loss or gradients of step {step} are not finite; step skipped "
                      f"({self.skipped} so far)")


# The optimizers whose fused kernels take GradScaler's found_inf, and so skip a step on the device.
FUSABLE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def skips_on_device(optimizer) -> bool:
    """Whether ``optimizer.step()`` skips on the device when handed ``found_inf``: torch's fused
    SGD, Adam and AdamW do. SGD's first step with momentum fills its buffers from the gradient,
    so there only without dampening, where ``prepare_momentum`` makes that first step a plain one."""
    return isinstance(optimizer, FUSABLE) and all(
        group.get("fused") and not (isinstance(optimizer, torch.optim.SGD) and group["momentum"]
                                    and group["dampening"]) for group in optimizer.param_groups)


def prepare_momentum(optimizer) -> None:
    """Zero momentum buffers for fused SGD's parameters that have none. Its first step makes them
    with torch.empty_like and fills them in the kernel, which a skipped step does not run (a
    torch behaviour, GradScaler's too), so the next step would read garbage. Without dampening, a
    step from a zero buffer is the first step's update to the bit (0 x momentum + grad)."""
    if not isinstance(optimizer, torch.optim.SGD):
        return
    for group in optimizer.param_groups:
        if group["momentum"]:
            for p in group["params"]:
                if p.requires_grad and "momentum_buffer" not in optimizer.state[p]:
                    optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)


def use_fused_kernels(optimizer, convert: bool = True) -> bool:
    """With ``convert``, torch's fused kernels for SGD, Adam and AdamW where the user left the
    choice to torch (``fused`` and ``foreach`` unset): one kernel for every parameter, and the
    step can skip a non-finite update on the device (``skips_on_device``). Existing state (Adam's
    step counts, loaded before) is moved where the fused kernels want it. An optimizer whose
    groups are all fused then tells GradScaler to hand it found_inf. True if every group is fused.

    The Session converts on GPUs only: on a CPU, reading the flag costs no device sync, and
    torch's fused CPU kernels run a parallel region per tensor, which on busy cores is far slower
    than foreach (docs/own-loop.md)."""
    if not isinstance(optimizer, FUSABLE):
        return False
    for group in optimizer.param_groups if convert else ():
        params = group["params"]
        chosen = group.get("fused") is not None or group.get("foreach") is not None
        usable = all(p.is_floating_point() and not p.is_complex() for p in params) and not group.get("differentiable")
        if chosen or not usable or group.get("capturable"):
            continue
        group["fused"], group["foreach"] = True, None
        for p in params:
            step = optimizer.state.get(p, {}).get("step")
            if step is not None:
                optimizer.state[p]["step"] = torch.as_tensor(step, dtype=torch.float32, device=p.device).clone()
    fused = all(group.get("fused") for group in optimizer.param_groups)
    if fused:
        optimizer._step_supports_amp_scaling = True  # GradScaler hands it found_inf instead of reading it
    return fused
