"""The training loop on Horovod's DistributedOptimizer, one process per GPU or CPU slot.

``Trainer.fit`` reads top to bottom: start Horovod, place the process, shard the data,
scale the learning rate, wrap the optimizer, make every rank start from rank 0's weights,
then per step: K local backward passes, one allreduce, unscale and clip, step. Metrics are
summed across ranks in one allreduce per report; validation counts every test sample once.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import sys
import time
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from hvdkit import checkpoint, data, env, models, preemption
from hvdkit.config import ConfigError, TrainConfig, to_dict, validate
from hvdkit.metrics import Metrics
from hvdkit.preemption import StopSignal
from hvdkit.watchdog import Watchdog


def learning_rate(cfg: TrainConfig, epoch: float, final_epoch: float, lr_scaler: float) -> float:
    """At (fractional) ``epoch`` of ``final_epoch``: gradual warmup from base_lr to
    base_lr x lr_scaler (Goyal et al.), then step or cosine decay."""
    peak = cfg.base_lr * lr_scaler
    if epoch < cfg.warmup_epochs:
        return cfg.base_lr * (1 + (lr_scaler - 1) * epoch / cfg.warmup_epochs)
    if cfg.lr_schedule == "step":
        return peak * cfg.lr_decay_factor ** sum(epoch >= e for e in cfg.lr_decay_epochs)
    if cfg.lr_schedule == "cosine":
        progress = (epoch - cfg.warmup_epochs) / max(1e-9, final_epoch - cfg.warmup_epochs)
        return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return peak


def lr_scaler(cfg: TrainConfig, hvd, device: torch.device) -> float:
    """Linear scaling: a step averages size x K micro-batches' gradients. Adasum adapts to
    the gradients instead; on GPUs it still sums within a node (Horovod's rule)."""
    if cfg.use_adasum:
        gpu_local_sum = device.type == "cuda" and hvd.nccl_built()
        return cfg.batches_per_allreduce * (hvd.local_size() if gpu_local_sum else 1)
    return cfg.batches_per_allreduce * hvd.size()


def amp_setup(cfg: TrainConfig, device: torch.device):
    """(autocast dtype, GradScaler or None): bf16 needs no loss scaling; fp16 on GPUs does."""
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    return amp_dtype, torch.amp.GradScaler("cuda") if cfg.amp and device.type == "cuda" else None


def train_step(cfg: TrainConfig, model, optimizer, scaler, images, labels, lr: float, window: torch.Tensor,
               device: torch.device, amp_dtype) -> None:
    """One optimizer step over a batch of K micro-batches; adds loss, hits and count to ``window``."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad()

    # K micro-batches: gradients accumulate locally; the K-th backward starts the allreduce.
    micro_batches = list(zip(images.split(cfg.batch_size), labels.split(cfg.batch_size), strict=True))
    for x, y in micro_batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=cfg.amp):
            output = model(x)
            loss = F.cross_entropy(output, y)
        window[:3] += torch.stack([loss.detach().float() * len(y), (output.argmax(1) == y).sum().float(),
                                   torch.tensor(float(len(y)), device=device)])
        loss = loss / len(micro_batches)
        (scaler.scale(loss) if scaler else loss).backward()

    # Averaging: wait for the averaged gradients, unscale and clip them, then step without a
    # second synchronize. Adasum combines the ranks' updates inside step() instead, so there
    # the local gradients are unscaled and clipped.
    if not cfg.use_adasum:
        optimizer.synchronize()
    if scaler:
        scaler.unscale_(optimizer)
    if cfg.clip_grad_norm:
        nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm)
    with contextlib.nullcontext() if cfg.use_adasum else optimizer.skip_synchronize():
        if scaler:
            scaler.step(optimizer)
        else:
            optimizer.step()
    if scaler:
        scaler.update()


def place_process(local_rank: int, local_size: int) -> torch.device:
    """The GPU local_rank % GPUs when there are GPUs; else the CPU with OMP_NUM_THREADS threads,
    or a fair share of this node's cores."""
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # the job script's choice (Slurm: cpus-per-task)
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // local_size))
    return torch.device("cpu")


def stall_settings(timeout: float) -> dict:
    """Horovod's stall inspector: warn about a collective some rank has not joined after
    min(60 s, timeout/2), naming the tensor and the missing ranks, and end the job after
    ``timeout`` seconds instead of hanging until the allocation's time limit. 0 disables it.
    It works under the MPI controller only; the Watchdog covers Gloo."""
    if timeout <= 0:
        return {"HOROVOD_STALL_CHECK_DISABLE": "1"}
    return {"HOROVOD_STALL_CHECK_TIME_SECONDS": str(max(1, int(min(60.0, timeout / 2)))),
            "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": str(max(1, int(timeout)))}


def performance_settings(on_gpu: bool) -> dict:
    """Horovod and Open MPI knobs measured best for this loop (docs/performance.md).

    On CPUs the ranks' compute threads take every core, so a rank waiting in MPI must
    yield its core instead of spinning on it: Horovod's background thread waits in an MPI
    collective each cycle, and Open MPI busy-polls unless told it is oversubscribed. Once
    waiting yields, a 0.1 ms cycle costs training nothing measurable and cuts the latency
    of every allreduce, which waits for the next cycle, from ~1.2 ms to ~0.3 ms. GPUs are
    left at Horovod's defaults: no GPU was available to measure them.
    """
    if on_gpu:
        return {}
    return {"OMPI_MCA_mpi_yield_when_idle": "1", "HOROVOD_CYCLE_TIME": "0.1"}


def horovod_settings(cfg: TrainConfig) -> dict:
    """What the Trainer sets before hvd.init(); a variable the user exported wins."""
    return {**performance_settings(torch.cuda.is_available()), **stall_settings(cfg.stall_timeout)}


def distributed_optimizer(cfg: TrainConfig, model: nn.Module, hvd):
    """SGD wrapped in Horovod's DistributedOptimizer as the config asks."""
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.base_lr, momentum=cfg.momentum,
                                weight_decay=cfg.weight_decay)
    return hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if cfg.fp16_allreduce else hvd.Compression.none,
        backward_passes_per_step=cfg.batches_per_allreduce,
        op=hvd.Adasum if cfg.use_adasum else hvd.Average,
        gradient_predivide_factor=cfg.gradient_predivide_factor)


OOM_HINT = ("out of memory: lower --batch-size (it is per rank), use --amp, or a smaller --image-size; "
            "see README 'When things go wrong'")
NCCL_HINT = ("NCCL error: rerun with NCCL_DEBUG=INFO to see which link failed; on hosts with several "
             "network interfaces set NCCL_SOCKET_IFNAME (e.g. ib0 or eth0); see README 'When things go wrong'")


def failure_hint(exc: BaseException) -> Optional[str]:
    """The troubleshooting line for failures with a known fix, else None."""
    text = str(exc)
    if isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in text or "out of memory" in text:
        return f"{OOM_HINT} ({text.splitlines()[0] if text else type(exc).__name__})"
    if "NCCL" in text or "nccl" in text:
        return f"{NCCL_HINT} ({text.splitlines()[0]})"
    return None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Trainer:
    """Data-parallel training of ``model`` on ``train_set``, evaluated on ``test_set``.

    Without a model and datasets, they are built from the config's names. Datasets yield
    (input, label) pairs; the loss is cross-entropy over the model's outputs.
    """

    def __init__(self, config: Optional[TrainConfig] = None, model: Optional[nn.Module] = None,
                 train_set: Optional[Dataset] = None, test_set: Optional[Dataset] = None) -> None:
        self.cfg = validate(config or TrainConfig())
        if (train_set is None) != (test_set is None):
            raise ConfigError("Trainer: give both train_set and test_set, or neither")
        if train_set is None:
            built = data.build(self.cfg)
            train_set, test_set = built.train, built.test
            if model is None:
                seed_everything(self.cfg.seed)  # the same initial weights in every run with this seed
                model = models.build(self.cfg.model, built.in_channels, built.image_size, built.num_classes)
        if model is None:
            raise ConfigError("Trainer: a model is required with your own datasets")
        self.model, self.train_set, self.test_set = model, train_set, test_set
        if self.cfg.checkpoint_dir and not self.cfg.resume and checkpoint.existing(self.cfg.checkpoint_dir):
            raise ConfigError(f"checkpoint_dir {self.cfg.checkpoint_dir} holds checkpoints of an earlier run, "
                              f"which this run would delete; resume it (drop --no-resume) or use another directory")

    def fit(self) -> dict:
        import horovod.torch as hvd

        cfg = self.cfg
        for name, value in horovod_settings(cfg).items():
            os.environ.setdefault(name, value)
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        watchdog = Watchdog.after_stall_inspector(cfg.stall_timeout, rank)
        problem = env.disagreement(env.detect(), rank, size, hvd.local_rank())
        if problem:
            print(f"hvdkit: warning: {problem}", file=sys.stderr, flush=True)
        device = place_process(hvd.local_rank(), hvd.local_size())
        seed_everything(cfg.seed + rank)
        if len(self.train_set) < size * cfg.batch_size:
            raise ConfigError(f"data: the training set has {len(self.train_set)} samples, fewer than "
                              f"world size x batch_size = {size} x {cfg.batch_size}")

        train_loader, sampler, test_loader = data.loaders(self.train_set, self.test_set, cfg, rank, size,
                                                          pin_memory=device.type == "cuda")
        model = self.model.to(device)

        scaling = lr_scaler(cfg, hvd, device)
        optimizer = distributed_optimizer(cfg, model, hvd)
        amp_dtype, scaler = amp_setup(cfg, device)

        # Every rank starts from rank 0's state: a checkpoint it loaded, or its initial weights.
        # Optimizer state first: on a rank with empty state Horovod takes a dummy step, whose
        # effect on the weights the parameter broadcast then overwrites.
        epoch, step = self._resume(model, optimizer, scaler, hvd)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)

        steps_per_epoch = len(train_loader)
        total_steps = cfg.epochs * steps_per_epoch
        if cfg.max_steps is not None:
            total_steps = min(total_steps, cfg.max_steps)
        metrics = Metrics(cfg.log_dir, total_steps, enabled=rank == 0)
        metrics.write({"event": "config", "world_size": size, **to_dict(cfg)})

        reported_step = step
        # Since the last report: loss x samples, correct, samples; and whether a stop signal came.
        window = torch.zeros(4, device=device)
        stop = StopSignal()
        stopping = False
        train = {"loss": float("nan"), "accuracy": float("nan")}
        test = {}
        samples_trained, train_seconds = 0.0, 0.0
        wall_start = report_start = time.perf_counter()
        while epoch < cfg.epochs and step < total_steps:
            # A resumed epoch continues where its checkpoint was taken, in the same order.
            sampler.set_epoch(epoch, start=(step - epoch * steps_per_epoch) * train_loader.batch_size)
            model.train()
            for images, labels in train_loader:
                watchdog.beat(f"training step {step + 1}")
                lr = learning_rate(cfg, step / steps_per_epoch, total_steps / steps_per_epoch, scaling)
                train_step(cfg, model, optimizer, scaler, images, labels, lr, window, device, amp_dtype)
                step += 1

                end_of_epoch = step % steps_per_epoch == 0 or step == total_steps
                if step % cfg.log_interval == 0 or end_of_epoch:
                    window[3] = float(stop.received is not None)
                    loss_sum, correct, count, stops = hvd.allreduce(window, op=hvd.Sum, name="train.metrics").tolist()
                    stopping = stops > 0  # every rank stops at this step, whichever got the signal
                    now = time.perf_counter()
                    samples_trained += count
                    train_seconds += now - report_start
                    train = {"loss": loss_sum / count, "accuracy": correct / count}
                    metrics.record("train", step, {"epoch": epoch + 1, **train, "lr": lr, "world_size": size,
                                                   "images_per_sec": count / (now - report_start)},
                                   advance=step - reported_step)
                    window.zero_()
                    report_start, reported_step = now, step
                periodic = cfg.checkpoint_steps and step % cfg.checkpoint_steps == 0 and not end_of_epoch
                if cfg.checkpoint_dir and (periodic or stopping):
                    self._save(model, optimizer, scaler, epoch, step, hvd)
                if step >= total_steps or stopping:
                    break
            if stopping:
                break

            # A rank with fewer batches waits here instead of hanging the others' allreduce.
            if device.type == "cuda":
                hvd.join(device.index)
            else:
                hvd.join()  # with a device argument, a GPU build of Horovod hangs on a CPU-only host
            if step == (epoch + 1) * steps_per_epoch:  # not when max_steps stopped it part-way
                epoch += 1
            watchdog.beat(f"evaluation after step {step}")
            test = self.evaluate(model, test_loader, device, cfg.amp, amp_dtype, hvd)
            metrics.record("test", step, {"epoch": epoch, **test})
            if cfg.checkpoint_dir:
                watchdog.beat(f"checkpoint of step {step}")
                self._save(model, optimizer, scaler, epoch, step, hvd)
            report_start = time.perf_counter()

        stop.restore()
        if not test:  # resumed at the very end, or stopped before an epoch ended
            test = self.evaluate(model, test_loader, device, cfg.amp, amp_dtype, hvd)
        summary = {
            "event": "summary", "epochs": epoch, "steps": step, "world_size": size,
            "model": cfg.model, "dataset": cfg.dataset,
            "train_loss": train["loss"], "train_accuracy": train["accuracy"],
            "test_loss": test.get("loss"), "test_accuracy": test.get("accuracy"),
            "test_samples": test.get("samples"),
            "images_per_sec": samples_trained / train_seconds if train_seconds else 0.0,
            "wall_seconds": time.perf_counter() - wall_start,
        }
        if stopping:
            saved = f"checkpoint of step {step} saved" if cfg.checkpoint_dir else "no --checkpoint-dir: progress lost"
            outcome = preemption.requeue(os.environ, cfg.max_requeues) if rank == 0 else ""
            summary.update(stopped=True, exit_code=preemption.exit_code(outcome) if rank == 0 else 0)
            if rank == 0:
                print(f"hvdkit: stopped by signal {stop.received or 'on another rank'} at step {step}; {saved}; "
                      f"{outcome}", file=sys.stderr, flush=True)
        watchdog.stop()
        metrics.write(summary)
        metrics.close()
        if rank == 0:
            print(json.dumps(summary), flush=True)
        return summary

    def fit_elastic(self) -> dict:
        """Elastic training: ranks may leave or join; the job goes on with those left.

        Horovod restores the last committed state (model, optimizer, sampler position, epoch,
        step) on every rank after a change, and the ElasticSampler shares the rest of the
        epoch among the new set of ranks. The learning rate follows the current world size.
        """
        import horovod.torch as hvd

        cfg = self.cfg
        hvd.init()
        device = place_process(hvd.local_rank(), hvd.local_size())
        seed_everything(cfg.seed + hvd.rank())
        model = self.model.to(device)
        optimizer = distributed_optimizer(cfg, model, hvd)
        amp_dtype, scaler = amp_setup(cfg, device)
        sampler = hvd.elastic.ElasticSampler(self.train_set, shuffle=True, seed=cfg.seed)
        pin_memory = device.type == "cuda"
        loader = torch.utils.data.DataLoader(self.train_set, batch_size=cfg.batch_size * cfg.batches_per_allreduce,
                                             sampler=sampler, **data.loader_options(cfg, hvd.rank(), pin_memory))
        state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0)
        sinks = {"metrics": Metrics(cfg.log_dir, 0, enabled=hvd.rank() == 0)}
        sinks["metrics"].write({"event": "config", "world_size": hvd.size(), **to_dict(cfg)})

        def on_reset() -> None:
            """After ranks left or joined, rank 0 may be another process: it takes the sinks."""
            sinks["metrics"].close()
            sinks["metrics"] = Metrics(cfg.log_dir, 0, enabled=hvd.rank() == 0)
            sinks["metrics"].write({"event": "reset", "step": state.step, "world_size": hvd.size()})

        state.register_reset_callbacks([on_reset])
        final_step = cfg.max_steps or float("inf")
        result = {}

        @hvd.elastic.run
        def train(state) -> None:
            window = torch.zeros(3, device=device)
            while state.epoch < cfg.epochs and state.step < final_step:
                model.train()
                for images, labels in loader:
                    epoch = state.epoch + sampler.processed_num / len(self.train_set)
                    lr = learning_rate(cfg, epoch, cfg.epochs, lr_scaler(cfg, hvd, device))
                    train_step(cfg, model, optimizer, scaler, images, labels, lr, window, device, amp_dtype)
                    sampler.record_batch(0, loader.batch_size)
                    state.step += 1
                    if state.step % cfg.log_interval == 0:
                        loss_sum, correct, count = hvd.allreduce(window, op=hvd.Sum, name="train.metrics").tolist()
                        result["train"] = {"loss": loss_sum / count, "accuracy": correct / count}
                        sinks["metrics"].record("train", state.step, {"epoch": state.epoch + 1, **result["train"],
                                                                      "lr": lr, "world_size": hvd.size()})
                        window.zero_()
                    if state.step % cfg.commit_steps == 0:
                        state.commit()  # also where Horovod applies a change of hosts
                    if state.step >= final_step:
                        break
                else:
                    state.epoch += 1
                    sampler.set_epoch(state.epoch)
                test_loader = data.test_loader(self.test_set, cfg, hvd.rank(), hvd.size(), pin_memory)
                result["test"] = self.evaluate(model, test_loader, device, cfg.amp, amp_dtype, hvd)
                sinks["metrics"].record("test", state.step, {"epoch": state.epoch, **result["test"]})
                state.commit()

        wall_start = time.perf_counter()
        train(state)
        train_result = result.get("train", {})
        test = result.get("test", {})
        summary = {
            "event": "summary", "elastic": True, "epochs": state.epoch, "steps": state.step,
            "world_size": hvd.size(), "model": cfg.model, "dataset": cfg.dataset,
            "train_loss": train_result.get("loss"), "train_accuracy": train_result.get("accuracy"),
            "test_loss": test.get("loss"), "test_accuracy": test.get("accuracy"),
            "test_samples": test.get("samples"), "wall_seconds": time.perf_counter() - wall_start,
        }
        sinks["metrics"].write(summary)
        sinks["metrics"].close()
        if hvd.rank() == 0:
            print(json.dumps(summary), flush=True)
        return summary

    def _save(self, model, optimizer, scaler, epoch: int, step: int, hvd) -> None:
        """Every rank contributes its RNG state; rank 0 writes the checkpoint of ``step``."""
        rng = hvd.allgather_object(rng_state())
        if hvd.rank() != 0:
            return
        checkpoint.save(self.cfg.checkpoint_dir, step, {
            "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict() if scaler else None, "rng": rng,
            "epoch": epoch, "step": step, "world_size": hvd.size(), "config": to_dict(self.cfg),
        }, keep=self.cfg.keep_checkpoints)

    def _resume(self, model, optimizer, scaler, hvd) -> tuple[int, int]:
        """(epoch, step) to start from: rank 0 loads the newest valid checkpoint into the
        model and optimizer (the caller broadcasts them) and shares the rest; (0, 0) if none."""
        cfg = self.cfg
        if not (cfg.checkpoint_dir and cfg.resume):
            return 0, 0
        shared = None
        if hvd.rank() == 0:
            try:
                shared = self._load_on_rank0(model, optimizer, scaler, hvd.size())
            except (checkpoint.CheckpointError, ConfigError) as exc:
                shared = {"error": str(exc)}
        shared = hvd.broadcast_object(shared, root_rank=0, name="resume")
        if shared is None:
            return 0, 0
        if "error" in shared:  # every rank stops with the same line
            raise checkpoint.CheckpointError(shared["error"])
        set_rng_state(shared["rng"][hvd.rank()])
        if hvd.rank() == 0:
            print(f"hvdkit: resumed from {shared['path']} (epoch {shared['epoch'] + 1}, step {shared['step']})",
                  file=sys.stderr, flush=True)
        return shared["epoch"], shared["step"]

    def _load_on_rank0(self, model, optimizer, scaler, size: int) -> Optional[dict]:
        def warn(message: str) -> None:
            print(f"hvdkit: warning: {message}", file=sys.stderr, flush=True)

        found = checkpoint.load_latest(self.cfg.checkpoint_dir, warn)
        if found is None:
            return None
        path, state = found
        if state["world_size"] != size:
            raise ConfigError(f"checkpoint {path} was written by {state['world_size']} ranks, this job has {size}; "
                              f"resume with {state['world_size']} ranks (the data order and learning rate "
                              f"depend on it), or start afresh in another --checkpoint-dir")
        if state["config"]["model"] != self.cfg.model:
            raise ConfigError(f"checkpoint {path} is of model {state['config']['model']!r}, "
                              f"not {self.cfg.model!r}")
        try:
            model.load_state_dict(state["model"])
        except RuntimeError as exc:
            raise ConfigError(f"checkpoint {path} does not fit this model: "
                              f"{str(exc).splitlines()[0]}") from None
        optimizer.load_state_dict(state["optimizer"])
        if scaler and state["scaler"]:
            scaler.load_state_dict(state["scaler"])
        return {"path": str(path), "epoch": state["epoch"], "step": state["step"], "rng": state["rng"]}

    @staticmethod
    def evaluate(model: nn.Module, loader, device: torch.device, amp: bool, amp_dtype, hvd) -> dict:
        """Loss and accuracy over the whole test set, each sample counted once on one rank."""
        model.eval()
        totals = torch.zeros(3, device=device)
        with torch.no_grad():
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp):
                    output = model(x)
                totals += torch.stack([F.cross_entropy(output.float(), y, reduction="sum"),
                                       (output.argmax(1) == y).sum().float(),
                                       torch.tensor(float(len(y)), device=device)])
        loss_sum, correct, count = hvd.allreduce(totals, op=hvd.Sum, name="test.metrics").tolist()
        return {"loss": loss_sum / max(count, 1), "accuracy": correct / max(count, 1), "samples": int(count)}
