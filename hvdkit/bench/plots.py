"""The files a benchmark leaves: the allreduce CSV and the PNG plots."""

from __future__ import annotations

import argparse
from pathlib import Path

from hvdkit.bench.figures import format_size


def write_allreduce_csv(record: dict, path: Path) -> None:
    lines = ["implementation,bytes,count,time_us,algbw_GBps,busbw_GBps"]
    for row in record["rows"]:
        for name in record["implementations"]:
            cell = row[name]
            lines.append(f"{name},{row['bytes']},{row['count']},{cell['time_us']:.3f},{cell['algbw']:.6f},"
                         f"{cell['busbw']:.6f}")
    path.write_text("\n".join(lines) + "\n")


def pyplot():
    """matplotlib's pyplot drawing to files (bench figures, `hvdkit plot`)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on a cluster node
    import matplotlib.pyplot as plt
    return plt


def plot_allreduce(record: dict, path: Path) -> None:
    plt = pyplot()
    fig, (bw_ax, time_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    sizes = [row["bytes"] for row in record["rows"]]
    for name in record["implementations"]:
        bw_ax.plot(sizes, [row[name]["busbw"] for row in record["rows"]], marker="o", label=name)
        time_ax.plot(sizes, [row[name]["time_us"] for row in record["rows"]], marker="o", label=name)
    for ax, label in ((bw_ax, "bus bandwidth (GB/s)"), (time_ax, "time per allreduce (us)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [format_size(s) for s in sizes], rotation=60)
        ax.set_xlabel("message size")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    time_ax.set_yscale("log")
    bw_ax.legend()
    fig.suptitle(f"allreduce, {record['world_size']} ranks, {record['environment']['host']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_scaling(table: list[dict], args: argparse.Namespace, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    nps = [row["np"] for row in table]
    base = table[0]["total_img_sec"] / table[0]["np"]
    ax.plot(nps, [row["total_img_sec"] for row in table], marker="o", label=f"{args.impl} measured")
    ax.plot(nps, [n * base for n in nps], linestyle="--", label="linear")
    for row in table:
        ax.annotate(f"{row['efficiency']:.0%}", (row["np"], row["total_img_sec"]), textcoords="offset points",
                    xytext=(4, -12))
    ax.set_xticks(nps)
    ax.set_xlabel("ranks (np)")
    ax.set_ylabel("images/sec, all ranks")
    ax.set_title(f"{args.model}, batch {args.batch_size} per rank")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_zero(table: dict, path) -> None:
    from hvdkit.bench.plots import pyplot

    plt = pyplot()
    fig, (rate_ax, bytes_ax) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(table)
    rate_ax.bar(names, [table[n]["samples_per_sec"] for n in names])
    rate_ax.set_ylabel("samples/sec (all ranks)")
    for offset, key in enumerate(("params", "grads", "optimizer_state")):
        bytes_ax.bar([i + 0.27 * (offset - 1) for i in range(len(names))], [table[n][key] / 2**20 for n in names],
                     width=0.27, label=key)
    bytes_ax.set_xticks(range(len(names)), names)
    bytes_ax.set_ylabel("MB held by one rank")
    bytes_ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
