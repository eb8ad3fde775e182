"""A job's ranks as a grid of process sets: tensor parallel innermost, then data parallel (the
pipeline's axis, outermost, is 1 until pipelines come), as Megatron's parallel_state orders them.

Global rank r holds tensor-parallel rank ``r % tp`` of data-parallel replica ``r // tp``: a
tensor-parallel group is ``tp`` consecutive ranks, which a launcher places on one host (its
traffic is every layer's), and a data-parallel group the ranks that hold the same shards. One
place holds every group: the rest of hvdkit asks the mesh for a rank's coordinates and sets.

Horovod's process sets are fixed at ``hvd.init``: every rank makes the same list, in the same
order (``Mesh.process_sets``, passed to ``hvd.init(process_sets=...)``), then ``bind`` finds its
own. A group of one rank gets no set (its collectives are the identity, never called), and a
group that is the whole job is Horovod's global set: neither is registered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hvdkit.config import ConfigError


@dataclass
class Group:
    """One rank's group on one axis: its ``ranks`` (global, in order), this rank's place in them,
    and the Horovod process set its collectives run on (None for a group of one rank)."""

    ranks: list[int]
    rank: int
    process_set: Optional[object] = None

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass
class Mesh:
    """The (dp, tp) grid of a job of ``size`` ranks. Made before ``hvd.init`` (size from the
    launcher: hvdkit.env.detect), on every rank alike; ``bind`` after it. Starts nothing."""

    size: int
    tp: int = 1
    _sets: dict = field(default_factory=dict, repr=False)  # the ranks of each registered group -> its set
    tp_group: Optional[Group] = None
    dp_group: Optional[Group] = None

    def __post_init__(self) -> None:
        if self.tp < 1 or self.size % self.tp:
            raise ConfigError(f"tp: {self.tp} does not divide the job's {self.size} ranks; give a tp that does "
                              f"(tensor-parallel groups are tp consecutive ranks)")

    @property
    def dp(self) -> int:
        return self.size // self.tp

    def tp_ranks(self) -> list[list[int]]:
        """Each tensor-parallel group's global ranks: ``tp`` consecutive ranks."""
        return [[d * self.tp + t for t in range(self.tp)] for d in range(self.dp)]

    def dp_ranks(self) -> list[list[int]]:
        """Each data-parallel group's global ranks: those holding the same tensor-parallel shards."""
        return [[d * self.tp + t for d in range(self.dp)] for t in range(self.tp)]

    def data_parallel(self, hvd) -> tuple[int, int]:
        """(this rank's data-parallel replica, the number of replicas): which shard of the data it
        reads and how many there are, what the seeds, loaders and learning rate scale by. Without
        tensor parallelism Horovod's own rank and size, read at the call (an elastic run's change)."""
        if self.tp == 1:
            return hvd.rank(), hvd.size()
        return self.dp_group.rank, self.dp

    def process_sets(self, hvd) -> list:
        """The Horovod process sets to make at ``hvd.init`` (every rank the same list, in this order):
        the tensor-parallel groups, then the data-parallel ones, each of more than one rank and
        fewer than the whole job."""
        self._sets = {}
        for ranks in [*self.tp_ranks(), *self.dp_ranks()]:
            if 1 < len(ranks) < self.size:
                self._sets[tuple(ranks)] = hvd.ProcessSet(ranks)
        return list(self._sets.values())

    def bind(self, hvd) -> "Mesh":
        """After ``hvd.init(process_sets=self.process_sets(hvd))``: this rank's groups, with their sets."""
        if hvd.size() != self.size:
            raise ConfigError(f"tp: the mesh was made for {self.size} ranks, Horovod has {hvd.size()}")
        me = hvd.rank()
        self.tp_group = self._group(next(g for g in self.tp_ranks() if me in g), me, hvd)
        self.dp_group = self._group(next(g for g in self.dp_ranks() if me in g), me, hvd)
        return self

    def _group(self, ranks: list[int], me: int, hvd) -> Group:
        if len(ranks) == 1:
            process_set = None
        elif len(ranks) == self.size:
            process_set = hvd.global_process_set
        else:
            process_set = self._sets[tuple(ranks)]
        return Group(ranks, ranks.index(me), process_set)
