"""Trains one small model many ways on every rank, for tests/zero/test_zero.py: each optimizer (SGD
with momentum, Adam, AdamW; two param groups and a frozen layer), with and without gradient
accumulation and clipping, under Horovod's DistributedOptimizer and hvdkit's stage 1 and 2, and
as one process (plain torch, no Horovod) with the whole global batch.

The global batch of every step is the same at any world size: rank r of N takes its rows of the
step's rows, so every way should reach the same weights. Rank 0 saves, to argv[1], each run's
final weights, and every rank's optimizer-state and gradient bytes measured from the tensors
after the last step of the Adam runs. With --scaler, it trains with fp16 loss scaling instead
(train_scaled).
"""

import contextlib
import sys

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn

from hvdkit.rank.memory import memory_of
from hvdkit.zero import optimizer as zero

STEPS, ROWS = 50, 12  # rows of a micro-batch over all ranks: divisible by 1, 2 and 3
BUCKET_BYTES = 2048  # several buckets, and parameters cut between ranks' slices


def model() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    net[0].requires_grad_(False)  # the frozen layer, in the optimizer's first group all the same
    return net


def optimizer(name: str, net: nn.Module) -> torch.optim.Optimizer:
    groups = [{"params": [*net[0].parameters(), *net[2].parameters()], "lr": 0.05, "weight_decay": 0.01},
              {"params": list(net[4].parameters()), "lr": 0.02}]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    return {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name](groups, lr=0.01)


def wrap(impl: str, opt, net: nn.Module, passes: int):
    if impl == "one process":
        return opt
    if impl == "horovod":
        return hvd.DistributedOptimizer(opt, named_parameters=net.named_parameters(), backward_passes_per_step=passes)
    return zero.ShardedOptimizer(opt, hvd, int(impl[-1]), backward_passes_per_step=passes, bucket_bytes=BUCKET_BYTES)


def train(name: str, impl: str, passes: int, clip: float):
    net = model()
    opt = wrap(impl, optimizer(name, net), net, passes)
    alone = impl == "one process"
    if not alone:
        hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    size, rank = (1, 0) if alone else (hvd.size(), hvd.rank())
    share = ROWS // size
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(passes):
            generator = torch.Generator().manual_seed(1000 * step + micro)
            x, y = torch.randn(ROWS, 10, generator=generator), torch.randint(0, 4, (ROWS,), generator=generator)
            mine = slice(rank * share, (rank + 1) * share)
            (F.cross_entropy(net(x[mine]), y[mine]) / passes).backward()
        if not alone:
            opt.synchronize()
        if clip:
            if isinstance(opt, zero.ShardedOptimizer):
                opt.clip_grad_norm_(clip)
            else:
                nn.utils.clip_grad_norm_(net.parameters(), clip)
        with contextlib.nullcontext() if alone else opt.skip_synchronize():
            opt.step()
    return [p.detach().clone() for p in net.parameters()], memory_of(opt)


def train_scaled(impl: str, overflow_at: int):
    """fp16 autocast with a GradScaler (torch's, on the CPU), an inf planted in rank 1's gradient
    at one step: the averaged gradient holds it in one rank's slice only."""
    net = model()
    opt = wrap(impl, optimizer("adamw", net), net, 1)
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    share = ROWS // hvd.size()
    planted = {"now": False}

    def plant(grad: torch.Tensor) -> torch.Tensor:  # before any hook of the optimizer's sees it
        if planted["now"]:
            grad = grad.clone()
            grad[3, 5] = float("inf")
        return grad
    net[2].weight.register_hook(plant)
    for step in range(10):
        planted["now"] = step == overflow_at and hvd.rank() == 1
        opt.zero_grad()
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(ROWS, 10, generator=generator), torch.randint(0, 4, (ROWS,), generator=generator)
        mine = slice(hvd.rank() * share, (hvd.rank() + 1) * share)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(net(x[mine]), y[mine])
        scaler.scale(loss).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        if isinstance(opt, zero.ShardedOptimizer):
            opt.agree_on_overflow(scaler)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
    return [p.detach().clone() for p in net.parameters()], scaler.get_scale()


def main() -> None:
    torch.set_num_threads(1)  # three ranks on two cores: torch's own threads would fight over them
    hvd.init()
    if sys.argv[2:] == ["--scaler"]:
        scaled = {impl: train_scaled(impl, overflow_at=3) for impl in ("horovod", "zero1", "zero2")}
        if hvd.rank() == 0:
            torch.save(scaled, sys.argv[1])
        return
    weights, memory = {}, {}
    for name in ("sgd", "adam", "adamw"):
        for passes, clip in ((1, 0.0), (2, 0.5)):
            for impl in ("one process", "horovod", "zero1", "zero2"):
                weights[name, passes, clip, impl], held = train(name, impl, passes, clip)
                if name == "adam" and passes == 1 and impl != "one process":
                    memory[impl] = hvd.allgather_object(held)
    if hvd.rank() == 0:
        torch.save({"size": hvd.size(), "weights": weights, "memory": memory}, sys.argv[1])


if __name__ == "__main__":
    main()
