"""`hvdkit bench tp-ops`: tensor parallelism's operators (hvdkit.parallel.ops, on Horovod) beside
torch's functional collectives (``torch.distributed._functional_collectives`` over Gloo) on the
same tensors, in the same ranks: each operator's latency, alternating rounds, every round's ratio.

The tensors are those of a GPT block of ``--width`` features over ``--batch-size`` sequences of
``--seq-len`` tokens split over every rank of the job (tp = np): a row-parallel layer's output
summed (``reduce_from_tp``; ``copy_to_tp``'s backward is the same allreduce), a column-parallel
output joined along the features (``gather_from_tp``), and sequence parallelism's gather and
reduce-scatter along the sequence. Each pair's results are compared once before timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from hvdkit import env
from hvdkit.bench.drivers import RunFailed, default_np, launch_command, run_launch, save_record
from hvdkit.bench.figures import BenchError
from hvdkit.bench.workers import init_torch_distributed

OPS = ("reduce_from_tp", "gather_from_tp", "gather_from_sp", "reduce_scatter_to_sp")


def tp_ops(args: argparse.Namespace) -> int:
    """The driver: one launch of ``args.np`` ranks; the table, and rank 0's record under --out."""
    np = args.np or default_np()
    if args.seq_len % np or args.width % np:
        raise BenchError(f"tp-ops: --seq-len {args.seq_len} and --width {args.width} must each split over the "
                         f"{np} ranks (one tensor-parallel group)")
    worker = ["tp-ops", "--worker", "--width", str(args.width), "--seq-len", str(args.seq_len),
              "--batch-size", str(args.batch_size), "--repeats", str(args.repeats), "--iters", str(args.iters)]
    print(f"== tp-ops: np={np} (tp {np}), width {args.width}, {args.batch_size} x {args.seq_len} tokens, "
          f"{args.repeats} alternating rounds of {args.iters} calls", flush=True)
    record = run_launch(launch_command(args, np, worker), "bench.tp_ops", "tp-ops benchmark", args.timeout)
    print(f"\n{'operator':<22} {'shape in':<16} {'hvdkit us':>10} {'torch us':>10} {'ratio':>6}  "
          f"{'hvdkit CPU us':>13} {'torch CPU us':>12}  rounds (hvdkit/torch)")
    for row in record["rows"]:
        print(f"{row['op']:<22} {'x'.join(map(str, row['shape'])):<16} {row['hvdkit_us']:>10.1f} "
              f"{row['torch_us']:>10.1f} {row['ratio']:>6.3f}  {row['hvdkit_cpu_us']:>13.1f} "
              f"{row['torch_cpu_us']:>12.1f}  {' '.join(f'{r:.3f}' for r in row['rounds'])}")
    return save_record(args, "tp-ops", record)


def tp_ops_worker(args: argparse.Namespace) -> None:
    """In every rank: torch.distributed over Gloo and Horovod side by side, each operator's pair
    checked equal, then timed in alternating rounds (the first of each round alternates); rank 0
    prints the record: per operator, the median over rounds of the slowest rank's microseconds a
    call, and of the training thread's CPU a call."""
    import horovod.torch as hvd
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from hvdkit.parallel import ops
    from hvdkit.parallel.mesh import Mesh
    from hvdkit.rank.start.startup import place_process

    launch = env.detect()
    place_process(launch.local_rank or 0, launch.local_size or 1)
    init_torch_distributed("gloo")
    mesh = Mesh(launch.size, launch.size)
    hvd.init(process_sets=mesh.process_sets(hvd) or None)
    mesh.bind(hvd)
    group, world = mesh.tp_group, dist.group.WORLD
    rank, size = hvd.rank(), hvd.size()
    batch, length, width = args.batch_size, args.seq_len, args.width
    if length % size or width % size:
        raise RunFailed(f"tp-ops: --seq-len {length} and --width {width} must split over {size} ranks")
    generator = torch.Generator().manual_seed(rank)
    full = torch.randn(batch, length, width, generator=generator)
    block = torch.randn(batch, length, width // size, generator=generator)
    part = torch.randn(batch, length // size, width, generator=generator)
    pairs = {
        "reduce_from_tp": (full, lambda t: ops.reduce_from_tp(t, group, "bench.tp.reduce"),
                           lambda t: funcol.wait_tensor(funcol.all_reduce(t, "sum", world))),
        "gather_from_tp": (block, lambda t: ops.gather_from_tp(t, group, "bench.tp.gather"),
                           lambda t: funcol.wait_tensor(funcol.all_gather_tensor(t, 2, world))),
        "gather_from_sp": (part, lambda t: ops.gather_from_sp(t, group, "bench.sp.gather", 1),
                           lambda t: funcol.wait_tensor(funcol.all_gather_tensor(t, 1, world))),
        "reduce_scatter_to_sp": (full, lambda t: ops.reduce_scatter_to_sp(t, group, "bench.sp.scatter", 1),
                                 lambda t: funcol.wait_tensor(funcol.reduce_scatter_tensor(t, "sum", 1, world))),
    }
    rows = []
    for name, (tensor, ours, theirs) in pairs.items():
        got, want = ours(tensor), theirs(tensor)
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
            raise RunFailed(f"tp-ops: {name} gave another result than torch's on rank {rank}")
        timed = {"hvdkit": [], "torch": []}
        for round_ in range(args.repeats):
            order = ("hvdkit", "torch") if round_ % 2 == 0 else ("torch", "hvdkit")
            for impl in order:
                call = ours if impl == "hvdkit" else theirs
                call(tensor)
                dist.barrier()
                wall, cpu = time.perf_counter(), time.thread_time()
                for _ in range(args.iters):
                    call(tensor)
                timed[impl].append(((time.perf_counter() - wall) / args.iters,
                                    (time.thread_time() - cpu) / args.iters))
        gathered = [None] * size
        dist.all_gather_object(gathered, timed)
        slowest = {impl: [max(r[impl][i][0] for r in gathered) for i in range(args.repeats)] for impl in timed}
        rounds = [h / t for h, t in zip(slowest["hvdkit"], slowest["torch"], strict=True)]
        rows.append({"op": name, "shape": list(tensor.shape), "hvdkit_us": 1e6 * statistics.median(slowest["hvdkit"]),
                     "torch_us": 1e6 * statistics.median(slowest["torch"]), "ratio": statistics.median(rounds),
                     "rounds": rounds,
                     "hvdkit_cpu_us": 1e6 * statistics.median(c for _, c in timed["hvdkit"]),
                     "torch_cpu_us": 1e6 * statistics.median(c for _, c in timed["torch"])})
    if rank == 0:
        print(json.dumps({"event": "bench.tp_ops", "np": size, "controller": "mpi" if hvd.mpi_enabled() else "gloo",
                          "width": width, "seq_len": length, "batch_size": batch, "repeats": args.repeats,
                          "iters": args.iters, "rows": rows}), flush=True)
    dist.barrier()
    hvd.shutdown()
