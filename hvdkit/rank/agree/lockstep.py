"""Lockstep: the ranks make hvdkit's collective calls in the same order, or the job ends at
once with one line saying which rank did what.

Horovod pairs collectives by name, so a call made on one rank only (``if rank == 0:
session.save()``, the Horovod habit) or ranks taking different numbers of steps leave a rank
waiting for a tensor the others never send: a hang until the stall limit. So each of the
Session's calls that communicate first meets the other ranks in one small allreduce of one
name, ``hvdkit.rank.agree.lockstep``, in which every rank fills its own row: which call, after how many
steps, and the stop signal it received. Ranks at different calls meet each other there and
all see who is where; the same allreduce is the stop agreement (the largest signal wins).

A step's meeting is submitted before its gradients' allreduces where the loop calls
``session.backward`` (else in ``session.step()``), so it travels in their Horovod cycle (one
small allreduce a step, as the one-number stop agreement it replaces was) and is read, before
the gradients are awaited, at no extra wait. Nothing is left in flight
between calls: an allreduce still pending when another collective (a join, a checkpoint's
allgather) starts is how ranks fell a step out of line.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from horovod.common.exceptions import HorovodInternalError

from hvdkit import job

# What each call is, in the lines that name it; its place in CALLS, plus one, is its code in the allreduce.
STEP = "session.step()"
SHOULD_STOP = "session.should_stop()"
SAVE = "session.save()"
REPORT = "session.report()"
EVALUATE = "session.evaluate()"
CHECK_CONSISTENCY = "session.check_consistency()"
EPOCH_END = "the end of an epoch (session.epochs() or session.join())"
FINISH = "session.finish()"
CALLS = (STEP, SHOULD_STOP, SAVE, REPORT, EVALUATE, CHECK_CONSISTENCY, EPOCH_END, FINISH)
ENDS = (EPOCH_END, FINISH)  # a rank that arrives here has taken all its steps
RANK_ZERO_HABIT = {  # what the call does on rank 0 alone, for the line that says to call it everywhere
    SAVE: "rank 0 alone writes the file", REPORT: "rank 0 alone prints and writes the metrics",
    EVALUATE: "each rank evaluates its share of the data", CHECK_CONSISTENCY: "every rank's copy is compared",
}
FIELDS = 3  # call, steps taken, stop signal; in float64, exact for any step count


class LockstepError(RuntimeError):
    """The ranks made different hvdkit calls, or took different numbers of steps."""

    exit_code = job.BAD_INPUT  # a mistake in the loop, as bad input is


class RankEnded(RuntimeError):
    """Another rank ended (it raised, returned, or was killed) while this one waited for it."""

    exit_code = job.FAILED


class Lockstep:
    """The meetings of one Session's ranks, and the stop they agreed on."""

    def __init__(self, hvd, strict: bool = True, gone: Callable[[int], str] = lambda size: "") -> None:
        self.hvd, self.gone = hvd, gone  # gone: 'rank 1 (host h, pid p) is gone ...' where the heartbeats tell
        self.strict = strict  # False in elastic runs: a worker joining mid-run meets the others before it syncs
        self.pending: Optional[tuple] = None  # (handle, call, steps) of a meeting submitted, not yet read
        self.signum = 0  # the stop signal all ranks agreed on, 0 until one is
        self._rows: Optional[torch.Tensor] = None  # the meeting's tensor, made once per world size
        self._codes = {call: index + 1 for index, call in enumerate(CALLS)}
        self.held: Optional[Callable] = None  # the optimizer's with_last_bucket, holding this step's meeting

    def submit(self, call: str, steps: int, signum: int) -> None:
        """Start this rank's part of a meeting at ``call`` after ``steps`` steps: its row filled in
        the one tensor every meeting reuses (read back in ``collect`` before the next is made),
        summed in place."""
        rows = self._rows
        if rows is None or not self.strict:  # elastic: the size and rank of now
            self._rank, size = self.hvd.rank(), self.hvd.size()
            if rows is None or rows.shape[0] != size:
                rows = self._rows = torch.zeros(size, FIELDS, dtype=torch.float64)
                self._table = rows.numpy()
        table = self._table
        table.fill(0.0)
        table[self._rank] = (self._codes[call], steps, signum)
        handle = self.hvd.allreduce_async_(rows, op=self.hvd.Sum, name="hvdkit.lockstep")
        self.pending = (handle, call, steps)

    def start_step(self, steps: int, signum: Callable[[], int], optimizer=None) -> None:
        """This step's meeting: submitted now, or, where ``optimizer`` (from backward()) sends
        gradient buckets (hvdkit.rank.step.buckets' ``with_last_bucket``), held until just before the
        step's last bucket goes (``held``), so that one Horovod cycle carries both: a meeting in a
        cycle of its own cost a quarter of a small model's step
        (docs/performance.md#the-steps-duties-counted). ``signum``: the stop signal received
        (None: none), read when it is sent."""
        with_last_bucket = getattr(optimizer, "with_last_bucket", None) if optimizer else None

        def send() -> None:
            self.held = None
            self.submit(STEP, steps, signum() or 0)

        if with_last_bucket is None:
            send()
        else:
            self.held = with_last_bucket
            with_last_bucket(send)

    def send_held(self) -> None:
        """The meeting held for a last bucket that did not go from backward (a gradient not made on
        this rank) or that another call comes before (backward() without step()): submitted now."""
        with_last_bucket, self.held = self.held, None
        if with_last_bucket is not None:
            send = with_last_bucket(None)
            if send is not None:
                send()

    def collect(self) -> int:
        """Wait for the meeting submitted, if any; LockstepError if the ranks were not at the same
        call after the same steps. The agreed stop signal (0: none)."""
        if self.pending is None:
            return self.signum
        handle, call, steps = self.pending
        self.pending = None
        self.hvd.synchronize(handle)
        table = self._table  # host memory on every device: the tensor is a CPU one
        if self.strict and not (table[:, :2] == table[0, :2]).all():
            raise LockstepError(mismatch(table.tolist()))
        if not self.signum:
            self.signum = int(table[:, 2].max())
        return self.signum

    def abandon(self) -> None:
        """Elastic: a meeting started before a reset belongs to the old ranks; the next one gets a
        tensor of its own, which nothing of the old ranks' may still write into."""
        self.pending = self._rows = None
        if self.held is not None:
            self.held(None)
            self.held = None

    def read_after_shutdown(self) -> None:
        """Horovod shut down while a meeting was submitted: the LockstepError of a meeting that
        completed first, which is why another rank ended. A rank taking fewer steps leaves as soon as
        its meeting shows the mismatch, while this one may still be starting its gradients'
        allreduces, which then fail; its meeting had already completed and says why."""
        try:
            self.collect()
        except HorovodInternalError:  # it did not complete: the shutdown is all there is to say
            pass

    def meet(self, call: str, steps: int, signum: int) -> int:
        self.submit(call, steps, signum)
        return self.collect()

    def meet_now(self, call: str, steps: int, signum: int, rank: int) -> int:
        """Every rank at ``call`` after ``steps`` steps, or one line saying who is where; a step's
        meeting still open or held (the loop called backward() without step()) is read first."""
        self.send_held()
        with self.waiting(call, steps, rank):
            self.collect()
            return self.meet(call, steps, signum)

    def waiting(self, call: str, steps: int, rank: int) -> "_Waiting":
        """A context in which Horovod's shutdown by another rank (it raised, returned early or was
        killed) is said in one line; elastic runs (not strict) recover from it instead. A class,
        not a generator: it is entered twice a step."""
        return _Waiting(self, call, steps, rank)

    def shut_down_while(self, call: str, steps: int, rank: int) -> "RankEnded":
        """The error that says Horovod shut down while ``rank`` waited in ``call``."""
        self.read_after_shutdown()
        gone = self.gone(self.hvd.size())
        return RankEnded(f"Horovod shut down while rank {rank} waited in {where(call, steps)}: " + (
            gone or "another rank ended (it raised, returned early or was killed) or Horovod's stall inspector "
                    "ended the job; the lines above say which"))


class _Waiting:
    """Lockstep.waiting's context."""

    __slots__ = ("lockstep", "call", "steps", "rank")

    def __init__(self, lockstep: Lockstep, call: str, steps: int, rank: int) -> None:
        self.lockstep, self.call, self.steps, self.rank = lockstep, call, steps, rank

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, traceback) -> bool:
        if kind is None or not issubclass(kind, HorovodInternalError) or not self.lockstep.strict:
            return False
        raise self.lockstep.shut_down_while(self.call, self.steps, self.rank) from None


def where(call: str, steps: int) -> str:
    return f"{call} (step {steps + 1})" if call == STEP else f"{call} after step {steps}"


def mismatch(rows: list[list[float]]) -> Optional[str]:
    """The line saying how the ranks' rows (call code, steps) differ; None if they do not."""
    at = {rank: (CALLS[int(code) - 1] if code else "no hvdkit call", int(steps))
          for rank, (code, steps, _) in enumerate(rows)}
    if len(set(at.values())) == 1:
        return None
    groups: dict[tuple, list[int]] = {}
    for rank, place in at.items():
        groups.setdefault(place, []).append(rank)

    def who(place) -> str:
        ranks = groups[place]
        return f"rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks)} at {where(*place)}"

    # The odd one out: the place the fewest ranks are at, a call other than step() on a tie.
    odd = min(groups, key=lambda place: (len(groups[place]), place[0] == STEP))
    others = [place for place in groups if place != odd]
    seen = f"{who(odd)}, {'; '.join(who(place) for place in others)}"
    calls = {place[0] for place in groups}
    steps = {place[1] for place in groups}
    if len(calls) == 1 or calls & set(ENDS) or len(steps) > 1 and odd[0] not in RANK_ZERO_HABIT:
        return (f"the ranks took different numbers of steps ({seen}): every rank must take the same number of "
                f"steps; give each the same number of batches (session.loader does; with a loader of your own, "
                f"a DistributedSampler), and do not break out of the loop on one rank only")
    habit = RANK_ZERO_HABIT.get(odd[0])
    return (f"the ranks made different hvdkit calls ({seen}): {odd[0]} must be called by every rank at the same "
            f"point of the loop" + (f", not under `if rank == 0` ({habit})" if habit else ""))


def _ranks(ranks: list[int]) -> str:
    if len(ranks) <= 8:
        return ", ".join(map(str, ranks))
    return f"{', '.join(map(str, ranks[:6]))} and {len(ranks) - 6} more"
