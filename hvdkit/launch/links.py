"""`hvdkit launch --max-restarts`'s line to its ranks (hvdkit.rank.liveness.link): each rank connects at
its start and says who it is; one whose connection closes without saying it was leaving died (a
signal, a crash), and the other ranks are told to end at once, so that the restart follows the
death in a fraction of a second instead of after mpirun's kill sequence on every host. A stop
signal goes to the ranks on other hosts on it (hvdkit.launch.supervise.pass_on). The ranks of a
standby attempt (started ahead of need) say they are ready on it, and wait there until go()."""

from __future__ import annotations

import contextlib
import selectors
import socket
import sys
import threading
from dataclasses import dataclass
from typing import Optional

from hvdkit import job


@dataclass
class Rank:
    """One rank's end of the line: who it said it is, whether it said it was leaving, or (a
    standby's) that it is ready."""
    rank: str = "?"
    size: int = 0
    pid: str = "?"
    host: str = "?"
    leaving: bool = False
    ready: bool = False  # a standby's rank, waiting to be told to go
    said: bytes = b""

    def described(self) -> str:
        """A rank that died without a word, for a restart's line where its guard left none (the
        guard died with it: its host was lost)."""
        return (f"rank {self.rank} (host {self.host}, pid {self.pid}) ended without a word (a signal, a crash or its "
                f"host lost)")


class Links:
    """A server on ``address`` (where every rank reaches this host) for one attempt of the job."""

    def __init__(self, address: str) -> None:
        self._server = socket.create_server((address, 0), backlog=128)
        self.address = f"{address}:{self._server.getsockname()[1]}"
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._server, selectors.EVENT_READ)
        self._ranks: dict[socket.socket, Rank] = {}
        self._lock = threading.Lock()  # _ranks: a stop signal's handler reads it
        self.died: Optional[Rank] = None
        self._go = False  # go() was called: a standby's rank that says it is ready goes at once
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="hvdkit-rank-links", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=0.2):
                if key.fileobj is self._server:
                    self._accept()
                else:
                    self._read(key.fileobj)

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            connection, _ = self._server.accept()
            with self._lock:
                self._ranks[connection] = Rank()
            self._selector.register(connection, selectors.EVENT_READ)

    def _read(self, connection: socket.socket) -> None:
        rank = self._ranks[connection]
        try:
            data = connection.recv(4096)
        except OSError:
            data = b""
        if data:
            rank.said += data
            *lines, rank.said = rank.said.split(b"\n")
            for words in (line.decode(errors="replace").split() for line in lines):
                if words[:1] == [job.HELLO] and len(words) == 5 and words[2].isdigit():
                    rank.rank, rank.pid, rank.host = words[1], words[3], words[4]
                    rank.size = int(words[2])
                    with contextlib.suppress(OSError):
                        connection.sendall(f"{job.WELCOME}\n".encode())
                elif words == [job.LEAVING]:
                    rank.leaving = True
                elif words == [job.READY]:
                    rank.leaving = True  # ends its connection when told to go: no death
                    with self._lock:  # go() reads who waits
                        go, rank.ready = self._go, True
                    if go:
                        with contextlib.suppress(OSError):
                            connection.sendall(f"{job.GO}\n".encode())
            return
        self._selector.unregister(connection)
        with self._lock:
            del self._ranks[connection]
        connection.close()
        if rank.size and not rank.leaving and self.died is None:  # a rank that said who it is, not a stray connection
            self.died = rank
            self._end_others()

    def _end_others(self) -> None:
        rank = self.died
        print(f"hvdkit launch: rank {rank.rank} (pid {rank.pid} on {rank.host}) ended without a word (a signal or "
              f"a crash); ending the other ranks now", file=sys.stderr, flush=True)
        with self._lock:
            ranks = list(self._ranks)
        for connection in ranks:
            with contextlib.suppress(OSError):
                connection.sendall(f"{job.END}\n".encode())

    def go(self) -> None:
        """The standby attempt is needed: its ranks, waiting or still starting, go on."""
        with self._lock:
            self._go = True
            waiting = [connection for connection, rank in self._ranks.items() if rank.ready]
        for connection in waiting:
            with contextlib.suppress(OSError):
                connection.sendall(f"{job.GO}\n".encode())

    def waiting(self) -> int:
        """How many of a standby's ranks wait to be told to go."""
        with self._lock:
            return 0 if self._go else sum(rank.ready for rank in self._ranks.values())

    def complete(self) -> bool:
        """Whether every rank of the job has said who it is."""
        with self._lock:
            sizes = [rank.size for rank in self._ranks.values() if rank.size]
        return bool(sizes) and len(sizes) == sizes[0]

    def stop(self, signum: int) -> bool:
        """Signal ``signum`` to the ranks on other hosts (the ranks here are signalled directly);
        whether every rank of the job is on the line, so that no other way is needed."""
        here = socket.gethostname()
        with self._lock:
            ranks = list(self._ranks.items())
        for connection, rank in ranks:
            if rank.size and rank.host != here:  # one not known yet may be here: told twice, a second SIGINT kills
                with contextlib.suppress(OSError):
                    connection.sendall(f"{job.STOP} {signum}\n".encode())
        sizes = {rank.size for _, rank in ranks}
        return self.died is None and len(sizes) == 1 and len(ranks) == sizes.pop() > 0  # 0: one not known yet

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for connection in [*self._ranks, self._server]:
            self._selector.unregister(connection)
            connection.close()
        self._selector.close()
