"""ZeRO's snapshots in host memory, for hvdkit launch's restarts: no rank holds the whole optimizer
state (at stage 3 nor the weights), so each rank keeps its own snapshot (the model, the
optimizer's manifest and its shard, at stage 3 with its slices of the weights) in
a folder of its host's, and a copy of another rank's shard: at each snapshot every rank sends its
shard to its buddy, the next rank on another host, by an alltoall left in flight (the snapshot's
writing thread waits for it). Every shard is then on two hosts, so losing one loses none.

A resume takes the newest step that every shard has somewhere, each file checked by its digest,
where it is as new as the newest checkpoint or newer (memory is read faster); each shard reaches
its rank by one alltoall, the rest of the state by a broadcast. A snapshot serves a restart at
the same world size only (a restart keeps it); any other resume reads the checkpoints, which re-slice.

A folder's name says which shards its files hold (``zero-of-3-holds-1-0``: the job's world
size, its rank's own shard 1, the copy of rank 0's), so a resume knows where each shard is
before reading any file.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import socket
import sys
from pathlib import Path
from typing import Callable, Optional

import torch

from hvdkit import checkpoint
from hvdkit.config import ConfigError

FOLDER = re.compile(r"zero-of-(\d+)-holds-(\d+(?:-\d+)*)")
KEEP = 2  # a newer snapshot on one rank than on another still leaves a step they all have


def buddies(hosts: list[str]) -> list[Optional[int]]:
    """For each rank, the rank that keeps a copy of its shard: the next one after it, around the
    ranks, on another host; None where every rank is on one host (a copy there saves nothing)."""
    size = len(hosts)
    return [next((b % size for b in range(r + 1, r + size) if hosts[b % size] != hosts[r]), None)
            for r in range(size)]


def folder_name(rank: int, size: int, copies_of: list[int]) -> str:
    return f"zero-of-{size}-holds-{'-'.join(map(str, [rank, *copies_of]))}"


def plan(reports: list[list], size: int, newer_than: int) -> Optional[tuple[int, dict[int, tuple[int, str]]]]:
    """(the step to resume from, each shard's holder: shard -> (rank, folder)) from every rank's
    scan (lists of (folder, shards it holds, its steps)): the newest step newer than
    ``newer_than`` that every shard of ``size`` ranks has; None where there is none."""
    holders: dict[tuple[int, int], tuple[int, str]] = {}
    for rank, folders in enumerate(reports):
        for folder, held, steps in folders:
            for step in steps:
                for shard in held:
                    holders.setdefault((step, shard), (rank, folder))
    for step in sorted({step for step, _ in holders}, reverse=True):
        if step <= newer_than:
            break
        if all((step, shard) in holders for shard in range(size)):
            return step, {shard: holders[step, shard] for shard in range(size)}
    return None


def _pieces(shard: dict) -> list[tuple]:
    """(bucket, key, tensor) of a shard's tensors that are not scalars, in a fixed order: its
    optimizer state's, then (stage 3) its slices of the weights, with the key None."""
    state = [(n, key, value) for n, values in sorted(shard["state"].items()) for key, value in values.items()
             if torch.is_tensor(value) and value.dim()]
    return state + [(n, None, value) for n, value in sorted(shard.get("weights", {}).items())]


class ShardSnapshots:
    """One rank's ZeRO snapshots: arrange() at setup (a collective), take() at each snapshot
    (no wait), resume() at setup, drop() at the end."""

    def __init__(self, hvd, optimizer, host_dir: str) -> None:
        self.hvd, self.optimizer, self.host_dir = hvd, optimizer, host_dir
        self.buddy: Optional[int] = None
        self.copies_of: list[int] = []  # the ranks whose shard this one keeps a copy of
        self.names: list[str] = []  # every rank's folder name
        self.folder = ""

    def arrange(self) -> None:
        """Who keeps whose copy, from every rank's host: one gather, at setup."""
        rank, size = self.hvd.rank(), self.hvd.size()
        hosts = self.hvd.allgather_object(socket.gethostname(), name="hvdkit.snapshot.hosts")
        pairs = buddies(hosts)
        self.buddy = pairs[rank]
        self.copies_of = [s for s in range(size) if pairs[s] == rank]
        self.names = [folder_name(r, size, [s for s in range(size) if pairs[s] == r]) for r in range(size)]
        self.folder = os.path.join(self.host_dir, self.names[rank])

    def copy_bytes(self) -> int:
        """Bytes of the copies this rank keeps (each shard's tensors as large as its own)."""
        return len(self.copies_of) * sum(t.nbytes for _, _, t in _pieces(self.optimizer.shard_state()))

    def take(self, step: int) -> dict:
        """This rank's shard, and the copies of others' it keeps, for its snapshot of ``step``: its
        own as the live tensors (the writer copies them before the next update), the copies as a
        Later resolved by the writing thread once the alltoall sent now has arrived."""
        own = self.optimizer.shard_state()
        entry = {own["rank"]: own}
        if self.buddy is None:  # every rank on one host: none has a buddy
            return entry
        pieces = _pieces(own)
        flat = (torch.cat([t.detach().contiguous().view(-1).view(torch.uint8) for _, _, t in pieces])
                if pieces else torch.empty(0, dtype=torch.uint8))
        splits = [0] * self.hvd.size()
        if self.buddy is not None:
            splits[self.buddy] = flat.numel()
        handle = self.hvd.alltoall_async(flat, splits=torch.tensor(splits, dtype=torch.int32),
                                         name=f"hvdkit.snapshot.shards.{step}")
        # A copy has this rank's layout (every rank's slices are alike) and its scalars (Adam's step:
        # every slice is stepped together), taken now: they change at the next update.
        layout = [(n, key, t.dtype, tuple(t.shape), t.nbytes) for n, key, t in pieces]
        scalars = {n: {k: v.clone() if torch.is_tensor(v) else v for k, v in values.items()
                       if not (torch.is_tensor(v) and v.dim())} for n, values in own["state"].items()}
        entry["copies"] = checkpoint.Later(lambda: self._copies(handle, layout, scalars, own))
        return entry

    def _copies(self, handle, layout: list, scalars: dict, own: dict) -> dict:
        """The shards other ranks sent to be kept here, by their rank, rebuilt with ``layout`` in
        the order of this rank's ``own`` shard."""
        received, counts = self.hvd.synchronize(handle)
        data, at, copies = received.cpu(), 0, {}
        for source, count in enumerate(counts.tolist()):
            if not count:
                continue
            part, placed, offset = data[at:at + count], {}, 0
            for n, key, dtype, shape, nbytes in layout:
                placed[n, key] = part[offset:offset + nbytes].clone().view(dtype).reshape(shape)
                offset += nbytes
            state = {n: {k: placed[n, k] if (n, k) in placed else _on_host(scalars[n][k]) for k in values}
                     for n, values in own["state"].items()}
            copies[source] = {"rank": source, "world_size": self.hvd.size(), "state": state}
            if "weights" in own:
                copies[source]["weights"] = {n: placed[n, None] for n in own["weights"]}
            at += count
        return copies

    def _scan(self) -> list[tuple[str, list[int], list[int]]]:
        """This rank's share of its host's shard folders (its ranks split them): (folder, the shards
        it holds, the steps of its files), of this world size's folders only."""
        host = Path(self.host_dir)
        found = sorted(p for p in host.iterdir() if (m := FOLDER.fullmatch(p.name))
                       and int(m[1]) == self.hvd.size()) if host.is_dir() else []
        mine = found[self.hvd.local_rank()::self.hvd.local_size()]
        scanned = []
        for folder in mine:
            checkpoint.clean_partials(str(folder))
            held = [int(s) for s in FOLDER.fullmatch(folder.name)[2].split("-")]
            scanned.append((str(folder), held, [checkpoint.step_of(p) for p in checkpoint.existing(str(folder))]))
        return scanned

    def resume(self, newer_than: int, accept: Callable[[Path, dict], dict]) -> Optional[dict]:
        """On every rank: the state to resume from (``accept``'s of the main state, with this rank's
        shard under ``zero_shard``, or ``{"error": ...}`` to raise on every rank), or None where
        no step newer than ``newer_than`` has every shard somewhere, or one does not verify."""
        hvd, rank, size = self.hvd, self.hvd.rank(), self.hvd.size()
        found = plan(hvd.allgather_object(self._scan(), name="hvdkit.resume.shards"), size, newer_than)
        if found is None:
            return None
        step, holders = found
        mine = {shard: folder for shard, (holder, folder) in holders.items() if holder == rank}
        loaded, problem = {}, None
        for folder in sorted(set(mine.values())):
            try:
                loaded[folder] = checkpoint.load(checkpoint.path_for(folder, step))
            except checkpoint.CheckpointError as exc:
                problem = str(exc)
        problems = [p for p in hvd.allgather_object(problem, name="hvdkit.resume.shards.read") if p]
        if problems:
            if rank == 0:
                print(f"hvdkit: warning: {problems[0]}; using the newest checkpoint instead", file=sys.stderr,
                      flush=True)
            return None
        sends = [pickle.dumps(_held(loaded[mine[s]], s)) if s in mine else b"" for s in range(size)]
        data = b"".join(sends)
        received, _ = hvd.alltoall(torch.frombuffer(bytearray(data), dtype=torch.uint8) if data
                                   else torch.empty(0, dtype=torch.uint8),
                                   splits=torch.tensor([len(s) for s in sends], dtype=torch.int32),
                                   name="hvdkit.resume.shards.send")
        own = pickle.loads(received.numpy().tobytes())
        root, folder = holders[0]
        main = None
        if rank == root:
            state = {k: v for k, v in loaded[folder].items() if k != "zero_shards"}
            try:
                main = accept(checkpoint.path_for(folder, step), state)
            except (checkpoint.CheckpointError, ConfigError) as exc:
                main = {"error": exc}
        main = hvd.broadcast_object(main, root_rank=root, name="hvdkit.resume")
        return main if "error" in main else {**main, "zero_shard": own}

    def drop(self) -> None:
        """The run ended: this rank's folder goes, and (its host's first rank) those of earlier
        attempts, which no rank of this one writes; the host's folder with the last of them."""
        shutil.rmtree(self.folder, ignore_errors=True)
        if self.hvd.local_rank() == 0 and os.path.isdir(self.host_dir):
            for old in Path(self.host_dir).iterdir():
                if old.name not in self.names:
                    shutil.rmtree(old, ignore_errors=True)
        for folder in (self.host_dir, os.path.dirname(self.host_dir)):
            try:
                os.rmdir(folder)
            except OSError:
                break


def _on_host(value):
    """A scalar of a shard's state as the snapshot's own shard keeps it: on the host."""
    return value.cpu() if torch.is_tensor(value) else value


def _held(state: dict, shard: int) -> dict:
    """Shard ``shard`` from a snapshot's state: its own, or a copy it keeps."""
    kept = state["zero_shards"]
    if shard in kept:
        return kept[shard]
    return kept["copies"][shard]
