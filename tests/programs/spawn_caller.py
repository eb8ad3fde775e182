"""A user's script that calls hvdkit.run: its functions are defined in ``__main__``, so they travel
by value, as a notebook's do. Prints one JSON line per call for tests/launch/test_spawn.py.

    python tests/programs/spawn_caller.py errors LAUNCHER
    python tests/programs/spawn_caller.py interrupt LAUNCHER CHECKPOINT_DIR LOG_DIR
    python tests/programs/spawn_caller.py forever LAUNCHER CHECKPOINT_DIR LOG_DIR   (until this process is ended)
"""

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import hvdkit


def raises_on_rank_one():
    import horovod.torch as hvd
    import torch

    if hvd.rank() == 1:
        raise ValueError("rank one's bad value")
    hvd.allreduce(torch.ones(1))  # rank 0 waits in a collective that rank 1 never joins


def returns_a_generator():
    return (step for step in range(3))


def train(checkpoint_dir, log_dir):
    """Trains until stopped: the Session checkpoints on the Ctrl-C passed to it."""
    config = hvdkit.TrainConfig(model="mlp", dataset="synthetic", epochs=1000, log_interval=5,
                                checkpoint_dir=checkpoint_dir, log_dir=log_dir)
    return hvdkit.Trainer(config).fit()


def errors(launcher):
    for fn in (raises_on_rank_one, returns_a_generator):
        try:
            hvdkit.run(fn, np=2, launcher=launcher)
            print(json.dumps({"fn": fn.__name__, "error": None}), flush=True)
        except hvdkit.RunError as exc:
            print(json.dumps({"fn": fn.__name__, "error": str(exc), "rank": exc.rank, "host": exc.host,
                              "cause": repr(exc.__cause__)}), flush=True)


def interrupt(launcher, checkpoint_dir, log_dir):
    """Ctrl-C as a notebook's stop button sends it: SIGINT to this process, from another thread,
    5 s after the call and once training has reported (so that there is a step to save)."""
    started = time.monotonic()
    sent = {}

    def press_stop():
        metrics = Path(log_dir) / "metrics.jsonl"
        while time.monotonic() - started < 5 or not (metrics.exists() and '"train"' in metrics.read_text()):
            time.sleep(0.1)
        sent["at"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=press_stop, daemon=True).start()
    try:
        hvdkit.run(train, checkpoint_dir, log_dir, np=2, launcher=launcher)
        print(json.dumps({"interrupted": False}), flush=True)
    except KeyboardInterrupt:
        print(json.dumps({"interrupted": True, "returned_after": time.monotonic() - sent["at"],
                          "sent_after": sent["at"] - started}), flush=True)


def forever(launcher, checkpoint_dir, log_dir):
    hvdkit.run(train, checkpoint_dir, log_dir, np=2, launcher=launcher)


if __name__ == "__main__":
    {"errors": errors, "interrupt": interrupt, "forever": forever}[sys.argv[1]](*sys.argv[2:])
