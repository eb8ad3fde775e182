"""`hvdkit bench pp-transport`: the ways to pass a pipeline's activations between two neighbouring
stages, on the same tensors in the same two ranks: hvdkit's (hvdkit.parallel.pipeline.transport:
a named broadcast within the pair's process set, rooted at the sender, into a buffer the receiver
keeps), Horovod's alltoall within the pair (the sender's rows to the other rank, none back),
mpi4py's point-to-point on a communicator of its own (a duplicate of MPI's world, beside Horovod's:
under MPI only, a Gloo launch has no MPI world), and torch.distributed's isend/irecv over Gloo, a
group beside Horovod: the peer a user would reach for, and the last of the transports the pipeline
could use.

The ranks run with the product's settings (a Session's: Horovod's cycle time among them). Each is
timed as a ping-pong (stage 0 sends, stage 1 sends the same tensor back, as a gradient
goes back), in alternating rounds; a transfer is half a round trip. The tensors are activations of
the GPT at ``--width`` over micro-batches of ``--batch-size`` sequences of each ``--seq-lens``.
Each way's result is checked equal to what was sent once before timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from hvdkit import env
from hvdkit.bench.drivers import RunFailed, launch_command, run_launch, save_record
from hvdkit.bench.workers import apply_defaults, init_torch_distributed

WAYS = ("hvdkit", "alltoall", "mpi4py", "torch")
COMPARED = ("hvdkit", "alltoall", "mpi4py")  # each beside torch's, round by round


def pp_transport(args: argparse.Namespace) -> int:
    """The driver: one launch of 2 ranks; the table, and rank 0's record under --out."""
    worker = ["pp-transport", "--worker", "--width", str(args.width), "--seq-lens", ",".join(map(str, args.seq_lens)),
              "--batch-size", str(args.batch_size), "--repeats", str(args.repeats), "--iters", str(args.iters)]
    print(f"== pp-transport: 2 ranks (pp 2), activations of {args.batch_size} x seq x {args.width} fp32, "
          f"{args.repeats} alternating rounds of {args.iters} round trips", flush=True)
    record = run_launch(launch_command(args, 2, worker), "bench.pp_transport", "pp-transport benchmark", args.timeout)
    ways = [way for way in WAYS if way not in record["skipped"]]
    for way, why in record["skipped"].items():
        print(f"({way} not measured: {why})", flush=True)
    compared = [way for way in COMPARED if way in ways]
    print(f"\n{'shape':<14} {'KiB':>7} " + " ".join(f"{way + ' us':>12}" for way in ways)
          + " " + " ".join(f"{way + '/torch':>15}" for way in compared)
          + f" {'hvdkit MB/s':>11} {'torch MB/s':>10}  rounds hvdkit/torch")
    for row in record["rows"]:
        print(f"{'x'.join(map(str, row['shape'])):<14} {row['bytes'] / 1024:>7.0f} "
              + " ".join(f"{row['us'][way]:>12.1f}" for way in ways) + " "
              + " ".join(f"{row['ratio'][way]:>15.3f}" for way in compared)
              + f" {row['bytes'] / row['us']['hvdkit']:>11.0f} {row['bytes'] / row['us']['torch']:>10.0f}  "
              + " ".join(f"{r:.2f}" for r in row["rounds"]["hvdkit"]))
    return save_record(args, "pp-transport", record)


def pp_transport_worker(args: argparse.Namespace) -> None:
    """In each of the 2 ranks: Horovod and torch.distributed (Gloo) side by side; per shape, each
    way checked, then timed in alternating rounds (the first way of a round rotates); rank 0 prints
    the record: per shape and way, the median over rounds of the slower rank's microseconds a
    transfer, each round's ratio to torch's, and the training thread's CPU a transfer."""
    import horovod.torch as hvd
    import torch
    import torch.distributed as dist

    from hvdkit.parallel.mesh import Mesh
    from hvdkit.parallel.pipeline.transport import Link
    from hvdkit.rank.start.startup import performance_settings, place_process

    launch = env.detect()
    if launch.size != 2:
        raise RunFailed(f"pp-transport: runs on 2 ranks (one pair of stages), not {launch.size}")
    # the product's settings (a Session's, before Horovod starts): its cycle time on one host
    apply_defaults(performance_settings(torch.cuda.is_available(), launch.spans_hosts, gloo_built=hvd.gloo_built()))
    place_process(launch.local_rank or 0, launch.local_size or 1)
    init_torch_distributed("gloo")
    mesh = Mesh(2, pp=2)
    hvd.init(process_sets=mesh.process_sets(hvd) or None)
    mesh.bind(hvd)
    rank = hvd.rank()
    link = Link(mesh.next_pair or mesh.previous_pair, "bench.pp")
    skipped = {}
    if os.environ.get("HOROVOD_CONTROLLER") == "gloo" or not hvd.mpi_enabled():
        skipped["mpi4py"] = "a Gloo launch (horovodrun --gloo) has no MPI world"
    communicator = None if skipped else _own_communicator()
    rows = []
    for length in args.seq_lens:
        shape = (args.batch_size, length, args.width)
        sent = torch.randn(*shape, generator=torch.Generator().manual_seed(length))
        key = (length,)

        ways = _ways(rank, link, shape, key, communicator)
        for name, way in ways.items():
            got = way(sent, 0)
            if not torch.equal(got, sent):
                raise RunFailed(f"pp-transport: {name} brought back another tensor than it sent, on rank {rank}")
        timed: dict = {name: [] for name in ways}
        for round_ in range(args.repeats):
            names = [name for name in WAYS if name in ways]
            order = names[round_ % len(names):] + names[:round_ % len(names)]
            for name in order:
                dist.barrier()
                wall, cpu = time.perf_counter(), time.thread_time()
                for index in range(args.iters):
                    ways[name](sent, index)
                timed[name].append(((time.perf_counter() - wall) / (2 * args.iters),
                                    (time.thread_time() - cpu) / (2 * args.iters)))
        gathered = [None] * 2
        dist.all_gather_object(gathered, timed)
        slowest = {name: [max(r[name][i][0] for r in gathered) for i in range(args.repeats)] for name in ways}
        rounds = {name: [ours / theirs for ours, theirs in zip(slowest[name], slowest["torch"], strict=True)]
                  for name in COMPARED if name in ways}
        rows.append({"shape": list(shape), "bytes": sent.numel() * sent.element_size(),
                     "us": {name: 1e6 * statistics.median(slowest[name]) for name in ways},
                     "ratio": {name: statistics.median(rounds[name]) for name in rounds}, "rounds": rounds,
                     "cpu_us": {name: 1e6 * statistics.median(c for _, c in timed[name]) for name in ways}})
    if rank == 0:
        print(json.dumps({"event": "bench.pp_transport", "np": 2, "controller": "mpi" if hvd.mpi_enabled() else "gloo",
                          "width": args.width, "batch_size": args.batch_size, "repeats": args.repeats,
                          "iters": args.iters, "skipped": skipped, "rows": rows}), flush=True)
    dist.barrier()
    if communicator is not None:
        communicator.Free()
    hvd.shutdown()


def _own_communicator():
    """A duplicate of MPI's world for mpi4py's sends, as a pipeline would hold its own: its messages
    never meet Horovod's (MPI initialized by Horovod, at the thread level it asks: multiple)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD.Dup()


def _ways(rank: int, link, shape: tuple, key: tuple, communicator=None) -> dict:
    """The ways of one ping-pong of ``shape`` between the pair's two ranks, by name (mpi4py's where
    ``communicator`` is given): each takes the tensor and the round trip's index and returns what came
    back."""
    import torch
    import torch.distributed as dist
    from horovod.torch import mpi_ops

    pair_set = link.pair.process_set

    def hvdkit_way(tensor, index):
        if rank == 0:
            link.send(tensor, "activation", index, key)
            back = link.receive("gradient", index, key, tensor.device)
        else:
            back = link.receive("activation", index, key, tensor.device)
            link.send(back, "gradient", index, key)
        link.settle()
        return back

    one = torch.tensor([0, shape[0]] if rank == 0 else [shape[0], 0], dtype=torch.int32)
    none = torch.zeros(2, dtype=torch.int32)
    nothing = torch.empty(0, *shape[1:])

    def alltoall_way(tensor, index):  # each call carries one direction: its sender's rows, none back
        forward, _ = mpi_ops.alltoall(tensor if rank == 0 else nothing, one if rank == 0 else none,
                                      name=f"bench.a2a.f.{index % 2}", process_set=pair_set)
        backward, _ = mpi_ops.alltoall(forward if rank == 1 else nothing, one if rank == 1 else none,
                                       name=f"bench.a2a.b.{index % 2}", process_set=pair_set)
        return backward if rank == 0 else forward

    buffer = torch.empty(shape)

    def torch_way(tensor, index):
        if rank == 0:
            dist.isend(tensor, 1).wait()
            dist.irecv(buffer, 1).wait()
        else:
            dist.irecv(buffer, 0).wait()
            dist.isend(buffer, 0).wait()
        return buffer

    ways = {"hvdkit": hvdkit_way, "alltoall": alltoall_way, "torch": torch_way}
    if communicator is not None:
        landing = torch.empty(shape)

        def mpi4py_way(tensor, index):  # the buffers as NumPy views of the tensors: no copy
            other = 1 - rank
            if rank == 0:
                communicator.Isend(tensor.numpy(), dest=other, tag=index % 2).Wait()
                communicator.Irecv(landing.numpy(), source=other, tag=index % 2).Wait()
            else:
                communicator.Irecv(landing.numpy(), source=other, tag=index % 2).Wait()
                communicator.Isend(landing.numpy(), dest=other, tag=index % 2).Wait()
            return landing

        ways["mpi4py"] = mpi4py_way
    return ways
