"""The buckets of a sharded optimizer (hvdkit.zero.optimizer): consecutive trainable parameters
of one param group, last layer first, each one flat vector. The layout depends on the parameters
alone, not on the world size, so that a sharded checkpoint, which records it, re-partitions to
any world size (hvdkit.zero.shards)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

# Not the gradient buckets' rule (hvdkit.rank.step.buckets): this layout is saved in checkpoints, so it
# may not change with the device, and 8 MiB rather than 32 gave a lower peak and ran faster on CPUs
# (docs/zero.md).
BUCKET_BYTES = 8 * 1024 * 1024


@dataclass
class Bucket:
    """Parameters reduced and updated as one flat vector; ``params`` index the optimizer's
    parameters in the order its state_dict numbers them."""

    group: int
    params: list[int]
    shapes: list[tuple]
    offsets: list[int]
    length: int

    def slice_length(self, size: int) -> int:
        return math.ceil(self.length / size)

    def describe(self) -> dict:
        return {"group": self.group, "params": self.params, "shapes": [list(s) for s in self.shapes],
                "offsets": self.offsets, "length": self.length}

    @classmethod
    def from_description(cls, d: dict) -> "Bucket":
        return cls(d["group"], list(d["params"]), [tuple(s) for s in d["shapes"]], list(d["offsets"]), d["length"])


def layout(param_groups: list[dict], bucket_bytes: int = BUCKET_BYTES) -> list[Bucket]:
    """The buckets of the trainable parameters: the same on every rank and at every world size."""
    numbered, index = [], 0
    for g, group in enumerate(param_groups):
        for p in group["params"]:
            numbered.append((g, index, p))
            index += 1
    buckets: list[Bucket] = []
    current: Optional[Bucket] = None
    key = None
    for g, i, p in reversed(numbered):
        if not p.requires_grad:
            continue
        if current is None or key != (g, p.dtype, p.device) or current.length * p.element_size() >= bucket_bytes:
            current, key = Bucket(g, [], [], [], 0), (g, p.dtype, p.device)
            buckets.append(current)
        current.params.append(i)
        current.shapes.append(tuple(p.shape))
        current.offsets.append(current.length)
        current.length += p.numel()
    return buckets
