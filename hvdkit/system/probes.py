"""Probes of a host, a launcher's server or a rank over TCP: is it there (hvdkit.rank.liveness.lifeline, hvdkit
launch, hvdkit.rank.liveness.watchdog)."""

from __future__ import annotations

import os
import socket
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from hvdkit.job import PROBE_SECONDS


def probe(address: str, port: int, timeout: float = PROBE_SECONDS) -> Optional[bool]:
    """One TCP connection to ``address:port``: True if accepted, False if refused (the host is
    up, nothing listens there), None if nothing answered within ``timeout``. A rank probes its
    launcher's server this way (hvdkit.rank.liveness.lifeline), `hvdkit launch` the other hosts."""
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:  # timed out, unreachable
        return None


def probe_all(targets: list[tuple[str, int]], timeout: float) -> dict[tuple[str, int], Optional[bool]]:
    """``probe`` of each target at once: the answers within ``timeout`` of the first."""
    if not targets:
        return {}
    with ThreadPoolExecutor(max_workers=min(len(targets), 32), thread_name_prefix="hvdkit-probe") as pool:
        return dict(zip(targets, pool.map(lambda target: probe(*target, timeout=timeout), targets), strict=True))


class Presence:
    """A TCP port held open by this process until it ends: a peer's probe of it that is refused (its
    host answers, nothing listens there) knows at once that the process is gone, where a heartbeat
    takes seconds to go stale. Nothing is read; ``drain`` closes what probes left. Processes forked
    from this one close their copy, so a DataLoader worker that outlives its rank does not hold it."""

    def __init__(self) -> None:
        self._socket: Optional[socket.socket] = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._socket.bind(("", 0))
            self._socket.listen(64)
            self._socket.setblocking(False)
        except OSError:
            self._socket.close()
            raise
        self.port = self._socket.getsockname()[1]
        own = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: own() is not None and own().close())

    def drain(self) -> None:
        while self._socket is not None:
            try:
                connection, _ = self._socket.accept()
            except OSError:  # none waiting, or closed
                return
            connection.close()

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
