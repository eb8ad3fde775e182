"""One rank of test_horovod_fixes: what hvdkit's fixes to Horovod's source change, checked on
the installed build. Prints one JSON record per rank (selftest.parse_records reads them)."""

import json
import os
import resource
import time

import horovod.torch as hvd
import numpy as np
import torch

WAIT_SECONDS = 2.0
IDLE_SECONDS = 1.5


def process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    os.environ.setdefault("HOROVOD_CYCLE_TIME", "0.1")  # hvdkit's CPU setting (process.performance_settings)
    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()
    result = {"event": "horovod_fixes", "rank": rank, "size": hvd.size(),
              "controller": "mpi" if hvd.mpi_enabled() else "gloo"}

    # float16 sums: with two ranks each element is added once, in float32, and rounded once to
    # nearest even, by the vectorised and the one-at-a-time path alike; 1003 elements reach both
    # (8 at a time, then the rest), with values from subnormal to thousands.
    rng = np.random.default_rng(rank)
    mine = (rng.standard_normal(1003) * 10.0 ** rng.integers(-7, 4, 1003)).astype(np.float16)
    got = hvd.allreduce(torch.from_numpy(mine), op=hvd.Sum, name="fp16.sum").numpy()
    both = hvd.allgather(torch.from_numpy(mine)[None], name="fp16.inputs").numpy()
    want = (both[0].astype(np.float32) + both[1].astype(np.float32)).astype(np.float16)
    result["fp16_mismatches"] = int((got.view(np.uint16) != want.view(np.uint16)).sum())

    # Waiting for an allreduce that another rank joins late: the waiting thread should sleep,
    # not spend its core (Horovod's own wait spun on sched_yield).
    if rank == 1:
        time.sleep(WAIT_SECONDS)
    cpu, wall = time.thread_time(), time.perf_counter()
    hvd.allreduce(torch.ones(4), name="late")
    result["wait_cpu_s"], result["wait_wall_s"] = time.thread_time() - cpu, time.perf_counter() - wall

    # The same allreduce again, now in the response cache, with rank 1 as late: the background
    # thread waits in the negotiation's bit-vector allreduce, where Open MPI's blocking call spun
    # until the late rank came; the whole process should sleep.
    if rank == 1:
        time.sleep(WAIT_SECONDS)
    cpu, wall = process_cpu_s(), time.perf_counter()
    hvd.allreduce(torch.ones(4), name="late")
    result["cached_wait_cpu_s"], result["cached_wait_wall_s"] = process_cpu_s() - cpu, time.perf_counter() - wall

    # Idle, with nothing enqueued: Horovod's background thread ran a negotiation every cycle
    # regardless, 0.5-0.65 s of CPU a second under Gloo at a 0.1 ms cycle; it should sleep.
    cpu, wall = process_cpu_s(), time.perf_counter()
    time.sleep(IDLE_SECONDS)
    result["idle_cpu_s"], result["idle_wall_s"] = process_cpu_s() - cpu, time.perf_counter() - wall

    # An allreduce that fails still raises on every rank through the new wait.
    try:
        hvd.allreduce(torch.ones(3 + rank), name="mismatched")
        result["mismatch_error"] = None
    except Exception as error:  # Horovod's HorovodInternalError
        result["mismatch_error"] = f"{type(error).__name__}: {error}"
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
