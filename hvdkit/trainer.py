"""The Trainer: a loop over ``hvdkit.Session`` for any model, loss and batch shape.

``Trainer.fit`` reads top to bottom: start the session, shard the data, build the
optimizer and its learning-rate schedule, set up (resume or broadcast), then per epoch the
steps, a report every ``log_interval`` steps, an evaluation, and a checkpoint; ``session.run``
runs those epochs, inside Horovod's elastic run for an elastic job. What a step does lives in
``train_step``, which the benchmark shares.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from hvdkit import checkpoint, data, models
from hvdkit.config import ConfigError, TrainConfig, validate
from hvdkit.data import batch_len
from hvdkit.models import seed_everything, sync_batch_norm
from hvdkit.session import Session

# A loss function takes the model and one micro-batch (already on the device) and returns the
# loss, or the loss and a dict of named metrics, each a mean over the micro-batch's samples.
LossFn = Callable[[nn.Module, Any], Any]
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


def classification_loss(model: nn.Module, batch) -> tuple[torch.Tensor, dict]:
    """Cross-entropy and accuracy for ``(input, class index)`` batches; (B, T, C) outputs
    with (B, T) targets are scored per position."""
    inputs, labels = batch
    if labels.is_floating_point():
        raise ConfigError("loss_fn: the default loss is cross-entropy over integer class labels, and the labels are "
                          f"{labels.dtype}; pass loss_fn= (e.g. mean squared error for regression)")
    output = model(inputs)
    logits, targets = output.flatten(0, -2), labels.flatten()
    loss = F.cross_entropy(logits.float(), targets)
    return loss, {"accuracy": (logits.argmax(-1) == targets).float().mean()}


def language_model_loss(model: nn.Module, batch) -> tuple[torch.Tensor, dict]:
    """Next-token cross-entropy per token (nats), and the same in bits per byte."""
    tokens, targets = batch
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    return loss, {"bits_per_byte": loss.detach() / math.log(2)}


def loss_and_metrics(loss_fn: LossFn, model: nn.Module, batch) -> tuple[torch.Tensor, dict]:
    result = loss_fn(model, batch)
    return result if isinstance(result, tuple) else (result, {})


def make_optimizer(cfg: TrainConfig) -> OptimizerFactory:
    """The optimizer that ``cfg.optimizer`` names, at base_lr (the schedule scales it)."""
    def factory(parameters):
        if cfg.optimizer == "sgd":
            return torch.optim.SGD(parameters, lr=cfg.base_lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        optimizer = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
        return optimizer(parameters, lr=cfg.base_lr, weight_decay=cfg.weight_decay)
    return factory


def lr_factor(cfg: TrainConfig, epoch: float, final_epoch: float, multiplier: float) -> float:
    """The learning rate at (fractional) ``epoch``, as a multiple of base_lr: a linear warmup to
    the peak (base_lr x multiplier) from base_lr (Goyal et al.), or from 0 when the peak is
    base_lr itself; then step or cosine decay."""
    if epoch < cfg.warmup_epochs:
        start = 1.0 if multiplier > 1 else 0.0
        return start + (multiplier - start) * epoch / cfg.warmup_epochs
    if cfg.lr_schedule == "step":
        return multiplier * cfg.lr_decay_factor ** sum(epoch >= e for e in cfg.lr_decay_epochs)
    if cfg.lr_schedule == "cosine":
        progress = (epoch - cfg.warmup_epochs) / max(1e-9, final_epoch - cfg.warmup_epochs)
        return multiplier * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return multiplier


def train_step(session: Session, model: nn.Module, loss_fn: LossFn, batch) -> None:
    """One optimizer step over a batch of K micro-batches, logging each one's metrics (with ``pp``, the
    last stage's: ``pipeline_step``)."""
    session.optimizer.zero_grad()
    if session.cfg.pp > 1:
        pipeline_step(session, loss_fn, batch)
        return
    for micro in session.micro_batches(batch):
        with session.autocast():
            loss, metrics = loss_and_metrics(loss_fn, model, micro)
        session.backward(loss)
        session.log(batch_len(micro), loss=loss, **metrics)
    session.step()


def pipeline_step(session: Session, loss_fn: LossFn, batch) -> None:
    """``train_step`` through a pipeline (hvdkit.rank.step.pipelined): ``batch`` (inputs, targets) run
    by the schedule; on the last stage ``loss_fn`` is given the stage's output as the model's (a
    callable returning it) and the micro-batch, and each micro-batch's metrics are logged there."""
    logged = []

    def last_stage_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss, metrics = loss_and_metrics(loss_fn, lambda _: output, (None, targets))
        logged.append((batch_len(targets), loss, metrics))
        return loss

    session.pipeline.step(batch, last_stage_loss)
    for samples, loss, metrics in logged:
        session.log(samples, loss=loss, **metrics)
    session.step()


OOM_HINT = ("out of memory: lower --batch-size (it is per rank), use --amp, or a smaller --image-size; "
            "see docs/troubleshooting.md")
NCCL_HINT = ("NCCL error: rerun with NCCL_DEBUG=INFO to see which link failed; on hosts with several "
             "network interfaces set NCCL_SOCKET_IFNAME (e.g. ib0 or eth0); see docs/troubleshooting.md")
PEER_HINT = "stopped because another rank ended first; that rank's own line says why"


def failure_hint(exc: BaseException) -> Optional[str]:
    """The troubleshooting line for failures with a known fix, else None."""
    text = str(exc)
    if isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in text or "out of memory" in text:
        return f"{OOM_HINT} ({text.splitlines()[0] if text else type(exc).__name__})"
    if "NCCL" in text or "nccl" in text:
        return f"{NCCL_HINT} ({text.splitlines()[0]})"
    if "Horovod has been shut down" in text:  # a rank failed or exited: the others learn it here
        return PEER_HINT
    return None


class Trainer:
    """Data-parallel training of ``model`` on ``train_set``, evaluated on ``test_set``.

    Without a model and datasets, they are built from the config's names. Datasets (or
    DataLoaders) may yield any nesting of tuples, lists and dicts of tensors. ``loss_fn(model,
    batch)`` returns the loss, or the loss and a dict of metrics (means over the batch); the
    default is cross-entropy with accuracy over ``(input, class)`` batches. ``optimizer`` makes
    an optimizer from parameters (default: the config's ``optimizer`` at ``base_lr``); the
    config's schedule and lr_scaling multiply each parameter group's initial rate.
    """

    def __init__(self, config: Optional[TrainConfig] = None, model: Optional[nn.Module] = None,
                 train_set: Optional[Dataset | DataLoader] = None,
                 test_set: Optional[Dataset | DataLoader] = None, *,
                 optimizer: Optional[OptimizerFactory] = None, loss_fn: Optional[LossFn] = None) -> None:
        self.cfg = cfg = validate(config or TrainConfig())
        if (train_set is None) != (test_set is None):
            raise ConfigError("Trainer: give both train_set and test_set, or neither")
        self.tokens_per_sample = 0
        # The summary names what is trained: the config's names, or your own classes.
        self.names = {"model": type(model).__name__,
                      "dataset": type(getattr(train_set, "dataset", train_set)).__name__}  # a DataLoader's
        if train_set is None:
            built = data.build(cfg)
            train_set, test_set = built.train, built.test
            self.tokens_per_sample = built.tokens_per_sample
            self.names["dataset"] = cfg.dataset
            if model is None:
                seed_everything(cfg.seed)  # the same initial weights in every run with this seed
                model = (models.build_language_model(cfg.model, built.num_classes, cfg.seq_len)
                         if built.tokens_per_sample else
                         models.build(cfg.model, built.in_channels, built.image_size, built.num_classes))
                self.names["model"] = cfg.model
            if loss_fn is None:
                loss_fn = language_model_loss if built.tokens_per_sample else classification_loss
        if model is None:
            raise ConfigError("Trainer: a model is required with your own datasets")
        self.model, self.train_set, self.test_set = model, train_set, test_set
        self.loss_fn = loss_fn or classification_loss
        self.make_optimizer = optimizer or make_optimizer(cfg)
        if cfg.checkpoint_dir and not cfg.resume and checkpoint.existing(cfg.checkpoint_dir):
            raise ConfigError(f"checkpoint_dir {cfg.checkpoint_dir} holds checkpoints of an earlier run, "
                              f"which this run would delete; resume it (drop --no-resume) or use another directory")

    def _prepare(self, session: Session) -> nn.Module:
        """The model as the config asks: synchronized batch norm, split for tensor parallelism, compiled."""
        model = sync_batch_norm(self.model) if self.cfg.sync_batch_norm else self.model
        model = session.parallelize(model)
        return torch.compile(model) if self.cfg.compile else model

    def fit(self) -> dict:
        """Train, evaluate after each epoch, return the summary. Elastic runs (``elastic``) take the
        same loop, which Session.run() runs again from the last commit after a change of hosts."""
        cfg = self.cfg
        session = self.session = Session(cfg)
        loader = session.loader(self.train_set)
        test_loader = session.eval_loader(self.test_set)
        model = self._prepare(session)
        optimizer = self.make_optimizer(model.parameters())
        per_epoch = session.steps_per_epoch()
        total_steps = min(cfg.epochs * per_epoch, cfg.max_steps or math.inf)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, session.lr_lambda(
            lambda epoch, multiplier: lr_factor(cfg, epoch, total_steps / per_epoch, multiplier)))
        model, optimizer = session.setup(model, optimizer, scheduler)
        self._continue_schedule(scheduler, per_epoch, total_steps)
        result = {"train": {"loss": math.nan}, "test": {}}

        def epochs() -> None:
            for epoch in session.epochs(cfg.epochs, max_steps=cfg.max_steps or None):
                model.train()
                for batch in loader:
                    lr = optimizer.param_groups[0]["lr"]
                    train_step(session, model, self.loss_fn, batch)
                    if session.report_due():
                        result["train"] = session.report("train", epoch=epoch + 1, lr=lr, world_size=session.size)
                    if session.should_stop() or session.global_step >= (cfg.max_steps or math.inf):
                        break
                if session.stopped:
                    break
                result["test"] = self.evaluate(test_loader)

        session.run(epochs)
        if not result["test"] and not session.stopped:  # resumed at its end; a stopped job has no time to spare
            result["test"] = self.evaluate(test_loader)
        elastic = {"elastic": True, "world_size_changes": session.world_size_changes()} if cfg.elastic else {}
        return session.finish({**elastic, **self.summary(result["train"], result["test"])})

    def fit_elastic(self) -> dict:
        """fit(), which trains elastic runs too; kept for callers of earlier versions."""
        return self.fit()

    def _continue_schedule(self, scheduler, per_epoch: int, total_steps: int) -> None:
        """After a resume the learning rate at each step is this run's schedule at that step.

        That matters when the run trains longer (or shorter) than the checkpointed one meant to:
        a cosine decay stretches to the new end from here on, and the line printed says so; step
        and constant schedules do not depend on the end and are unchanged."""
        saved, cfg, session = self.session.resumed_config, self.cfg, self.session
        if saved is None:
            return
        for group, base_lr, factor in zip(session.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas,
                                          strict=True):
            group["lr"] = base_lr * factor(session.global_step)
        old_total = min(saved["epochs"] * per_epoch, saved["max_steps"] or math.inf)
        if old_total == total_steps or session.global_step >= total_steps:
            return
        step = session.global_step
        if cfg.lr_schedule == "cosine":
            old_lr, new_lr = (lr_factor(cfg, step / per_epoch, end / per_epoch, session.lr_multiplier()) * cfg.base_lr
                              for end in (old_total, total_steps))
            change = f"the cosine decay now ends at step {total_steps}: lr at step {step} {old_lr:.4g} -> {new_lr:.4g}"
        else:
            change = f"the {cfg.lr_schedule} schedule does not depend on the end and is unchanged"
        session.print(f"hvdkit: resumed run trains to step {total_steps} instead of {old_total}; {change}",
                      file=sys.stderr)

    def evaluate(self, test_loader) -> dict:
        """The loss and metrics over the whole test set, each sample counted once."""
        session = self.session

        def metrics_of(batch):
            if session.cfg.pp > 1:  # the last stage's output, as the model's: the other stages log nothing
                inputs, targets = batch
                output = session.pipeline.forward(inputs)
                if output is None:
                    return 0, {}
                loss, metrics = loss_and_metrics(self.loss_fn, lambda _: output, (None, targets))
            else:
                loss, metrics = loss_and_metrics(self.loss_fn, session.model, batch)
            return batch_len(batch), {"loss": loss, **metrics}

        return session.evaluate(test_loader, metrics_of)

    def summary(self, train: dict, test: dict) -> dict:
        samples_per_sec = self.session.throughput()
        rates = {"samples_per_sec": samples_per_sec}
        if isinstance(self.train_set, data.Readable):  # every rank's count of unreadable samples skipped
            counts = torch.tensor([float(self.train_set.skipped.value + self.test_set.skipped.value)])
            rates["skipped_samples"] = int(self.session.hvd.allreduce(counts, op=self.session.hvd.Sum,
                                                                      name="hvdkit.skipped").item())
        if self.tokens_per_sample:
            rates["tokens_per_sec"] = samples_per_sec * self.tokens_per_sample
        return {**self.names, **{f"train_{k}": v for k, v in train.items()},
                **{f"test_{k}": v for k, v in test.items()}, **rates}
