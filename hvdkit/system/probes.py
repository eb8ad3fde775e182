"""Probes of a host or a launcher's server over TCP: is it there (hvdkit.rank.lifeline, hvdkit launch)."""

from __future__ import annotations

import socket
from typing import Optional

from hvdkit.job import PROBE_SECONDS


def probe(address: str, port: int, timeout: float = PROBE_SECONDS) -> Optional[bool]:
    """One TCP connection to ``address:port``: True if accepted, False if refused (the host is
    up, nothing listens there), None if nothing answered within ``timeout``. A rank probes its
    launcher's server this way (hvdkit.rank.lifeline), `hvdkit launch` the other hosts."""
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:  # timed out, unreachable
        return None
