"""A job's ranks as a grid of process sets: tensor parallel innermost, then data parallel, then
the pipeline's stages outermost, as Megatron's parallel_state orders them.

Global rank r holds tensor-parallel rank ``r % tp`` of data-parallel replica ``(r // tp) % dp`` in
pipeline stage ``r // (dp * tp)``: a tensor-parallel group is ``tp`` consecutive ranks, which a
launcher places on one host (its traffic is every layer's), a data-parallel group the ranks that
hold the same shards of the same stage, and a pipeline the ranks that hold the same shards of each
stage (its neighbours pass activations on: a stage's traffic is one tensor per micro-batch, which
crosses hosts well). One place holds every group: the rest of hvdkit asks the mesh for a rank's
coordinates and sets.

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
    """The (pp, dp, tp) grid of a job of ``size`` ranks. Made before ``hvd.init`` (size from the
    launcher: hvdkit.env.detect), on every rank alike; ``bind`` after it. Starts nothing."""

    size: int
    tp: int = 1
    pp: int = 1
    _sets: dict = field(default_factory=dict, repr=False)  # the ranks of each registered group -> its set
    tp_group: Optional[Group] = None
    dp_group: Optional[Group] = None
    pp_group: Optional[Group] = None  # this rank's pipeline: its rank there is its stage
    previous_pair: Optional[Group] = None  # (the previous stage's rank, this one): what stage s - 1 sends here
    next_pair: Optional[Group] = None  # (this rank, the next stage's): what this stage sends on
    ends_group: Optional[Group] = None  # (the first stage's rank, the last's), on those two: a tied embedding's

    def __post_init__(self) -> None:
        if self.tp < 1 or self.size % self.tp:
            raise ConfigError(f"tp: {self.tp} does not divide the job's {self.size} ranks; give a tp that does "
                              f"(tensor-parallel groups are tp consecutive ranks)")
        if self.pp < 1 or self.size % (self.pp * self.tp):
            raise ConfigError(f"pp: {self.pp} stages of {self.tp} ranks (pp x tp = {self.pp * self.tp}) do not divide "
                              f"the job's {self.size} ranks; give a pp and tp whose product does")

    @property
    def dp(self) -> int:
        return self.size // (self.tp * self.pp)

    def _rank(self, stage: int, replica: int, shard: int) -> int:
        return (stage * self.dp + replica) * self.tp + shard

    def tp_ranks(self) -> list[list[int]]:
        """Each tensor-parallel group's global ranks: ``tp`` consecutive ranks."""
        return [[self._rank(p, d, t) for t in range(self.tp)] for p in range(self.pp) for d in range(self.dp)]

    def dp_ranks(self) -> list[list[int]]:
        """Each data-parallel group's global ranks: those holding the same shards of the same stage."""
        return [[self._rank(p, d, t) for d in range(self.dp)] for p in range(self.pp) for t in range(self.tp)]

    def pp_ranks(self) -> list[list[int]]:
        """Each pipeline's global ranks, stage by stage: those holding the same shards of each stage."""
        return [[self._rank(p, d, t) for p in range(self.pp)] for d in range(self.dp) for t in range(self.tp)]

    def ends_ranks(self) -> list[list[int]]:
        """Each pipeline's first and last stage's ranks: what holds an embedding tied to the output."""
        return [[ranks[0], ranks[-1]] for ranks in self.pp_ranks()] if self.pp > 1 else []

    def pairs(self) -> list[list[int]]:
        """Each pair of neighbouring stages' ranks in one pipeline (stage s, stage s + 1)."""
        return [ranks[s:s + 2] for ranks in self.pp_ranks() for s in range(self.pp - 1)]

    def data_parallel(self, hvd) -> tuple[int, int]:
        """(this rank's data-parallel replica, the number of replicas): which shard of the data it
        reads and how many there are, what the seeds, loaders and learning rate scale by. Without
        tensor parallelism Horovod's own rank and size, read at the call (an elastic run's change)."""
        if self.tp == 1 and self.pp == 1:
            return hvd.rank(), hvd.size()
        return self.dp_group.rank, self.dp

    def process_sets(self, hvd, shared: Optional[dict] = None) -> list:
        """The Horovod process sets to make at ``hvd.init`` (every rank the same list, in this order):
        the tensor-parallel groups, the data-parallel ones, the pipelines, their neighbouring pairs
        and their ends (first and last stage), each of more than one rank and fewer than the whole
        job, each set once. ``shared``: the sets of the job's other meshes by their ranks (a program
        with several), reused and added to; the list returned is this mesh's new ones."""
        shared = {} if shared is None else shared
        self._sets, new = {}, []
        for ranks in [*self.tp_ranks(), *self.dp_ranks(), *self.pp_ranks(), *self.pairs(), *self.ends_ranks()]:
            if 1 < len(ranks) < self.size and tuple(ranks) not in self._sets:
                if tuple(ranks) not in shared:
                    shared[tuple(ranks)] = hvd.ProcessSet(ranks)
                    new.append(shared[tuple(ranks)])
                self._sets[tuple(ranks)] = shared[tuple(ranks)]
        return new

    def bind(self, hvd) -> "Mesh":
        """After ``hvd.init(process_sets=self.process_sets(hvd))``: this rank's groups, with their sets."""
        if hvd.size() != self.size:
            raise ConfigError(f"tp: the mesh was made for {self.size} ranks, Horovod has {hvd.size()}")
        me = hvd.rank()
        self.tp_group = self._group(next(g for g in self.tp_ranks() if me in g), me, hvd)
        self.dp_group = self._group(next(g for g in self.dp_ranks() if me in g), me, hvd)
        self.pp_group = self._group(next(g for g in self.pp_ranks() if me in g), me, hvd)
        pipeline, stage = self.pp_group.ranks, self.pp_group.rank
        self.previous_pair = self._group(pipeline[stage - 1:stage + 1], me, hvd) if stage > 0 else None
        self.next_pair = self._group(pipeline[stage:stage + 2], me, hvd) if stage < self.pp - 1 else None
        ends = [pipeline[0], pipeline[-1]]
        self.ends_group = self._group(ends, me, hvd) if self.pp > 1 and me in ends else None
        return self

    def _group(self, ranks: list[int], me: int, hvd) -> Group:
        if len(ranks) == 1:
            process_set = None
        elif len(ranks) == self.size:
            process_set = hvd.global_process_set
        else:
            process_set = self._sets[tuple(ranks)]
        return Group(ranks, ranks.index(me), process_set)
