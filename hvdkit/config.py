"""The training configuration: one typed dataclass, read from YAML and command-line overrides.

Every key is checked before ``hvd.init()``, so a typo fails in one line on every rank
instead of after the job has taken its nodes. The command-line flags are generated from the
dataclass, so a new key is one new field; names follow Horovod's examples where they exist.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence


class ConfigError(ValueError):
    """A bad configuration value; the message names the key."""


LR_SCHEDULES = ("cosine", "step", "none")
LR_SCALINGS = ("linear", "sqrt", "none")
OPTIMIZERS = ("sgd", "adamw", "adam")
NONFINITE_ACTIONS = ("stop", "skip")
PP_SCHEDULES = ("1f1b", "gpipe")  # hvdkit.parallel.pipeline.schedules


@dataclass
class TrainConfig:
    """Hyper-parameters and paths of one training run. Batch size is per rank, as in Horovod."""

    model: str = field(default="cnn", metadata={"help": "model name (see `hvdkit train --list`)"})
    dataset: str = field(default="digits", metadata={
        "help": "digits (embedded), text (embedded), mnist, cifar10, imagefolder, synthetic"})
    data_dir: Optional[str] = field(default=None, metadata={
        "help": "root of mnist/cifar10/imagefolder data; for text, a .txt file or a folder of them"})
    image_size: int = field(default=32, metadata={"help": "side of imagefolder/synthetic images"})
    seq_len: int = field(default=64, metadata={"help": "text: tokens (bytes) per training sequence"})
    batch_size: int = field(default=32, metadata={"help": "samples per rank per backward pass"})
    epochs: int = field(default=12, metadata={"help": "passes over the training set"})
    max_steps: Optional[int] = field(default=None, metadata={"help": "stop after this many optimizer steps"})
    optimizer: str = field(default="sgd", metadata={"help": "sgd, adamw or adam"})
    base_lr: float = field(default=0.025, metadata={"help": "learning rate of one rank; scaled as lr_scaling says"})
    lr_scaling: str = field(default="linear", metadata={
        "help": "peak lr = base_lr x (size x K) for linear, x sqrt(size x K) for sqrt, x 1 for none"})
    momentum: float = field(default=0.9, metadata={"help": "SGD momentum"})
    weight_decay: float = field(default=5e-5, metadata={"help": "weight decay (decoupled for adamw)"})
    warmup_epochs: float = field(default=1.0, metadata={
        "help": "linear warmup to the peak lr, from base_lr (from 0 if the peak is base_lr)"})
    lr_schedule: str = field(default="cosine", metadata={"help": "after warmup: cosine, step or none"})
    lr_decay_epochs: list = field(default_factory=lambda: [30, 60, 80],
                                  metadata={"help": "epochs at which the step schedule decays", "item": int})
    lr_decay_factor: float = field(default=0.1, metadata={"help": "factor of each step decay"})
    batches_per_allreduce: int = field(default=1, metadata={"help": "K: local backward passes per allreduce"})
    fp16_allreduce: bool = field(default=False, metadata={"help": "compress gradients to fp16 for the allreduce"})
    use_adasum: bool = field(default=False, metadata={"help": "Adasum instead of averaging"})
    gradient_predivide_factor: float = field(default=1.0, metadata={"help": "divide gradients before the sum"})
    zero: int = field(default=0, metadata={
        "help": "shard across ranks: 1 the optimizer state, 2 also the gradients, 3 also the weights (ZeRO); 0 off"})
    zero_groups: list = field(default_factory=list, metadata={
        "help": "zero 3: the modules whose weights are gathered together (fnmatch patterns of their names, as "
                "blocks.*); by default each block of the model's ModuleLists and Sequentials", "item": str})
    tp: int = field(default=1, metadata={
        "help": "tensor parallelism: split each layer of the model across this many consecutive ranks (a "
                "data-parallel replica is tp ranks; session.parallelize(model) splits it, docs/model-parallelism.md)"})
    sequence_parallel: bool = field(default=False, metadata={
        "help": "with tp: the norms and dropouts between the split layers run on each rank's part of the sequence "
                "(gathered into the split layers, reduce-scattered out of them): less activation memory, the same "
                "traffic; the built-in GPT's plan, docs/model-parallelism.md"})
    pp: int = field(default=1, metadata={
        "help": "pipeline parallelism: cut the model into this many stages, one after another on as many ranks (a "
                "data-parallel replica is pp x tp ranks; session.parallelize(model) cuts it, "
                "docs/model-parallelism.md)"})
    micro_batches: int = field(default=0, metadata={
        "help": "with pp: the micro-batches of batch_size samples each step's batch runs through the pipeline as "
                "(batches_per_allreduce, as the pipeline counts it); 1f1b needs at least pp"})
    pp_schedule: str = field(default="1f1b", metadata={
        "help": "with pp: the order of the micro-batches' forward and backward passes: 1f1b or gpipe"})
    pp_cuts: list = field(default_factory=list, metadata={
        "help": "with pp: where stages 1 to pp-1 begin (module names, as blocks.3, as torch's split_spec), or "
                "parameters or time (the GPT's blocks balanced by parameter count, or by the measured seconds of "
                "each one's forward and backward); by default equal parts", "item": str})
    amp: bool = field(default=False, metadata={"help": "mixed precision: bf16 on CPU, fp16 + GradScaler on GPU"})
    clip_grad_norm: Optional[float] = field(default=None, metadata={"help": "clip gradients to this total norm"})
    elementwise_optimizer: bool = field(default=False, metadata={
        "help": "your optimizer's class (not one of torch's) updates each element from its own gradient and state "
                "alone, as SGD and Adam do: its gradient buckets may be stepped as they land, and zero may shard it "
                "(torch's own elementwise classes need no saying)"})
    sync_batch_norm: bool = field(default=False, metadata={
        "help": "replace BatchNorm layers with hvd.SyncBatchNorm (statistics over all ranks' batches)"})
    compile: bool = field(default=False, metadata={"help": "torch.compile the model"})
    fused_optimizer: bool = field(default=True, metadata={
        "help": "on GPUs: torch's fused kernel for SGD, Adam and AdamW where the optimizer leaves fused and foreach "
                "unset: one kernel a step, and a non-finite step skipped on the device without a host sync"})
    channels_last: bool = field(default=True, metadata={
        "help": "on GPUs, for a model with 2-D convolutions: its 4-D inputs in channels-last memory format, so "
                "cuDNN convolves in NHWC (the weights stay contiguous, as Horovod's collectives need)"})
    cudnn_benchmark: bool = field(default=True, metadata={
        "help": "on GPUs: cuDNN times its convolution algorithms for each new input shape and keeps the fastest; "
                "off where shapes change every batch"})
    tf32: bool = field(default=False, metadata={
        "help": "on GPUs: TF32 tensor cores for fp32 matmuls and convolutions (changes numerics); off: torch's "
                "defaults"})
    seed: int = field(default=42, metadata={"help": "random seed (each rank adds its rank)"})
    num_workers: int = field(default=0, metadata={"help": "data loader worker processes per rank"})
    log_interval: int = field(default=10, metadata={"help": "optimizer steps between metric reports"})
    eval_batches: int = field(default=0, metadata={
        "help": "evaluate on each data-parallel replica's first N batches of the evaluation set (0: all of it)"})
    logger: str = field(default="tensorboard", metadata={
        "help": "where rank 0's reports go besides metrics.jsonl, comma-separated: tensorboard, csv, mlflow, wandb; "
                "none for metrics.jsonl alone"})
    tracking_uri: Optional[str] = field(default=None, metadata={
        "help": "MLflow's tracking URI (default: $MLFLOW_TRACKING_URI, else a file store ./mlruns)"})
    log_dir: Optional[str] = field(default=None, metadata={
        "help": "metrics.jsonl and the trackers' files: TensorBoard events, csv/, wandb/ (default: a new "
                "runs/<date>-<time> per run)"})
    checkpoint_dir: Optional[str] = field(default=None, metadata={"help": "where rank 0 writes checkpoints"})
    checkpoint_steps: Optional[int] = field(default=None,
                                            metadata={"help": "also checkpoint every N steps (default: per epoch)"})
    keep_checkpoints: int = field(default=3, metadata={"help": "how many of the newest checkpoints to keep"})
    async_checkpoint: bool = field(default=True, metadata={
        "help": "write checkpoints in the background: training waits only while the state is copied to host "
                "memory (which holds a second copy of it from then on); the save before is finished first, "
                "and before the job ends"})
    sharded_checkpoint: bool = field(default=False, metadata={
        "help": "every rank writes a part of each checkpoint in parallel (the weights and the optimizer state, "
                "split by tensor), rank 0 the rest once every part is durable; resume and export read it as one, "
                "and it may resume at another world size (K adapts). Not with elastic"})
    snapshot_steps: int = field(default=0, metadata={
        "help": "every N steps each host also keeps the state in memory (/dev/shm), for hvdkit launch "
                "--max-restarts: a restart resumes from it where it is newer than the newest checkpoint, and it "
                "is gone when the job ends; 0 off. With zero, each rank's shard is also kept on another host. Not with "
                "sharded_checkpoint or elastic"})
    stall_timeout: float = field(default=300.0, metadata={
        "help": "seconds without progress after which the job ends, naming the stalled rank (exit 75); Horovod "
                "names the tensor it waits for before that; 0 off"})
    elastic: bool = field(default=False, metadata={
        "help": "elastic training (horovodrun --min-np/--max-np with a host discovery script)"})
    commit_steps: int = field(default=10, metadata={"help": "elastic: commit the state every N steps"})
    max_requeues: int = field(default=3, metadata={"help": "after a stop signal (SIGUSR1), requeue the Slurm job "
                                                         "at most this many times"})
    resume: bool = field(default=True, metadata={"help": "resume from the newest valid checkpoint in checkpoint_dir"})
    on_nonfinite: str = field(default="stop", metadata={
        "help": "a NaN/inf loss or gradient: stop (one line naming the step, last good checkpoint kept) or skip "
                "the step (as GradScaler does), stopping after 10 in a row"})
    check_consistency_steps: int = field(default=100, metadata={
        "help": "every N steps and before each checkpoint, check that every rank holds the same weights, buffers "
                "and optimizer state (under zero, what every rank holds alike: not the slices); a difference stops "
                "the job naming the ranks (exit 77); 0 off"})
    straggler_threshold: float = field(default=0.15, metadata={
        "help": "name a rank whose compute time per step is this fraction above the median rank's for 3 reports "
                "in a row; 0 off"})
    skip_bad_samples: bool = field(default=False, metadata={
        "help": "skip samples that cannot be read (counted in the summary) instead of stopping at the first"})


# What a resume may change: how long to train, and how the run is logged, checkpointed, watched
# and sharded (any zero stage takes any stage's checkpoint: hvdkit.zero.shards; any tp a tp run's, whose
# checkpoints are whole: hvdkit.rank.resume.checkpoints). Anything else
# would make the resumed run a different run than the one checkpointed (batch size moves the
# data position, base_lr is restored from the checkpoint, ...).
RESUME_MAY_CHANGE = ("epochs", "max_steps", "data_dir", "num_workers", "log_interval", "eval_batches", "log_dir",
                     "logger", "tracking_uri", "checkpoint_dir", "checkpoint_steps", "keep_checkpoints",
                     "async_checkpoint", "sharded_checkpoint", "snapshot_steps", "stall_timeout", "max_requeues",
                     "resume", "compile", "fused_optimizer", "channels_last", "cudnn_benchmark", "tf32",
                     "commit_steps", "on_nonfinite", "elementwise_optimizer", "skip_bad_samples",
                     "check_consistency_steps", "straggler_threshold", "zero", "zero_groups", "tp",
                     "sequence_parallel", "pp", "micro_batches", "pp_schedule", "pp_cuts")


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
_HINTS = typing.get_type_hints(TrainConfig)


def _base_type(name: str):
    """(type, optional) of a field: Optional[int] -> (int, True), list -> (list, False)."""
    hint = _HINTS[name]
    args = typing.get_args(hint)
    if type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return hint, False


def _coerce(name: str, value: Any) -> Any:
    """The value as the field's type; YAML's int is accepted for a float, nothing looser."""
    kind, optional = _base_type(name)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"config: {name} must be set (got null)")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is list:
        item = FIELDS[name].metadata["item"]
        if not isinstance(value, list) or not all(isinstance(v, item) and not isinstance(v, bool) for v in value):
            raise ConfigError(f"config: {name} must be a list of {item.__name__} (got {value!r})")
        return list(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"config: {name} must be {kind.__name__} (got {type(value).__name__} {value!r})")
    return value


def validate(cfg: TrainConfig) -> TrainConfig:
    """Reject impossible values, naming the key. Registries are checked by the caller's lookups."""
    for name, value in dataclasses.asdict(cfg).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"config: {name} must be a finite number (got {value})")
    positive = ("batch_size", "epochs", "base_lr", "batches_per_allreduce", "log_interval",
                "gradient_predivide_factor", "lr_decay_factor", "image_size", "keep_checkpoints",
                "commit_steps", "seq_len")
    for name in positive:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"config: {name} must be > 0 (got {getattr(cfg, name)})")
    for name in ("momentum", "weight_decay", "warmup_epochs", "num_workers", "stall_timeout", "max_requeues",
                 "check_consistency_steps", "straggler_threshold", "snapshot_steps", "eval_batches"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"config: {name} must be >= 0 (got {getattr(cfg, name)})")
    for name in ("max_steps", "checkpoint_steps"):
        if getattr(cfg, name) is not None and getattr(cfg, name) <= 0:
            raise ConfigError(f"config: {name} must be > 0 (got {getattr(cfg, name)})")
    if cfg.clip_grad_norm is not None and cfg.clip_grad_norm <= 0:
        raise ConfigError(f"config: clip_grad_norm must be > 0 (got {cfg.clip_grad_norm})")
    if cfg.lr_schedule not in LR_SCHEDULES:
        raise ConfigError(f"config: lr_schedule must be one of {', '.join(LR_SCHEDULES)} (got {cfg.lr_schedule!r})")
    for name, choices in (("lr_scaling", LR_SCALINGS), ("optimizer", OPTIMIZERS), ("on_nonfinite", NONFINITE_ACTIONS),
                          ("pp_schedule", PP_SCHEDULES)):
        if getattr(cfg, name) not in choices:
            raise ConfigError(f"config: {name} must be one of {', '.join(choices)} (got {getattr(cfg, name)!r})")
    if cfg.zero not in (0, 1, 2, 3):
        raise ConfigError(f"config: zero must be 0, 1, 2 or 3 (got {cfg.zero})")
    if cfg.zero_groups and cfg.zero != 3:
        raise ConfigError("config: zero_groups names the groups of zero 3's sharded weights; set zero 3, or drop it")
    if cfg.zero == 3 and cfg.compile:
        raise ConfigError("config: zero 3 is not yet for compile: its gathers hook each group's forward, "
                          "which torch.compile would trace; drop one")
    if cfg.zero and cfg.use_adasum:
        raise ConfigError("config: zero cannot be used with use_adasum: Adasum combines each rank's update of whole "
                          "parameters, and a sharded optimizer updates slices; use one or the other")
    if cfg.zero and cfg.elastic:
        raise ConfigError("config: zero cannot be used with elastic: the optimizer state is split across the ranks, "
                          "and an elastic job loses ranks without a save; use one or the other")
    if cfg.sharded_checkpoint and cfg.elastic:
        raise ConfigError("config: sharded_checkpoint cannot be used with elastic: an elastic job's rank 0 writes its "
                          "checkpoints alone, while workers may be leaving or joining; use one or the other")
    if cfg.snapshot_steps and (cfg.sharded_checkpoint or cfg.elastic or not cfg.checkpoint_dir):
        raise ConfigError("config: snapshot_steps needs a checkpoint_dir, and is not yet for sharded_checkpoint or "
                          "elastic (a sharded checkpoint's parts, an elastic job's changing ranks)")
    if cfg.tp < 1:
        raise ConfigError(f"config: tp must be >= 1 (got {cfg.tp})")
    beside_tp = [name for name, on in (("zero 3", cfg.zero == 3), ("use_adasum", cfg.use_adasum),
                                       ("elastic", cfg.elastic), ("sharded_checkpoint", cfg.sharded_checkpoint),
                                       ("snapshot_steps with zero", cfg.snapshot_steps and cfg.zero)) if on]
    if cfg.tp > 1 and beside_tp:
        raise ConfigError(f"config: tp is not yet for {', '.join(beside_tp)} (docs/model-parallelism.md says what "
                          f"tensor parallelism runs with); drop one")
    if cfg.sequence_parallel and cfg.tp == 1:
        raise ConfigError("config: sequence_parallel splits the sequence across a tensor-parallel group: give tp > 1 "
                          "too")
    _check_pipeline(cfg)
    if cfg.use_adasum and cfg.gradient_predivide_factor != 1.0:
        raise ConfigError("config: gradient_predivide_factor must be 1.0 with use_adasum (Horovod averages only)")
    for name in ("log_dir", "checkpoint_dir"):
        _check_writable(name, getattr(cfg, name))
    try:
        problem = missing_logger_extra(logger_names(cfg.logger))
    except ValueError as exc:
        problem = str(exc)
    if problem:
        raise ConfigError(f"config: logger {cfg.logger!r}: {problem}")
    return cfg


def _check_pipeline(cfg: TrainConfig) -> None:
    """The pipeline's keys: ``micro_batches`` sets batches_per_allreduce (the step's micro-batches, which
    the pipeline runs by its schedule), and what pipelines do not run with yet is refused."""
    if cfg.pp < 1:
        raise ConfigError(f"config: pp must be >= 1 (got {cfg.pp})")
    if cfg.pp == 1:
        if cfg.micro_batches or cfg.pp_cuts:
            raise ConfigError("config: micro_batches and pp_cuts are the pipeline's: give pp > 1 too (without a "
                              "pipeline, batches_per_allreduce sets the micro-batches of a step)")
        return
    if cfg.micro_batches < 0 or (cfg.micro_batches and cfg.batches_per_allreduce not in (1, cfg.micro_batches)):
        raise ConfigError(f"config: micro_batches {cfg.micro_batches} and batches_per_allreduce "
                          f"{cfg.batches_per_allreduce} both say how many micro-batches a step has; give one")
    if cfg.micro_batches:
        cfg.batches_per_allreduce = cfg.micro_batches
    if cfg.pp_schedule == "1f1b" and cfg.batches_per_allreduce < cfg.pp:
        raise ConfigError(f"config: 1f1b over {cfg.pp} stages needs at least {cfg.pp} micro-batches a step (it has "
                          f"{cfg.batches_per_allreduce}); give micro_batches {cfg.pp} or more, or pp_schedule gpipe")
    beside = [name for name, on in (("zero 3", cfg.zero == 3), ("use_adasum", cfg.use_adasum),
                                    ("elastic", cfg.elastic), ("sharded_checkpoint", cfg.sharded_checkpoint),
                                    ("snapshot_steps", cfg.snapshot_steps), ("amp", cfg.amp),
                                    ("sequence_parallel", cfg.sequence_parallel), ("compile", cfg.compile),
                                    ("sync_batch_norm", cfg.sync_batch_norm)) if on]
    if beside:
        raise ConfigError(f"config: pp is not yet for {', '.join(beside)} (docs/model-parallelism.md says what "
                          f"pipelines run with); drop one")


LOGGERS = ("tensorboard", "csv", "mlflow", "wandb")  # what --logger takes (hvdkit.rank.reports.loggers makes them)
LOGGER_EXTRAS = {"mlflow": "mlflow", "wandb": "wandb"}  # logger: the module its extra installs


def logger_names(text: Optional[str]) -> list[str]:
    """The logger names of ``--logger`` ("mlflow,csv"; "none" or "" for metrics.jsonl alone),
    or ValueError naming the unknown one."""
    chosen = [name.strip().lower() for name in (text or "").split(",") if name.strip()]
    if chosen == ["none"]:
        return []
    for name in chosen:
        if name not in LOGGERS:
            raise ValueError(f"unknown logger {name!r}: choose from {', '.join(LOGGERS)}, or none")
    return list(dict.fromkeys(chosen))


def missing_logger_extra(chosen: Sequence[str]) -> Optional[str]:
    """The problem with the first chosen logger whose package is not installed, else None."""
    for name in chosen:
        module = LOGGER_EXTRAS.get(name)
        if module and importlib.util.find_spec(module) is None:
            return f"the {name} logger needs the {module} package: pip install 'hvdkit[{name}]'"
    return None


def _check_writable(name: str, path: Optional[str]) -> None:
    if path is None:
        return
    target = Path(path)
    existing = next((p for p in (target, *target.parents) if p.exists()), Path("."))
    if not existing.is_dir():
        raise ConfigError(f"config: {name} {path!r} is not a directory ({existing} is a file)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"config: {name} {path!r} is not writable ({existing})")


def from_mapping(values: Mapping[str, Any], base: Optional[TrainConfig] = None) -> TrainConfig:
    """A config from ``base`` (defaults if None) with ``values`` applied; unknown keys rejected."""
    updates = {}
    for key, value in values.items():
        name = str(key).replace("-", "_")
        if name not in FIELDS:
            raise ConfigError(f"config: unknown key {key!r}")
        updates[name] = _coerce(name, value)
    return dataclasses.replace(base or TrainConfig(), **updates)


ENV_PREFIX = "HVDKIT_"


def from_environ(environ: Mapping[str, str]) -> dict:
    """Config keys set as HVDKIT_<KEY> variables (``HVDKIT_CHECKPOINT_DIR=ckpt``), each value read
    as YAML, so that a job script can point anyone's script at its directories without adding
    flags to it. Variables of other hvdkit settings (HVDKIT_CACHE_DIR, ...) are not keys."""
    import yaml

    values = {}
    for name in FIELDS:
        variable = ENV_PREFIX + name.upper()
        text = environ.get(variable)
        if text is None:
            continue
        kind, _ = _base_type(name)
        try:
            values[name] = _coerce(name, text if kind is str else yaml.safe_load(text))
        except (ConfigError, yaml.YAMLError) as exc:
            problem = str(exc).removeprefix("config: ") if isinstance(exc, ConfigError) else "not valid YAML"
            raise ConfigError(f"config: {variable}={text!r}: {problem}") from None
    return values


def load_yaml(path: str) -> dict:
    import yaml  # here, so that `hvdkit doctor` still runs where PyYAML is missing

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"config: cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "not valid YAML"
        raise ConfigError(f"config: {path}{where}: malformed YAML: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path} must hold a mapping of keys, not {type(data).__name__}")
    return data


# How `hvdkit train --help` groups the flags; every key is in exactly one group.
GROUPS = {
    "data": ("dataset", "data_dir", "image_size", "seq_len", "batch_size", "num_workers", "skip_bad_samples", "seed"),
    "model": ("model", "sync_batch_norm", "compile"),
    "optimization": ("epochs", "max_steps", "optimizer", "base_lr", "lr_scaling", "momentum", "weight_decay",
                     "warmup_epochs", "lr_schedule", "lr_decay_epochs", "lr_decay_factor", "clip_grad_norm", "amp",
                     "on_nonfinite", "elementwise_optimizer"),
    "distributed": ("batches_per_allreduce", "zero", "zero_groups", "tp", "sequence_parallel", "pp", "micro_batches",
                    "pp_schedule", "pp_cuts", "fp16_allreduce", "use_adasum",
                    "gradient_predivide_factor",
                    "stall_timeout", "elastic", "commit_steps"),
    "checkpoints": ("checkpoint_dir", "checkpoint_steps", "keep_checkpoints", "async_checkpoint",
                    "sharded_checkpoint", "snapshot_steps", "resume", "max_requeues"),
    "logging": ("log_dir", "log_interval", "eval_batches", "logger", "tracking_uri"),
    "checks": ("check_consistency_steps", "straggler_threshold"),
    "speed": ("fused_optimizer", "channels_last", "cudnn_benchmark", "tf32"),
}
ALIASES = {"base_lr": ("--lr",)}  # Horovod's examples say --lr


def _default_text(f: dataclasses.Field) -> str:
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if value is None:
        return ""
    if isinstance(value, bool):
        return " (default: on)" if value else " (default: off)"
    return f" (default: {_show(value)})"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field (``--batch-size``), grouped, each help ending with the default; a flag
    left out keeps the value of the YAML file, of an HVDKIT_<KEY> variable, or the default."""
    parser.add_argument("--config", help="YAML file of config keys; HVDKIT_<KEY> variables override it, "
                                         "flags override both")
    for title, names in GROUPS.items():
        group = parser.add_argument_group(title)
        for name in names:
            f = FIELDS[name]
            kind, _ = _base_type(name)
            flags = ["--" + name.replace("_", "-"), *ALIASES.get(name, ())]
            common = dict(dest=name, default=argparse.SUPPRESS, help=f.metadata["help"] + _default_text(f))
            if kind is bool:
                group.add_argument(*flags, action=argparse.BooleanOptionalAction, **common)
            elif kind is list:
                group.add_argument(*flags, nargs="+", type=f.metadata["item"], **common)
            else:
                group.add_argument(*flags, type=kind, **common)


def from_args(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> TrainConfig:
    """Defaults, then the YAML file, then HVDKIT_<KEY> variables (how job scripts hand over their
    directories), then command-line flags; then validation."""
    overrides = {name: getattr(args, name) for name in FIELDS if hasattr(args, name)}
    cfg = from_mapping(load_yaml(args.config)) if getattr(args, "config", None) else TrainConfig()
    cfg = from_mapping(from_environ(environ), base=cfg)
    return validate(from_mapping(overrides, base=cfg))


def to_dict(cfg: TrainConfig) -> dict:
    return dataclasses.asdict(cfg)


def resume_conflict(saved: Mapping[str, Any], cfg: TrainConfig, adapted: Sequence[str] = ()) -> Optional[str]:
    """Why a run with ``cfg`` cannot resume a checkpoint written with the ``saved`` keys, or None;
    the ``adapted`` keys are the resume's to set (a sharded run at another world size)."""
    if bool(saved.get("elastic")) != cfg.elastic:  # the data position is kept differently
        wrote = "an elastic run (--elastic)" if saved.get("elastic") else "a fixed-size run (without --elastic)"
        return f"was written by {wrote}: resume it the same way, or start afresh in another --checkpoint-dir"
    for name, value in to_dict(cfg).items():
        if name in RESUME_MAY_CHANGE or name in adapted or name not in saved or saved[name] == value:
            continue
        flag = "--" + name.replace("_", "-")
        return (f"was written with {flag} {_show(saved[name])} and this run asks for {_show(value)}; a resume "
                f"continues that run, so only --epochs, --max-steps, --data-dir, --zero, --tp and logging, checkpoint "
                f"and watchdog settings may change: drop {flag}, or start afresh in another --checkpoint-dir")
    return None


def _show(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def parse(argv: Sequence[str]) -> TrainConfig:
    """Parse ``hvdkit train`` arguments into a validated config (for scripts and tests)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return from_args(parser.parse_args(argv))
