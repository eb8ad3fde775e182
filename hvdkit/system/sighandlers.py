"""Signal handlers, set one way: hvdkit's handlers for a block of code, the previous ones after,
nohup's SIGHUP kept ignored."""

from __future__ import annotations

import signal
import threading
from typing import Sequence


def unless_nohup(signals: Sequence[int]) -> list[int]:
    """``signals`` less SIGHUP where it is ignored: `nohup` ignores it so that a job outlives its
    terminal, and hvdkit keeps it so."""
    return [sig for sig in signals if sig != signal.SIGHUP or signal.getsignal(sig) != signal.SIG_IGN]


class Handlers:
    """The one way hvdkit handles signals: ``handler`` for ``signals`` from ``install()`` (or the
    start of a ``with`` block) until ``restore()`` (or its end), the previous handlers after.
    nohup's SIGHUP stays ignored (unless_nohup). Only the main thread can set handlers: in any
    other, nothing is set (the job still ends with its caller, by PR_SET_PDEATHSIG)."""

    def __init__(self, signals: Sequence[int], handler) -> None:
        self.signals, self.handler = signals, handler
        self.previous: dict = {}  # signal: the handler before, to restore or to pass a signal on to

    def install(self) -> "Handlers":
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self.handler) for sig in unless_nohup(self.signals)}
        return self

    def restore(self) -> None:
        previous, self.previous = self.previous, {}
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    __enter__ = install

    def __exit__(self, *exc) -> None:
        self.restore()
