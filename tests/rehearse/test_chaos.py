"""`hvdkit rehearse --chaos`: real jobs on namespace hosts through real faults, held to an
undisturbed run (hvdkit.rehearse.chaos).

One short run per launcher family, each a few faults at a fixed seed, the menu shared out among
them, each held to its own undisturbed run; the Session loop's under horovodrun --mpi is also
the one plain mpirun's and the planted defects' runs are held to (the same loop ends bitwise the
same whichever launcher started its ranks, and each run it spares is seconds of the suite): an
elastic job under plain horovodrun (Gloo), plain mpirun, hvdkit launch (out of memory, a
preemption, kills as the job resumes; and with in-job restarts on 4 hosts), a Session loop under
plain horovodrun --mpi. Then two planted defects the tool must catch, and bad input. (The soak's
seed 101 on 3 hosts is replayed by the soak itself, tests/programs/chaos_soak.sh.)
"""

import json
import os
import re
import subprocess
import sys
import uuid

import pytest

from conftest import REPO, require_namespaces
from hvdkit.launch import restarts
from hvdkit.rehearse import diagnosis, faults, verdict
from rehearse.test_rehearse import REHEARSE, environment, wait_for_none_left

LOOP = str(REPO / "tests" / "programs" / "chaos_loop.py")
TRAIN = ["hvdkit", "train", "--model", "mlp", "--image-size", "48", "--dataset", "synthetic", "--max-steps", "160",
         "--checkpoint-steps", "20", "--warmup-epochs", "0", "--lr-schedule", "none", "--log-interval", "40"]
# Each rank alone on its host, one thread wherever it runs: so every attempt computes as the undisturbed run did.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
MPIRUN = ("mpirun -np 2 --hostfile $HVDKIT_HOSTFILE --allow-run-as-root -x PATH -x OMP_NUM_THREADS "
          "-x HVDKIT_CHECKPOINT_DIR -x HVDKIT_CHECKPOINT_STEPS")
# Open MPI's own texts where it ends the job itself at a lost host, each naming the host: its TCP transport's,
# whose peer's connection dropped (help-mpi-btl-tcp.txt), and mpirun's, whose ssh to the host's daemon
# dropped first (help-errmgr-base.txt).
OPEN_MPI_ENDED = {"An MPI communication peer process has unexpectedly disconnected": r"Peer host:\s+{host}\b",
                  "ORTE has lost communication with a remote daemon": r"Remote daemon: \S+ on node {host}\b"}


def test_bad_input_is_one_line_exit_2_and_nothing_made(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    command = ["--", "hvdkit", "train", "--checkpoint-dir", str(ckpt)]
    cases = {
        ("--chaos", "3", "--faults", "kill,meteor"): "--faults: unknown fault 'meteor'; the menu: kill, stall,",
        ("--chaos", "-1"): "--chaos -1: the number of faults is 0 or more",
        ("--hosts", "1", "--chaos", "2", "--faults", "kill,host-lost"):
            "--faults host-lost needs --hosts 2 or more",
        ("--hosts", "2", "--chaos", "2", "--faults", "partition", "--slurm"): "--chaos strikes its own faults",
        ("--faults", "kill"): "--faults goes with --chaos K",
        ("--chaos", "2", "--faults", "kill,preempt", "--", "sh", "-c", "horovodrun --min-np 1 hvdkit train"):
            "--faults preempt: an elastic job is rehearsed with the faults it rides out: kill, stall, host-lost,",
        ("--chaos", "2", "--tolerance", "0.1"): "--tolerance is for an elastic job's final model",
        ("--chaos", "2", "--min-diagnosed", "1.5"): "--min-diagnosed 1.5: a fraction of the endings, from 0 to 1",
        ("--min-diagnosed", "1"): "--min-diagnosed goes with --chaos K",
    }
    for args, words in cases.items():
        proc = subprocess.run([*REHEARSE, *args, "--out", str(out), *command], capture_output=True, text=True,
                              cwd=tmp_path)
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.count("\n") == 1 and words in proc.stderr, (args, proc.stderr)
    (ckpt / "ckpt-step000000010.pt").parent.mkdir()
    (ckpt / "ckpt-step000000010.pt").write_bytes(b"a user's")
    proc = subprocess.run([*REHEARSE, "--chaos", "1", "--out", str(out), *command], capture_output=True, text=True)
    assert proc.returncode == 2 and f"{ckpt} is not empty" in proc.stderr, proc.stderr
    assert (ckpt / "ckpt-step000000010.pt").read_bytes() == b"a user's"
    proc = subprocess.run([*REHEARSE, "--chaos", "1", "--", "hvdkit", "train"], capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "HVDKIT_CHECKPOINT_DIR"})
    assert proc.returncode == 2 and "--chaos needs the job's checkpoint directory" in proc.stderr, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"], "no report folder, nothing else"


def test_a_seed_gives_the_same_schedule_and_every_fault_before_any_twice():
    steps = [10, 20, 30, 40, 50]
    first = faults.plan(7, 12, list(faults.FAULTS), steps)
    assert first == faults.plan(7, 12, list(faults.FAULTS), steps)
    assert first != faults.plan(8, 12, list(faults.FAULTS), steps)
    assert sorted(s.fault for s in first[:len(faults.FAULTS)]) == sorted(faults.FAULTS)
    assert [s.step for s in first] == sorted(s.step for s in first) and {s.step for s in first} <= {10, 20, 30, 40}


def test_each_fault_has_a_moment_between_checkpoints_and_the_writes_faults_none():
    strikes = faults.plan(7, 30, list(faults.FAULTS), [10, 20, 30, 40, 50])
    assert all(s.delay == 0.0 for s in strikes if s.fault in faults.AT_ONCE)
    delays = [s.delay for s in strikes if s.fault not in faults.AT_ONCE]
    assert all(0.0 <= d < faults.LATEST for d in delays) and len(set(delays)) == len(delays)
    assert max(delays) > faults.LATEST / 2 > min(delays), "moments spread over the time between checkpoints"


def test_a_faults_cost_is_read_from_the_jobs_metrics_across_its_restarts():
    """Two starts after two faults (an in-job restart from a snapshot, then one from the checkpoint
    of step 20), each report stamped with the wall time, as metrics.jsonl holds them; a stall rode
    out (no start follows it before the end)."""
    from hvdkit.rehearse import goodput

    found = [{"event": "config", "log_interval": 1, "time": 100.0},
             *({"event": "train", "step": s, "time": 100.0 + s} for s in range(1, 26)),
             {"event": "config", "log_interval": 1, "time": 129.0},  # struck at 125.5: step 25 done
             *({"event": "train", "step": s, "time": 110.0 + s} for s in range(25, 33)),
             {"event": "config", "log_interval": 1, "time": 150.0},  # struck at 142.4: step 32 done
             {"event": "train", "step": "bad"}, *({"event": "train", "step": s, "time": 135.0 + s}
                                                 for s in range(21, 40))]
    costs = goodput.per_fault(found, [(1, 125.5), (2, 142.4), (3, 180.0)])
    assert costs == {1: {"seconds_to_next_step": 9.5, "step_at_fault": 25, "went_on_from": 24, "steps_redone": 1},
                     2: {"seconds_to_next_step": 13.6, "step_at_fault": 32, "went_on_from": 20, "steps_redone": 12}}
    total = goodput.summary(list(costs.values()), 40.0, 80.0)
    assert total == {"faults_measured": 2, "mean_seconds_to_next_step": 11.55, "mean_steps_redone": 6.5,
                     "effective_training_time_ratio": 0.5, "undisturbed_seconds": 40.0, "disturbed_seconds": 80.0}
    coarse = [{**r, "log_interval": 10} if r.get("event") == "config" else r for r in found]
    assert goodput.per_fault(coarse, [(1, 125.5)]) == {1: {"seconds_to_next_step": 9.5}}


def test_an_undisturbed_runs_start_up_and_steady_step_are_read_from_its_reports():
    """From the launch to the first trained step, and the median time from one step to the next:
    a checkpoint's slower step does not move the median."""
    from hvdkit.rehearse import goodput

    found = [{"event": "config", "time": 101.0}, {"event": "train", "step": 1, "time": 104.5},
             *({"event": "train", "step": s, "time": 104.5 + 0.01 * (s - 1) + (0.5 if s > 20 else 0.0)}
               for s in range(2, 31))]
    assert goodput.pace(found, 100.0) == {"startup_seconds": 4.5, "trained_steps": 30, "steady_step_ms": 10.0,
                                          "training_seconds": 0.79}
    assert goodput.pace([{"event": "config", "time": 101.0}], 100.0) == {}


def test_states_are_compared_bitwise_and_the_first_difference_named():
    import torch

    a = {"model": {"w": torch.ones(3)}, "optimizer": {"state": {0: {"step": torch.tensor(4.0)}}}, "step": 4}
    b = {"model": {"w": torch.ones(3)}, "optimizer": {"state": {0: {"step": torch.tensor(4.0)}}}, "step": 4}
    assert verdict.difference(a, b) is None
    b["model"]["w"] = torch.ones(3).nextafter(torch.full((3,), 2.0))
    assert verdict.difference(a, b).startswith("model.w differs (largest difference 1.19e-07)")


def test_an_attempts_ending_is_hvdkit_launchs_last_word_not_its_first(tmp_path):
    """After a lost host without a spare, hvdkit launch's first line names the rank that died
    with it, its last why the job ends: the last is the attempt's ending."""
    log = tmp_path / "attempt-0.log"
    log.write_text("hvdkit launch: rank 1 (pid 26143 on node1) ended without a word (a signal or a crash); ending "
                   "the other ranks now\n[1,0]<stderr>:[train] step 161/264\nhvdkit launch: host node1 (10.0.0.2, "
                   "rank 1) refuses ssh (port 22): no rank starts there; the job ended without it; no restart "
                   "without node1: -np 3 is more than the 2 slots in node0:1,node2:1; exit 76\n")
    assert verdict.last_line(log).startswith("hvdkit launch: host node1 (10.0.0.2, rank 1) refuses ssh")


def test_an_ending_is_diagnosed_where_its_line_names_the_cause_and_the_rank_or_host(tmp_path):
    """Lines as the launchers and hvdkit print them (the soak's, issue 64): which name their
    fault's cause and target, and why the others do not."""
    guard_line = ("hvdkit launch: rank 1 (host node1, pid 4242) was killed by the kernel's out-of-memory killer "
                  "(SIGKILL) after step 41; its peak 0.61 GiB: lower the batch size")
    cases = [
        ("oom", "rank 1 (node1)", guard_line, None),
        ("kill", "rank 1 (node1)", guard_line, "it does not say killed"),
        ("kill", "rank 0 (node0)", "mpirun noticed that process rank 0 with PID 0 on node node0 exited on signal 9 "
                                   "(Killed).", None),
        ("kill", "rank 1 (node1)", "horovodrun: rank 0 on node0 exited with code 137; the other ranks were ended",
         "it does not name rank 1 (node1)"),
        ("while-resuming", "rank 1 (node1), then rank 2 (node2)", "mpirun noticed that process rank 2 with PID 22318 "
                                                                  "on node node2 exited on signal 9 (Killed).", None),
        ("host-lost", "node2", "hvdkit launch: host node2 (10.231.0.13, rank 2) does not answer on the network; the "
                               "job ended without it", None),
        ("host-lost", "node2", "hvdkit launch: host node2 (10.231.0.13, rank 2) refuses ssh (port 22) since the job "
                               "began: no rank starts there; the job ended without it", None),
        ("host-lost", "node1", "hvdkit train: Horovod shut down while rank 0 waited in session.step() (step 39): "
                               "another rank ended", "it does not say host lost"),
        ("disk-full", "/ckpt", "hvdkit train: cannot write checkpoint /ckpt/x.pt: No space left on device", None),
        ("preempt", "every rank", "hvdkit launch: stopped by SIGTERM at step 90; checkpoint of step 90 saved", None),
        ("stall", "rank 1 (node1)", "", "no line"),
    ]
    for fault, target, line, why in cases:
        assert diagnosis.missed(fault, target, line) == why, (fault, target, line)
    log = tmp_path / "attempt-1.log"
    log.write_text(f"[1,0]<stdout>:step 3\n{guard_line}\nhvdkit launch: {guard_line[14:]}; restart 1 of 3 on "
                   f"node0:1,node1:1, from the newest checkpoint\n")
    strikes = [{"number": 1, "fault": "oom", "target": "rank 1 (node1)", "attempt": 1, "restarted_in_job": True},
               {"number": 2, "fault": "stall", "target": "rank 0 (node0)", "attempt": 1},
               {"number": 3, "fault": "kill", "target": "rank 0 (node0)", "attempt": 1,
                "ended": {"code": 137, "line": "horovodrun: rank 1 on node1 exited with code 137"}}]
    said = diagnosis.score(strikes, tmp_path)
    preempted = {"number": 4, "fault": "preempt", "target": "every rank", "attempt": 2, "phase": "training"}
    killed = {"number": 5, "fault": "kill", "target": "rank 1 (node1)", "attempt": 2, "phase": "training",
              "ended": {"code": 143, "line": "hvdkit launch: stopped by SIGTERM at step 292; checkpoint saved"}}
    assert diagnosis.score([preempted, killed], tmp_path)["diagnosed"] == 1, "the preemption ended that attempt"
    resuming = {"number": 6, "fault": "while-resuming", "target": "rank 1 (node1), then rank 2 (node2)", "attempt": 3,
                "phase": "training", "ended": {"code": 137, "line": "hvdkit launch: rank 2 (host node2, pid 8180) was "
                                                                    "killed by SIGKILL"}}
    also = {"number": 7, "fault": "kill", "target": "rank 0 (node0)", "attempt": 3, "phase": "training", "ended": {
        "code": 137, "line": "hvdkit launch: rank 1 (host node1, pid 7629) was killed by SIGKILL after step 180"}}
    assert diagnosis.score([resuming, also], tmp_path)["diagnosed"] == 2, \
        "attempt 3 ended by the while-resuming's first kill (rank 1); its second (rank 2) ended attempt 4"
    wrong = {**resuming, "ended": {"code": 137, "line": "hvdkit launch: rank 1 (host node1) was killed by SIGKILL"}}
    assert diagnosis.score([wrong], tmp_path)["diagnosed"] == 0, "the second kill's attempt: rank 2"
    assert said == {"diagnosed": 1, "endings": 2, "misses": [{
        "number": 3, "fault": "kill", "target": "rank 0 (node0)", "why": "it does not name rank 0 (node0)",
        "line": "horovodrun: rank 1 on node1 exited with code 137"}]}
    assert diagnosis.below(said, 0.95) == "diagnosed 1 of 2 endings (0.50), below --min-diagnosed 0.95"
    assert diagnosis.below(said, 0.5) is None and diagnosis.below(said, None) is None
    assert diagnosis.below({"diagnosed": 36, "endings": 38}, 0.95) == \
        "diagnosed 36 of 38 endings (0.94), below --min-diagnosed 0.95", "0.947 is not rounded up to 0.95"
    for run, diagnosed in (("a", said), ("b", {"diagnosed": 3, "endings": 3, "misses": []})):
        (tmp_path / run).mkdir()
        (tmp_path / run / "report.json").write_text(json.dumps({"diagnosis": diagnosed}))
    assert diagnosis.total(sorted(tmp_path.glob("*/report.json"))) == [
        "not diagnosed: a fault 3 (kill rank 0 (node0)): it does not name rank 0 (node0): horovodrun: rank 1 on "
        "node1 exited with code 137", "diagnosed 4 of 5 endings (0.80)"]


def _chaos(tmp_path, name, seed, faults, command, reference=None, count=None, env=None, hosts=2, extra=()):
    """``hvdkit rehearse --chaos`` as a user types it; its exit code, stderr and report."""
    mark, ckpt, out = uuid.uuid4().hex, tmp_path / f"{name}-ckpt", tmp_path / f"{name}-out"
    count = count or len(faults.split(","))
    args = [*REHEARSE, "--hosts", str(hosts), "--chaos", str(count), "--chaos-seed", str(seed), "--faults", faults,
            "--out", str(out), "--checkpoint-dir", str(ckpt), *extra]
    if reference:
        args += ["--reference", str(reference)]
    environ = {**environment(mark), **ONE_THREAD, "HVDKIT_CHECKPOINT_DIR": str(ckpt), **(env or {})}
    proc = subprocess.Popen([*args, "--", *command(ckpt)], env=environ, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:  # timed out: stopped as a user would, so that it removes its hosts and job
            proc.terminate()
            try:
                proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            wait_for_none_left(proc.pid, mark, tmp_path)
    wait_for_none_left(proc.pid, mark, tmp_path)
    report = json.loads((out / "report.json").read_text())
    return proc.returncode, err, report


def _survived(code, err, report, names):
    assert code == 0, err[-4000:]
    assert [s["fault"] for s in report["strikes"]] == sorted(names.split(","), key=[
        s["fault"] for s in report["strikes"]].index)
    assert all(s["phase"] for s in report["strikes"]), report["strikes"]
    assert report["final"]["equal"] and report["problems"] == [] and report["left"] == {}, report
    assert report["not_struck"] == [], report["not_struck"]
    count = len(names.split(","))
    assert f"{count} of {count} faults struck and survived, the final checkpoint equals the undisturbed run's" in err


ELASTIC = ("horovodrun -np 2 --min-np 1 --max-np 2 --blacklist-cooldown-range 3 5 --host-discovery-script "
           "hvdkit-discover-hosts")


@pytest.mark.slow
def test_an_elastic_job_under_plain_horovodrun_rides_out_a_stall_a_kill_and_a_lost_host_given_back(tmp_path):
    """hvdkit train --elastic under plain horovodrun (Gloo): a stall, a rank killed (the job goes on
    at one rank), then node1 lost (out of discovery, given back once the job has checkpointed
    without it): the job finishes, its model within the tolerance of the undisturbed run's.
    A smaller learning rate than the default's: there the synthetic task is chaotic and any change
    of world size sends the weights far (docs/rehearse.md#elastic-jobs)."""
    require_namespaces()
    code, err, report = _chaos(tmp_path, "elastic", 12, "host-lost,stall,kill", lambda ckpt: [
        "sh", "-c", f"{ELASTIC} {' '.join(TRAIN)} --elastic --lr 0.005 --checkpoint-dir {ckpt}"])
    assert code == 0, err[-4000:]
    assert [s["fault"] for s in report["strikes"]] == ["stall", "kill", "host-lost"], "the schedule seed 12 draws"
    assert all(s["phase"] for s in report["strikes"]), report["strikes"]
    assert report["problems"] == [] and report["left"] == {} and report["not_struck"] == [], report
    (lost,) = [s for s in report["strikes"] if s["fault"] == "host-lost"]
    assert "; given back " in lost["phase"] and "node1 given back " in err, lost
    final = report["final"]
    assert final["tolerance"] == faults.ELASTIC_TOLERANCE and 0 < final["distance"] <= final["tolerance"], final
    assert "3 of 3 faults struck and survived, the final checkpoint is " in err


@pytest.mark.slow
def test_plain_mpirun_survives_a_full_disk_a_stall_a_kill_during_a_write_and_a_lost_host(tmp_path, loop_run):
    """A Session loop under plain mpirun (the soak runs hvdkit train under it too), held to the
    same loop's undisturbed run under horovodrun --mpi; every ending's line names its cause and
    its rank or host: the lost host's too, though mpirun ends the other rank a second after it
    notices (the survivor probes the lost rank's port: hvdkit.rank.liveness.watchdog). The one ending
    allowed to go unsaid is the lost host's where Open MPI ended the survivor itself: its TCP
    transport saw the peer's connection drop in the middle of an exchange and called _exit, or
    mpirun saw its ssh to the host's daemon drop first and ended the job, so no code of hvdkit's ran
    (docs/rehearse.md, open); Open MPI's own text is then checked to name the host."""
    faults = "disk-full,stall,in-write,host-lost"
    code, err, report = _chaos(tmp_path, "mpirun", 12, faults,
                               lambda ckpt: ["sh", "-c", f"{MPIRUN} {sys.executable} {LOOP} 120"],
                               reference=loop_run[2]["reference"]["dir"], env={"HVDKIT_CHECKPOINT_STEPS": "10"},
                               extra=["--min-diagnosed", "0.6"])
    _survived(code, err, report, faults)
    for miss in report["diagnosis"]["misses"]:
        (strike,) = [s for s in report["strikes"] if s["number"] == miss["number"]]
        log = (tmp_path / "mpirun-out" / f"attempt-{strike['attempt']}.log").read_text(errors="replace")
        said = [where for text, where in OPEN_MPI_ENDED.items() if text in log]
        assert miss["fault"] == "host-lost" and said, report["diagnosis"]
        assert re.search(said[0].format(host=re.escape(miss["target"])), log), log[-3000:]
        print(f"the lost host's ending went unsaid: Open MPI ended the survivor itself ({miss['line']!r})")
    (full,) = [s for s in report["strikes"] if s["fault"] == "disk-full"]
    assert "No space left on device; the previous checkpoints are untouched" in full["ended"]["line"]
    (in_write,) = [s for s in report["strikes"] if s["fault"] == "in-write"]
    assert in_write["phase"].startswith("checkpoint write"), in_write
    assert all(s["back_training_seconds"] for s in report["strikes"] if s["ended"]), report["strikes"]


@pytest.mark.slow
def test_in_job_restarts_of_zero_go_on_from_snapshots_and_a_lost_hosts_shard_from_its_buddy_on_the_spare(tmp_path):
    """hvdkit launch -np 3 --max-restarts on 4 hosts (one spare), ZeRO stage 3 with AdamW, a
    snapshot every step: a rank killed at a random moment between checkpoints, then a host lost
    (its snapshots, its rank's own shard of the optimizer's state and its slices of the weights
    with it): each restarted within the one attempt, the second on the spare host, going on from a
    snapshot (at most one step redone, from the job's own step reports), so the lost rank's shard
    came from the copy its buddy on another host kept; bitwise at the end (the chaos run's own
    undisturbed run), no snapshot left in host memory. Stage 3's shard holds what stage 2's does and
    the weights' slices besides, so one run covers both (each is about two minutes of the suite); stage
    2's shard going to its buddy's host: tests/checks/test_sync_audit.py, the plan of whose copy a
    resume reads: tests/rank/test_shard_snapshots.py."""
    require_namespaces()
    every_step = [*TRAIN[:TRAIN.index("--log-interval")], "--log-interval", "1", "--log-dir", str(tmp_path / "logs"),
                  "--zero", "3", "--optimizer", "adamw", "--max-steps", "80"]  # seed 1 strikes after steps 20 and 40
    code, err, report = _chaos(tmp_path, "restarts", 1, "kill,host-lost", lambda ckpt: [
        "hvdkit", "launch", "-np", "3", "--max-restarts", "5", "--", *every_step, "--snapshot-steps", "1",
        "--checkpoint-dir", str(ckpt)], hosts=4)
    assert code == 0, err[-4000:]
    assert report["final"]["equal"] and report["problems"] == [] and report["left"] == {}, report
    assert [a["number"] for a in report["attempts"]] == [0, 1], "no requeue: every fault restarted in the job"
    assert all(s["restarted_in_job"] and s["steps_redone"] <= 1 for s in report["strikes"]), report["strikes"]
    (lost,) = [s for s in report["strikes"] if s["fault"] == "host-lost"]
    assert lost["target"] in ("node1", "node2"), "a host that runs a rank, not the spare"
    spare = ",".join(f"node{i}:1" for i in range(4) if f"node{i}" != lost["target"])
    log = (tmp_path / "restarts-out" / "attempt-1.log").read_text()
    restart = f"of 5 on {spare} (without {lost['target']}), from the newest checkpoint"
    assert restart in log, log[-4000:]
    resumed = log[log.index(restart):].split("resumed from ")[1].split(" (")[0]
    assert resumed.startswith(restarts.SHM) and "/zero-of-3-holds-" in resumed, resumed
    assert report["goodput"]["faults_measured"] == 2 and "goodput: " in err


@pytest.mark.slow
def test_out_of_memory_kills_a_preemption_and_kills_as_the_job_resumes_are_each_named_and_end_bitwise(tmp_path):
    """hvdkit train with a DataLoader worker per rank under hvdkit launch on 2 hosts, four faults at
    seed 20: a kill and another as the restarted job resumes (while-resuming), a preemption
    (SIGUSR1, requeued), rank 0's worker out of memory, rank 1 out of memory. Each oom for real: the
    process confined to a memory cgroup, a process started in it past the limit, the kernel's
    out-of-memory killer ends it. Every ending's line names its cause and rank, the oom lines the
    peak (the guard's, hvdkit.launch.guard), held by --min-diagnosed 1; the final checkpoint is
    bitwise the undisturbed run's."""
    require_namespaces()
    names = "oom,while-resuming,oom,preempt"
    code, err, report = _chaos(tmp_path, "oom", 20, names, lambda ckpt: [
        "hvdkit", "launch", "-np", "2", "--", *TRAIN, "--num-workers", "1", "--checkpoint-dir", str(ckpt)],
        extra=["--min-diagnosed", "1"])
    _survived(code, err, report, names)
    resuming, preempt, worker, rank = report["strikes"]
    assert re.fullmatch(r"rank 0 \(node0\)'s DataLoader worker \(pid \d+\)", worker["target"]), worker
    pid = worker["target"].split("(pid ")[1].rstrip(")")
    assert re.search(rf"rank 0 \(host node0, pid \d+\) ended \(exit \d+\)( after step \d+)? after the kernel's "
                     rf"out-of-memory killer killed its process {pid} \(a DataLoader worker\); its peak \d+\.\d\d GiB",
                     worker["ended"]["line"]), worker
    assert rank["target"] == "rank 1 (node1)" and rank["phase"] == "training", rank
    assert re.search(r"rank 1 \(host node1, pid \d+\) was killed by the kernel's out-of-memory killer \(SIGKILL\)"
                     r"( after step \d+)?; its peak \d+\.\d\d GiB", rank["ended"]["line"]), rank
    assert "killed again" in resuming["phase"], resuming
    assert preempt["ended"]["line"].startswith(f"hvdkit launch: stopped by {preempt['signal']} at step "), preempt
    diagnosis = report["diagnosis"]
    assert diagnosis["misses"] == [] and diagnosis["diagnosed"] == diagnosis["endings"] >= 4, diagnosis


@pytest.fixture(scope="module")
def loop_run(tmp_path_factory):
    """A Session loop under plain horovodrun --mpi through a partition, a slow link and a lost host:
    its undisturbed run is the reference of the planted defects' run, under the same launcher."""
    require_namespaces()
    tmp_path = tmp_path_factory.mktemp("loop")
    return _chaos(tmp_path, "loop", 13, "partition,slow,host-lost", _loop(), env={"HVDKIT_CHECKPOINT_STEPS": "10"})


def _loop(*args):
    return lambda ckpt: ["sh", "-c", f"horovodrun --mpi -np 2 -H $HVDKIT_HOSTS {sys.executable} {LOOP} 120 "
                                     + " ".join(args)]


@pytest.mark.slow
def test_a_session_loop_under_horovodrun_mpi_survives_a_partition_a_slow_link_and_a_lost_host(loop_run):
    _survived(*loop_run, "partition,slow,host-lost")


@pytest.mark.slow
def test_planted_defects_fail_the_chaos_run_each_in_a_line_naming_the_fault_and_what_differed(tmp_path, loop_run):
    """A loop that forgets its weights on resume and leaves a process of rank 1 running: both
    caught in one run, each said in its own line."""
    code, err, report = _chaos(tmp_path, "planted", 5, "kill", _loop("--plant", "forget", "--plant", "linger"),
                               reference=loop_run[2]["reference"]["dir"], env={"HVDKIT_CHECKPOINT_STEPS": "10"})
    assert code == 1, err[-3000:]
    forgot = "the final checkpoint differs from the undisturbed run's after fault 1 (kill): model.0.weight differs"
    lingered = "after fault 1 (kill rank "
    for words in (forgot, lingered):
        assert sum(words in problem for problem in report["problems"]) == 1, report["problems"]
        (line,) = [line for line in err.splitlines() if words in line]
        assert line.startswith("hvdkit rehearse: chaos: "), line
    (line,) = [line for line in err.splitlines() if lingered in line]
    assert "left running once the job ended: sleep 300" in line and "on node1" in line, line
    how = r"\(pid \d+, sleeping( in \w+)?, parent \S+ \(pid \d+\), [\d.]+ s old\)"  # processes.how_it_is
    assert re.search(rf"sleep 300 {how} on node1", line), line
    assert "FAILED (2 problem(s))" in err.splitlines()[-1] and "--chaos-seed 5" in err.splitlines()[-1]
