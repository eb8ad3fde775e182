"""Dropout's random draws under tensor parallelism (Megatron's RNG tracker, tensor_parallel/random.py).

Outside the tensor-parallel regions every rank of a tensor-parallel group holds the same
activations, so its dropout masks must agree: there the ranks draw from torch's own generator,
seeded alike. Inside a region each rank holds its own block (its heads, its block of the MLP's
hidden features), and the same mask on every block would drop the same features of every block:
there the draws come from a generator of the tracker's, seeded apart by tensor-parallel rank
(``seed + 2718 + rank``, Megatron's offset), inside ``with tracker.fork():``. The tracker's state
goes into the checkpoint (``state_dict``) and comes back on resume, so a resumed run draws the
masks the uninterrupted one would have.

On a GPU the CUDA generator of the current device is swapped (reading and setting its state
does not wait for the device); on a CPU torch's default generator.

Activation checkpointing recomputes a forward in the backward: torch's checkpoint brings back
torch's own generator for it, and ``checkpoint`` (Megatron's CheckpointFunction does the same)
brings back the tracker's too, so that the recomputed regions draw the masks the forward drew.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

OFFSET = 2718  # Megatron's: a tensor-parallel seed apart from any data-parallel one


class RNGTracker:
    """The generator of the tensor-parallel regions of one rank of ``group``: made at setup from
    the run's ``seed`` on every rank (no collective); ``fork()`` around the draws of a region."""

    def __init__(self, seed: int, group, device: Optional[torch.device] = None) -> None:
        self.device = device or torch.device("cpu")
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(seed + OFFSET + group.rank)
            self.state = self._get()

    def _get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Draws inside come from this rank's tensor-parallel generator, which goes on from where
        the last region left it; torch's own generator is as it was after."""
        outside = self._get()
        self._set(self.state)
        try:
            yield
        finally:
            self.state = self._get()
            self._set(outside)

    def checkpoint(self, function, *args, **kwargs):
        """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)`` whose
        recomputation draws the tracker's masks of the forward again: the tracker's state at the
        forward's start is put back for the recomputation, and the state of the moment after it."""
        import torch.utils.checkpoint

        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=self._contexts,
                                                 **kwargs)

    def _contexts(self) -> tuple:
        """(forward, recomputation) contexts of one checkpointed call (torch's ``context_fn``)."""
        at_forward: list = []

        @contextlib.contextmanager
        def forward() -> Iterator[None]:
            at_forward.append(self.state.clone())
            yield

        @contextlib.contextmanager
        def recomputation() -> Iterator[None]:
            now, self.state = self.state, at_forward[0].clone()
            try:
                yield
            finally:
                self.state = now

        return forward(), recomputation()

    def state_dict(self) -> dict:
        return {"tensor_parallel": self.state.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.state = state["tensor_parallel"].clone()
