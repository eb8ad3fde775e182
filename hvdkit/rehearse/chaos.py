"""`hvdkit rehearse --chaos K`: a job run through K faults drawn at random, restarted after each
ending as a scheduler requeues it, until it finishes; then held to an undisturbed run of the
same command, bitwise.

Each fault strikes at a moment the job's own files mark: once a checkpoint of step S or later
has been written since the fault before (S drawn from the undisturbed run's checkpoint steps),
or, for ``in-write``, once the write of such a checkpoint is under way (its temporary file is
there); then, but for ``in-write`` and ``disk-full``, a delay drawn with the schedule (a fraction
of the undisturbed run's time between two checkpoints), so that faults land between checkpoints
too. The schedule comes from the seed alone, so ``--chaos-seed S`` again strikes the same faults
after the same checkpoints; where within a step they land is the machine's doing.

What must hold, checked here and said in one line each otherwise: the job finishes; its final
checkpoint equals the undisturbed run's in every tensor of the model and optimizer; no
checkpoint, once written, is lost or stops reading; nothing is left running on the hosts after
each ending, and no temporary file in the checkpoint directory at the end.

An elastic job (horovodrun's --host-discovery-script) rides its faults out instead of ending:
a lost host leaves the discovery's hostfile and comes back to it once the job has checkpointed
without it. Its steps at a smaller world size take other batches and learning rates, so its
final model is held to the undisturbed run's within a tolerance, not bitwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional

import inotify_simple as inotify

from hvdkit import checkpoint, job
from hvdkit.launch import restarts
from hvdkit.rehearse import processes, verdict
from hvdkit.rehearse.faults import ELASTIC_TOLERANCE, FAULTS, OOM_BYTES, OOM_EXCESS, Strike
from hvdkit.rehearse.namespaces import Hosts
from hvdkit.system import cgroups, proctree, wholefiles

GIVE_BACK_SECONDS = 30.0  # a lost host is listed again at the latest this long after its loss
TICK = 0.05  # how often the faults' moments are looked for, at most
GIVEN_DEADLINE = 1800.0  # seconds an attempt may take when the undisturbed run was not timed here
# Seconds after the command ends for its processes on the hosts to go. A rank that horovodrun
# --gloo started over ssh, its launcher gone, ends itself once it has not answered for
# LOST_SECONDS (hvdkit.rank.liveness.lifeline), found by a probe up to one interval later that may itself
# take one. mpirun's daemons and hvdkit launch end what they started before they exit: a few
# seconds for a process in its exit.
SETTLE = job.LOST_SECONDS + 2 * job.PROBE_SECONDS + 3.0
SETTLE_WITHOUT_LIFELINE = 5.0
RESUMED = re.compile(r"hvdkit: resumed from \S+ \(epoch \d+, step (\d+)")
BALLAST = ".chaos-ballast"  # disk-full's file, in the checkpoint directory's own filesystem
STEPS_FILE = "chaos-steps.json"  # beside the undisturbed run's checkpoints: every step it wrote one at
SLOW = "20mbit"  # slow's link (tc tbf; netem's delay is not in every kernel)
NOT_AT_A_RANK = ("host-lost", "partition", "slow", "disk-full")  # faults that strike a host or the disk


class Chaos:
    """One chaos run on ``hosts``: the undisturbed run (or ``reference``), then the faults."""

    def __init__(self, command: list[str], hosts: Hosts, env: dict, ckpt: Path, out: Path, report: verdict.Report,
                 say: Callable[[str], None], running: dict, elastic: bool = False,
                 tolerance: Optional[float] = None) -> None:
        self.command, self.hosts, self.env, self.ckpt, self.out = command, hosts, env, ckpt, out
        self.report, self.say, self.running, self.elastic = report, say, running, elastic
        self.hostfile = Path(env["HVDKIT_HOSTS_FILE"])  # an elastic job's discovery reads it
        self.listed = self.hostfile.read_text().splitlines()
        self.tolerance = ELASTIC_TOLERANCE if tolerance is None else tolerance
        self.away: dict[str, tuple[Strike, int, float]] = {}  # an elastic job's lost host: its strike, step, when
        self.started = time.monotonic()
        self.undo: list[Callable[[], None]] = []  # what ends an in-run fault early, at its attempt's end
        self.timers: list[threading.Timer] = []
        self.ballast: Optional[Path] = None
        self.room = 0  # what disk-full leaves free in the checkpoint directory's filesystem
        self.deadline: Optional[float] = None  # for an attempt: four times the undisturbed run's time
        self.second: Optional[dict] = None  # while-resuming's second kill, due in the next attempt
        self.struck_at: dict[int, float] = {}  # a strike's number: when it struck (monotonic)
        self.pending: list[Strike] = []
        self.armed: dict[int, float] = {}  # a strike's number: when its checkpoint came (monotonic)
        self.interval = 0.0  # seconds between two checkpoints in the undisturbed run (reference())
        self.tag = env.get(restarts.SNAPSHOT_TAG, "")  # the job's snapshot folders carry it
        self.snapshots = processes.snapshots(self.tag)  # those there before: not the job's
        # A small checkpoint is written in a few milliseconds: in-write hears of its temporary
        # file from the kernel (inotify) rather than looking for it.
        self.notify = inotify.INotify()
        self.folders = {self.notify.add_watch(ckpt, inotify.flags.CREATE): ckpt}
        self.writing: list[tuple[int, Path]] = []  # (step, temporary file) of writes begun since the last tick
        self.newest_seen = 0  # the newest checkpoint step ever written: it must not go

    # -- the undisturbed run ---------------------------------------------------------------
    def reference(self, given: Optional[Path]) -> Optional[Path]:
        """The undisturbed run's newest checkpoint, and the steps of every checkpoint it wrote."""
        if given is not None:  # its steps as its chaos run saw them written, else those it kept
            listed = given / STEPS_FILE
            steps = (json.loads(listed.read_text()) if listed.is_file()
                     else [checkpoint.step_of(p) for p in checkpoint.existing(str(given))])
            self.report.reference = {"dir": str(given), "steps": steps, "seconds": None}
            self.deadline = GIVEN_DEADLINE
            return checkpoint.existing(str(given))[-1]
        self.say("the undisturbed run first, for the final state to compare with")
        seen: set[int] = set()
        began, began_wall = time.monotonic(), time.time()
        attempt = self._attempt(0, lambda: seen.update(self._written()))
        self._after(attempt, [])
        if attempt.code != 0:
            self.report.problems.append(f"the undisturbed run failed (exit {attempt.code}: {attempt.line}); "
                                        f"its output: {attempt.log}")
            return None
        kept = self.out / "reference"
        shutil.copytree(self.ckpt, kept)
        (kept / STEPS_FILE).write_text(json.dumps(sorted(seen)) + "\n")
        for entry in list(self.ckpt.iterdir()):
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        seconds = time.monotonic() - began
        self.deadline = max(120.0, 4 * seconds)
        self.report.reference = {"dir": str(kept), "steps": sorted(seen), "seconds": round(seconds, 1),
                                 "began_wall": began_wall}
        if len(seen) > 1:  # the mean time from one checkpoint to the next, at the undisturbed pace
            self.interval = seconds * (max(seen) - min(seen)) / (len(seen) - 1) / max(seen)
        if not seen:
            self.report.problems.append("the job wrote no checkpoint: --chaos needs one that checkpoints "
                                        "(--checkpoint-dir and --checkpoint-steps)")
            return None
        return checkpoint.existing(str(kept))[-1]

    # -- the faults -------------------------------------------------------------------------
    def run(self, strikes: list[Strike], final: Path, limit: int) -> None:
        """The attempts, striking ``strikes`` in order, until the job finishes at ``final``'s step."""
        self.pending = list(strikes)
        final_step = checkpoint.step_of(final)
        previous: list[Strike] = []  # those that ended the attempt before: their time until training again
        for number in range(1, limit + 1):
            state = {"number": number, "known": self._written(), "started": None, "read": 0, "looked": 0.0,
                     "log": self.out / f"attempt-{number}.log", "resumed": False, "mine": [], "previous": previous}
            attempt = self._attempt(number, lambda state=state: self._watch(state))
            self._undo()
            self.report.world_size_changes += verdict.world_size_changes(Path(attempt.log))
            mine = state["mine"]
            if attempt.code != 0 and mine:  # the last that ends a job ended it: those before were ridden
                enders = [s for s in mine if self._ends(s.fault)]  # out, or restarted within the job
                (enders or mine)[-1].ended = {"code": attempt.code, "line": attempt.line}
            self._after(attempt, mine)
            previous = [s for s in mine if s.ended]
            if "signal" in self.running:
                self.report.problems.append("stopped by a signal before the job finished")
                return
            # An elastic job's last step may differ: where epochs end it, their steps follow the world size.
            if attempt.code == 0 and (self.elastic or self._newest_step() == final_step):
                for strike in self.pending:
                    self._unstruck(strike, "the job finished first")
                return
            if attempt.code == 0:
                self.say(f"attempt {number} ended with exit 0 at step {self._newest_step()} of {final_step}: "
                         "requeued, as a scheduler would")
            elif not mine:
                self.report.problems.append(f"attempt {number} ended with exit {attempt.code} and no fault struck "
                                            f"it: {attempt.line} (output: {attempt.log})")
                return
            else:
                self.say(f"attempt {number} ended: exit {attempt.code}: {attempt.line}")
            self._prepare_restart()
        self.report.problems.append(f"the job did not finish in {limit} attempts")

    def _ends(self, fault: str) -> bool:
        return FAULTS[fault].ends and not self.elastic

    def _watch(self, state: dict) -> None:
        """Every tick of an attempt: the newest checkpoint, the job's start and resume, and the
        next fault if its moment has come."""
        written = self._written()
        self.newest_seen = max(self.newest_seen, *written) if written else self.newest_seen
        self._top_up()
        for host, (_, newest, since) in list(self.away.items()):
            if self.newest_seen > newest or time.monotonic() - since > GIVE_BACK_SECONDS:
                self._give_back(host)
        self._look(state)
        self._second_kill(state)
        if len(self.pending) > 1 and self.pending[0].fault == "in-write" and \
                self._due(self.pending[1], state, written):
            missed = self.pending.pop(0)  # no write of its step was heard of before the next fault's moment
            self._unstruck(missed, "no checkpoint write was seen under way before the next fault's moment")
        if self.pending and self._due(self.pending[0], state, written) and self._moment(self.pending[0]):
            strike = self.pending.pop(0)
            strike.at_step = max([self.newest_seen, *(step for step, _ in self.writing)])
            state["known"] = written
            state["mine"].append(strike)
            try:
                struck = self._strike(strike, state["number"])
            except (OSError, RuntimeError, ValueError) as exc:
                struck = True
                self.report.problems.append(f"{strike.describe()} could not strike: {exc}")
            if not struck:  # no rank to strike: this attempt is ending; its moment comes again in the next
                state["mine"].remove(strike)
                self.pending.insert(0, strike)
        self.writing = []

    def _moment(self, strike: Strike) -> bool:
        """Its moment come: its delay after the checkpoint it waits for, as a fraction of the time
        between two checkpoints in the undisturbed run (at once where that was not timed here)."""
        now = time.monotonic()
        due = self.armed.setdefault(strike.number, now)
        return now - due >= strike.delay * self.interval

    def _unstruck(self, strike: Strike, why: str) -> None:
        """A fault of the schedule that found no moment: said, and in the report; not the job's failure."""
        self.report.not_struck.append(f"{strike.describe()}: {why}")
        self.say(f"warning: {strike.describe()} did not strike: {why}")

    def _due(self, strike: Strike, state: dict, written: set[int]) -> bool:
        """Its moment: a checkpoint of its step or later written since the fault before (in-write:
        being written); or, for the first fault of an attempt that began from such a checkpoint,
        the job's line that it resumed (its next checkpoint may be its last, written as it ends)."""
        if strike.fault == "in-write":
            return any(step >= strike.step for step, _ in self.writing)
        if state["resumed"] and not state["mine"] and max(state["known"], default=0) >= strike.step:
            return True
        return any(step >= strike.step for step in written - state["known"])

    def _strike(self, strike: Strike, attempt: int) -> bool:
        """Strike it now; False, with nothing recorded, where it finds no rank to strike (the attempt is ending)."""
        fault = strike.fault
        found = {} if fault in NOT_AT_A_RANK else processes.ranks(self.hosts)
        if fault not in NOT_AT_A_RANK and not found:
            return False
        self.struck_at[strike.number] = now = time.monotonic()
        strike.struck_wall = time.time()
        strike.attempt, strike.struck_after = attempt, round(now - self.started, 1)
        strike.phase = "training"
        if fault in ("host-lost", "partition", "slow"):
            others = self.hosts.names[1:]
            running = sorted({host for _, host in processes.ranks(self.hosts).values()} & set(others))
            others = running or others  # a host that runs none (a spare) is struck only where all run none
            host = others[min(int(strike.pick * len(others)), len(others) - 1)]
            strike.target = host
            self.say(f"{strike.describe()}")
            if fault == "host-lost" and self.elastic:  # out of discovery first, as a drained node
                self.away[host] = (strike, self.newest_seen, time.monotonic())
                self._list_hosts()
            if fault == "host-lost":
                self.hosts.lose(host)
                for folder in processes.snapshots(self.tag) - self.snapshots:  # its memory goes with it
                    shutil.rmtree(folder / host, ignore_errors=True)
            elif fault == "partition":
                self.hosts.link(host, up=False)
                self._later(strike.seconds, lambda: self.hosts.link(host, up=True))
            else:
                self.hosts.shape(host, SLOW)
                self._later(strike.seconds, lambda: self.hosts.unshape(host))
            return True
        if fault == "disk-full":
            strike.target = str(self.ckpt)
            self.say(strike.describe())
            self._fill()
            return True
        import psutil

        if fault == "preempt":
            strike.target = "every rank"
            self.say(strike.describe())
            for process, _ in found.values():
                with contextlib.suppress(psutil.Error):
                    process.send_signal(getattr(signal, strike.signal))
            return True
        if fault == "in-write":
            rank = self._writer(found)
        else:
            rank = sorted(found)[min(int(strike.pick * len(found)), len(found) - 1)]
        process, host = found[rank]
        strike.target = f"rank {rank} ({host})"
        if fault == "oom":
            # The rank or one of its DataLoader workers, each as likely: the draw's fraction within the rank's share.
            workers = processes.loader_workers(process)
            which = min(int((strike.pick * len(found)) % 1 * (len(workers) + 1)), len(workers))
            if which:
                process = workers[which - 1]
                strike.target += f"'s DataLoader worker (pid {process.pid})"
        self.say(strike.describe())
        if fault == "stall":
            process.send_signal(signal.SIGSTOP)
            self._later(strike.seconds, lambda: process.send_signal(signal.SIGCONT))
            return True
        if fault == "oom":
            try:
                confined = cgroups.confine(process.pid, OOM_BYTES, f"hvdkit-chaos-oom-{process.pid}")
            except OSError as exc:
                strike.phase = ""
                self._unstruck(strike, f"no memory cgroup to confine the process in: {exc}")
                return True
            self.undo.append(lambda: cgroups.release(confined))
            cgroups.exceed(confined, OOM_EXCESS)
            return True
        with contextlib.suppress(psutil.Error):
            process.kill()
        if fault == "in-write":
            strike.phase = ("checkpoint write" if processes.partials(self.ckpt)
                            else "checkpoint write (its write had just ended)")
        if fault == "while-resuming":
            self.second = {"strike": strike, "delay": strike.seconds / 4}
        return True

    def _writer(self, found: dict) -> int:
        """The rank whose temporary file is there (a shard's part names it), else rank 0."""
        for path in processes.partials(self.ckpt):
            rank = checkpoint.rank_of_part(path.name)
            if rank in found:
                return rank
        return 0 if 0 in found else sorted(found)[0]

    def _second_kill(self, state: dict) -> None:
        """while-resuming's second kill: a rank of the restarted job, ``delay`` after its ranks appear."""
        second = self.second
        if not second or second["strike"].attempt == state["number"] or state["started"] is None:
            return
        if time.monotonic() - state["started"] < second["delay"]:
            return
        found = processes.ranks(self.hosts)
        if not found:
            return
        self.second = None
        strike = second["strike"]
        state["mine"].append(strike)
        rank = sorted(found)[-1]
        process, host = found[rank]
        strike.phase = f"training, then rank {rank} killed again {second['delay']:.1f} s into the restart"
        strike.target = f"{strike.target}, then rank {rank} ({host})"  # what ends the attempt its line names
        self.say(f"{strike.describe()}: and rank {rank} ({host}) as the job starts again")
        with contextlib.suppress(Exception):
            process.kill()

    def _look(self, state: dict) -> None:
        """Five times a second: whether the ranks are up, and the job's output so far for its
        resume line (the time until the faults that ended the attempt before were overcome)."""
        now = time.monotonic()
        if now - state["looked"] < 0.2:
            return
        state["looked"] = now
        if state["started"] is None and processes.ranks(self.hosts):
            state["started"] = now
        if state["resumed"]:
            return
        with contextlib.suppress(OSError), open(state["log"], "rb") as log:
            log.seek(state["read"])
            lines = log.read().rpartition(b"\n")[0]  # whole lines only: the next look reads the rest
            state["read"] += len(lines) + 1 if lines else 0
            match = RESUMED.search(lines.decode(errors="replace"))
            if match:
                state["resumed"] = True
                for strike in state["previous"]:
                    strike.resumed_step = int(match[1])
                    strike.back_training_seconds = round(now - self.struck_at[strike.number], 1)
                    strike.steps_redone = max(0, (strike.at_step or 0) - strike.resumed_step)

    def _fill(self) -> None:
        """Leave less room in the checkpoint's filesystem than half its newest checkpoint takes."""
        newest = checkpoint.existing(str(self.ckpt))
        need = sum(p.stat().st_size for p in [newest[-1], *checkpoint.shard_folder(newest[-1]).glob("*")]
                   if p.is_file()) if newest else 1 << 20
        self.ballast, self.room = self.ckpt / BALLAST, need // 2
        self._top_up()

    def _top_up(self) -> None:
        """The ballast grown by what the job has freed since (its rotation deletes old
        checkpoints): the disk stays full until the job ends."""
        if self.ballast is None:
            return
        free = shutil.disk_usage(self.ckpt).free
        if free <= self.room:
            return
        with open(self.ballast, "ab") as f:
            with contextlib.suppress(OSError):
                os.posix_fallocate(f.fileno(), 0, f.seek(0, os.SEEK_END) + free - self.room)

    def _later(self, seconds: float, action: Callable[[], None]) -> None:
        done = threading.Event()

        def once() -> None:
            if not done.is_set():
                done.set()
                with contextlib.suppress(Exception):
                    action()

        timer = threading.Timer(seconds, once)
        timer.daemon = True
        timer.start()
        self.timers.append(timer)
        self.undo.append(once)

    def _undo(self) -> None:
        for timer in self.timers:
            timer.cancel()
        for action in self.undo:
            action()
        self.timers, self.undo = [], []
        for host in list(self.away):
            self._give_back(host)

    def _list_hosts(self) -> None:
        """The discovery's hostfile: every host but those away."""
        kept = [line for line in self.listed if line.split()[0].split(":")[0] not in self.away]
        wholefiles.write_whole(self.hostfile, "".join(line + "\n" for line in kept))

    def _give_back(self, host: str) -> None:
        """A lost host of an elastic job back: up, its sshd started, listed again for discovery."""
        strike, _, since = self.away.pop(host)
        self.hosts.link(host, up=True)
        self.hosts.restart_sshd(host)
        self._list_hosts()
        strike.phase += f"; given back {time.monotonic() - since:.1f} s later, at checkpoint step {self.newest_seen}"
        self.say(f"{host} given back {time.monotonic() - since:.1f} s after its loss "
                 f"(the job's newest checkpoint then: step {self.newest_seen})")

    def _prepare_restart(self) -> None:
        """As a scheduler requeues onto healthy nodes: lost hosts back, space freed."""
        if self.ballast is not None:
            self.ballast.unlink(missing_ok=True)
            self.ballast = None
        for name in self.hosts.names[1:]:
            if self.hosts.sshd[name].poll() is not None:
                self.hosts.link(name, up=True)
                self.hosts.restart_sshd(name)

    def _after(self, attempt: verdict.Attempt, mine: list[Strike]) -> None:
        """After an ending: nothing of the job on the hosts; no written checkpoint lost."""
        what = mine[-1].describe() if mine else ("the undisturbed run" if attempt.number == 0
                                                 else f"attempt {attempt.number}")
        left, seconds = processes.settled(lambda: processes.left_running(self.hosts), SETTLE, SETTLE_WITHOUT_LIFELINE)
        self.report.attempts[-1]["settled_seconds"] = seconds
        if left:
            self.report.problems.append(f"after {what}: {len(left)} process(es) left running once the job ended: "
                                        + "; ".join(left[:4]))
            self.report.left.setdefault("processes", []).extend(left)
            for name in self.hosts.names:
                self.hosts.end_jobs(name)
        kept = sorted(processes.snapshots(self.tag) - self.snapshots)
        if kept:  # each attempt's snapshots go with it (hvdkit launch and the ranks remove them)
            self.report.problems.append(f"after {what}: snapshots left in host memory: {', '.join(map(str, kept))}")
            self.report.left.setdefault("snapshots", []).extend(map(str, kept))
            for folder in kept:
                shutil.rmtree(folder, ignore_errors=True)
        if self.newest_seen and self._newest_step() < self.newest_seen:
            self.report.problems.append(f"after {what}: checkpoint step {self.newest_seen} was written and is gone "
                                        f"(the newest now: {self._newest_step()})")

    def _attempt(self, number: int, watch: Callable[[], None]) -> verdict.Attempt:
        """The command once, on node0, its output to a log; ``watch`` every tick until it ends."""
        attempt = verdict.Attempt(number, log=str(self.out / f"attempt-{number}.log"))
        began = time.monotonic()
        with open(attempt.log, "w") as log:
            self.running["proc"] = proc = subprocess.Popen(self.hosts.on(self.hosts.names[0], self.command),
                                                           env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                                           process_group=0)
            try:
                proctree.wait_child(proc, timeout=0)  # its reaper started: returncode is set once it ends
                while (code := proc.returncode) is None:
                    self._notice()  # returns as soon as a file appears in the checkpoint directory
                    watch()
                    if self.deadline is not None and time.monotonic() - began > self.deadline:
                        self.report.problems.append(f"attempt {number} did not end within {self.deadline:.0f} s "
                                                    f"(output: {attempt.log})")
                        proctree.end_processes(proctree.tree(proc.pid), grace=5)
                        code = proctree.wait_child(proc, timeout=10)
                        break
            finally:
                self.running.pop("proc", None)
        attempt.code, attempt.seconds = job.shell_code(code), round(time.monotonic() - began, 1)
        attempt.line = verdict.last_line(Path(attempt.log)) if code else ""
        self.report.attempts.append(asdict(attempt))
        return attempt

    def _notice(self) -> None:
        """Wait up to a tick for files made in the checkpoint directory and its shard folders;
        note the steps whose write has begun (a temporary file), for in-write."""
        for event in self.notify.read(timeout=int(TICK * 1000)):
            folder = self.folders.get(event.wd, self.ckpt)
            if event.mask & inotify.flags.ISDIR and checkpoint.is_shard_folder(event.name):
                with contextlib.suppress(OSError):
                    self.folders[self.notify.add_watch(folder / event.name, inotify.flags.CREATE)] = folder / event.name
            elif event.name.endswith(wholefiles.PARTIAL):
                step = processes.step_of_partial(folder / event.name)
                if step is not None:
                    self.writing.append((step, folder / event.name))

    def _written(self) -> set[int]:
        return {checkpoint.step_of(path) for path in checkpoint.existing(str(self.ckpt))}

    def _newest_step(self) -> int:
        return max(self._written(), default=0)
