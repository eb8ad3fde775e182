"""The benchmarks' arithmetic: sizes, bandwidths, rates, totals, ratios. Pure, and checked by the
tests on hand-made inputs; no test times anything."""

from __future__ import annotations

import math
import re
import statistics
from typing import Sequence

ALLREDUCE_IMPLS = ("mpi4py", "torch.distributed", "horovod in-place", "horovod out-of-place")


_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


class BenchError(ValueError):
    """Bad benchmark input; printed as one line, exit code 2."""


def parse_size(text: str) -> int:
    """Bytes in ``4K``, ``256M``, ``1G`` or ``4096`` (binary units, as nccl-tests)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)I?B?\s*", text.upper())
    nbytes = int(match.group(1)) * _UNITS[match.group(2)] if match else 0
    if nbytes < 4 or nbytes % 4:
        raise BenchError(f"size {text!r}: expected a multiple of 4 bytes (float32) like 4096, 4K, 16M or 1G")
    return nbytes


def size_range(spec: str) -> list[int]:
    """``4K..256M``: every power of two from the first to the last (nccl-tests' -b/-e/-f 2);
    ``4K,1M,64M``: those sizes."""
    if ".." in spec:
        low_text, high_text = spec.split("..", 1)
        low, high = parse_size(low_text), parse_size(high_text)
        if high < low:
            raise BenchError(f"sizes {spec!r}: the last size is smaller than the first")
        sizes = []
        while low <= high:
            sizes.append(low)
            low *= 2
        return sizes
    return [parse_size(part) for part in spec.split(",")]


def format_size(nbytes: int) -> str:
    for unit in ("G", "M", "K"):
        if nbytes >= _UNITS[unit] and nbytes % _UNITS[unit] == 0:
            return f"{nbytes // _UNITS[unit]}{unit}"
    return str(nbytes)


def algbw(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes, as nccl-tests): the buffer size over the time."""
    return nbytes / seconds / 1e9


def busbw(algorithm_bandwidth: float, ranks: int) -> float:
    """Bus bandwidth of an allreduce: algbw x 2(n-1)/n, what each rank's link must carry,
    comparable across world sizes and with the hardware's peak (nccl-tests' definition)."""
    return algorithm_bandwidth * 2 * (ranks - 1) / ranks


def rate_stats(rates: Sequence[float]) -> tuple[float, float]:
    """(mean, 1.96 x standard deviation) of per-iteration rates, as Horovod's benchmark prints."""
    mean = statistics.fmean(rates)
    return mean, 1.96 * (statistics.pstdev(rates) if len(rates) > 1 else 0.0)


def cross_rank_total(rank_rates: Sequence[Sequence[float]]) -> dict:
    """Totals from every rank's own (mean, conf): measured on each rank, not rank 0's x N."""
    total = sum(mean for mean, _ in rank_rates)
    conf = sum(conf for _, conf in rank_rates)
    return {"total_img_sec": total, "total_img_sec_conf": conf,
            "img_sec_per_device": total / len(rank_rates), "img_sec_per_device_conf": conf / len(rank_rates),
            "rank_img_sec": [mean for mean, _ in rank_rates]}


def scaling_table(totals: dict[int, float]) -> list[dict]:
    """Per world size: throughput, speedup and efficiency against the smallest size run
    (np=1 when it was), with the same per-rank batch."""
    base_np = min(totals)
    base_per_rank = totals[base_np] / base_np
    return [{"np": n, "total_img_sec": totals[n], "per_rank_img_sec": totals[n] / n,
             "speedup": totals[n] / totals[base_np], "efficiency": totals[n] / (n * base_per_rank)}
            for n in sorted(totals)]


def default_iterations(nbytes: int) -> int:
    """Enough iterations that a small size is not all launch noise, few for large sizes."""
    return max(10, min(1000, (256 << 20) // nbytes))


def ratio_rows(record: dict) -> list[dict]:
    """Per size: the gradient path's (Horovod in-place) busbw over each peer's."""
    peers = [n for n in record["implementations"] if not n.startswith("horovod")]
    return [{peer: row["horovod in-place"]["busbw"] / row[peer]["busbw"] if row[peer]["busbw"] else math.nan
             for peer in peers} for row in record["rows"]]


def ratio_summary(record: dict, large: int = 16 << 20) -> dict:
    """The issue's targets as figures: in-place vs raw MPI at >= 16 MiB, vs torch at every size."""
    rows, ratios = record["rows"], ratio_rows(record)
    found, lines = {}, []
    if "mpi4py" in record["implementations"]:
        big = [r["mpi4py"] for row, r in zip(rows, ratios, strict=True) if row["bytes"] >= large]
        if big:
            found["in-place/mpi4py min >=16M"] = min(big)
            lines.append(f"horovod in-place / mpi4py busbw, sizes >= 16M: min {min(big):.2f}")
    found["in-place/torch min"] = min(r["torch.distributed"] for r in ratios)
    lines.append(f"horovod in-place / torch.distributed busbw, every size: min {found['in-place/torch min']:.2f}")
    return {"ratios": found, "lines": lines}


# --- hvdkit bench zero ----------------------------------------------------------------------

ZERO_IMPLS = ("zero1", "zero2", "zero3", "horovod", "torch-zero", "fsdp2")
# Tensor parallelism over every rank (the GPT only; named in --impls): hvdkit's plan on Horovod (tp-sp:
# with sequence parallelism), and torch's parallelize_module with the same plan. Each rank steps the
# whole global batch.
TP_IMPLS = ("tp", "tp-sp", "torch-tp")
LADDER_WIDTHS = (512, 640, 768, 896, 1024, 1152, 1280, 1536)
LADDER_STEP = 1.03  # neighbouring models of the ladder differ by at least 3% of parameters
BASELINE_RSS = 1100 * 2**20  # a rank's resident memory before its model: torch, Horovod, MPI (none on a GPU)


def gpt(width: int, layers: int, seq_len: int):
    """The bench's GPT: bytes in, 8 heads."""
    from hvdkit.models import TinyGPT

    return TinyGPT(256, seq_len, width, layers, heads=8)


def peak_saving(table: dict, size: int) -> dict:
    """Each stage's peak below DistributedOptimizer's, beside what DeepSpeed's formula says
    sharding saves for fp32 Adam (16 bytes a parameter unsharded): 8(1 - 1/N) bytes a parameter
    at stage 1, 12(1 - 1/N) at stage 2, 16(1 - 1/N) at stage 3."""
    parameters = table["horovod"]["params"] / 4
    rows = {}
    for impl, per_parameter in (("zero1", 8), ("zero2", 12), ("zero3", 16)):
        if impl not in table:
            continue
        measured = table["horovod"]["peak"] - table[impl]["peak"]
        formula = per_parameter * (1 - 1 / size) * parameters
        rows[impl] = {"measured": measured, "formula": formula, "ratio": measured / formula if formula else None}
    return rows


def ladder(cap: int, size: int, seq_len: int) -> list[tuple[int, int, int]]:
    """(parameters, width, layers) of GPTs in increasing size, neighbours at least LADDER_STEP
    apart, up to the largest that the formula lets any loop fit in ``cap`` (stage 2's 4 + 12/N
    bytes a parameter, or stage 3's 16/N where fewer)."""
    import torch

    most = cap / min(4 + 12 / size, 16 / size)
    found = []
    for width in LADDER_WIDTHS:
        for layers in range(1, 97):
            with torch.device("meta"):
                count = sum(p.numel() for p in gpt(width, layers, seq_len).parameters())
            if count > most:
                break
            found.append((count, width, layers))
    rungs: list[tuple[int, int, int]] = []
    for rung in sorted(found):
        if not rungs or rung[0] >= rungs[-1][0] * LADDER_STEP:
            rungs.append(rung)
    return rungs


def largest(fits, count: int, first: int) -> int:
    """The largest index below ``count`` for which ``fits`` (true up to some index, false after)
    holds, -1 if none: probing from ``first`` outwards in growing steps, then bisecting."""
    low, high, step = -1, count, 1
    probe = min(max(first, 0), count - 1)
    if fits(probe):
        low = probe
        while low + step < high and fits(low + step):
            low, step = low + step, step * 2
        high = min(high, low + step)
    else:
        high = probe
        while high - step > low and not fits(high - step):
            high, step = high - step, step * 2
        low = max(low, high - step)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


# Bytes a parameter each loop needed with fp32 Adam at the peak, measured at np=2 (weights,
# gradients, state, the optimizer's temporaries): where the search for each starts, nothing more.
def zero_guess(impl: str, size: int) -> float:
    return {"horovod": 17.5, "torch-zero": 12 + 8 / size, "zero1": 8 + 10 / size, "zero2": 4 + 13 / size,
            "zero3": 17 / size, "fsdp2": 17 / size, "tp": 17 / size, "tp-sp": 17 / size,
            "torch-tp": 17 / size}[impl]
