"""A rank on hvdkit launch's line (hvdkit.rank.liveness.link) and nothing else: `link_rank.py RANK SIZE
[fork]`. It says on stdout whether it is on the line, and each signal it gets; SIGUSR2 ends it by
Python's own exit (its line says it is leaving, at exit). With ``fork`` it first forks a child
that sleeps, as a DataLoader's worker waits, and says its pid. Started as a standby's rank
(HVDKIT_STANDBY=1), it first waits until it is told to go, as the Session's start does."""

import os
import signal
import sys
import time

from hvdkit.rank.liveness import link

got: list[str] = []


def say(number, frame) -> None:
    got.append(signal.Signals(number).name)
    print(f"got {got[-1]}", flush=True)


link.wait_for_go(os.environ)
for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(signum, say)
print("on the line" if link.connect(os.environ, int(sys.argv[1]), int(sys.argv[2])) else "no line", flush=True)
if sys.argv[3:] == ["fork"]:
    child = os.fork()
    if child == 0:
        time.sleep(3600)
        os._exit(0)
    print(f"child {child}", flush=True)
while "SIGUSR2" not in got:
    time.sleep(0.02)
