"""The Session's parts on their own, each handed what it uses, in one real Horovod process of
world size 1 (hvd.init() in a process of its own, so that the test process never holds MPI).
`python tests/programs/parts_worker.py PART DIR` checks PART and exits 0, or fails with the assertion."""

import os
import signal
import sys
import threading
from pathlib import Path

import horovod.torch as hvd
import torch
from torch import nn
from torch.utils.data import TensorDataset

from hvdkit import checkpoint
from hvdkit.config import ConfigError, TrainConfig, from_mapping, validate
from hvdkit.parallel.mesh import Mesh
from hvdkit.rank.agree.consistency import Consistency
from hvdkit.rank.agree.lockstep import Lockstep
from hvdkit.rank.agree.stragglers import StepTimes
from hvdkit.rank.ending import stops
from hvdkit.rank.finish import Ending
from hvdkit.rank.liveness import link
from hvdkit.rank.liveness.lifeline import Lifeline
from hvdkit.rank.liveness.watchdog import Watchdog
from hvdkit.rank.reports.report import Reports
from hvdkit.rank.resume.checkpoints import RunCheckpoints
from hvdkit.rank.resume.elastic import Elastic
from hvdkit.rank.resume.host_snapshots import HostSnapshots
from hvdkit.rank.resume.reading import Ahead, CheckpointReader
from hvdkit.rank.start.loaders import Loaders
from hvdkit.rank.state import RunState
from hvdkit.rank.step.training import NonFiniteError, TrainingStep

CPU = torch.device("cpu")
MESH = Mesh(1)  # the whole job (one rank) data parallel: hvd's own rank and size


def config(**keys) -> TrainConfig:
    return validate(from_mapping(keys, base=TrainConfig()))


def trained(state: RunState, cfg: TrainConfig) -> None:
    torch.manual_seed(0)
    state.model = nn.Linear(3, 2)
    state.inner = torch.optim.SGD(state.model.parameters(), lr=0.1)
    state.optimizer = hvd.DistributedOptimizer(state.inner, named_parameters=state.model.named_parameters())


def loaders(directory: Path) -> None:
    """epochs() moves the state's epoch on and saves after each; a position from other batch sizes is refused."""
    cfg, state = config(batch_size=2), RunState()
    part = Loaders(cfg, hvd, CPU, state, MESH)
    loader = part.train(TensorDataset(torch.arange(10.0)), None, False, {})
    assert part.steps_per_epoch() == 5 and part.batch_sizes() == [2]
    saved = []
    for epoch in part.epochs(2, None, epoch_ended=lambda: False, save=lambda: saved.append(state.epoch)):
        state.global_step += len(list(loader))
        assert epoch == state.epoch
    assert (state.epoch, state.global_step, saved, state.total_steps) == (2, 10, [1, 2], 10)
    part.resumed_batches = [4]
    try:
        next(part.epochs(3, None, epoch_ended=lambda: False, save=lambda: None))
    except ConfigError as exc:
        assert "loader batches of [4] samples per step and this run's are [2]" in str(exc), exc
    else:
        raise AssertionError("a position from other batch sizes was taken")


def step(directory: Path) -> None:
    """A non-finite step is skipped (weights kept) or stops the run naming what is kept."""
    times = StepTimes(0, 1, 0.0)
    for mode in ("skip", "stop"):
        cfg, state = config(on_nonfinite=mode), RunState()
        trained(state, cfg)
        part = TrainingStep(cfg, hvd, CPU, state, times, checkpoint_left=lambda: "last good checkpoint X kept",
                            mesh=MESH)
        before = [p.detach().clone() for p in state.model.parameters()]
        state.optimizer.zero_grad()
        part.backward(state.model(torch.full((1, 3), float("nan"))).sum())
        try:
            part.apply()
        except NonFiniteError as exc:
            assert mode == "stop" and "step 1 (epoch 1) are not finite" in str(exc) and "X kept" in str(exc), exc
        else:
            assert mode == "skip" and part.skipped == 1
        assert all(torch.equal(a, b) for a, b in zip(before, state.model.parameters(), strict=True))


def checkpoints(directory: Path) -> None:
    """save() checks consistency, writes the state with the loaders' position; restore() takes it back."""
    cfg = config(checkpoint_dir=str(directory / "ckpt"), check_consistency_steps=1, batch_size=2)
    state, watchdog = RunState(log_dir=str(directory)), Watchdog(0, 0)
    trained(state, cfg)
    loader_part, consistency = Loaders(cfg, hvd, CPU, state, MESH), Consistency(cfg, hvd, CPU, state, MESH)
    loader_part.train(TensorDataset(torch.arange(8.0)), None, True, {})
    part = RunCheckpoints(cfg, hvd, state, loader_part, consistency, watchdog, None, None, MESH)
    state.global_step, state.epoch, state.extra["mine"] = 3, 1, 7
    part.save()
    assert consistency.last_good == 3 and checkpoint.existing(cfg.checkpoint_dir)[-1].name.endswith("000000003.pt")
    weights = {k: v.clone() for k, v in state.model.state_dict().items()}
    fresh = RunState(log_dir=str(directory))
    trained(fresh, cfg)
    with torch.no_grad():
        fresh.model.weight.add_(1.0)
    restored = RunCheckpoints(cfg, hvd, fresh, Loaders(cfg, hvd, CPU, fresh, MESH),
                              Consistency(cfg, hvd, CPU, fresh, MESH), watchdog, None, None, MESH).restore()
    assert restored["loader_batches"] == [2] and (fresh.global_step, fresh.epoch, fresh.extra) == (3, 1, {"mine": 7})
    assert all(torch.equal(weights[k], v) for k, v in fresh.model.state_dict().items())


def reading(directory: Path) -> None:
    """read_ahead: a sharded run resumed at another world size goes on with the K that keeps the global
    batch, in a copy of its config; an unsharded run refuses that checkpoint (read ahead, raised by restore)."""
    cfg = config(checkpoint_dir=str(directory / "ckpt"), batch_size=2, batches_per_allreduce=3,
                 sharded_checkpoint=True)
    state = RunState(log_dir=str(directory))
    trained(state, cfg)
    loader_part = Loaders(cfg, hvd, CPU, state, MESH)
    loader_part.train(TensorDataset(torch.arange(12.0)), None, True, {})
    state.global_step = 4
    RunCheckpoints(cfg, hvd, state, loader_part, Consistency(cfg, hvd, CPU, state, MESH), Watchdog(0, 0), None,
                   None, MESH).save()
    written = checkpoint.load(checkpoint.existing(cfg.checkpoint_dir)[-1])
    checkpoint.save(cfg.checkpoint_dir, 8, {**written, "world_size": 2, "rng": written["rng"] * 2}, keep=2)
    ahead = CheckpointReader(cfg, hvd, None, MESH).read_ahead()
    assert ahead.cfg.batches_per_allreduce == 6 and cfg.batches_per_allreduce == 3, "K in a copy of the config"
    assert ahead.state["path"].endswith("ckpt-step000000008.pt") and ahead.state["step"] == 4
    plain = config(checkpoint_dir=cfg.checkpoint_dir, batch_size=2, batches_per_allreduce=3)
    unread = config(checkpoint_dir=cfg.checkpoint_dir, batch_size=2, batches_per_allreduce=3, resume=False)
    assert CheckpointReader(unread, hvd, None, MESH).read_ahead() == Ahead(unread), "not resuming: no read ahead"
    ahead = CheckpointReader(plain, hvd, None, MESH).read_ahead()
    assert ahead.cfg == plain and "was written by 2 ranks, this job has 1" in str(ahead.state["error"]), ahead
    try:
        CheckpointReader(plain, hvd, None, MESH).read()
        raise AssertionError("an unsharded run took a checkpoint of 2 ranks")
    except ConfigError as exc:
        assert "was written by 2 ranks, this job has 1" in str(exc), exc


def reports(directory: Path) -> None:
    """log() sums on the device; report() gives the sample-weighted means and writes rank 0's record."""
    cfg, state = config(log_interval=4), RunState(log_dir=str(directory), total_steps=10)
    part = Reports(cfg, hvd, CPU, state, StepTimes(0, 1, 0.0))
    assert [s for s in range(1, 11) if (setattr(state, "global_step", s) or part.due(epoch_ended=s == 5))] == \
        [4, 5, 8, 10]
    part.log(2, {"loss": torch.tensor(1.0)})
    part.log(6, {"loss": torch.tensor(3.0)})
    assert part.report("train", {"lr": 0.5}) == {"loss": 2.5}
    part.metrics().close()
    (record,) = [line for line in (directory / "metrics.jsonl").read_text().splitlines() if '"train"' in line]
    assert '"lr": 0.5' in record and '"loss": 2.5' in record, record


def held() -> dict:
    """What this process holds that a part could start: threads, stop handlers and the wakeup fd,
    sys.excepthook, the launcher line's hooks, file locks (/proc/locks)."""
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    locks = [line for line in Path("/proc/locks").read_text().splitlines() if f" {os.getpid()} " in line]
    return {"threads": sorted(t.name for t in threading.enumerate()), "excepthook": sys.excepthook,
            "handlers": [signal.getsignal(s) for s in stops.SIGNALS], "wakeup": wakeup,
            "before_end": list(link._before_end), "locks": locks}


def start_nothing(directory: Path) -> None:
    """Each part made leaves the process as it was; its start() changes what it says it starts."""
    cfg = config(checkpoint_dir=str(directory / "ckpt"), log_dir=str(directory / "logs"), stall_timeout=60)
    before = held()
    state, times = RunState(log_dir=cfg.log_dir), StepTimes(0, 1, 0.0)
    watchdog, signals = Watchdog(cfg.stall_timeout, 0), stops.StopSignal(rank=0)
    signals.watchdog = watchdog
    lockstep, reports = Lockstep(hvd), Reports(cfg, hvd, CPU, state, times)
    loaders, consistency = Loaders(cfg, hvd, CPU, state, MESH), Consistency(cfg, hvd, CPU, state, MESH)
    snapshots = HostSnapshots(hvd, str(directory / "snapshots"))
    CheckpointReader(cfg, hvd, snapshots, MESH)
    checkpoints = RunCheckpoints(cfg, hvd, state, loaders, consistency, watchdog, snapshots, None, MESH)
    ending = Ending(cfg, hvd, state, lockstep, signals, checkpoints, reports, watchdog,
                    Lifeline("127.0.0.1", 9, 0), (ConfigError,), (ConfigError,))
    step = TrainingStep(cfg, hvd, CPU, state, times, checkpoints.checkpoint_left, MESH)
    Elastic(cfg, hvd, state, loaders, checkpoints, reports, times, lockstep, step.settle)
    assert held() == before, (before, held())
    watchdog.start()
    assert "hvdkit-watchdog" in held()["threads"]
    signals.install()
    assert held()["handlers"] != before["handlers"] and held()["wakeup"] != before["wakeup"]
    ending.start()
    now = held()
    assert now["excepthook"] is not before["excepthook"] and len(now["before_end"]) == len(before["before_end"]) + 1
    assert "hvdkit-lifeline" in now["threads"] and len(now["locks"]) == len(before["locks"]) + 2, now
    ending.release()
    ending.undo_hook(), ending.undo_before_end(), signals.restore()
    assert {k: v for k, v in held().items() if k != "threads"} == {k: v for k, v in before.items() if k != "threads"}


if __name__ == "__main__":
    hvd.init()
    globals()[sys.argv[1]](Path(sys.argv[2]))
    print(f"{sys.argv[1]}: ok", flush=True)
