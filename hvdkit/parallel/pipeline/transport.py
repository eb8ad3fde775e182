"""Activations and their gradients between neighbouring pipeline stages, over Horovod.

Horovod has no point-to-point send: a transfer is a broadcast within the two ranks' process set
(hvdkit.parallel.mesh's pairs, made at ``hvd.init``), rooted at the sender, into a buffer the
receiver keeps for that micro-batch from step to step. Both ranks name it alike (the boundary,
the direction, the micro-batch), so a send and the receive it meets are one collective whatever
else either rank has in flight: a send is started and left in flight (``send``), a receive is
started early (``post``: at the step's start, for every micro-batch) and waited for where its
tensor is needed (``receive``). Horovod matches collectives by name, not by order, so a schedule
whose sends are all started before the receives that wait is deadlock-free
(hvdkit.parallel.pipeline.schedules). Measured against Horovod's alltoall and torch's
isend/irecv: `hvdkit bench pp-transport` (docs/performance.md).

The receiver needs the tensor's shape and dtype before the broadcast. They are sent once per
boundary, direction and micro-batch input shape (a small int64 tensor before the first transfer
of that shape), then remembered: every rank of the pipeline reads the same batches, so all agree
on when a shape is new.
"""

from __future__ import annotations

import torch

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
META = 8  # the shape's header: the dtype's index, the number of dimensions, the dimensions


def _broadcast(tensor: torch.Tensor, root: int, name: str, process_set):
    from horovod.torch import mpi_ops

    return mpi_ops._broadcast_async(tensor, tensor, root, name, process_set)


def _wait(handle) -> None:
    from horovod.torch import mpi_ops

    mpi_ops.synchronize(handle)


class Link:
    """This rank's side of one boundary of its pipeline: ``pair`` (hvdkit.parallel.mesh.Group, the
    two neighbours' ranks, sender of activations first), ``name`` its collectives' prefix. Made by
    each of the two stages alike; its sends stay in flight until ``settle``."""

    def __init__(self, pair, name: str) -> None:
        self.pair, self.name = pair, name
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

    def send(self, tensor: torch.Tensor, direction: str, index: int, key: tuple) -> None:
        """Start sending ``tensor`` (micro-batch ``index``'s, ``direction`` "activation" or
        "gradient") to the other stage; ``key``: the micro-batch's input shape."""
        tensor = tensor.detach().contiguous()
        me = self.pair.ranks[self.pair.rank]
        if (direction, key) not in self.shapes:
            header = torch.zeros(META, dtype=torch.int64)
            header[0], header[1] = DTYPES.index(tensor.dtype), tensor.dim()
            header[2:2 + tensor.dim()] = torch.tensor(tensor.shape)
            self.in_flight.append((_broadcast(header, me, f"{self.name}.{direction}.shape.{index}",
                                              self.pair.process_set), header))
            self.shapes[(direction, key)] = (tuple(tensor.shape), tensor.dtype)
        self.in_flight.append((_broadcast(tensor, me, f"{self.name}.{direction}.{index}", self.pair.process_set),
                               tensor))

    def post(self, direction: str, index: int, key: tuple, device: torch.device) -> None:
        """Start receiving micro-batch ``index``'s tensor of ``direction`` into its kept buffer, where
        its shape is known (after the first step of that shape), so that Horovod has negotiated it
        by the time ``receive`` waits: a receive started only where its tensor is needed cost more
        than a millisecond on the critical path each (docs/performance.md)."""
        known = self.shapes.get((direction, key))
        if known is None or (direction, index) in self.posted:
            return
        buffer = self.buffers.get((direction, key, index))
        if buffer is None or buffer.device != device:
            buffer = self.buffers[(direction, key, index)] = torch.empty(known[0], dtype=known[1], device=device)
        handle = _broadcast(buffer, self.other, f"{self.name}.{direction}.{index}", self.pair.process_set)
        self.posted[(direction, index)] = (handle, buffer)

    def receive(self, direction: str, index: int, key: tuple, device: torch.device) -> torch.Tensor:
        """Micro-batch ``index``'s tensor of ``direction`` from the other stage, waited for (started
        here where ``post`` did not)."""
        if (direction, key) not in self.shapes:
            header = torch.zeros(META, dtype=torch.int64)
            _wait(_broadcast(header, self.other, f"{self.name}.{direction}.shape.{index}", self.pair.process_set))
            dims = int(header[1])
            self.shapes[(direction, key)] = tuple(int(d) for d in header[2:2 + dims]), DTYPES[int(header[0])]
        self.post(direction, index, key, device)
        handle, buffer = self.posted.pop((direction, index))
        _wait(handle)
        return buffer.view(buffer.shape)  # a tensor of its own each time (its .grad too), over the kept storage

    def settle(self) -> None:
        """Wait for this rank's sends: at the end of a schedule, before the names are used again."""
        for handle, _ in self.in_flight:
            _wait(handle)
        self.in_flight.clear()
