"""A real 2-process check of the installed Horovod: collectives and 5 training steps.

`hvdkit doctor --selftest` launches ``horovodrun -np 2 -H localhost:2 --gloo|--mpi`` on this
module's worker, built by ``launch.local_command`` as `hvdkit launch` builds it; each rank
prints one JSON line of raw results, and ``check`` compares them with what the collectives
must give. The test suite runs the same worker under horovodrun and mpirun,
so what `hvdkit doctor --selftest` vouches for is what the tests check.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Sequence

from hvdkit import env

NP = 2
TRAIN_STEPS = 5
RESULT_EVENT = "selftest"


def mpi_root_env(environ=os.environ) -> dict:
    """Open MPI refuses to start as root unless told; tests and CI run as root."""
    env = dict(environ)
    if os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def worker_command() -> list[str]:
    return [sys.executable, "-m", "hvdkit.checks.selftest", "--worker"]


def _weights_digest(model) -> str:
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def worker() -> None:
    """One rank: run the collectives and the training steps, print one JSON line of results."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    launch = env.detect()
    result = {"event": RESULT_EVENT, "rank": rank, "size": size,
              "controller": "mpi" if hvd.mpi_enabled() else "gloo",
              "launcher": launch.launcher, "launcher_rank": launch.rank, "launcher_size": launch.size}

    result["allreduce_sum"] = hvd.allreduce(torch.arange(4.0) + rank, op=hvd.Sum, name="ar").tolist()
    result["broadcast"] = hvd.broadcast(torch.full((3,), float(rank)), root_rank=size - 1, name="bc").tolist()
    result["allgather"] = hvd.allgather(torch.tensor([rank]), name="ag").tolist()

    payload = torch.ones(1 << 18)  # 1 MiB of float32
    hvd.allreduce(payload, name="warmup")
    start = time.perf_counter()
    for i in range(10):
        hvd.allreduce(payload, name=f"timed.{i}")
    result["allreduce_1mib_ms"] = (time.perf_counter() - start) / 10 * 1e3

    # Different initial weights and data on each rank: broadcast and averaging must make
    # the ranks agree bit for bit, and training must move the weights.
    torch.manual_seed(1234 + rank)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    result["initial_weights_sha256"] = _weights_digest(model)
    for _ in range(TRAIN_STEPS):
        x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    result["weights_sha256"] = _weights_digest(model)
    print(json.dumps(result), flush=True)
    hvd.shutdown()


def parse_records(output: str, event: str) -> list[dict]:
    """The JSON records of ``event`` in a launcher's output, in order of appearance.

    Launchers prefix lines ("[1,0]<stdout>:") and may glue two ranks' lines together, so
    records are decoded wherever they start rather than line by line.
    """
    decoder = json.JSONDecoder()
    marker = '{"event": "%s"' % event
    records = []
    start = output.find(marker)
    while start >= 0:
        try:
            record, end = decoder.raw_decode(output, start)
            records.append(record)
        except json.JSONDecodeError:
            end = start + len(marker)
        start = output.find(marker, end)
    return records


def parse_results(output: str) -> list[dict]:
    """The selftest's per-rank results, ordered by rank."""
    return sorted(parse_records(output, RESULT_EVENT), key=lambda r: r["rank"])


def check(results: Sequence[dict], np: int = NP) -> list[str]:
    """What is wrong with the ranks' results; empty when the collectives and training agree."""
    problems = []
    if [r["rank"] for r in results] != list(range(np)):
        return [f"expected results from ranks 0..{np - 1}, got ranks {[r['rank'] for r in results]}"]
    expected_sum = [np * i + np * (np - 1) / 2 for i in range(4)]
    for r in results:
        if r["size"] != np:
            problems.append(f"rank {r['rank']}: size {r['size']}, expected {np}")
        if (r["launcher_rank"], r["launcher_size"]) != (r["rank"], r["size"]):
            problems.append(f"rank {r['rank']}: the launcher ({r['launcher']}) says rank "
                            f"{r['launcher_rank']} of {r['launcher_size']}, Horovod says {r['rank']} of {r['size']}")
        if r["allreduce_sum"] != expected_sum:
            problems.append(f"rank {r['rank']}: allreduce gave {r['allreduce_sum']}, expected {expected_sum}")
        if r["broadcast"] != [float(np - 1)] * 3:
            problems.append(f"rank {r['rank']}: broadcast gave {r['broadcast']}")
        if r["allgather"] != list(range(np)):
            problems.append(f"rank {r['rank']}: allgather gave {r['allgather']}")
        if r["weights_sha256"] == r["initial_weights_sha256"]:
            problems.append(f"rank {r['rank']}: {TRAIN_STEPS} training steps left the weights unchanged")
    if len({r["initial_weights_sha256"] for r in results}) != 1:
        problems.append("broadcast_parameters left the ranks with different initial weights")
    if len({r["weights_sha256"] for r in results}) != 1:
        problems.append(f"weights differ across ranks after {TRAIN_STEPS} DistributedOptimizer steps")
    return problems


@dataclass
class Outcome:
    name: str
    ok: bool
    seconds: float
    detail: str


def run(name: str, command: Sequence[str], timeout: float = 180) -> Outcome:
    """Launch the worker with ``command`` and check what the ranks report."""
    start = time.monotonic()
    try:
        proc = subprocess.run(command, env=mpi_root_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Outcome(name, False, time.monotonic() - start, f"no result within {timeout:.0f} s")
    seconds = time.monotonic() - start
    results = parse_results(proc.stdout)
    problems = check(results) if results else []
    if proc.returncode != 0 or not results:
        tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-3:]
        problems.insert(0, f"exit code {proc.returncode}: " + " | ".join(tail))
    if problems:
        return Outcome(name, False, seconds, "; ".join(problems))
    latency = max(r["allreduce_1mib_ms"] for r in results)
    return Outcome(name, True, seconds,
                   f"allreduce/broadcast/allgather correct, {TRAIN_STEPS} steps bitwise-identical on "
                   f"{NP} ranks, 1 MiB allreduce {latency:.2f} ms")


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        worker()
    else:
        sys.exit("usage: python -m hvdkit.checks.selftest --worker  (run by `hvdkit doctor --selftest`)")
