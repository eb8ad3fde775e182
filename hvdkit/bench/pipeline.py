"""`hvdkit bench pp`: a pipeline's step at pp 2, hvdkit's (hvdkit.parallel.pipeline: ``Pipeline``
over Horovod) beside torch.distributed.pipelining's same schedule (``ScheduleGPipe``,
``Schedule1F1B`` over Gloo), on the same GPT cut in the same two ranks, in alternating rounds: each
step's time and every round's ratio; each stage's bubble (hvdkit's, from its first forward to its
last backward: no optimizer, no data-parallel reduction) and time computing (the rest of that
span); and each stage's tensor bytes (weights, gradients and Adam's state) against half the whole
model's.

The GPT (``--width``, ``--layers``, ``--seq-len``) is cut between its blocks in two equal halves
(the first stage also holds the embeddings, the last the final norm and the byte-sized output
layer); a step is ``--batch-size`` sequences in each of ``--micro-batches`` micro-batches counts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from hvdkit import env
from hvdkit.bench.drivers import RunFailed, launch_command, run_launch, save_record
from hvdkit.bench.workers import apply_defaults, init_torch_distributed

IMPLS = ("hvdkit", "hvdkit-horovod", "torch")  # hvdkit-horovod: hvdkit's over Horovod's broadcasts, where auto is MPI


def pipeline_bench(args: argparse.Namespace) -> int:
    """The driver: one launch of 2 ranks; the tables, and rank 0's record under --out."""
    worker = ["pp", "--worker", "--width", str(args.width), "--layers", str(args.layers), "--seq-len",
              str(args.seq_len), "--batch-size", str(args.batch_size), "--micro-batches",
              ",".join(map(str, args.micro_batches)), "--schedules", ",".join(args.schedules), "--repeats",
              str(args.repeats), "--steps", str(args.steps)]
    print(f"== pp: 2 ranks (pp 2), GPT width {args.width} x {args.layers} blocks, {args.batch_size} x "
          f"{args.seq_len} tokens a step, {args.repeats} alternating rounds of {args.steps} steps", flush=True)
    record = run_launch(launch_command(args, 2, worker), "bench.pp", "pp benchmark", args.timeout)
    print(f"hvdkit's transport: {record['rows'][0]['transport'] if record['rows'] else '-'}", flush=True)
    print(f"\n{'schedule':<8} {'m':>3} {'hvdkit s':>9} {'torch s':>9} {'ratio':>6} {'broadcast':>9}  {'bubble 0':>8} "
          f"{'bubble 1':>8} {'(p-1)/(m+p-1)':>13}  {'computing s 0/1':>15}  {'CPU s hvdkit/torch':>18}  "
          f"rounds hvdkit/torch")
    for row in record["rows"]:
        print(f"{row['schedule']:<8} {row['micro_batches']:>3} {row['seconds']['hvdkit']:>9.3f} "
              f"{row['seconds']['torch']:>9.3f} {row['ratio']:>6.3f} {_shown(row['broadcast_ratio']):>9}  "
              f"{row['bubble'][0]:>8.3f} "
              f"{row['bubble'][1]:>8.3f} "
              f"{row['ideal_bubble']:>13.3f}  {row['computing'][0]:>7.3f}/{row['computing'][1]:<7.3f}  "
              f"{row['cpu']['hvdkit']:>8.3f}/{row['cpu']['torch']:<9.3f}  "
              + " ".join(f"{r:.3f}" for r in row["rounds"]))
    for stage, held in enumerate(record["memory"]):
        print(f"stage {stage}: {held['bytes'] / 2**20:.1f} MiB of weights, gradients and Adam state, "
              f"{held['bytes'] / (record['whole_bytes'] / 2):.3f}x half the whole model's "
              f"({record['whole_bytes'] / 2**20:.1f} MiB)")
    return save_record(args, "pp", record)


def _shown(ratio) -> str:
    return "-" if ratio is None else f"{ratio:.3f}"


def pipeline_worker(args: argparse.Namespace) -> None:
    """In each of the 2 ranks: Horovod and torch.distributed (Gloo) side by side, each rank holding
    its stage twice (one copy per implementation, the same weights); per schedule and number of
    micro-batches, the two in alternating rounds of ``steps`` steps (forward, backward, Adam),
    their losses checked equal on the last stage first; rank 0 prints the record."""
    import copy

    import horovod.torch as hvd
    import torch
    import torch.distributed as dist

    from hvdkit.models import TinyGPT
    from hvdkit.parallel.mesh import Mesh
    from hvdkit.parallel.pipeline.stages import gpt_stage
    from hvdkit.rank.start.startup import performance_settings, place_process

    launch = env.detect()
    if launch.size != 2:
        raise RunFailed(f"pp: runs on 2 ranks (two stages), not {launch.size}")
    apply_defaults(performance_settings(torch.cuda.is_available(), launch.spans_hosts, gloo_built=hvd.gloo_built()))
    place_process(launch.local_rank or 0, launch.local_size or 1)
    torch.set_num_threads(1)
    init_torch_distributed("gloo")
    mesh = Mesh(2, pp=2)
    hvd.init(process_sets=mesh.process_sets(hvd) or None)
    mesh.bind(hvd)
    stage_index = mesh.pp_group.rank
    torch.manual_seed(0)
    whole = TinyGPT(256, args.seq_len, width=args.width, layers=args.layers, heads=max(1, args.width // 64))
    whole_bytes = 16 * sum(p.numel() for p in whole.parameters())  # fp32 weights, gradients, Adam's two moments
    ours_module = gpt_stage(whole, stage_index, 2)
    theirs_module, broadcast_module = copy.deepcopy(ours_module), copy.deepcopy(ours_module)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (args.batch_size, args.seq_len + 1), generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def loss_fn(logits, target):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    rows = []
    memory = None
    for schedule in args.schedules:
        for micro_batches in args.micro_batches:
            ours, steps = _arms(ours_module, theirs_module, broadcast_module, mesh, schedule, micro_batches, inputs,
                                targets, loss_fn)
            impls = [impl for impl in IMPLS if impl in steps]
            first = {impl: step() for impl, step in steps.items()}  # the same weights: the same first losses
            for impl in impls[:-1]:  # each of hvdkit's beside torch's
                if stage_index == 1 and not torch.allclose(torch.stack(first[impl]), torch.stack(first["torch"]),
                                                           rtol=1e-4, atol=1e-5):
                    raise RunFailed(f"pp: {schedule}'s first losses differ: {impl} {first[impl]}, torch "
                                    f"{first['torch']}")
            timed: dict = {impl: [] for impl in impls}
            bubbles = []
            for round_ in range(args.repeats):
                for impl in impls[round_ % len(impls):] + impls[:round_ % len(impls)]:
                    dist.barrier()
                    wall, cpu = time.perf_counter(), time.thread_time()
                    for _ in range(args.steps):
                        steps[impl]()
                        if impl == "hvdkit":
                            bubbles.append((ours.times.bubble, ours.times.span - ours.times.waiting))
                    timed[impl].append(((time.perf_counter() - wall) / args.steps,
                                        (time.thread_time() - cpu) / args.steps))
            gathered = [None] * 2
            dist.all_gather_object(gathered, {"timed": timed, "bubble": statistics.median(b for b, _ in bubbles),
                                              "computing": statistics.median(c for _, c in bubbles)})
            slowest = {impl: [max(r["timed"][impl][i][0] for r in gathered) for i in range(args.repeats)]
                       for impl in impls}
            rounds = [h / t for h, t in zip(slowest["hvdkit"], slowest["torch"], strict=True)]
            by_broadcast = ([h / t for h, t in zip(slowest["hvdkit-horovod"], slowest["torch"], strict=True)]
                            if "hvdkit-horovod" in slowest else [])
            rows.append({"schedule": schedule, "micro_batches": micro_batches, "transport": ours.transport,
                         "seconds": {impl: statistics.median(slowest[impl]) for impl in impls},
                         "ratio": statistics.median(rounds), "rounds": rounds,
                         "broadcast_ratio": statistics.median(by_broadcast) if by_broadcast else None,
                         "broadcast_rounds": by_broadcast,
                         "bubble": [r["bubble"] for r in gathered], "ideal_bubble": 1 / (micro_batches + 1),
                         "computing": [r["computing"] for r in gathered],
                         "cpu": {impl: statistics.median(c for _, c in timed[impl]) for impl in impls}})
            if memory is None:
                held = sum(t.numel() * t.element_size() for p in ours_module.parameters()
                           for t in (p, p.grad, *ours.optimizer.state[p].values()) if t is not None and t.dim())
                memory = [None] * 2
                dist.all_gather_object(memory, {"bytes": held})
    if stage_index == 0:
        print(json.dumps({"event": "bench.pp", "np": 2, "controller": "mpi" if hvd.mpi_enabled() else "gloo",
                          "width": args.width, "layers": args.layers, "seq_len": args.seq_len,
                          "batch_size": args.batch_size, "repeats": args.repeats, "steps": args.steps,
                          "whole_bytes": whole_bytes, "memory": memory, "rows": rows}), flush=True)
    dist.barrier()
    hvd.shutdown()


def _arms(ours_module, theirs_module, broadcast_module, mesh, schedule: str, micro_batches: int, inputs, targets,
          loss_fn):
    """hvdkit's Pipeline (with its optimizer as ``.optimizer``) and each implementation's step by
    name: forward and backward of the batch by ``schedule``, then Adam; each returns the last
    stage's losses. Where hvdkit's transport is MPI's, also hvdkit's over Horovod's broadcasts
    ("hvdkit-horovod", on ``broadcast_module``): the measurement that chose the transport."""
    import torch
    from torch.distributed import pipelining

    from hvdkit.parallel.pipeline.stages import Pipeline

    stage_index = mesh.pp_group.rank
    ours = Pipeline(ours_module, mesh, schedule, micro_batches)
    ours.optimizer = torch.optim.Adam(ours_module.parameters(), lr=1e-4)
    stage = pipelining.PipelineStage(theirs_module, stage_index, 2, torch.device("cpu"))
    kind = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}[schedule]
    theirs = kind(stage, micro_batches, loss_fn=loss_fn)
    theirs_optimizer = torch.optim.Adam(theirs_module.parameters(), lr=1e-4)

    def stepped(pipeline):
        def step():
            pipeline.optimizer.zero_grad()
            losses = pipeline.step(inputs, targets, loss_fn)
            pipeline.optimizer.step()
            return losses
        return step

    steps = {"hvdkit": stepped(ours)}
    if ours.transport == "mpi":
        broadcast = Pipeline(broadcast_module, mesh, schedule, micro_batches, transport="horovod")
        broadcast.optimizer = torch.optim.Adam(broadcast_module.parameters(), lr=1e-4)
        steps["hvdkit-horovod"] = stepped(broadcast)

    def theirs_step():
        theirs_optimizer.zero_grad()
        losses: list = []
        if stage_index == 0:
            theirs.step(inputs)
        else:
            theirs.step(target=targets, losses=losses)
        theirs_optimizer.step()
        return losses

    return ours, {**steps, "torch": theirs_step}
