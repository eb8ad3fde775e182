"""A rank's heavy imports, with Python's cyclic garbage collector paused while they load.

Loading torch, horovod.torch and torch._dynamo makes millions of long-lived objects and almost
no garbage, yet the allocations set off collection after collection that walk them all: 4.9
CPU-s with the collector running, 4.0 with it paused (``python -c "import torch,
horovod.torch, torch._dynamo"``, three runs each). Every rank of every job pays this at start.
What was loaded is then frozen (``gc.freeze``), out of the way of later collections as well.
This module imports nothing heavy itself, so that it can be entered before torch is loaded.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def load_for_training() -> None:
    """torch, horovod.torch and torch._dynamo, with the collector paused. torch._dynamo is the
    largest (2 of a rank's 5 CPU-s): each torch optimizer's ``__init__`` is wrapped so that dynamo
    does not trace it, and that wrapper imports torch._dynamo at the first optimizer made, so
    every training process loads it; here it loads once, before the loop's own setup."""
    with collector_paused():
        import horovod.torch  # noqa: F401
        import torch  # noqa: F401
        import torch._dynamo  # noqa: F401
