"""Steady steps of one loop shape, audited (hvdkit.checks.syncaudit): prints rank 0's counts per
step as JSON. Run under a launcher: ``python sync_audit_script.py SHAPE LAYERS``.

Shapes: trainer (the Trainer's step and its loop's calls: train_step, report_due, should_stop),
session (the README's own loop), amp (the own loop with fp16 loss scaling: the Session's
GradScaler is made for CUDA, so on a CPU a CPU GradScaler stands in for it; its found_inf and
unscale kernels are the same calls), zero1, zero2 and zero3 (the own loop with the sharded
optimizer and Adam; at stage 3 each Linear is a group of its own), snapshot (the own loop with a
snapshot in host memory every step, into the folder HVDKIT_SNAPSHOT_DIR names, as hvdkit launch
--max-restarts does), zero2-snapshot (zero2's with a snapshot every step: on ranks whose host
names differ, each sends its shard to the other's snapshot), tp and tp-sequence-parallel (the own
loop with Session(tp=2), the GPT of 2 x LAYERS blocks split by its plan), pp (the GPT cut in 2
stages, hvdkit.parallel.pipeline's 1F1B over 4 micro-batches, Adam, in a loop of one's own),
pp-session (the same cut by Session(pp=2, micro_batches=4), stepped by session.pipeline.step), each
optimizer fused as the Session makes it on a GPU. LAYERS: hidden 1024x1024 layers of the MLP,
about half a ZeRO bucket each. On a GPU (`make gpu-check`) the audited steps also run under
torch.cuda.set_sync_debug_mode("warn"), whose warnings, one per synchronizing CUDA call, are
counted per step. Then one more step and a report: the step where the non-finite flags of all
the steps before are read, once.
"""

import json
import os
import sys
import warnings

import torch
import torch.nn.functional as F

import hvdkit
from hvdkit.checks.syncaudit import SyncAudit
from hvdkit.models import TinyGPT
from hvdkit.parallel.mesh import Mesh
from hvdkit.parallel.pipeline.stages import Pipeline, gpt_stage
from hvdkit.trainer import classification_loss, train_step

WARMUP, AUDITED = 3, 10


def main() -> None:
    shape, layers = sys.argv[1], int(sys.argv[2])
    zero = {"zero1": 1, "zero2": 2, "zero2-snapshot": 2, "zero3": 3}.get(shape, 0)
    snapshots = {"checkpoint_dir": os.path.join(os.path.dirname(os.environ["HVDKIT_SNAPSHOT_DIR"]), "ckpt"),
                 "snapshot_steps": 1} if shape.endswith("snapshot") else {}
    tp = {"tp": 2, "tp-sequence-parallel": 2}.get(shape, 1)
    pipelined = {"pp": 2, "micro_batches": 4} if shape == "pp-session" else {}
    session = hvdkit.Session(batch_size=8, log_interval=10_000, check_consistency_steps=0, logger="none",
                             zero=zero, amp=shape == "amp", seed=0, tp=tp,
                             sequence_parallel=shape == "tp-sequence-parallel", **snapshots, **pipelined)
    torch.manual_seed(0)
    if tp > 1 or shape.startswith("pp"):  # the GPT, split by its plan over the tensor-parallel group, or cut
        model = TinyGPT(64, 16, width=64, layers=2 * layers, heads=4)
        batch = (torch.randint(0, 64, (8, 16)), torch.randint(0, 64, (8, 16)))
    else:
        model = torch.nn.Sequential(torch.nn.Linear(32, 1024), torch.nn.ReLU(),
                                    *[torch.nn.Linear(1024, 1024) for _ in range(layers)], torch.nn.Linear(1024, 10))
        batch = (torch.randn(8, 32), torch.randint(0, 10, (8,)))
    pipeline = None
    if shape == "pp":  # the loop of docs/model-parallelism.md: 1F1B over 4 micro-batches, no Session's step
        mesh = Mesh(session.hvd.size(), pp=2).bind(session.hvd)  # at 2 ranks the pipeline is the whole job
        model = gpt_stage(model, mesh.pp_group.rank, 2)
        pipeline = Pipeline(model, mesh, "1f1b", 4)
    elif tp > 1 or pipelined:
        model = session.parallelize(model)
    # Fused, as the Session makes them on a GPU (on a CPU it leaves them: a read costs no sync there).
    inner = (torch.optim.Adam(model.parameters(), lr=1e-4, fused=True) if zero or pipeline else
             torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=True))
    if pipeline:
        optimizer = inner
    else:
        model, optimizer = session.setup(model, inner)
    if shape == "amp" and session.device.type == "cpu":
        session.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    cuda = session.device.type == "cuda"
    if cuda:  # as a loader with pin_memory gives them: copied to the GPU without a sync
        batch = tuple(t.pin_memory() for t in batch)

    def step() -> None:
        if pipelined:  # the Session's pipeline step, as docs/own-loop.md writes it
            optimizer.zero_grad()
            for loss in session.pipeline.step(batch, lambda logits, y: F.cross_entropy(logits.reshape(-1, 64),
                                                                                       y.reshape(-1))):
                session.log(2, loss=loss)
            session.step()
            session.should_stop()
            return
        if pipeline:
            optimizer.zero_grad()
            pipeline.step(*batch, lambda logits, y: F.cross_entropy(logits.reshape(-1, 64), y.reshape(-1)))
            optimizer.step()
            return
        if tp > 1:
            optimizer.zero_grad()
            x, y = batch
            loss = F.cross_entropy(model(x).reshape(-1, 64), y.reshape(-1))
            session.backward(loss)
            session.log(len(y), loss=loss)
            session.step()
            session.should_stop()
            return
        if shape == "trainer":
            train_step(session, model, classification_loss, batch)
            session.report_due()
            session.should_stop()
            return
        optimizer.zero_grad()
        for x, y in session.micro_batches(batch):
            with session.autocast():
                loss = F.cross_entropy(model(x), y)
            session.backward(loss)
            session.log(len(y), loss=loss)
        session.step()
        session.should_stop()

    for _ in range(WARMUP):
        step()
    per_step = []
    with SyncAudit() as audit, warnings.catch_warnings(record=True) as syncs:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        for _ in range(AUDITED):
            step()
            counts = audit.take()
            found = [f"{w.filename}:{w.lineno}: {w.message}" for w in syncs if "synchronizing CUDA" in str(w.message)]
            counts["cuda_syncs"], counts["cuda_sync_lines"] = len(found), found[:3]
            counts.pop("wait_seconds")
            per_step.append(counts)
            syncs.clear()
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
        step()
        if not pipeline:
            session.report("train")
        reported = audit.take()
    buckets = len(optimizer.buckets) if zero else None
    session.finish()
    if session.rank == 0:
        print(json.dumps({"event": "sync.audit", "shape": shape, "layers": layers, "buckets": buckets,
                          "steps": per_step, "report_step": reported}), flush=True)


if __name__ == "__main__":
    main()
