"""`bench synthetic --profile`: where a step's time goes, per implementation, in a few lines.

A few steps after the timed ones run under torch.profiler and hvdkit.checks.syncaudit: the ops
that take the most CPU and device time per step, the host syncs per step (what the profiler saw
block the host: a tensor's value read, a stream or device synchronized), and the Horovod wait
points with the time spent in them. The summary rides in the worker's record; the driver writes
one JSON and one text table per implementation beside the figures.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # torch is imported where steps are profiled: the bench's command line does not wait for it
    import torch

STEPS = 5
TOP = 8
# Profiler events that block the host until the device has finished what it was given.
HOST_SYNCS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def profile_steps(step: Callable[[], None], device: torch.device, steps: int = STEPS) -> dict:
    """Run ``steps`` steps under the profiler and the sync audit; their summary per step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from hvdkit.checks.syncaudit import SyncAudit

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    audit = SyncAudit()
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        with audit:
            for _ in range(steps):
                step()
            counts = audit.take()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
    events = prof.key_averages()

    def top(key: str) -> list[dict]:
        rows = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:TOP]
        return [{"op": e.key, "ms_per_step": round(getattr(e, key) / 1e3 / steps, 3),
                 "calls_per_step": round(e.count / steps, 2)} for e in rows if getattr(e, key) > 0]

    syncs = {e.key: round(e.count / steps, 2) for e in events if e.key in HOST_SYNCS}
    return {"steps": steps, "ms_per_step": round(seconds * 1e3 / steps, 3),
            "top_cpu": top("self_cpu_time_total"),
            "top_device": top("self_device_time_total") if device.type == "cuda" else [],
            "host_syncs_per_step": syncs,
            "blocking_reads_per_step": {k: round(v / steps, 2) for k, v in counts["reads"].items()},
            "horovod_wait_points_per_step": round(counts["waits"] / steps, 2),
            "horovod_wait_ms_per_step": round(counts["wait_seconds"] * 1e3 / steps, 3)}


def text(label: str, summary: dict) -> str:
    """The summary as a short table a person reads."""
    lines = [f"{label}: {summary['ms_per_step']:.2f} ms per step over {summary['steps']} profiled steps",
             f"host syncs per step: {summary['host_syncs_per_step'] or 'none'}",
             "blocking tensor reads per step (hvdkit.checks.syncaudit): "
             f"{summary['blocking_reads_per_step'] or 'none'}",
             f"Horovod wait points per step: {summary['horovod_wait_points_per_step']} "
             f"({summary['horovod_wait_ms_per_step']:.2f} ms)"]
    for title, key in (("CPU", "top_cpu"), ("device", "top_device")):
        if summary[key]:
            lines.append(f"top {title} ops (self ms per step, calls per step):")
            lines += [f"  {row['ms_per_step']:9.3f}  {row['calls_per_step']:7.2f}  {row['op']}" for row in summary[key]]
    return "\n".join(lines) + "\n"
