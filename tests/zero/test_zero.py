"""The sharded optimizer (hvdkit.zero.optimizer, hvdkit.zero.shards) in real horovodrun jobs of 2 and 3 ranks.

tests/programs/zero_worker.py trains one model many ways and reports the weights and the bytes each rank
holds; tests/programs/zero_script.py is a user's own loop with a Session, for checkpoints and export.
"""

import os
import shutil
import sys

import pytest
import torch
from torch import nn

from conftest import REPO, leaves, run
from hvdkit import checkpoint
from hvdkit.config import ConfigError
from hvdkit.launch import planner
from hvdkit.zero import optimizer as zero

pytestmark = pytest.mark.slow

PROGRAMS = REPO / "tests" / "programs"
WORKER, SCRIPT = str(PROGRAMS / "zero_worker.py"), str(PROGRAMS / "zero_script.py")
# Open MPI spins while it waits; three ranks on two cores then take turns slowly (66 s against 14 s).
QUIET = {"OMPI_MCA_mpi_yield_when_idle": "1"}


def _env(**keys) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HVDKIT_")}
    return {**environ, **QUIET, **{f"HVDKIT_{k.upper()}": str(v) for k, v in keys.items()}}


def _run(cmd, env=None, np=1, how="horovodrun --gloo", timeout=300):
    proc = run(planner.local_command(how, np, cmd) if np > 1 else cmd, env=env or _env(), timeout=timeout)
    return proc


def _ok(proc):
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _close(a, b, what):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=0, msg=what)


# Each controller at each world size, and each with its collectives in flight and waited for one at a
# time: the pairs in four runs (each starts 2-3 ranks and trains 24 ways), not all eight combinations.
@pytest.mark.parametrize("how, np, in_flight", [("horovodrun --gloo", 2, ""), ("horovodrun --mpi", 3, ""),
                                                ("horovodrun --gloo", 3, "1"), ("horovodrun --mpi", 2, "1")])
def test_stages_train_as_distributed_optimizer_and_one_process(tmp_path, how, np, in_flight):
    """``in_flight`` "1": the collectives kept in flight together, as on GPUs (HVDKIT_ZERO_IN_FLIGHT)."""
    out = tmp_path / "out.pt"
    _ok(_run([sys.executable, WORKER, str(out)], np=np, how=how, env=_env(zero_in_flight=in_flight)))
    result = torch.load(out, weights_only=False)
    assert result["size"] == np
    weights = result["weights"]
    assert len(weights) == 24  # 3 optimizers x (plain, accumulation + clipping) x 4 ways
    initial = zero_worker_initial()
    for (name, passes, clip, impl), got in weights.items():
        what = f"{name}, K={passes}, clip={clip}, {impl} at np={np}"
        _close(got, weights[name, passes, clip, "horovod"], f"{what} vs DistributedOptimizer")
        _close(got, weights[name, passes, clip, "one process"], f"{what} vs one process")
        assert not torch.equal(got[2], initial[2]), f"{what}: did not train"
    # Bytes each rank holds after the last Adam step, counted from its tensors.
    whole = result["memory"]["horovod"]
    for impl in ("zero1", "zero2"):
        for rank, held in enumerate(result["memory"][impl]):
            assert held["optimizer_state"] == pytest.approx(whole[rank]["optimizer_state"] / np, rel=0.05), impl
    for rank, held in enumerate(result["memory"]["zero2"]):
        assert held["grads"] == pytest.approx(whole[rank]["grads"] / np, rel=0.05)


def test_an_overflow_in_one_ranks_slice_skips_the_step_on_every_rank(tmp_path):
    """fp16 loss scaling (torch's GradScaler on the CPU, as the Session's on a GPU): rank 1's inf
    ends up in one rank's slice; every rank skips that step and halves the scale, as Horovod's."""
    out = tmp_path / "scaled.pt"
    # Without the agreement one rank would step (and allgather) while the other skips: a hang.
    _ok(_run([sys.executable, WORKER, str(out), "--scaler"], np=2, how="horovodrun --gloo", timeout=120))
    result = torch.load(out, weights_only=False)
    weights, scale = result["horovod"]
    assert scale == 2.0 ** 9, "DistributedOptimizer skipped the step and halved the scale"
    for impl in ("zero1", "zero2"):
        _close(result[impl][0], weights, impl)
        assert result[impl][1] == scale, impl


def zero_worker_initial():
    from programs import zero_worker

    return [p.detach() for p in zero_worker.model().parameters()]


def test_sharded_checkpoint_resumes_at_other_world_sizes_as_its_export(tmp_path):
    """Saved at np=2 (K=3), resumed at np=1 (K becomes 6) and np=3 (K 2), stage 2 then 1; each
    equals plain torch continuing from `hvdkit checkpoint export` with the same global batch."""
    saved = tmp_path / "saved"
    keys = dict(batch_size=2, batches_per_allreduce=3, checkpoint_steps=5)
    _ok(_run([sys.executable, SCRIPT, "10", str(tmp_path / "np2.pt")], np=2, how="horovodrun --mpi",
             env=_env(zero=2, checkpoint_dir=saved, log_dir=tmp_path / "log2", **keys)))
    newest = checkpoint.existing(str(saved))[-1]
    assert newest.name == "ckpt-step000000010.pt"
    main = checkpoint.load(newest)
    manifest = main["optimizer"]
    assert manifest["world_size"] == 2 and [s["file"] for s in main["parts"]] == [
        "part-00000-of-00002.pt", "part-00001-of-00002.pt"]
    assert not any(torch.is_tensor(v) for v in leaves(manifest)), "the main file holds no optimizer state"
    # Each rank wrote only its slices: half of the state, as its part holds it.
    held = [_tensor_bytes(checkpoint.load(checkpoint.shard_folder(newest) / s["file"])["zero"]["state"])
            for s in main["parts"]]
    exported = tmp_path / "export"
    proc = _ok(run([sys.executable, "-m", "hvdkit", "checkpoint", "export", str(saved), str(exported)]))
    assert "exported" in proc.stdout
    plain = torch.load(exported / "optimizer.pt")
    whole = _tensor_bytes(plain["state"])
    assert all(abs(h - whole / 2) <= 0.05 * whole / 2 for h in held), (held, whole)
    # The export is plain torch: AdamW and the model load it as it is.
    from programs import zero_script

    model = zero_script.model()
    model.load_state_dict(torch.load(exported / "model.pt"))
    adamw = torch.optim.AdamW([{"params": [*model[0].parameters(), *model[2].parameters()]},
                               {"params": list(model[4].parameters())}])
    adamw.load_state_dict(plain)
    assert sorted(adamw.state_dict()["state"]) == [2, 3, 4, 5], "the frozen layer has no state"

    resumes = ((1, None, dict(zero=2), 6), (3, "horovodrun --mpi", dict(zero=1), 2),
               (3, "horovodrun --gloo", dict(zero=3), 2))
    _resumes_at_1_and_3_as_its_export(tmp_path, saved, exported, main, keys, resumes)


def test_a_stage_3_checkpoint_resumes_at_other_world_sizes_and_stages_as_its_export(tmp_path):
    """Stage 3 saved at np=2 (K=3), by parameter: the main file holds the frozen layer whole and names
    each sharded weight, each rank's part its slices of the weights and their AdamW state; resumed
    at np=1 at stage 3 (K 6), np=3 at stage 2 (K 2) and np=3 at zero 0 (K 2), each as plain torch
    continuing from its export."""
    saved = tmp_path / "saved"
    keys = dict(batch_size=2, batches_per_allreduce=3, checkpoint_steps=5)
    _ok(_run([sys.executable, SCRIPT, "10", str(tmp_path / "np2.pt")], np=2, how="horovodrun --mpi",
             env=_env(zero=3, checkpoint_dir=saved, log_dir=tmp_path / "log2", **keys)))
    newest = checkpoint.existing(str(saved))[-1]
    main = checkpoint.load(newest)
    manifest = main["optimizer"]
    assert manifest["zero"] == 3 and {k for k, v in main["model"].items() if v is not None} == {"0.weight", "0.bias"}, \
        "only the frozen layer whole"
    assert manifest["weights"] == [None, None, ["2.weight"], ["2.bias"], ["4.weight"], ["4.bias"]]
    parts = [checkpoint.load(checkpoint.shard_folder(newest) / p["file"])["zero"] for p in main["parts"]]
    trained = 32 * 32 + 32 + 4 * 32 + 4
    assert [sum(w.numel() for w in part["weights"].values()) for part in parts] == [trained // 2] * 2, \
        "each rank's part holds its half of the two units"
    exported = tmp_path / "export"
    _ok(run([sys.executable, "-m", "hvdkit", "checkpoint", "export", str(saved), str(exported)]))
    whole = torch.load(exported / "model.pt")
    assert list(whole) == list(torch.load(tmp_path / "np2.pt")), "the export's state_dict is the model's"
    for name, value in torch.load(tmp_path / "np2.pt").items():
        assert torch.equal(whole[name], value), name
    resumes = ((1, None, dict(zero=3), 6), (3, "horovodrun --mpi", dict(zero=2), 2),
               (3, "horovodrun --gloo", dict(zero=0, sharded_checkpoint="true"), 2))
    _resumes_at_1_and_3_as_its_export(tmp_path, saved, exported, {**main, "model": whole}, keys, resumes)


def test_a_sharded_distributed_optimizer_checkpoint_resumes_at_other_world_sizes_as_its_export(tmp_path):
    """--sharded-checkpoint without ZeRO: saved at np=2 (K=3), each rank writing a part of the
    weights and the AdamW state; resumed at np=1 (K 6), np=3 (K 2) and np=3 at zero 3 (the whole
    state sliced), as plain torch from its export with the same global batch."""
    saved = tmp_path / "saved"
    keys = dict(batch_size=2, batches_per_allreduce=3, checkpoint_steps=5, sharded_checkpoint="true")
    _ok(_run([sys.executable, SCRIPT, "10", str(tmp_path / "np2.pt")], np=2, how="horovodrun --mpi",
             env=_env(checkpoint_dir=saved, log_dir=tmp_path / "log2", **keys)))
    newest = checkpoint.existing(str(saved))[-1]
    assert newest.name == "ckpt-step000000010.pt"
    raw = checkpoint.load(newest)
    assert [p["file"] for p in raw["parts"]] == ["part-00001-of-00002.pt"], "rank 1 wrote a part"
    assert any(isinstance(v, checkpoint.Part) for v in leaves(raw["optimizer"])), "AdamW state was split"
    exported = tmp_path / "export"
    _ok(run([sys.executable, "-m", "hvdkit", "checkpoint", "export", str(saved), str(exported)]))
    main = checkpoint.load_whole(newest)
    resumes = ((1, None, {}, 6), (3, "horovodrun --mpi", {}, 2), (3, "horovodrun --gloo", dict(zero=3), 2))
    _resumes_at_1_and_3_as_its_export(tmp_path, saved, exported, main, keys, resumes)


def _resumes_at_1_and_3_as_its_export(tmp_path, saved, exported, main, keys, sizes):
    """Each resumed copy of ``saved`` at np 1 and 3 (K adapted, the global batch kept) ends as
    plain torch continuing from ``exported`` on one process with that global batch."""
    _ok(_run([sys.executable, SCRIPT, "16", str(tmp_path / "plain.pt"), "--export", str(exported)], np=1,
             how=None, env=_env(log_dir=tmp_path / "logp", batch_size=2, batches_per_allreduce=6)))
    unsharded = torch.load(tmp_path / "plain.pt")
    for index, (np, how, more, k) in enumerate(sizes):
        resumed = tmp_path / f"resumed{index}"
        shutil.copytree(saved, resumed)
        proc = _ok(_run([sys.executable, SCRIPT, "16", str(tmp_path / f"r{np}.pt")], np=np, how=how,
                        env=_env(checkpoint_dir=resumed, log_dir=tmp_path / f"logr{index}", **{**keys, **more})))
        assert f"batches_per_allreduce 3 -> {k} keeps the global batch of 12 samples" in proc.stderr
        assert "resumed from" in proc.stderr and "step 10" in proc.stderr
        sharded = torch.load(tmp_path / f"r{np}.pt")
        _close(sharded.values(), unsharded.values(), f"resumed at np={np}")
        assert not torch.equal(sharded["4.weight"], main["model"]["4.weight"])


def _tensor_bytes(state: dict) -> int:
    return sum(v.numel() * v.element_size() for v in leaves(state) if torch.is_tensor(v) and v.dim())


def test_sigkill_during_a_sharded_save_leaves_the_previous_checkpoint_in_use(tmp_path):
    ckpt = tmp_path / "ckpt"
    env = _env(zero=2, checkpoint_dir=ckpt, log_dir=tmp_path / "log", batch_size=2, batches_per_allreduce=3,
               checkpoint_steps=5)
    proc = _run([sys.executable, SCRIPT, "16", str(tmp_path / "w.pt"), "--kill-at", "10"], np=2,
                how="horovodrun --mpi", env=env)
    assert proc.returncode != 0
    # Every shard of step 10 was written; its main file, which commits them, was not.
    assert [p.name for p in checkpoint.existing(str(ckpt))] == ["ckpt-step000000005.pt"]
    assert len(list((ckpt / "ckpt-step000000010.pt.shards").glob("part-*.pt"))) == 2
    env["HVDKIT_LOG_DIR"] = str(tmp_path / "log2")
    proc = _ok(_run([sys.executable, SCRIPT, "16", str(tmp_path / "w.pt")], np=2, how="horovodrun --mpi", env=env))
    assert "resumed from" in proc.stderr and "ckpt-step000000005.pt (epoch 1, step 5)" in proc.stderr
    assert [p.name for p in checkpoint.existing(str(ckpt))] == [
        "ckpt-step000000005.pt", "ckpt-step000000010.pt", "ckpt-step000000015.pt"]


class _OwnSGD(torch.optim.SGD):
    """A user's SGD: its step() is its own."""

    def __init__(self, params):
        super().__init__(params, lr=0.1)


class _Elementwise(torch.optim.Optimizer):
    """Not a torch optimizer that hvdkit knows to be elementwise."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})


@pytest.mark.parametrize("make, words", [
    (lambda p: torch.optim.LBFGS(p), "LBFGS: it needs a closure"),
    (lambda p: torch.optim.SparseAdam(p), "SparseAdam: it takes sparse gradients"),
    (lambda p: torch.optim.Adafactor(p), "Adafactor: it does not update each element on its own"),
    (lambda p: _Elementwise(p), "_Elementwise: it does not update each element on its own"),
    (lambda p: _OwnSGD(p), "_OwnSGD: it subclasses SGD, and its step\\(\\) may look at every parameter at once .*"
                           "say so with elementwise_optimizer"),
])
def test_optimizers_that_cannot_be_sharded_are_refused_in_one_line(make, words):
    model = nn.Linear(4, 2)
    with pytest.raises(ConfigError, match=words) as caught:
        zero.check(make(model.parameters()), model, 1)
    assert "\n" not in str(caught.value)


def test_a_subclass_of_an_elementwise_optimizer_is_sharded_once_declared_so():
    """A subclass's step() may compute a statistic over every parameter (a global-norm clip), which
    each rank's slices would change: refused above unless the user says it is elementwise."""
    model = nn.Linear(4, 2)
    zero.check(_OwnSGD(model.parameters()), model, 2, declared=True)
    zero.check(torch.optim.SGD(model.parameters(), lr=0.1), model, 2)


class Controller:
    """Which of Horovod's operations a job runs: what the check reads of ``hvd``. A Horovod
    built elsewhere cannot be installed beside hvdkit's here, so its version string stands in."""

    def __init__(self, mpi: bool) -> None:
        self.mpi = mpi

    def mpi_enabled(self) -> bool:
        return self.mpi

    def gloo_enabled(self) -> bool:
        return not self.mpi


def test_mpi_operations_of_a_horovod_not_built_by_hvdkit_are_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^zero: this Horovod \(0.28.1\) was not built by hvdkit.*"
                                          r"horovodrun --gloo\)$") as caught:
        zero.check_collectives(Controller(mpi=True), "0.28.1")
    assert "\n" not in str(caught.value)
    zero.check_collectives(Controller(mpi=False), "0.28.1")  # Gloo takes aliased buffers as they are
    zero.check_collectives(Controller(mpi=True), "0.28.1+hvdkit.6a3c993f27a8")


def test_sparse_gradients_are_refused_in_one_line():
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    with pytest.raises(ConfigError, match=r"sparse gradients of 0 \(Embedding with sparse=True\)"):
        zero.check(torch.optim.SGD(model.parameters(), lr=0.1), model, 2)


@pytest.mark.parametrize("flags, words", [
    (["--zero", "1", "--use-adasum"], "zero cannot be used with use_adasum"),
    (["--zero", "2", "--elastic"], "zero cannot be used with elastic"),
    (["--zero", "4"], "zero must be 0, 1, 2 or 3"),
    (["--zero", "3", "--compile"], "zero 3 is not yet for compile"),
    (["--zero-groups", "blocks.*"], "zero_groups names the groups of zero 3's sharded weights"),
])
def test_impossible_combinations_stop_before_training_and_write_nothing(tmp_path, flags, words):
    proc = run([sys.executable, "-m", "hvdkit", "train", "--checkpoint-dir", str(tmp_path / "ckpt"),
                "--log-dir", str(tmp_path / "logs"), *flags])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and words in proc.stderr
    assert not list(tmp_path.iterdir())


def test_zero_groups_that_name_no_module_are_refused_in_one_line_before_a_step(tmp_path):
    proc = run([sys.executable, "-m", "hvdkit", "train", "--checkpoint-dir", str(tmp_path / "ckpt"),
                "--log-dir", str(tmp_path / "logs"), "--zero", "3", "--zero-groups", "blocks.*"])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert "zero: no module of Sequential is named as zero_groups says (blocks.*)" in proc.stderr
    assert not checkpoint.existing(str(tmp_path / "ckpt"))


def test_a_refused_optimizer_in_a_session_loop_ends_every_rank_with_its_line(tmp_path):
    script = tmp_path / "lbfgs.py"
    script.write_text("import torch, hvdkit\n"
                      "session = hvdkit.Session(zero=1)\n"
                      "model = torch.nn.Linear(4, 2)\n"
                      "session.setup(model, torch.optim.LBFGS(model.parameters()))\n"
                      "print('trained')\n")
    proc = _run([sys.executable, str(script)], np=2, env=_env(checkpoint_dir=tmp_path / "ckpt",
                                                              log_dir=tmp_path / "logs"))
    assert proc.returncode != 0 and "trained" not in proc.stdout
    assert "zero: stage 1 cannot shard LBFGS: it needs a closure" in proc.stderr
    assert not checkpoint.existing(str(tmp_path / "ckpt"))


def _skipped_for_the_one_before(tmp_path, save, what: str) -> None:
    """Checkpoints 5 and 10 by ``save(step)`` (returning step's shard); 10's shard altered, then gone."""
    save(5)
    shard = save(10)
    warnings = []
    assert checkpoint.load_latest(str(tmp_path), warnings.append)[1]["step"] == 10
    shard.write_bytes(shard.read_bytes()[:-3] + b"xyz")
    assert checkpoint.load_latest(str(tmp_path), warnings.append)[1]["step"] == 5
    assert f"its {what} {shard.name} fails its checksum; using ckpt-step000000005.pt" in warnings[-1]
    shard.unlink()
    assert checkpoint.load_latest(str(tmp_path), warnings.append)[1]["step"] == 5
    assert f"is incomplete: its {what} {shard.name} cannot be read" in warnings[-1]


def test_a_checkpoint_whose_shard_is_missing_or_corrupted_is_skipped_for_the_one_before(tmp_path):
    """A checkpoint of an earlier hvdkit: its shards named in the optimizer's manifest."""
    def save(step):
        main = checkpoint.path_for(str(tmp_path), step)
        digest = checkpoint.write(checkpoint.shard_folder(main) / "rank-00000-of-00001.pt", {"state": {}})
        checkpoint.save(str(tmp_path), step, {"step": step, "optimizer": {
            "shards": [{"file": "rank-00000-of-00001.pt", "sha256": digest}]}}, keep=3)
        return checkpoint.shard_folder(main) / "rank-00000-of-00001.pt"

    _skipped_for_the_one_before(tmp_path, save, "shard")


def test_a_checkpoint_whose_zero_part_is_missing_or_corrupted_is_skipped_for_the_one_before(tmp_path):
    """ZeRO's shards are parts like a sharded checkpoint's: the main file names each with its checksum."""
    def save(step):
        main = checkpoint.path_for(str(tmp_path), step)
        part = checkpoint.shard_folder(main) / checkpoint.part_name(0, 1)
        digest = checkpoint.write(part, {"zero": {"state": {}}})
        checkpoint.save(str(tmp_path), step, {"step": step, "optimizer": {"zero": 1, "world_size": 1, "buckets": []},
                                              "parts": [{"file": part.name, "sha256": digest}]}, keep=3)
        return part

    _skipped_for_the_one_before(tmp_path, save, "part")
