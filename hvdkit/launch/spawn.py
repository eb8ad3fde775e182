"""`hvdkit.run`: call a function on every rank from Python or a notebook, and get its return values.

    results = hvdkit.run(train, settings, np=2, launcher="horovodrun")   # [rank 0's value, rank 1's]

Horovod's `horovod.run` and Accelerate's `notebook_launcher` do the same. The function and its
arguments travel by value (cloudpickle), so what a notebook or a script's ``__main__`` defines
works. The ranks are started by `hvdkit launch` (launch_command), so everything it does holds:
hosts and slots checked first, each rank's output in whole lines, a stop signal to every rank,
nothing left running. Each rank runs ``python -m hvdkit.launch.spawn DIR``: Horovod initialised, the
function called, and its value, or its exception and traceback, left in DIR, a directory the
caller made (in the working directory when the ranks may span hosts: ``hosts`` given, inside
`hvdkit rehearse` or a Slurm allocation; it must then be shared, as a cluster's home is). The
caller relays the ranks' output live, each line tagged ``[rank]``.

Ctrl-C in the caller (a notebook's stop button) is passed to every rank as SIGINT: a Session
stops at its next step and saves its checkpoint, as on Ctrl-C in a shell. What has not ended
within the stop grace period (hvdkit.job.stop_grace) is killed, and KeyboardInterrupt is
raised in the caller. SIGTERM and SIGHUP to the caller (a scheduler, a notebook server shutting
down, a closed terminal) stop the job the same way before the caller ends by them; a caller
killed outright takes the job with it (`hvdkit launch` gets SIGTERM when its parent dies).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from hvdkit import job
from hvdkit.launch import rank_output, supervise
from hvdkit.system import proctree, sighandlers, wholefiles
from hvdkit.system.launchers import HOROVODRUN, MPIRUN

LAUNCH_FLAGS = {HOROVODRUN.name: ["--launcher", HOROVODRUN.name], MPIRUN.name: ["--launcher", MPIRUN.name],
                "gloo": ["--launcher", HOROVODRUN.name, "--gloo"]}
CALL = "call.pkl"
ENDING = (signal.SIGTERM, signal.SIGHUP)  # the caller's own end, passed to the job first


class _Ended(BaseException):
    """The caller got one of ENDING (``signum``) while it waited for the job."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class RunError(RuntimeError):
    """A rank raised (``rank``, ``host`` and its ``remote_traceback``), returned a value that cannot
    be pickled, or the job ended before every rank returned."""

    def __init__(self, message: str, rank: Optional[int] = None, host: Optional[str] = None,
                 remote_traceback: Optional[str] = None) -> None:
        super().__init__(message)
        self.rank, self.host, self.remote_traceback = rank, host, remote_traceback


def launch_command(np: int, launcher: str, directory: str, hosts: Optional[str] = None,
                   env: Optional[Mapping[str, str]] = None) -> list[str]:
    """The `hvdkit launch` line that starts every rank of ``hvdkit.run``; ``env`` is set in each."""
    settings = [f"{name}={value}" for name, value in {"PYTHONUNBUFFERED": "1", **(env or {})}.items()]
    return [sys.executable, "-m", "hvdkit", "launch", "-np", str(np), *LAUNCH_FLAGS[launcher],
            *(["-H", hosts] if hosts else []), *[arg for setting in settings for arg in ("-x", setting)],
            "--", sys.executable, "-m", "hvdkit.launch.spawn", directory]


def run(fn: Callable, *args: Any, np: int = 2, launcher: str = "horovodrun", hosts: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None, **kwargs: Any) -> list:
    """``fn(*args, **kwargs)`` on ``np`` ranks; their return values in rank order. ``launcher``:
    horovodrun, mpirun or gloo (horovodrun --gloo); ``hosts``: host1:2,host2:2 (default: this
    machine); ``env``: variables set in every rank."""
    import cloudpickle

    if launcher not in LAUNCH_FLAGS:
        raise ValueError(f"hvdkit.run: launcher={launcher!r}; expected one of {', '.join(LAUNCH_FLAGS)}")
    if not isinstance(np, int) or np < 1:
        raise ValueError(f"hvdkit.run: np={np!r}; expected a whole number >= 1")
    try:
        call = cloudpickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise RunError(f"hvdkit.run: {getattr(fn, '__name__', fn)!r} or its arguments cannot be pickled to send "
                       f"to the ranks: {_one_line(exc)}") from None
    across_hosts = hosts or any(name in os.environ for name in ("HVDKIT_HOSTS", "SLURM_JOB_NODELIST"))
    directory = Path(tempfile.mkdtemp(prefix=".hvdkit-run-", dir=os.getcwd() if across_hosts else None))
    try:
        (directory / CALL).write_bytes(call)
        command = launch_command(np, launcher, str(directory), hosts, env)
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"), preexec_fn=supervise.end_with_parent)
        relays = [threading.Thread(target=_relay, args=(stream, name), daemon=True)
                  for stream, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))]
        for relay in relays:
            relay.start()
        handlers = sighandlers.Handlers(ENDING, _raise_ended).install()
        try:
            code = proctree.wait_child(proc)
        except KeyboardInterrupt:
            _stop(proc, signal.SIGINT, "Ctrl-C")
            raise
        except _Ended as ended:
            _stop(proc, ended.signum, signal.Signals(ended.signum).name)
            shutil.rmtree(directory, ignore_errors=True)  # the default action ends the caller before `finally`
            _end_by(ended.signum, handlers)
        finally:
            handlers.restore()
            for relay in relays:
                relay.join(timeout=5)
        return _results(directory, np, code)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _raise_ended(signum, frame) -> None:
    """ENDING's handler while the caller waits: _Ended, raised in proctree.wait_child's sleep."""
    raise _Ended(signum)


def _end_by(signum: int, handlers: sighandlers.Handlers) -> None:
    """With the job ended, the caller gets what it would have had: its own handler, if it had
    one, else the default action (its end) by the same signal."""
    handler = handlers.previous.get(signum, signal.SIG_DFL)
    handlers.restore()
    if callable(handler):
        handler(signum, None)
    elif handler == signal.SIG_DFL:
        os.kill(os.getpid(), signum)


def _stop(proc: subprocess.Popen, signum: int, what: str) -> None:
    """``signum`` to `hvdkit launch`, which passes it to every rank; after the stop grace period,
    or a second Ctrl-C or ending signal, every process of the job is killed by PID."""
    proc.send_signal(signum)
    grace = job.stop_grace()
    print(f"hvdkit.run: {what} passed to every rank; waiting up to {grace:g} s for them to save and end",
          file=sys.stderr, flush=True)
    try:
        if proctree.wait_child(proc, timeout=grace + job.KILL_AFTER_GRACE) is None:
            _kill_tree(proc)
    except (KeyboardInterrupt, _Ended):
        _kill_tree(proc)


def _kill_tree(proc: subprocess.Popen) -> None:
    proctree.end_processes(proctree.tree(proc.pid), grace=0)
    proctree.wait_child(proc)


def _relay(stream, name: str) -> None:
    """Each line of the job's ``stream`` (its stdout or stderr, ``name``) to the caller's stdout or
    stderr, as the rank wrote it, tagged ``[rank]``; the launcher's own lines as they are. The
    caller's streams are looked up per line: in a notebook, they are the running cell's."""
    for raw in iter(stream.readline, b""):
        match = rank_output.TAG.match(raw)  # [rank]<stdout>: (horovodrun --gloo) or [job,rank]<stdout>: (Open MPI)
        line = raw[match.end() if match else 0:].decode(errors="replace")
        if match:
            rank = (match[2] or match[1]).decode()
            line, name = f"[{rank}] {line}", "stdout" if match[3] == b"stdout" else "stderr"
        out = getattr(sys, name)
        out.write(line)
        out.flush()
    stream.close()


def _results(directory: Path, np: int, code: int) -> list:
    """The ranks' return values in rank order, or the RunError of what went wrong first."""
    import cloudpickle

    failures = [cloudpickle.loads(path.read_bytes()) for path in directory.glob("error-*.pkl")]
    if failures:
        first = min(failures, key=lambda failure: failure["time"])
        raise _error(first)
    missing = [rank for rank in range(np) if not (directory / f"result-{rank}.pkl").exists()]
    if missing:
        raise RunError(f"hvdkit.run: the job ended with exit code {code} before rank(s) "
                       f"{', '.join(map(str, missing))} returned; their output is above")
    return [cloudpickle.loads((directory / f"result-{rank}.pkl").read_bytes()) for rank in range(np)]


def _error(failure: dict) -> RunError:
    rank, host = failure["rank"], failure["host"]
    if failure["kind"] == "unpicklable":
        return RunError(f"hvdkit.run: rank {rank} on {host} returned a {failure['type']}, which cannot be pickled "
                        f"to send back: {failure['message']}", rank, host)
    error = RunError(f"rank {rank} on {host} raised {failure['type']}: {failure['message']}\n\n"
                     f"rank {rank}'s traceback:\n{failure['traceback']}", rank, host, failure["traceback"])
    error.__cause__ = failure.get("exception")
    return error


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _type_name(kind: type) -> str:
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _leave(directory: Path, name: str, data: bytes) -> None:
    """Write ``name`` in the run directory at once: the caller never reads half a file."""
    wholefiles.write_whole(directory / name, data)


def _fail(directory: Path, rank: int, record: dict) -> None:
    """Leave this rank's failure for the caller, then end the rank now: the others may wait in a
    collective that cannot complete, and the launcher ends them when one rank exits with an error."""
    import cloudpickle

    record.update(rank=rank, host=socket.gethostname(), time=time.time())
    try:
        data = cloudpickle.dumps(record)
    except Exception:  # the exception itself would not pickle: its text and traceback still go
        record.pop("exception", None)
        data = cloudpickle.dumps(record)
    _leave(directory, f"error-{rank}.pkl", data)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(job.FAILED)


def rank_main(directory: Path) -> int:
    """One rank: Horovod initialised, the call made, its value or failure left in ``directory``."""
    import cloudpickle
    import horovod.torch as hvd

    hvd.init()
    rank = hvd.rank()
    try:
        fn, args, kwargs = cloudpickle.loads((directory / CALL).read_bytes())
        value = fn(*args, **kwargs)
    except KeyboardInterrupt:  # Ctrl-C in the caller, passed to every rank
        return job.stopped_by(signal.SIGINT)
    except SystemExit as exc:  # a Session that stopped where the loop did not ask should_stop()
        return exc.code if isinstance(exc.code, int) else job.FAILED
    except BaseException as exc:
        _fail(directory, rank, {"kind": "raised", "type": _type_name(type(exc)), "message": _one_line(exc),
                                "traceback": traceback.format_exc(), "exception": exc})
    try:
        data = cloudpickle.dumps(value)
    except Exception as exc:
        _fail(directory, rank, {"kind": "unpicklable", "type": _type_name(type(value)), "message": _one_line(exc)})
    _leave(directory, f"result-{rank}.pkl", data)
    return 0


def main(argv: Sequence[str]) -> int:
    return rank_main(Path(argv[0]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
