"""The ring-allreduce cost model: what a step costs at N ranks on a link of a given speed,
from two things one run measures (compute time per step and gradient bytes).

A ring allreduce of B bytes over N ranks sends and receives 2(N-1)/N x B per rank, in
2(N-1) steps that each pay the link's latency once:

    t_allreduce = 2(N-1)/N x B / bandwidth + 2(N-1) x latency

Horovod starts allreducing gradients while backward still runs, so a step costs between
``compute + t_allreduce`` (no overlap: what CPU ranks get, whose cores also move the bytes)
and ``max(compute, t_allreduce)`` (full overlap: the best a GPU node can get). Both bounds
are given; the shaped-link runs in docs/performance.md say which one CPUs follow.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional


def ring_allreduce_seconds(nbytes: float, ranks: int, gbit: float, latency_s: float) -> float:
    """Seconds for one ring allreduce of ``nbytes`` over ``ranks`` on a ``gbit`` Gbit/s link."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes * 8 / (gbit * 1e9) + 2 * (ranks - 1) * latency_s


@dataclass
class Estimate:
    np: int
    gbit: float
    allreduce_ms: float
    step_ms_no_overlap: float
    step_ms_overlap: float
    img_sec_no_overlap: float  # the whole job's, like the benchmarks' "total img/sec"
    img_sec_overlap: float
    efficiency_no_overlap: float  # of a perfect np x one rank's compute-only rate
    efficiency_overlap: float


def estimate(compute_ms: float, gradient_bytes: float, batch_size: int, ranks: int, gbit: float,
             latency_us: float = 25.0) -> Estimate:
    """One row of the estimate: ``ranks`` ranks, each computing ``batch_size`` samples per step."""
    comm = ring_allreduce_seconds(gradient_bytes, ranks, gbit, latency_us * 1e-6) * 1e3
    serial, overlap = compute_ms + comm, max(compute_ms, comm)
    return Estimate(np=ranks, gbit=gbit, allreduce_ms=comm, step_ms_no_overlap=serial, step_ms_overlap=overlap,
                    img_sec_no_overlap=ranks * batch_size / serial * 1e3,
                    img_sec_overlap=ranks * batch_size / overlap * 1e3,
                    efficiency_no_overlap=compute_ms / serial, efficiency_overlap=compute_ms / overlap)


def table(compute_ms: float, gradient_bytes: float, batch_size: int, ranks: list[int], gbits: list[float],
          latency_us: float = 25.0) -> list[dict]:
    return [asdict(estimate(compute_ms, gradient_bytes, batch_size, n, g, latency_us)) for g in gbits for n in ranks]


def floor(compute_ms: float, gradient_bytes: float, batch_size: int, ranks: int, gbit: Optional[float],
          across_hosts: bool) -> Optional[dict]:
    """The fastest any data-parallel implementation could run one measured command: every step
    at least its compute and, across hosts, at least the ring allreduce of its gradients on the
    link, the two fully overlapped. None across hosts where the link's rate is not known."""
    if across_hosts and gbit is None:
        return None
    comm_ms = ring_allreduce_seconds(gradient_bytes, ranks, gbit, 0.0) * 1e3 if across_hosts else 0.0
    step_ms = max(compute_ms, comm_ms)
    return {"compute_ms": compute_ms, "gradient_bytes": gradient_bytes, "np": ranks, "gbit": gbit if across_hosts
            else None, "allreduce_ms": comm_ms, "step_ms": step_ms, "img_sec": ranks * batch_size / step_ms * 1e3,
            "bound": "link" if comm_ms > compute_ms else "compute"}
