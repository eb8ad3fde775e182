"""The own-loop API: the distributed parts of a training loop on Horovod, for your own loop.

A Horovod script keeps its loop and hands hvdkit the parts that are easy to get wrong::

    session = hvdkit.Session(batch_size=32, checkpoint_dir="ckpt")   # hvd.init(), device, seeds
    model, optimizer = session.setup(model, torch.optim.AdamW(model.parameters()))
    loader = session.loader(train_set)                  # sharded; a resume continues mid-epoch
    for epoch in session.epochs(10):                    # join, checkpoint at each epoch's end
        for batch in loader:
            optimizer.zero_grad()
            for x, y in session.micro_batches(batch):   # K micro-batches per allreduce
                with session.autocast():
                    loss = F.cross_entropy(model(x), y)
                session.backward(loss)
                session.log(len(y), loss=loss)
            session.step()                              # allreduce, unscale, clip, step
            if session.report_due():
                session.report("train")                 # every rank's sums in one allreduce
            if session.should_stop():                   # SIGUSR1: all ranks stop at one step
                break
    session.finish()

``Trainer`` is a loop over this class; ``Session(**keys)`` and ``hvdkit train --key`` read the same ``TrainConfig``
keys, checked alike (docs/own-loop.md; a pipeline's loop: hvdkit.rank.step.pipelined). ``Session`` is a facade, as
Lightning Fabric's is: it holds the run's state (hvdkit.rank.state) and delegates to the parts hvdkit.rank lists.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
from horovod.common.exceptions import HorovodInternalError
from torch import nn
from torch.utils.data import DataLoader

from hvdkit import job
from hvdkit.checkpoint import CheckpointError
from hvdkit.config import ConfigError, TrainConfig
from hvdkit.rank.agree import lockstep
from hvdkit.rank.agree.consistency import Consistency, DivergenceError
from hvdkit.rank.agree.lockstep import Lockstep, LockstepError, RankEnded, where
from hvdkit.rank.agree.stragglers import StepTimes
from hvdkit.rank.ending import stops
from hvdkit.rank.finish import Ending
from hvdkit.rank.liveness import orphan
from hvdkit.rank.liveness.lifeline import Lifeline
from hvdkit.rank.liveness.watchdog import Watchdog
from hvdkit.rank.memory import PhasePeaks
from hvdkit.rank.reports.loggers import LoggerError, take_loggers
from hvdkit.rank.reports.metrics import Metrics
from hvdkit.rank.reports.report import Reports
from hvdkit.rank.resume.checkpoints import RunCheckpoints
from hvdkit.rank.resume.elastic import Elastic
from hvdkit.rank.resume.host_snapshots import HostSnapshots
from hvdkit.rank.resume.reading import CheckpointReader
from hvdkit.rank.start import startup
from hvdkit.rank.start.loaders import Loaders
from hvdkit.rank.start.parallelize import split_model
from hvdkit.rank.state import RunState, state_field
from hvdkit.rank.step import training
from hvdkit.rank.step.buckets import distributed_optimizer
from hvdkit.rank.step.pipelined import PipelinePasses

# hvdkit's own errors: each ends every rank with one line instead of a traceback per rank.
OWN_ERRORS = (ConfigError, CheckpointError, training.NonFiniteError, DivergenceError, LockstepError, RankEnded,
              LoggerError)


class Session:
    """Horovod started for one training process, and the distributed parts of its loop.

    Keyword arguments are ``TrainConfig`` keys (``batch_size``, ``batches_per_allreduce``, ``amp``,
    ``clip_grad_norm``, ``checkpoint_dir``, ``tp``, ...), validated as ``hvdkit train`` validates its flags;
    without a ``config``, ``HVDKIT_<KEY>`` environment variables set the keys your keywords leave out
    (``HVDKIT_CHECKPOINT_DIR=ckpt``). Every method that communicates must be called by every rank at the
    same point of the loop, as with Horovod itself. hvdkit's own errors that your loop does not catch end
    every rank with one line (see hvdkit.rank.ending.stops).

    ``loggers``: where rank 0's reports go besides metrics.jsonl: names (as ``--logger``) and
    Logger objects of your own, such as ``MLflow(tracking_uri=...)`` (hvdkit.rank.reports.loggers).
    """

    def __init__(self, config: Optional[TrainConfig] = None, loggers: Union[str, Sequence, None] = None,
                 **keys) -> None:
        own_loggers = take_loggers(loggers, keys)
        cfg = startup.read_config(config, keys)
        self.hvd, self.device, self.mesh = hvd, device, mesh = startup.start(cfg)  # mesh: the (pp, dp, tp) groups
        snapshots = HostSnapshots.of_run(cfg, hvd, mesh)
        ahead = CheckpointReader(cfg, hvd, snapshots, mesh).read_ahead()  # resumed at another dp size: its K
        self.cfg = cfg = ahead.cfg
        self.watchdog = Watchdog(0 if cfg.elastic else cfg.stall_timeout, self.rank)
        self.amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16  # fp16 needs loss scaling, bf16 not
        self._state = state = RunState(
            scaler=torch.amp.GradScaler("cuda") if cfg.amp and device.type == "cuda" else None,
            peaks=PhasePeaks(device), log_dir=cfg.log_dir or startup.run_dir(cfg, hvd))
        self._signal = stops.StopSignal(rank=self.rank, watchdog=self.watchdog)
        self._unread_step = False  # a step's agreement that should_stop() has not read yet
        self._input_format = torch.preserve_format  # channels_last for a convolutional model on a GPU, from setup()
        self._lockstep = meetings = Lockstep(hvd, strict=not cfg.elastic, gone=self.watchdog.gone)
        self._times = times = StepTimes(self.rank, self.size, cfg.straggler_threshold)
        self._reports = reports = Reports(cfg, hvd, device, state, times, own_loggers, mesh)
        self._consistency = consistency = Consistency(cfg, hvd, device, state, mesh)
        self._loaders = loaders = Loaders(cfg, hvd, device, state, mesh)
        self._checkpoints = checkpoints = RunCheckpoints(cfg, hvd, state, loaders, consistency, self.watchdog,
                                                         snapshots, ahead.state, mesh)
        # Own errors: Horovod's shutdown met outside hvdkit's calls (your own loss.backward()) too.
        self._ending = Ending(cfg, hvd, state, meetings, self._signal, checkpoints, reports, self.watchdog,
                              Lifeline.from_environ(os.environ, self.rank),  # horovodrun --gloo's
                              OWN_ERRORS + (() if cfg.elastic else (HorovodInternalError,)),
                              (ConfigError, LockstepError))
        self._start()
        self._step = step = training.TrainingStep(cfg, hvd, device, state, times, checkpoints.checkpoint_left, mesh)
        self._elastic = Elastic(cfg, hvd, state, loaders, checkpoints, reports, times, meetings, step.settle)
        self.pipeline = PipelinePasses(cfg, mesh, device, state, self._start_step, self.watchdog.beat)  # pp's passes

    def _start(self) -> None:
        """The parts start (the order: hvdkit.rank). Elastic: the stop handlers on the driver's host
        only; elsewhere a signal ends that worker alone, as Horovod has it, and the job goes on."""
        self.watchdog.start()
        if not self.cfg.elastic or orphan.started_by_horovodrun_here():
            self._signal.install()
        self._ending.start()
        if self._signal.installed:
            orphan.watch(self._signal, Path(self.log_dir) / "ranks" / f"rank-{self.rank}-after-launcher.log")

    # -- who and where -------------------------------------------------------------------
    rank = property(lambda self: self.hvd.rank())
    size = property(lambda self: self.hvd.size())
    local_rank = property(lambda self: self.hvd.local_rank())
    is_main = property(lambda self: self.rank == 0)
    skipped_steps = property(lambda self: self._step.skipped, doc="Steps skipped as non-finite (on_nonfinite: skip)")
    step_times = property(lambda self: self._times,
                          doc="Each rank's compute and wait per step (hvdkit.rank.agree.stragglers)")

    # -- where the run is (hvdkit.rank.state), shared with the parts below -------------------
    global_step = state_field("global_step", "optimizer steps taken")
    epoch = state_field("epoch", "epochs finished")
    total_steps = state_field("total_steps", "for the progress bar; set it if you know it, epochs() does")
    stopped = state_field("stopped", "the ranks agreed on a stop and its checkpoint is written")
    exit_code = state_field("exit_code", "non-zero after a stop that was not requeued")
    log_dir = state_field("log_dir", "metrics, heartbeats and the run's lock")
    model = state_field("model", "the model setup() placed on this rank's device")
    optimizer = state_field("optimizer", "Horovod's DistributedOptimizer (or the sharded one) setup() made")
    scheduler = state_field("scheduler", "stepped once per optimizer step by step()")
    scaler = state_field("scaler", "fp16's GradScaler (amp on a GPU)")
    extra = state_field("extra", "your own picklable state, saved in checkpoints and restored on resume")
    resumed_config = state_field("resumed_config", "the config keys of the checkpoint resumed from")

    def print(self, *args, **kwargs) -> None:
        """print() on rank 0 only."""
        if self.rank == 0:
            print(*args, **kwargs, flush=True)

    # -- model, optimizer, resume (hvdkit.rank.resume.checkpoints) ------------------------------------------
    def parallelize(self, model: nn.Module, plan: Optional[dict] = None) -> nn.Module:
        """Every rank's whole ``model``, with ``pp`` cut into this rank's stage, with ``tp`` split across its
        group by ``plan`` (by default the GPT's), before the optimizer is made (hvdkit.rank.start.parallelize)."""
        return split_model(self.cfg, self.hvd, self.device, self.mesh, self._state, model, plan)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler=None):
        """(model, optimizer): the model on this rank's device, the optimizer wrapped in Horovod's
        DistributedOptimizer (over the data-parallel set; with ``zero``, hvdkit.zero's ShardedOptimizer), and every
        rank holding the same state: the newest valid checkpoint in ``checkpoint_dir``, else rank 0's initial
        weights (hvdkit.rank.resume.checkpoints). A ``scheduler`` is stepped once per optimizer step by ``step()``."""
        cfg, hvd = self.cfg, self.hvd
        self.watchdog.beat("setup()")  # the stall limit counts from here: loading data before it is not a stall
        model = training.on_device(model, self.device)
        self.model, self.scheduler, self._state.inner = model, scheduler, optimizer
        self._input_format = training.input_format(cfg, model, self.device)
        self.optimizer = distributed_optimizer(cfg, hvd, optimizer, model, self.device, self.mesh)
        with self._state.peaks.phase("setup and resume"):
            self._checkpoints.resume_or_broadcast(model)
        self._signal.step = self.global_step
        # After the resume, whose param groups replace these.
        training.use_fused_kernels(self.optimizer.inner if cfg.zero else self.optimizer,
                          convert=cfg.fused_optimizer and self.device.type == "cuda")
        self._reports.start()  # after the resume: the trackers continue the runs its checkpoint names
        # Heartbeats for naming a stalled rank, once the run is accepted: a refused resume leaves the log directory.
        job_dir = os.environ.get(job.JOB_DIR)
        self.watchdog.share(job_dir or str(Path(self.log_dir) / "ranks"), own=not job_dir, stacks=self.log_dir,
                            facts=self._checkpoints.resume_location())
        self._reports.restart_window()
        return model, self.optimizer

    def lr_multiplier(self) -> float:
        """Peak learning rate / base_lr for this world size, by ``lr_scaling``."""
        on_nccl = self.device.type == "cuda" and self.hvd.nccl_built()
        return training.lr_multiplier(self.cfg, self.mesh.data_parallel(self.hvd)[1], self.hvd.local_size(), on_nccl)

    def save(self, background: bool = False) -> None:
        """Write a checkpoint of this step to ``checkpoint_dir`` (all ranks call it; rank 0 writes):
        written when this returns, or with ``background`` (as the epochs' and periodic checkpoints
        are) once the state is copied, a thread writing it (``async_checkpoint``; finished before the
        next checkpoint and in finish())."""
        self._meet(lockstep.SAVE)
        self._step.settle()
        self._checkpoints.save(wait=not background)

    def run(self, loop: Callable[[], Any]) -> Any:
        """``loop()``, your epochs, once; in an elastic run inside Horovod's ``hvd.elastic.run``, which
        after a change of hosts restores the last commit on every rank and calls it again from
        there (hvdkit.rank.resume.elastic). Make the training loader with ``loader()`` first."""
        return self._elastic.run(loop) if self.cfg.elastic else loop()

    def save_elastic(self, sampler) -> None:
        """Elastic, your own ``hvd.elastic.run``: rank 0 writes the state just committed."""
        self._step.settle()
        self._checkpoints.save_elastic(sampler)

    def load_elastic(self, sampler) -> bool:
        """Elastic, your own ``hvd.elastic.run``: load the checkpoint read in setup() (no collective);
        False if none. The sampler's position goes into a stop's checkpoint."""
        return self._checkpoints.load_elastic(sampler)

    # -- data (hvdkit.rank.start.loaders) -------------------------------------------------------------
    def loader(self, data_or_loader, batch_size: Optional[int] = None, shuffle: bool = True,
               **loader_args) -> DataLoader:
        """A training DataLoader over this rank's shard, whose batches hold K micro-batches.
        Give a Dataset, or a DataLoader whose dataset, collate_fn and drop_last are kept."""
        return self._loaders.train(data_or_loader, batch_size, shuffle, loader_args)

    def elastic_loader(self, dataset, batch_size: Optional[int] = None, **loader_args) -> DataLoader:
        """Elastic, your own ``hvd.elastic.run``: a loader over Horovod's ElasticSampler (``loader.sampler``),
        for ``load_elastic`` and Horovod's ``TorchState``. ``loader()`` makes it for ``run()``."""
        return self._loaders.elastic(dataset, batch_size, loader_args)

    def eval_loader(self, data_or_loader, batch_size: Optional[int] = None, **loader_args) -> DataLoader:
        """This replica's share of an evaluation set (a Dataset, or a DataLoader whose dataset and collate_fn
        are kept), every sample on exactly one; with pp and no batch size given, a step's samples a batch."""
        return self._loaders.evaluation(data_or_loader, batch_size, loader_args)

    def steps_per_epoch(self) -> int:
        """Optimizer steps in a whole epoch of the first loader() (elastic: at this world size)."""
        return self._loaders.steps_per_epoch()

    def lr_lambda(self, factor: Callable[[float, float], float]) -> Callable[[int], float]:
        """For LambdaLR, after loader(): ``factor(epochs done, lr_multiplier())`` at each step, the epochs
        fractional (elastic: the epoch's samples processed), the multiplier at the world size of the moment."""
        on_nccl = self.device.type == "cuda" and self.hvd.nccl_built()
        return training.lr_lambda(self.cfg, self.hvd, self.mesh, on_nccl, self._loaders.progress(), factor)

    def epochs(self, count: int, max_steps: Optional[int] = None) -> Iterator[int]:
        """Epoch numbers from where a resume left off to ``count``; after each: join, then
        checkpoint (after what the loop body does past its batches, evaluation say). A resumed
        epoch continues at the sample where its checkpoint was taken, in the same order. Ends
        early when ``should_stop()`` agreed to stop, or at ``max_steps``."""
        if self.cfg.elastic:  # the epoch ends when its samples are processed, by whichever ranks there were
            return self._elastic.epochs(count, max_steps)
        return self._loaders.epochs(count, max_steps, self._epoch_ended, functools.partial(self.save, background=True))

    def join(self) -> None:
        """Wait for every rank to finish its batches. Every rank must have taken the same number of
        steps: ranks that did not end the job with one line saying so (hvdkit.rank.agree.lockstep)."""
        if self._epoch_ended():
            self._end_stopped()

    def _epoch_ended(self) -> bool:
        """Every rank at the end of its batches after the same steps; True where that took a stop
        the loop did not ask should_stop() about (its checkpoint is written)."""
        self.watchdog.beat(f"the end of epoch {self.epoch + 1} after step {self.global_step}")
        self._meet(lockstep.EPOCH_END)
        return self._ending.take_stop(self._step)

    # -- the step (hvdkit.rank.step.training) ------------------------------------------------------------
    def micro_batches(self, batch: Any) -> list:
        """``batch`` on this device, split into the micro-batches of one optimizer step."""
        return self._step.micro_batches(batch, self._loaders.micro_size, self._input_format)

    def autocast(self):
        """Mixed precision when ``amp``: fp16 on GPUs, bf16 on CPUs."""
        return torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.cfg.amp)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss, averaged over the step's micro-batches and scaled for fp16.
        The last micro-batch's starts the allreduce, the step's meeting (hvdkit.rank.agree.lockstep) with it."""
        with self._lockstep.waiting(lockstep.STEP, self.global_step, self.rank):  # the gradients' allreduces start here
            self._start_step(in_backward=True)
            with self._state.peaks.step_phase("backward", self.global_step):
                self._step.backward(loss)

    def step(self) -> None:
        """The optimizer step (see hvdkit.rank.step.training), once every rank is at this step (and has agreed on a
        stop: see should_stop); then a checkpoint every ``checkpoint_steps``. Each duty's cost: docs/performance.md."""
        self.watchdog.beat(f"training step {self.global_step + 1}")
        self._checkpoints.check()  # a background save that failed ends the run at the next step
        self._checkpoints.before_update()  # its copy of the weights, made during this forward and backward
        self._ending.record_saves()
        self._start_step()
        with self._lockstep.waiting(lockstep.STEP, self.global_step, self.rank), \
                self._state.peaks.step_phase("optimizer step", self.global_step, first="first optimizer step"):
            self._times.waiting()  # for a rank late to the step, the others wait here (hvdkit.rank.agree.stragglers)
            self._lockstep.collect()
            self._times.waited()
            self._elastic.before_update()  # before the update, whose scheduler reads its sampler (elastic run() only)
            self._step.apply()
        self.global_step += 1
        self._unread_step = True
        self._signal.step = self.global_step  # the steps done: a second Ctrl-C's
        self.watchdog.step_done(self.global_step)  # and the guard's
        self._elastic.stepped(stopping=bool(self._lockstep.signum))
        consistency, checkpoint = self._consistency.due(), self._checkpoints.due()
        if consistency or checkpoint:  # the flags read here, not in every step; both assert it
            self._step.settle()
        if consistency:
            self._consistency.check()
        self._checkpoints.after_step(checkpoint)  # or the snapshot due
        self._times.step_ended()

    def _start_step(self, in_backward: bool = False) -> None:
        """A step begins: a stop agreed at the last one that the loop did not ask should_stop() about ends the
        run here (its checkpoint written); else its meeting starts (Lockstep.start_step; step() sends it if held)."""
        if self._lockstep.pending is None and self._lockstep.held is None:
            self._end_stopped()
            self._lockstep.start_step(self.global_step, lambda: self._signal.received, in_backward and self.optimizer)
        elif not in_backward:
            self._lockstep.send_held()

    def check_consistency(self) -> None:
        """Check now that the ranks' copies of the model agree (all ranks call it at the same point; what is
        compared: hvdkit.rank.agree.consistency); a difference raises DivergenceError naming the ranks, which
        ends the job with one line and exit 77. It also runs every ``check_consistency_steps`` and before saves."""
        self._meet(lockstep.CHECK_CONSISTENCY)
        self._step.settle()
        self._consistency.check()

    # -- metrics (hvdkit.rank.reports.report) and stopping (hvdkit.rank.ending.stops) ------------------------------
    def log(self, samples: int, **means) -> None:
        """Add a micro-batch's metrics (each a mean over its ``samples``) to this report's sums."""
        self._reports.log(samples, means)

    def report_due(self) -> bool:
        """True every ``log_interval`` steps and at the end of each epoch."""
        return self._reports.due(self._loaders.epoch_ended())

    def report(self, stage: str = "train", **extra) -> dict:
        """The sample-weighted means of everything log()ged since the last report, over all ranks, in one
        allreduce; rank 0 shows and writes them with ``extra`` (e.g. lr) and the throughput."""
        self._meet(lockstep.REPORT)
        self._step.settle()
        return self._reports.report(stage, extra)

    def evaluate(self, eval_loader: DataLoader, metrics_of: Callable[[Any], tuple[int, dict]]) -> dict:
        """Means over the whole evaluation set, and its size: ``metrics_of(batch)`` gives
        (samples, means) for each batch of this rank's share (every rank needs one); training
        metrics logged since the last report are kept for the next one."""
        self._meet(lockstep.EVALUATE)
        return self._reports.evaluate(eval_loader, metrics_of, self.autocast())

    @property
    def metrics(self) -> Metrics:
        """Rank 0's sink (progress, metrics.jsonl, TensorBoard); other ranks' drops everything."""
        return self._reports.metrics()

    def throughput(self) -> float:
        """Training samples per second over all ranks, counted at reports."""
        return self._reports.throughput()

    def should_stop(self) -> bool:
        """True on every rank at the same step once any rank got SIGTERM, SIGHUP, SIGINT or SIGUSR1
        (see hvdkit.rank.ending.stops), with that step's checkpoint written. Call it after step(): it reads
        what the ranks agreed in the step's meeting, at no extra wait. A loop that does not call
        it stops as well, at its next step or epoch's end, and exits with the stop's code."""
        if self.stopped:
            return True
        self._checkpoints.require_elastic_sampler()
        if not self._unread_step:  # no step since the last call: meet now
            self._meet(lockstep.SHOULD_STOP)
        self._unread_step = False
        return self._ending.take_stop(self._step)

    def _meet(self, call: str) -> None:
        """Every rank at ``call`` after the same steps, or one line saying who is where (hvdkit.rank.agree.lockstep)."""
        self.watchdog.beat(where(call, self.global_step))
        self._lockstep.meet_now(call, self.global_step, self._signal.received or 0, self.rank)

    def _end_stopped(self) -> None:
        """A stop the loop did not ask should_stop() about: checkpoint, summary and exit here."""
        if self._ending.take_stop(self._step):
            raise SystemExit(self.finish()["exit_code"])

    def finish(self, summary: Optional[dict] = None) -> dict:
        """End the run: after a stop, say what was saved and requeue the Slurm job (rank 0); write, print (rank 0)
        and return the summary, whose exit_code is non-zero after a stop that was not requeued. The signal handlers
        go last: a requeue makes Slurm SIGTERM every task within milliseconds of scontrol's answer, which must not
        cut the report short."""
        if not self.cfg.elastic:  # elastic workers may be leaving or joining
            self._meet(lockstep.FINISH)  # before the handlers go: its error is said in one line
        return self._ending.finish(self._step, summary)

    def elastic_reset(self, step: int) -> None:
        """Elastic, your own ``hvd.elastic.run``: call it from a reset callback (hvdkit.rank.resume.elastic)."""
        self._elastic.reset(step)

    def world_size_changes(self) -> list:
        """Elastic: each change of world size in metrics.jsonl, with the seconds it lost."""
        return self._reports.world_size_changes()
