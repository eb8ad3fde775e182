"""`bench synthetic --counters`: the host time of each duty of a step, counted where it is called.

After the timed steps, as many more run with each duty of the step wrapped in a timer
(``time.perf_counter_ns`` on entry and exit): the Session's parts for hvdkit and its own loop
(every call its step makes), Horovod's optimizer and the model's forward for every arm. Each
line is a duty's time per step and its calls per step, less the timer's own cost, which is
measured first and printed. Times are inclusive: a line whose duty calls another counted one
holds it too (``within`` names the line it is part of), so that the lines of one level add up to
the step. Toggling a duty off cannot resolve 20 µs in a 6 ms step on a noisy machine; a timer
around each call can, since the call's own time is what it reads.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Any, Callable, Iterator, Optional

_NONE = object()
FIXED, GRADIENTS, STEP = "fixed duty", "pass over the gradients", "the step's work"


class Counters:
    """Timers put on an object's methods (an instance attribute over the class's), and taken off
    by ``restore``; ``table`` gives each one's µs and calls per step."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = defaultdict(int)
        self.cpu_ns: dict[str, int] = defaultdict(int)  # the training thread's CPU time in each
        self.calls: dict[str, int] = defaultdict(int)
        self.kinds: dict[str, tuple[str, Optional[str]]] = {}  # label -> (kind, the line it is within)
        self._undo: list[tuple[Any, str, bool]] = []
        self.overhead_ns = self._calibrate()

    def wrap(self, owner: Any, name: str, label: str, kind: str, within: Optional[str] = None) -> None:
        """Time every call of ``owner.name`` as ``label``."""
        original = getattr(owner, name)
        ns, cpu_ns, calls, clock, cpu = self.ns, self.cpu_ns, self.calls, time.perf_counter_ns, time.thread_time_ns

        def timed(*args, **kwargs):
            started, cpu_started = clock(), cpu()
            try:
                return original(*args, **kwargs)
            finally:
                cpu_ns[label] += cpu() - cpu_started
                ns[label] += clock() - started
                calls[label] += 1

        self._set(owner, name, timed, label, kind, within)

    def wrap_context(self, owner: Any, name: str, label: str, kind: str, within: Optional[str] = None) -> None:
        """Time the entry and the exit of the context manager ``owner.name()`` returns, not its body."""
        original = getattr(owner, name)
        ns, cpu_ns, calls, clock, cpu = self.ns, self.cpu_ns, self.calls, time.perf_counter_ns, time.thread_time_ns

        @contextlib.contextmanager
        def timed(*args, **kwargs) -> Iterator[Any]:
            started, cpu_started = clock(), cpu()
            manager = original(*args, **kwargs)
            value = manager.__enter__()
            ns[label] += clock() - started
            cpu_ns[label] += cpu() - cpu_started
            try:
                yield value
            except BaseException as exc:
                started, cpu_started = clock(), cpu()
                if not manager.__exit__(type(exc), exc, exc.__traceback__):
                    raise
            else:
                started, cpu_started = clock(), cpu()
                manager.__exit__(None, None, None)
            finally:
                cpu_ns[label] += cpu() - cpu_started
                ns[label] += clock() - started
                calls[label] += 1

        self._set(owner, name, timed, label, kind, within)

    def _set(self, owner: Any, name: str, timed: Callable, label: str, kind: str, within: Optional[str]) -> None:
        own = vars(owner).get(name, _NONE)
        self._undo.append((owner, name, own))
        setattr(owner, name, timed)
        self.kinds[label] = (kind, within)

    def restore(self) -> None:
        """The methods as they were: an attribute of the object's own put back, one of its class uncovered."""
        for owner, name, own in reversed(self._undo):
            if own is _NONE:
                delattr(owner, name)
            else:
                setattr(owner, name, own)
        self._undo = []

    def clear(self) -> None:
        self.ns.clear()
        self.cpu_ns.clear()
        self.calls.clear()

    def table(self, steps: int) -> list[dict]:
        """Each duty's µs per step, of the clock and of the training thread's CPU (its timer's cost
        taken off), and its calls per step, the most CPU first."""
        rows = []
        for label, (kind, within) in self.kinds.items():
            calls = self.calls.get(label, 0)
            us = max(0.0, (self.ns.get(label, 0) - calls * self.overhead_ns) / 1e3 / steps)
            cpu_us = max(0.0, (self.cpu_ns.get(label, 0) - calls * self.cpu_overhead_ns) / 1e3 / steps)
            rows.append({"duty": label, "kind": kind, "within": within, "us_per_step": round(us, 2),
                         "cpu_us_per_step": round(cpu_us, 2), "calls_per_step": round(calls / steps, 2)})
        return sorted(rows, key=lambda row: -row["cpu_us_per_step"])

    def _calibrate(self) -> float:
        """ns a timer adds to one call, of the clock (returned) and of the CPU (``cpu_overhead_ns``):
        a timed empty method's time less the bare one's, as an outer timer would see it."""
        class Empty:
            def call(self) -> None:
                pass

        bare, timed = Empty(), Empty()
        inner = Counters.__new__(Counters)
        inner.ns, inner.cpu_ns, inner.calls, inner.kinds, inner._undo = (defaultdict(int), defaultdict(int),
                                                                          defaultdict(int), {}, [])
        inner.wrap(timed, "call", "empty", FIXED)
        clock, cpu = time.perf_counter_ns, time.thread_time_ns
        best = []
        for subject in (bare, timed):
            runs = []
            for _ in range(5):
                started, cpu_started = clock(), cpu()
                for _ in range(20000):
                    subject.call()
                runs.append(((clock() - started) / 20000, (cpu() - cpu_started) / 20000))
            best.append(min(runs))
        # What a timer records of its own call: about half of what it adds to the caller's time.
        self.cpu_overhead_ns = max(0.0, (best[1][1] - best[0][1]) / 2)
        return max(0.0, (best[1][0] - best[0][0]) / 2)


def count_session(counters: Counters, session, model) -> None:
    """Timers on every duty of the Session's step (hvdkit.session.Session.step and its callers)."""
    s = session
    top = "session.step()"
    for name, label in (("micro_batches", "session.micro_batches()"), ("backward", "session.backward()"),
                        ("step", top), ("log", "session.log()")):
        counters.wrap(s, name, label, STEP)
    counters.wrap(model, "forward", "model.forward()", STEP)
    counters.wrap(s._step, "backward", "loss.backward() (TrainingStep.backward)", STEP, "session.backward()")
    counters.wrap(s._step, "apply", "TrainingStep.apply (synchronize, check, optimizer step)", STEP, top)
    counters.wrap(s._step, "_clip_and_check", "the guard's norm and flag (clip_and_check)", GRADIENTS,
                  "TrainingStep.apply (synchronize, check, optimizer step)")
    counters.wrap(s._step, "settle", "the guard's flag read (settle)", FIXED)
    optimizer = s.optimizer
    counters.wrap(optimizer, "synchronize", "optimizer.synchronize() (wait for the averaged gradients)", STEP,
                  "TrainingStep.apply (synchronize, check, optimizer step)")
    if hasattr(optimizer, "_grouped_allreduce_grad_async"):
        counters.wrap(optimizer, "_grouped_allreduce_grad_async",
                      "a bucket's allreduce started (the 1/size division, enqueue)", GRADIENTS,
                      "loss.backward() (TrainingStep.backward)")
    for name, label in (("_start_step", "the step's meeting started (_start_step)"),):
        counters.wrap(s, name, label, FIXED)
    fixed = [
        (s.watchdog, "beat", "watchdog.beat"), (s.watchdog, "step_done", "watchdog.step_done"),
        (s._checkpoints, "check", "checkpoints.check (a background save failed?)"),
        (s._checkpoints, "before_update", "checkpoints.before_update (a save's copy done?)"),
        (s._checkpoints, "due", "checkpoints.due"), (s._checkpoints, "after_step", "checkpoints.after_step"),
        (s._ending, "record_saves", "ending.record_saves"),
        (s._lockstep, "submit", "lockstep.submit (the meeting's allreduce started)"),
        (s._lockstep, "collect", "lockstep.collect (the meeting read)"),
        (s._times, "waiting", "step_times.waiting"), (s._times, "waited", "step_times.waited"),
        (s._times, "step_ended", "step_times.step_ended"),
        (s._elastic, "before_update", "elastic.before_update"), (s._elastic, "stepped", "elastic.stepped"),
        (s._consistency, "due", "consistency.due"), (s._reports, "log", "reports.log"),
    ]
    for owner, name, label in fixed:
        counters.wrap(owner, name, label, FIXED)
    # The meeting's collective itself: Horovod's enqueue and wait, as every collective pays them.
    counters.wrap(s.hvd, "allreduce_async_", "Horovod's enqueue of the meeting", STEP,
                  "lockstep.submit (the meeting's allreduce started)")
    counters.wrap(s.hvd, "synchronize", "Horovod's wait for the meeting", STEP, "lockstep.collect (the meeting read)")
    counters.wrap_context(s._lockstep, "waiting", "lockstep.waiting (entry and exit)", FIXED)
    counters.wrap_context(s._state.peaks, "phase", "memory phase (entry and exit)", FIXED)


def count_horovod(counters: Counters, optimizer, model) -> None:
    """Timers on Horovod's own loop: the forward, the gradient hooks' allreduces, the wait and the step."""
    top = "optimizer.step() (Horovod's: synchronize, then the step)"
    counters.wrap(model, "forward", "model.forward()", STEP)
    counters.wrap(optimizer, "zero_grad", "optimizer.zero_grad()", STEP)
    counters.wrap(optimizer, "step", top, STEP)
    counters.wrap(optimizer, "synchronize", "optimizer.synchronize() (wait for the averaged gradients)", STEP, top)
    counters.wrap(optimizer, "_allreduce_grad_async", "a gradient's allreduce started (enqueue)", GRADIENTS)


def count_steps(counters: Counters, step: Callable[[], None], steps: int) -> dict:
    """Run ``steps`` counted steps; the table, with the step's wall and training-thread CPU µs."""
    counters.clear()
    started, thread = time.perf_counter_ns(), time.thread_time_ns()
    for _ in range(steps):
        step()
    wall, cpu = time.perf_counter_ns() - started, time.thread_time_ns() - thread
    counters.restore()
    return {"steps": steps, "timer_ns": round(counters.overhead_ns, 1),
            "step_us": round(wall / 1e3 / steps, 1), "training_thread_cpu_us": round(cpu / 1e3 / steps, 1),
            "duties": counters.table(steps)}


def text(label: str, summary: dict) -> str:
    """The counters as a table a person reads."""
    lines = [f"{label}: {summary['step_us']:.0f} µs a step, {summary['training_thread_cpu_us']:.0f} µs of it the "
             f"training thread's CPU, over {summary['steps']} counted steps (each timer's "
             f"{summary['timer_ns']:.0f} ns taken off)",
             f"  {'CPU µs':>9} {'clock µs':>9} {'calls':>6}  {'kind':<24} duty (within)   [per step]"]
    for row in summary["duties"]:
        within = f"  (within {row['within']})" if row["within"] else ""
        lines.append(f"  {row['cpu_us_per_step']:>9.2f} {row['us_per_step']:>9.2f} {row['calls_per_step']:>6.2f}  "
                     f"{row['kind']:<24} {row['duty']}{within}")
    return "\n".join(lines) + "\n"
