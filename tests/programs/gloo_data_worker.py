"""One rank of test_horovod_fixes' Gloo-under-MPI test: under mpirun with
HOROVOD_CPU_OPERATIONS=gloo (hvdkit/build/patches/0011, 0012), the collectives hvdkit's ranks use
give the right values, in the global process set and in one registered later, which MPI serves.
Prints one JSON record per rank (selftest.parse_records reads them)."""

import json

import horovod.torch as hvd
import torch


def main() -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    result = {"event": "gloo_data", "rank": rank, "controller": "mpi" if hvd.mpi_enabled() else "gloo"}
    total = sum(range(1, size + 1))

    summed = hvd.allreduce(torch.full((1000,), float(rank + 1)), op=hvd.Sum, name="sum")
    in_place = torch.full((3_000_000,), float(rank + 1))  # a gradient-sized buffer, reduced where it lies
    address = in_place.data_ptr()
    hvd.allreduce_(in_place, op=hvd.Average, name="in_place")
    grouped = [torch.full((n,), float(rank + 1)) for n in (5, 700, 40_000)]
    hvd.grouped_allreduce_(grouped, op=hvd.Sum, name="grouped")  # fused: one buffer, copied in and out
    result["sums_right"] = bool((summed == total).all() and all((t == total).all() for t in grouped))
    result["average_right"] = bool((in_place == total / size).all()) and in_place.data_ptr() == address
    result["allgather"] = hvd.allgather(torch.tensor([rank]), name="gather").tolist()
    result["broadcast"] = hvd.broadcast(torch.tensor([rank * 10]), root_rank=1, name="bcast").item()

    # A process set registered after start has no Gloo context: its collectives go to MPI.
    pair = hvd.add_process_set([0, 1])
    if rank in (0, 1):
        result["pair_sum"] = hvd.allreduce(torch.ones(4), op=hvd.Sum, name="pair", process_set=pair)[0].item()
    hvd.remove_process_set(pair)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
