"""The checkpoint writer (hvdkit.checkpoint.writer): a background save writes the state as it was,
waits for values and copies in flight, and says a failed save once."""

import pytest
import torch

from hvdkit import checkpoint


def test_a_background_save_writes_the_state_as_it_was_when_saved(tmp_path):
    writer = checkpoint.Writer()
    weights = torch.arange(1_000_000, dtype=torch.float32)
    model = torch.nn.BatchNorm1d(3).state_dict()  # an OrderedDict with the _metadata load_state_dict reads
    state = {"model": {"w": weights, "tied": weights}, "optimizer": {"param_groups": [{"lr": 0.1}]}, "step": 5,
             "norm": model}
    target = writer.save(str(tmp_path), 5, state, keep=3)
    weights.add_(1)  # the training goes on while the thread writes
    state["optimizer"]["param_groups"][0]["lr"] = 0.2
    writer.finish()
    saved = checkpoint.load(target)
    assert torch.equal(saved["model"]["w"], torch.arange(1_000_000, dtype=torch.float32))
    assert saved["model"]["tied"].data_ptr() == saved["model"]["w"].data_ptr(), "shared memory stays shared"
    assert saved["optimizer"]["param_groups"][0]["lr"] == 0.1 and saved["step"] == 5
    assert type(saved["norm"]) is type(model) and saved["norm"]._metadata == model._metadata
    writer.save(str(tmp_path), 6, state, keep=3)  # the host buffers are reused: the new values are saved
    writer.finish()
    assert torch.equal(checkpoint.load(checkpoint.path_for(str(tmp_path), 6))["model"]["w"], weights)
    assert (writer.saves, writer.waits) == (2, 0) and writer.writing > 0 and writer.stall > 0
    assert [(r["step"], r["background"]) for r in writer.take_done()] == [(5, True), (6, True)]
    assert writer.take_done() == []


def test_a_value_known_after_the_save_returns_is_waited_for_by_the_writing_thread(tmp_path):
    """checkpoint.Later (a snapshot's RNG gather in flight): save() returns without calling it;
    the thread writes what it returns once it does."""
    import threading

    gathered = threading.Event()
    writer = checkpoint.Writer()
    target = writer.save(str(tmp_path), 3, {"rng": checkpoint.Later(lambda: gathered.wait(60) and [1, 2])}, keep=1)
    assert writer.in_flight() and not target.exists()
    gathered.set()
    writer.finish()
    assert checkpoint.load(target)["rng"] == [1, 2]


def _held_copies(monkeypatch):
    """The thread's deferred copies held until the event is set (a test seam in hvdkit's own code)."""
    import threading

    from hvdkit.checkpoint import writer

    release, real_copy = threading.Event(), writer._copy

    def held_copy(copies):
        release.wait(30)
        return real_copy(copies)

    monkeypatch.setattr(writer, "_copy", held_copy)
    return release


def test_deferred_tensors_are_copied_by_the_thread_before_the_next_update(tmp_path, monkeypatch):
    """The weights are copied while the next forward runs (which changes batch norm's statistics,
    copied before save() returns); before_update() waits for that copy, then the step may change them."""
    import threading

    release = _held_copies(monkeypatch)
    writer = checkpoint.Writer()
    weights, statistics = torch.zeros(1000), torch.zeros(10)
    target = writer.save(str(tmp_path), 1, {"w": weights, "running_mean": statistics}, keep=3, deferred=[weights])
    statistics.add_(1)  # the next forward
    waited = threading.Event()
    updater = threading.Thread(target=lambda: (writer.before_update(), waited.set()))
    updater.start()
    assert not waited.wait(0.3), "before_update() returned before the deferred copy was made"
    release.set()
    updater.join(30)
    weights.add_(1)  # the optimizer step
    writer.finish()
    saved = checkpoint.load(target)
    assert torch.equal(saved["w"], torch.zeros(1000)) and torch.equal(saved["running_mean"], torch.zeros(10))
    record, = writer.take_done()
    assert record["step"] == 1 and record["stall_seconds"] >= 0.3, record


def test_deferred_tensors_changed_before_the_update_fail_that_save_in_one_line(tmp_path, monkeypatch):
    """A loop that changes the weights in place between a background save and the next optimizer step
    (weight clipping after step()) would have a checkpoint of either values: it is not written."""
    writer = checkpoint.Writer()
    writer.save(str(tmp_path), 1, {"w": torch.zeros(10)}, keep=3)
    writer.finish()
    release = _held_copies(monkeypatch)  # the second save's copy only: the first is written as it comes
    weights = torch.zeros(10)
    writer.save(str(tmp_path), 2, {"w": weights}, keep=3, deferred=[weights])
    weights.clamp_(min=1)
    release.set()
    writer.wait()
    with pytest.raises(checkpoint.CheckpointError) as error:
        writer.check()
    assert str(error.value) == (
        f"checkpoint {tmp_path}/ckpt-step000000002.pt not written: 1 tensors of the weights or the optimizer's "
        f"state changed in place after the save and before the next optimizer step, while being copied in the "
        f"background; change them in the optimizer step, or save with --no-async-checkpoint "
        f"(async_checkpoint=False); the previous checkpoints are untouched")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-step000000001.pt"]


def test_a_save_waits_for_the_one_in_flight_and_a_failed_one_is_said_once(tmp_path, monkeypatch):
    """The thread is held at the write (a test seam in hvdkit's own code): the next save must wait."""
    import threading

    from hvdkit.checkpoint import writer as checkpoint_writer

    release, real_save = threading.Event(), checkpoint_writer.save

    def held_save(*args, **kwargs):
        release.wait(30)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(checkpoint_writer, "save", held_save)
    writer = checkpoint.Writer()
    writer.save(str(tmp_path), 1, {"step": 1}, keep=3)
    assert writer.in_flight()
    threading.Timer(0.2, release.set).start()
    writer.save(str(tmp_path), 2, {"step": 2}, keep=3)  # returns once the first is written
    assert checkpoint.path_for(str(tmp_path), 1).exists() and writer.waits == 1
    writer.finish()
    (tmp_path / "blocked").write_text("a file where the next save wants a directory")
    writer.save(str(tmp_path / "blocked"), 3, {"step": 3}, keep=3)
    writer.wait()
    with pytest.raises(checkpoint.CheckpointError, match="cannot write checkpoint .*blocked/ckpt-step000000003.pt"):
        writer.check()
    writer.check()  # said once
    assert [p.name for p in checkpoint.existing(str(tmp_path))] == ["ckpt-step000000001.pt", "ckpt-step000000002.pt"]
