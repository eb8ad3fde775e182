"""Sharded checkpoints: each rank writes the optimizer state of its own slices (at stage 3 its
slices of the weights too); nothing is gathered.

A sharded run's checkpoint is the usual file rank 0 writes (hvdkit.checkpoint) whose
"optimizer" entry is a manifest: the stage, the world size, the buckets (hvdkit.zero.optimizer) and
the param groups' options. Each rank's shard is its part of the checkpoint (hvdkit.checkpoint.parts),
under ``"zero"``, written atomically by its rank before rank 0 writes the main file, which names
every part with its sha256. The main file
is what makes the checkpoint exist: a save killed part-way leaves the previous checkpoint the
newest complete one.

The buckets do not depend on the world size, and each names its parameters (by index), their
shapes and offsets, so any element of any parameter's state is found in the shards of any size
and any stage: a run resumes at another size, or with other buckets, by reading, one file at a
time, the pieces of its new slices, and ``export`` assembles the plain optimizer state_dict that
a torch optimizer on one process loads as it is.

Stage 3 checkpoints its weights by parameter the same way: the main file's model holds only the
buffers and the weights not sharded (None in each sharded weight's place), each part its rank's
slices of the weights beside their state, and the manifest each parameter's state_dict names.
The slices are re-sliced by the same plan, and joined whole for a resume at stage 0, 1 or 2 and
for ``export``; no rank gathers the whole model to write it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch

from hvdkit import checkpoint
from hvdkit.checkpoint import CheckpointError
from hvdkit.zero.layout import Bucket
from hvdkit.zero.optimizer import ShardedOptimizer

WEIGHT = "hvdkit.weight"  # a stage-3 slice of the weights, re-sliced beside its optimizer state (never loaded as state)


def manifest(optimizer: ShardedOptimizer) -> dict:
    """What the main file says of a sharded optimizer, in place of its state: the stage, the world
    size, the buckets and the param groups (each rank's shard is its part of the checkpoint); at
    stage 3 also ``weights``: per parameter index, the state_dict names of its sharded weight,
    whose slices are in the parts, by bucket, beside the optimizer's (None: kept whole in the
    main file's model)."""
    described = {"zero": optimizer.stage, "world_size": optimizer.size,
                 "buckets": [b.describe() for b in optimizer.buckets], "groups": optimizer.group_options(),
                 "group_sizes": optimizer.group_sizes}
    if optimizer.stage == 3:
        described["weights"] = optimizer.weight_names()
    return described


def is_manifest(entry) -> bool:
    return isinstance(entry, dict) and "buckets" in entry


def holds_weights(entry) -> bool:
    """A stage-3 manifest: the sharded weights are in the parts (whole_model assembles them)."""
    return is_manifest(entry) and bool(entry.get("weights"))


def _entries(shard: dict, n: int) -> dict:
    """Bucket ``n``'s tensors in a shard: its optimizer state, and its slice of the weights under
    WEIGHT where the shard holds them (stage 3)."""
    entries = dict(shard["state"].get(n, {}))
    if n in shard.get("weights", {}):
        entries[WEIGHT] = shard["weights"][n]
    return entries


def _shard(folder: Path, manifest: dict, rank: int) -> dict:
    """Rank ``rank``'s shard (its ``state``: bucket number -> state) of the checkpoint whose
    optimizer ``manifest`` is, in its part, or in the shard file of a checkpoint written before
    one protocol for parts (checkpoint.legacy_shards)."""
    legacy = checkpoint.legacy_shards({"optimizer": manifest})
    if legacy:
        return checkpoint.load(folder / legacy[rank]["file"])
    return checkpoint.load(folder / checkpoint.part_name(rank, manifest["world_size"]))["zero"]


def _where(buckets: list[Bucket]) -> dict[int, tuple[int, int]]:
    """Parameter index -> (bucket number, offset in the bucket)."""
    return {i: (n, offset) for n, b in enumerate(buckets) for i, offset in zip(b.params, b.offsets, strict=True)}


def _copy_plan(old: list[Bucket], old_size: int, wanted: list[tuple]) -> dict[int, list[tuple]]:
    """For each wanted (target, param, first element, count, target position): the copies from the
    old shards, by old rank: (old bucket, old position, target, target position, length)."""
    where = _where(old)
    plan: dict[int, list[tuple]] = {}
    for target, param, first, count, at in wanted:
        n, offset = where[param]
        width = old[n].slice_length(old_size)
        lo, hi = offset + first, offset + first + count  # in the old bucket's flat vector
        for rank in range(lo // width, (hi - 1) // width + 1):
            a, b = max(lo, rank * width), min(hi, (rank + 1) * width)
            plan.setdefault(rank, []).append((n, a - rank * width, target, at + a - lo, b - a))
    return plan


def _apply(plan: dict[int, list[tuple]], folder: Path, manifest: dict, targets: dict) -> None:
    """Run ``plan``, reading one old shard at a time into ``targets`` (target -> state dict,
    tensors made at first use with ``targets``' sizes)."""
    for rank in sorted(plan):
        shard = _shard(folder, manifest, rank)
        for n, position, target, at, length in plan[rank]:
            state, size = targets[target]
            for key, value in _entries(shard, n).items():
                if not torch.is_tensor(value) or value.dim() == 0:
                    state[key] = value.clone() if torch.is_tensor(value) else value
                    continue
                whole = state.setdefault(key, torch.zeros(size, dtype=value.dtype))
                whole.view(-1)[at:at + length] = value[position:position + length]
        del shard


def load(optimizer: ShardedOptimizer, main: Path, manifest: dict) -> None:
    """This rank's slices' state from a sharded checkpoint written at any world size."""
    old = [Bucket.from_description(d) for d in manifest["buckets"]]
    if sorted(i for b in old for i in b.params) != sorted(i for b in optimizer.buckets for i in b.params):
        raise CheckpointError(f"checkpoint {main} shards other parameters than this optimizer trains "
                              f"(a layer frozen or unfrozen since); start afresh in another checkpoint_dir")
    wanted, rank = [], optimizer.rank
    for n, bucket in enumerate(optimizer.buckets):
        width = bucket.slice_length(optimizer.size)
        lo, hi = rank * width, (rank + 1) * width
        for i, offset, shape in zip(bucket.params, bucket.offsets, bucket.shapes, strict=True):
            a, b = max(lo, offset), min(hi, offset + math.prod(shape))
            if a < b:
                wanted.append((n, i, a - offset, b - a, a - lo))
    targets = {n: ({}, (b.slice_length(optimizer.size),)) for n, b in enumerate(optimizer.buckets)}
    _apply(_copy_plan(old, manifest["world_size"], wanted), checkpoint.shard_folder(main), manifest, targets)
    weights = {n: state.pop(WEIGHT) for n, (state, _) in targets.items() if WEIGHT in state}
    if optimizer.stage == 3 and holds_weights(manifest):
        optimizer.load_weight_slices(weights)  # else a stage-3 run's weights are in the main file's model
    optimizer.load_shard_state({n: state for n, (state, _) in targets.items() if state}, manifest["groups"])


def load_own(optimizer: ShardedOptimizer, snapshot: Path, manifest: dict, shard: dict) -> None:
    """This rank's slices' state from its shard as a snapshot kept it (rank.resume.shard_snapshots): the
    same world size and buckets, so it is this rank's state as it was, with nothing re-sliced."""
    if (manifest["buckets"] != [b.describe() for b in optimizer.buckets] or shard["rank"] != optimizer.rank
            or shard["world_size"] != optimizer.size):
        raise CheckpointError(f"snapshot {snapshot} shards other parameters, or other ranks, than this optimizer "
                              f"(a layer frozen or unfrozen since); start afresh in another checkpoint_dir")
    if "weights" in shard:
        optimizer.load_weight_slices(shard["weights"])
    optimizer.load_shard_state(shard["state"], manifest["groups"])


def _joined(main: Path, manifest: dict) -> tuple[dict, dict]:
    """(the torch state_dict of the whole optimizer, as one process would have it: every trained
    parameter's state at its own shape, the param groups numbering all parameters; the sharded
    weights whole, by state_dict name: a stage-3 checkpoint's, else none), every part read once."""
    old = [Bucket.from_description(d) for d in manifest["buckets"]]
    wanted, targets = [], {}
    for bucket in old:
        for i, shape in zip(bucket.params, bucket.shapes, strict=True):
            wanted.append((i, i, 0, math.prod(shape), 0))
            targets[i] = ({}, tuple(shape))
    _apply(_copy_plan(old, manifest["world_size"], wanted), checkpoint.shard_folder(main), manifest, targets)
    names = manifest.get("weights") or []
    weights = {}
    for i, (state, _) in targets.items():
        value = state.pop(WEIGHT, None)
        for name in (names[i] or []) if value is not None else []:
            weights[name] = value
    groups, first = [], 0
    for options, count in zip(manifest["groups"], manifest["group_sizes"], strict=True):
        groups.append({**options, "params": list(range(first, first + count))})
        first += count
    return {"state": {i: state for i, (state, _) in sorted(targets.items())}, "param_groups": groups}, weights


def plain_optimizer_state(main: Path, manifest: dict) -> dict:
    """The torch state_dict of the whole optimizer of sharded checkpoint ``main``, as one process
    would have it (a resume at zero 0 loads it)."""
    return _joined(main, manifest)[0]


def whole_model(main: Path, state: dict) -> dict:
    """The model's state_dict of checkpoint ``main`` (its ``state`` read whole) with whole weights:
    a stage-3 checkpoint's sharded weights joined from its parts (for a resume at stage 0, 1 or 2)."""
    if not holds_weights(state["optimizer"]):
        return state["model"]
    return _placed(state["model"], _joined(main, state["optimizer"])[1])


def _placed(model: dict, weights: dict) -> dict:
    """A stage-3 main file's model (None where a weight is sharded) with the joined ``weights``."""
    return {name: weights[name] if value is None else value for name, value in model.items()}


def plain_state(main: Path, state: dict) -> dict:
    """What checkpoint ``main`` (its ``state`` read whole) says of the training, as one process
    would hold it: step, model (a stage-3 one's weights joined), optimizer (a sharded one's joined),
    scheduler and GradScaler."""
    optimizer, model = state["optimizer"], state["model"]
    if is_manifest(optimizer):
        optimizer, weights = _joined(main, optimizer)
        model = _placed(model, weights)
    return {"step": state["step"], "model": model, "optimizer": optimizer,
            "scheduler": state.get("scheduler"), "scaler": state.get("scaler")}


def export(source: str, output: str) -> Path:
    """Write the model and optimizer state_dicts of checkpoint ``source`` (a file, or the newest
    valid one in a directory) as plain torch files in the new directory ``output``:
    model.pt, optimizer.pt, scheduler.pt (if any) and export.json (step, epoch, world size)."""
    out = Path(output)
    if out.exists():
        raise CheckpointError(f"export: {out} exists; name a new directory (nothing is overwritten)")
    path = Path(source)
    if path.is_dir():
        found = checkpoint.load_latest(str(path), lambda message: print(f"hvdkit: warning: {message}"))
        if found is None:
            raise CheckpointError(f"export: {path} holds no checkpoint")
        path, state = found
    else:
        state = checkpoint.load_whole(path)
    plain = plain_state(path, state)
    files = {"model.pt": plain["model"], "optimizer.pt": plain["optimizer"]}
    if plain["scheduler"] is not None:
        files["scheduler.pt"] = plain["scheduler"]
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for name, value in files.items():
            torch.save(value, staging / name)
        (staging / "export.json").write_text(json.dumps({
            "checkpoint": str(path), "step": state["step"], "epoch": state["epoch"],
            "world_size": state["world_size"], "zero": state["config"].get("zero", 0)}, indent=1) + "\n")
        os.rename(staging, out)  # the whole export appears at once, or none of it
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
