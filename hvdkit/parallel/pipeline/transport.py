"""Activations and their gradients between neighbouring pipeline stages: over MPI's point-to-point
where there is an MPI world, else over Horovod's collectives.

Chosen by measurement (`hvdkit bench pp-transport` and `hvdkit bench pp`, docs/performance.md):
where Horovod runs on MPI, the stage's tensors are on the CPU and each rank has a core of its own (MPI's
waits poll), a transfer is mpi4py's
``Isend``/``Irecv`` on a communicator of the pair's own (made once per pair, by its two ranks: its
messages never meet Horovod's), 0.11-0.36x the time of torch's isend/irecv over Gloo. Elsewhere
(``horovodrun --gloo``, which has no MPI world; a GPU's tensors, which a CUDA-aware MPI is not
assumed to take) it is a broadcast within the two ranks' Horovod process set (hvdkit.parallel.mesh's
pairs, made at ``hvd.init``), rooted at the sender, which Horovod matches by name: hvdkit has no
point-to-point send there (horovod/horovod#1224, #3418).

Either way a transfer lands in a buffer the receiver keeps for that micro-batch from step to step,
and both ranks name it alike (the boundary, the direction, the micro-batch: a tag under MPI, whose
messages between two ranks on one tag arrive in the order sent), so a send and the receive it meets
are one transfer whatever else either rank has in flight: a send is started and left in flight
(``send``), a receive is started early (``post``: at the step's start, for every micro-batch) and
waited for where its tensor is needed (``receive``). A schedule whose sends are all started before
the receives that wait is deadlock-free (hvdkit.parallel.pipeline.schedules).

The receiver needs the tensor's shape and dtype before the transfer. They are sent once per
boundary, direction and micro-batch input shape (a small int64 tensor before the first transfer
of that shape), then remembered: every rank of the pipeline reads the same batches, so all agree
on when a shape is new.
"""

from __future__ import annotations

import torch

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
META = 8  # the shape's header: the dtype's index, the number of dimensions, the dimensions
DIRECTIONS = ("activation", "gradient", "forward")  # what a tag's number says under MPI


class HorovodWire:
    """Transfers over Horovod: a broadcast within ``process_set`` rooted at the sender, named."""

    def __init__(self, process_set) -> None:
        self.process_set = process_set

    def start_send(self, tensor: torch.Tensor, me: int, other: int, name: str, tag: int):
        from horovod.torch import mpi_ops

        return mpi_ops._broadcast_async(tensor, tensor, me, name, self.process_set)

    def start_receive(self, buffer: torch.Tensor, other: int, name: str, tag: int):
        from horovod.torch import mpi_ops

        return mpi_ops._broadcast_async(buffer, buffer, other, name, self.process_set)

    @staticmethod
    def wait(handle) -> None:
        from horovod.torch import mpi_ops

        mpi_ops.synchronize(handle)


class MpiWire:
    """Transfers over mpi4py's point-to-point on ``communicator`` (the pair's own, whose ranks are
    the pair's in its order: ``pair_communicator``), tagged; CPU tensors only, seen as bytes."""

    def __init__(self, communicator, ranks: list[int]) -> None:
        self.communicator, self.ranks = communicator, ranks

    def start_send(self, tensor: torch.Tensor, me: int, other: int, name: str, tag: int):
        return self.communicator.Isend(_bytes(tensor), dest=self.ranks.index(other), tag=tag)

    def start_receive(self, buffer: torch.Tensor, other: int, name: str, tag: int):
        return self.communicator.Irecv(_bytes(buffer), source=self.ranks.index(other), tag=tag)

    @staticmethod
    def wait(handle) -> None:
        handle.Wait()


def _bytes(tensor: torch.Tensor):
    """A contiguous CPU tensor's bytes as a NumPy array over the same memory (bf16 has no NumPy type)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


_COMMUNICATORS: dict[tuple, object] = {}  # a pair's ranks -> its communicator, made once per process


def pair_communicator(ranks: list[int]):
    """The MPI communicator of the pipeline pair ``ranks`` (global ranks, as MPI's world numbers them
    under Horovod's MPI controller), made by its two ranks alone the first time either asks (MPI's
    Create_group is collective over the group only; a rank of a middle stage makes its previous
    pair's first, which its previous stage makes after its own previous pair's: no cycle)."""
    from mpi4py import MPI

    key = tuple(ranks)
    if key not in _COMMUNICATORS:
        world = MPI.COMM_WORLD
        _COMMUNICATORS[key] = world.Create_group(world.Get_group().Incl(list(ranks)), tag=min(ranks))
    return _COMMUNICATORS[key]


def mpi_usable(device: torch.device) -> bool:
    """Whether a pipeline on ``device`` may use MPI's point-to-point: Horovod runs on MPI (not Gloo:
    ``horovodrun --gloo`` has no MPI world), MPI allows calls from any thread (Horovod's background
    thread makes its own), the tensors are on the CPU, and this host has a core for each of its ranks:
    MPI's waits poll, which costs nothing on a core of the rank's own and slows the ranks that share
    one (Horovod's waits sleep)."""
    import os

    from horovod.torch import mpi_ops

    if device.type != "cpu" or not mpi_ops.mpi_enabled() or mpi_ops.local_size() > len(os.sched_getaffinity(0)):
        return False
    from mpi4py import MPI

    return MPI.Is_initialized() and MPI.Query_thread() == MPI.THREAD_MULTIPLE


class Link:
    """This rank's side of one boundary of its pipeline: ``pair`` (hvdkit.parallel.mesh.Group, the
    two neighbours' ranks, sender of activations first), ``name`` its transfers' prefix, ``transport``
    "mpi" (MpiWire on the pair's communicator) or "horovod" (HorovodWire on its process set). Made by
    each of the two stages alike, with the same transport; its sends stay in flight until ``settle``."""

    def __init__(self, pair, name: str, transport: str = "horovod") -> None:
        self.pair, self.name, self.transport = pair, name, transport
        self.wire = MpiWire(pair_communicator(pair.ranks), pair.ranks) if transport == "mpi" else \
            HorovodWire(pair.process_set)
        self.shapes: dict[tuple, tuple] = {}  # (direction, the micro-batch's input shape) -> (shape, dtype)
        self.in_flight: list = []  # (handle, the tensor it sends): kept alive until it has gone
        # What each receive lands in, by (direction, input shape, micro-batch), kept from step to step: a
        # fresh tensor of megabytes for every transfer cost as much again as the transfer (page faults;
        # docs/performance.md). A micro-batch's input is free again after its backward.
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.posted: dict[tuple, tuple] = {}  # (direction, micro-batch) -> (handle, buffer) of a receive started

    @property
    def other(self) -> int:
        return self.pair.ranks[1 - self.pair.rank]

    def _address(self, direction: str, index: int, header: bool = False) -> tuple[str, int]:
        """A transfer's name (Horovod's) and tag (MPI's): its direction, micro-batch, and whether it is the
        shape's header."""
        name = f"{self.name}.{direction}.{'shape.' if header else ''}{index}"
        return name, (index * len(DIRECTIONS) + DIRECTIONS.index(direction)) * 2 + header

    def send(self, tensor: torch.Tensor, direction: str, index: int, key: tuple) -> None:
        """Start sending ``tensor`` (micro-batch ``index``'s, ``direction`` "activation", "gradient" or
        "forward") to the other stage; ``key``: the micro-batch's input shape."""
        tensor = tensor.detach().contiguous()
        me = self.pair.ranks[self.pair.rank]
        if (direction, key) not in self.shapes:
            header = torch.zeros(META, dtype=torch.int64)
            header[0], header[1] = DTYPES.index(tensor.dtype), tensor.dim()
            header[2:2 + tensor.dim()] = torch.tensor(tensor.shape)
            self.in_flight.append((self.wire.start_send(header, me, self.other, *self._address(direction, index, True)),
                                   header))
            self.shapes[(direction, key)] = (tuple(tensor.shape), tensor.dtype)
        self.in_flight.append((self.wire.start_send(tensor, me, self.other, *self._address(direction, index)), tensor))

    def post(self, direction: str, index: int, key: tuple, device: torch.device) -> None:
        """Start receiving micro-batch ``index``'s tensor of ``direction`` into its kept buffer, where
        its shape is known (after the first step of that shape), so that it has been negotiated (or
        matched) by the time ``receive`` waits: a receive started only where its tensor is needed
        cost more than a millisecond on the critical path each over Horovod (docs/performance.md)."""
        known = self.shapes.get((direction, key))
        if known is None or (direction, index) in self.posted:
            return
        buffer = self.buffers.get((direction, key, index))
        if buffer is None or buffer.device != device:
            buffer = self.buffers[(direction, key, index)] = torch.empty(known[0], dtype=known[1], device=device)
        self.posted[(direction, index)] = (self.wire.start_receive(buffer, self.other,
                                                                   *self._address(direction, index)), buffer)

    def receive(self, direction: str, index: int, key: tuple, device: torch.device) -> torch.Tensor:
        """Micro-batch ``index``'s tensor of ``direction`` from the other stage, waited for (started
        here where ``post`` did not)."""
        if (direction, key) not in self.shapes:
            header = torch.zeros(META, dtype=torch.int64)
            self.wire.wait(self.wire.start_receive(header, self.other, *self._address(direction, index, True)))
            dims = int(header[1])
            self.shapes[(direction, key)] = tuple(int(d) for d in header[2:2 + dims]), DTYPES[int(header[0])]
        self.post(direction, index, key, device)
        handle, buffer = self.posted.pop((direction, index))
        self.wire.wait(handle)
        return buffer.view(buffer.shape)  # a tensor of its own each time (its .grad too), over the kept storage

    def settle(self) -> None:
        """Wait for this rank's sends: at the end of a schedule, before the names are used again."""
        for handle, _ in self.in_flight:
            self.wire.wait(handle)
        self.in_flight.clear()
