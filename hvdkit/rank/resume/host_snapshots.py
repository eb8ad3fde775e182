"""Snapshots (``snapshot_steps``): the state in host memory for hvdkit launch's restarts, in the
background beside the checkpoints, in a folder named by the host (hosts that share a memory, as
rehearsal hosts do, keep theirs apart). Each host's local rank 0 writes its copy; under ZeRO
every rank writes its own, with a copy of another's shard (rank.resume.shard_snapshots). Under
tensor parallelism each rank of the host's first tensor-parallel group (its local ranks 0 to tp-1:
a group runs on one host) writes its own blocks, in a folder of its own (``tp-<rank>``), and the
rank that reads them joins them whole (hvdkit.parallel.whole.joined_blocks)."""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import socket
import struct
from pathlib import Path
from typing import Callable, Optional

import torch

from hvdkit import checkpoint, job
from hvdkit.config import ConfigError
from hvdkit.parallel.whole import joined_blocks
from hvdkit.rank.resume.shard_snapshots import KEEP as SHARD_KEEP
from hvdkit.rank.resume.shard_snapshots import ShardSnapshots
from hvdkit.rank.start.startup import rng_state
from hvdkit.zero import shards


def _packed(state: dict) -> torch.Tensor:
    """A rank's RNG state as bytes with their length first, for a gather of unequal sizes."""
    data = pickle.dumps(state)
    return torch.frombuffer(bytearray(struct.pack("<q", len(data)) + data), dtype=torch.uint8)


def _unpacked(gathered: torch.Tensor) -> list:
    """Every rank's RNG state, in rank order, from the gather of ``_packed``'s."""
    data, found, at = gathered.numpy().tobytes(), [], 0
    while at < len(data):
        (length,) = struct.unpack_from("<q", data, at)
        found.append(pickle.loads(data[at + 8:at + 8 + length]))
        at += 8 + length
    return found


class HostSnapshots:
    """One rank's part in its job's snapshots, kept under ``root`` (HVDKIT_SNAPSHOT_DIR)."""

    @classmethod
    def of_run(cls, cfg, hvd, mesh=None) -> Optional["HostSnapshots"]:
        """The run's snapshots where it keeps them (``snapshot_steps`` under hvdkit launch's
        restarts, which name the root); else None. Starts nothing."""
        root = os.environ.get(job.SNAPSHOTS) if cfg.snapshot_steps else None
        return cls(hvd, root, mesh.tp if mesh else 1) if root else None

    def __init__(self, hvd, root: str, tp: int = 1) -> None:
        self.hvd, self.root, self.tp = hvd, root, tp
        self.dir = os.path.join(root, socket.gethostname())
        self.writer = checkpoint.Writer(background=True, raw=True)
        self.shards: Optional[ShardSnapshots] = None  # ZeRO's (arrange)
        self._rng_gathers: list = []  # RNG gathers in flight, on ranks that write no snapshot

    def arrange(self, optimizer) -> None:
        """ZeRO (``optimizer`` sharded): who keeps a copy of whose shard; a collective, at setup."""
        self.shards = ShardSnapshots(self.hvd, optimizer, self.dir)
        self.shards.arrange()

    def reader(self) -> int:
        """The rank that reads the state to resume from: rank 0, unless another host keeps a newer
        snapshot (rank 0's host may keep none, or an older one: its snapshot removed or unwritten).
        ZeRO's snapshots are read otherwise (ShardSnapshots.resume)."""
        if self.shards:
            return 0
        newest = -1
        if self.hvd.local_rank() == 0 and os.path.isdir(self.dir):
            for folder in self._folders():
                checkpoint.clean_partials(folder)
            newest = self.newest()
        steps = self.hvd.allgather_object(newest, name="hvdkit.resume.snapshots")
        return max(range(len(steps)), key=lambda rank: (steps[rank], -rank))

    def _folders(self) -> list[str]:
        """Where this host's snapshot is: its folder, or each tensor-parallel rank's in it."""
        return [self.dir] if self.tp == 1 else [os.path.join(self.dir, f"tp-{rank}") for rank in range(self.tp)]

    @property
    def writes(self) -> bool:
        """This rank writes (its part of) its host's snapshot: local rank 0, or under tensor
        parallelism each rank of the host's first group (local rank = tensor-parallel rank)."""
        return self.hvd.local_rank() < self.tp

    def newest(self) -> int:
        """The step of the newest snapshot on this host (-1: none); under tensor parallelism the step
        of every rank's blocks alike (-1 where they differ: a rank killed while it wrote)."""
        steps = {max(map(checkpoint.step_of, checkpoint.existing(folder)), default=-1) for folder in self._folders()}
        return steps.pop() if len(steps) == 1 else -1

    def load_latest(self, warn: Callable[[str], None]) -> Optional[tuple]:
        """(path, state) of this host's newest snapshot, as checkpoint.load_latest reads a checkpoint;
        under tensor parallelism each rank's blocks of that step, joined whole. None where there is none."""
        if self.tp == 1:
            return checkpoint.load_latest(self.dir, warn)
        step = self.newest()
        if step < 0:
            return None
        paths = [checkpoint.path_for(folder, step) for folder in self._folders()]
        return paths[0], joined_blocks([checkpoint.load_whole(path) for path in paths])

    def take(self, step: int, state_bytes: Callable[[], int], write: Callable,
             own_rng: Callable[[], dict] = rng_state) -> None:
        """Step ``step``'s state into host memory, by ``write(optimizer state, place=, rng=, ...)``
        (all ranks call it). No host sync and no wait on other ranks in the step: the copy from a
        GPU is queued, as a background checkpoint's is, and every rank's RNG state is gathered by
        a collective left in flight, which the snapshot's writing thread waits for."""
        self._settle_rng(wait=False)
        handle = self.hvd.allgather_async(_packed(own_rng()), name=f"hvdkit.snapshot.rng.{step}")
        rng = checkpoint.Later(lambda: _unpacked(self.hvd.synchronize(handle)))
        if self.shards:  # every rank writes its own
            held = self.shards.take(step)
            if not self.writer.saves:
                self._check_room(state_bytes() + self.shards.copy_bytes())
            write(shards.manifest(self.shards.optimizer), place=(self.shards.folder, self.writer, SHARD_KEEP),
                  rng=rng, zero_shards=held)
        elif not self.writes:
            self._rng_gathers.append(handle)
        else:
            if not self.writer.saves:
                self._check_room(state_bytes() * self.tp)
            write(None, place=(self._folders()[self.hvd.local_rank() if self.tp > 1 else 0], self.writer, 1), rng=rng)

    def _check_room(self, size: int) -> None:
        """ConfigError, with the sizes, where two snapshots of ``size`` bytes (the newest and the
        one being written) do not fit in the memory the host has free where they are kept."""
        Path(self.dir).mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.dir).free
        if 2 * size > free:
            error = ConfigError(f"snapshot_steps: two snapshots of this state take {2 * size / 2**20:.1f} MiB and "
                                f"{self.dir} has {free / 2**20:.1f} MiB free; snapshot a smaller state, or drop "
                                f"snapshot_steps")
            error.said_by_its_rank = self.hvd.rank() != 0
            raise error

    def _settle_rng(self, wait: bool = True) -> None:
        """The RNG gathers of a rank that writes no snapshot: those done are taken, without a wait
        in the step (``wait``: all of them, at the run's end)."""
        done = [h for h in self._rng_gathers if wait or self.hvd.poll(h)]
        for handle in done:
            self.hvd.synchronize(handle)
        self._rng_gathers = [h for h in self._rng_gathers if h not in done]

    def drop(self) -> None:
        """The run ended (finished or stopped; every rank calls it): its snapshots go (each host's local
        rank 0; under ZeRO each rank's own)."""
        self._settle_rng()
        if self.shards:
            self.writer.close()
            self.shards.drop()
        elif self.writes:
            self.writer.close()
        if self.tp > 1:  # every block's writer closed before its host's folder goes (all ranks are here: finish)
            self.hvd.allreduce(torch.zeros(1), name="hvdkit.snapshot.closed")
        if not self.shards and self.hvd.local_rank() == 0:
            shutil.rmtree(self.dir, ignore_errors=True)
            with contextlib.suppress(OSError):  # the job's folder, once no host sharing it keeps one
                os.rmdir(self.root)
