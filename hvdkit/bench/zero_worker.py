"""What runs in each rank of `hvdkit bench zero`: a model trained under hvdkit's ZeRO stages,
Horovod's DistributedOptimizer, torch's ZeroRedundancyOptimizer and FSDP2, or split by tensor
parallelism (hvdkit's ``Session(tp=N)``, the product's step; torch's parallelize_module), printing
one JSON record."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from types import SimpleNamespace

from hvdkit import env, job
from hvdkit.bench.figures import TP_IMPLS, gpt
from hvdkit.bench.workers import init_torch_distributed


def zero_worker(args: argparse.Namespace) -> None:
    """One rank of one loop: warm up, time the steps, report rates and bytes on rank 0."""
    import horovod.torch as hvd
    import torch
    import torch._dynamo  # noqa: F401  -- in the baseline: the sharded loops' imports bring it

    from hvdkit.rank.memory import PhasePeaks, peak_rss
    from hvdkit.rank.start.startup import place_process
    from hvdkit.zero import optimizer as zero
    from hvdkit.zero.stage3 import WeightShardedOptimizer

    baseline = peak_rss()  # this rank before its model: torch, Horovod, MPI
    launch = env.detect()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    device = torch.device("cuda", launch.local_rank or 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.memory_cap:
        _end_above(args.memory_cap, device)
    model, inputs, loss_of = _zero_model(args)
    model.to(device)
    tensor_parallel = args.impl in TP_IMPLS
    parameters = sum(p.numel() for p in model.parameters())  # before any sharding
    session, waited = None, [0.0]
    optimizer_class = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[args.optimizer]
    if args.impl in ("torch-zero", "fsdp2", "torch-tp"):
        import torch.distributed as dist

        place_process(launch.local_rank or 0, launch.local_size or 1)
        init_torch_distributed("nccl" if device.type == "cuda" else "gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
        make = {"torch-zero": _torch_zero, "fsdp2": _fsdp2, "torch-tp": _torch_tp}[args.impl]
        optimizer = make(model, optimizer_class, device)
        model = getattr(optimizer, "hvdkit_model", model)
        gather = _torch_gather
    elif args.impl in ("tp", "tp-sp"):  # the product's step, its defaults: one tensor-parallel group of every rank
        import hvdkit

        session = hvdkit.Session(tp=launch.size, sequence_parallel=args.impl == "tp-sp", batch_size=args.batch_size,
                                 logger="none", log_dir=tempfile.mkdtemp(prefix="hvdkit-bench-tp-"))
        rank, size = hvd.rank(), hvd.size()
        model = session.parallelize(model)  # the GPT's plan
        model, optimizer = session.setup(model, optimizer_class(model.parameters(), lr=1e-4))
        gather = hvd.allgather_object
        waited = _time_waits()
    else:
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        inner = optimizer_class(model.parameters(), lr=1e-4)
        if args.impl == "horovod":
            optimizer = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())
        elif args.impl == "zero3":
            optimizer = WeightShardedOptimizer(inner, hvd, model)
            optimizer.shard_model()
        else:
            optimizer = zero.ShardedOptimizer(inner, hvd, int(args.impl[-1]))
        gather = hvd.allgather_object
    # Tensor parallelism: every rank of the one group steps the whole global batch (size x batch).
    batch = [part.to(device) for part in inputs(torch.Generator().manual_seed(0 if tensor_parallel else rank),
                                                size if tensor_parallel else 1)]

    peaks = PhasePeaks(device)

    def step(when: str) -> None:
        with peaks.phase(f"{when}: forward and backward"):
            optimizer.zero_grad()
            loss = loss_of(model, batch)
            session.backward(loss) if session else loss.backward()
        with peaks.phase(f"{when}: optimizer step"):
            session.step() if session else optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    try:
        for n in range(args.warmup):
            step("first step" if n == 0 else "steady")
        start, cpu, waits = time.perf_counter(), time.thread_time(), waited[0]
        for _ in range(args.steps):
            step("steady")
        cpu = (time.thread_time() - cpu) / args.steps
        exposed = (waited[0] - waits) / args.steps
    except torch.cuda.OutOfMemoryError:  # past --memory-cap on a GPU
        print(json.dumps({"event": "bench.zero.over", "cuda_allocated": torch.cuda.max_memory_allocated(device),
                          "cap": args.memory_cap}), flush=True)
        os._exit(job.OVER_CAP)
    rate = args.batch_size * (size if tensor_parallel else 1) * args.steps / (time.perf_counter() - start)
    phases = peaks.summary()
    held = {**_held(model, optimizer, zero), "phases": phases}
    # The peak the cap and the table speak of: resident memory on a CPU, the allocator's on a GPU.
    held["peak"] = held["peak_rss"] if device.type == "cpu" else max(v for k, v in phases.items() if k != "unit")
    rows = gather({"samples_per_sec": rate, "cpu_per_step": cpu, "baseline": baseline, **held,
                   **({"exposed_per_step": exposed} if session else {})})
    if rank == 0:
        print(json.dumps({"event": "bench.zero", "impl": args.impl, "world_size": size, "model": args.model,
                          "parameters": parameters,
                          "samples_per_sec": rows[0]["samples_per_sec"] if tensor_parallel  # one group's
                          else sum(r["samples_per_sec"] for r in rows), "ranks": rows}), flush=True)
    if args.impl in ("torch-zero", "fsdp2", "torch-tp"):
        _end_torch_distributed()
    if session:
        session.finish()
        shutil.rmtree(session.log_dir, ignore_errors=True)


def _time_waits() -> list:
    """The seconds this thread waits in Horovod's synchronize (hvdkit.parallel.ops' collectives wait
    there), summed in the list's one item: the tensor-parallel communication the step cannot overlap."""
    from horovod.torch import mpi_ops

    synchronize, waited = mpi_ops.synchronize, [0.0]

    def timed(handle):
        began = time.perf_counter()
        try:
            return synchronize(handle)
        finally:
            waited[0] += time.perf_counter() - began

    mpi_ops.synchronize = timed
    return waited


def _end_torch_distributed() -> None:
    """Every rank done, the group ended, then this process, without the interpreter's teardown:
    Gloo's threads, still running while it unloads, abort a rank now and then (signal 6 after
    the record was printed)."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _zero_model(args: argparse.Namespace):
    """(model, inputs, loss_of): the model, a function of a generator giving one rank's batch,
    and the loss of a batch."""
    import torch
    import torch.nn.functional as F

    from hvdkit import models

    if args.model == "gpt":
        def tokens(generator, ranks=1):
            return [torch.randint(0, 256, (args.batch_size * ranks, args.seq_len + 1), generator=generator)]

        def next_token_loss(model, batch):
            (tokens,) = batch
            return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())

        return gpt(args.width, args.layers, args.seq_len), tokens, next_token_loss

    def images(generator, ranks=1):  # tensor parallelism's whole batch is the GPT's only (the driver says so)
        return [torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=generator),
                torch.randint(0, args.num_classes, (args.batch_size,), generator=generator)]

    def class_loss(model, batch):
        return F.cross_entropy(model(batch[0]), batch[1])

    return models.build(args.model, 3, args.image_size, args.num_classes), images, class_loss


def _end_above(cap: int, device) -> None:
    """Watch this rank's resident memory from a thread; past ``cap``, say so and end the process
    (its launcher then ends the others): a model that does not fit need not finish its steps.
    On a GPU the allocator itself refuses to pass the cap (the worker ends on its error)."""
    import threading

    import torch

    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(device).total_memory, device)
        return
    page = os.sysconf("SC_PAGE_SIZE")

    def watch() -> None:
        with open("/proc/self/statm") as statm:
            while True:
                statm.seek(0)
                resident = int(statm.read().split()[1]) * page
                if resident > cap:
                    print(json.dumps({"event": "bench.zero.over", "rss": resident, "cap": cap}), flush=True)
                    os._exit(job.OVER_CAP)
                time.sleep(0.01)

    threading.Thread(target=watch, name="hvdkit-memory-cap", daemon=True).start()


def _held(model, optimizer, zero) -> dict:
    """This rank's bytes after a step, counted from the tensors, and its peak resident memory."""
    from hvdkit.rank.memory import memory_of, peak_rss
    from hvdkit.zero.held import held_bytes

    if isinstance(optimizer, zero.ShardedOptimizer):
        return memory_of(optimizer)
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer steps its shard with this

    def own(tensor):  # FSDP2's DTensors: this rank's shard
        return getattr(tensor, "_local_tensor", tensor)

    params = [own(p) for p in model.parameters()]
    # what each gradient holds on this rank (a DTensor's local part may be of the whole: torch's TP embedding's)
    holders = [SimpleNamespace(grad=None if p.grad is None else own(p.grad)) for p in model.parameters()]
    states = [{k: own(v) for k, v in state.items()} for state in local.state.values()]
    return {**held_bytes(params, holders, states), "peak_rss": peak_rss()}


def _torch_zero(model, optimizer_class, device):
    """torch's ZeroRedundancyOptimizer under DDP."""
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class, lr=1e-4)
    optimizer.hvdkit_model = model
    return optimizer


def _fsdp2(model, optimizer_class, device):
    """torch's FSDP2: ``fully_shard`` on each block and on the model, as torchtitan applies it,
    over one mesh of every rank (Gloo on CPUs, NCCL on GPUs); the optimizer over its sharded
    parameters."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks if hasattr(model, "blocks") else ():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return optimizer_class(model.parameters(), lr=1e-4)


def _torch_tp(model, optimizer_class, device):
    """torch's tensor parallelism: ``parallelize_module`` with hvdkit's GPT plan written in torch's
    styles (the token embedding by rows of the vocabulary, q, k, v and up by columns, o and down by
    rows, the output layer by columns, its logits replicated), over one mesh of every rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    plan = {"tokens": RowwiseParallel(input_layouts=Replicate()), "head": ColwiseParallel(output_layouts=Replicate())}
    for index in range(len(model.blocks)):
        block = f"blocks.{index}"
        plan.update({f"{block}.attention.{name}": ColwiseParallel() for name in "qkv"})
        plan.update({f"{block}.attention.o": RowwiseParallel(), f"{block}.up": ColwiseParallel(),
                     f"{block}.down": RowwiseParallel()})
    parallelize_module(model, mesh, plan)
    return optimizer_class(model.parameters(), lr=1e-4)


def _torch_gather(value):
    import torch.distributed as dist

    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, value)
    return rows
