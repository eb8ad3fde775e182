"""Checkpoint files (hvdkit.checkpoint): snapshots' raw slots, a sharded state's parts, no partial
file left behind, and the formats earlier hvdkits wrote."""

import sys

import pytest
import torch

from conftest import REPO, run
from hvdkit import checkpoint
from hvdkit.system import wholefiles


def test_a_snapshot_reads_back_every_tensor_as_it_was_from_alternating_slots(tmp_path):
    """A snapshot's file (raw: its tensors' bytes in a slot beside it, xxh3-128): dtypes numpy
    lacks, a scalar, an empty tensor, a strided view, tied weights stored once and read back as
    one, a state_dict's metadata, plain values. The next snapshot goes into the other slot, so the
    one before still reads; a byte changed in the file or in its slot is a checksum mismatch."""
    from hvdkit.checkpoint import slots
    from hvdkit.rehearse import verdict

    norm = torch.nn.BatchNorm1d(3).state_dict()
    tied = torch.randn(5, 4)
    state = {"model": norm, "tied": [tied, tied], "bf16": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
             "strided": torch.randn(4, 6)[:, ::2], "scalar": torch.tensor(3.5), "empty": torch.empty(0, 4),
             "flags": torch.tensor([True, False]), "step": 7, "nested": {"lr": 0.1, "names": ("a", "b")}}
    first, second = checkpoint.path_for(str(tmp_path), 7), checkpoint.path_for(str(tmp_path), 8)
    mapped = slots.Mapped()
    digest = checkpoint.write(first, state, raw=mapped)
    assert first.read_bytes().startswith(b"HVDKIT-CHECKPOINT 1 raw xxh3-128=" + digest.encode() + b"\n")
    checkpoint.write(second, {**state, "step": 8, "tied": [tied + 1, tied + 1]}, raw=mapped)
    mapped.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name, second.name, "slot-a.data", "slot-b.data"]
    back = checkpoint.load(first)
    assert verdict.difference(back, state) is None and back["step"] == 7 and back["nested"]["names"] == ("a", "b")
    assert back["tied"][0] is back["tied"][1] and back["bf16"].dtype == torch.bfloat16
    assert back["empty"].shape == (0, 4) and torch.equal(back["strided"], state["strided"])
    assert type(back["model"]) is type(norm) and back["model"]._metadata == norm._metadata
    assert torch.equal(checkpoint.load(second)["tied"][1], tied + 1)
    for changed, why in ((tmp_path / "slot-b.data", "slot slot-b.data does not hold it"), (first, "checksum")):
        data = bytearray(changed.read_bytes())
        data[-3 if changed == first else 0] ^= 1
        changed.write_bytes(bytes(data))
        with pytest.raises(checkpoint.CheckpointError, match=f"corrupted.*{why}"):
            checkpoint.load(second if changed != first else first)


def test_a_sharded_state_splits_by_bytes_and_joins_whole(tmp_path):
    """Three ranks' parts of a state with tied weights, a buffer no rank shares and the
    optimizer's state; written as the ranks' writers do (one in the background), read as one."""
    tied = torch.randn(64, 32)
    shared = [tied, torch.randn(1000), torch.randn(10), torch.randn(300)]
    model = torch.nn.BatchNorm1d(3).state_dict()
    state = {"model": {"a": tied, "a_again": tied, "b": shared[1], "norm": model},
             "optimizer": {"state": {0: {"momentum": shared[2], "step": torch.tensor(3.0)}, 1: {"m": shared[3]}},
                           "param_groups": [{"lr": 0.1}]}, "step": 7}
    main, parts = checkpoint.split(state, shared, 3)
    # The largest first, each to the rank with the fewest bytes: 8192 to rank 0, 4000 to 1, 1200 and 40 to 2.
    assert parts[0] == {} and [sum(t.nbytes for t in p.values()) for p in parts[1:]] == [4000, 1240]
    assert main["model"]["a"] is tied and main["model"]["b"].file == "part-00001-of-00003.pt"
    assert torch.equal(main["model"]["norm"]["running_mean"], model["running_mean"]), "not shared: in the main file"
    assert type(main["model"]["norm"]) is type(model) and state["model"]["a"] is tied, "the state is left as it was"
    writers = [checkpoint.Writer(background=rank == 1) for rank in range(3)]
    for rank in (2, 1):
        writers[rank].save(str(tmp_path), 7, None, keep=3, part=(checkpoint.part_name(rank, 3), parts[rank]),
                           deferred=shared)
    writers[0].save(str(tmp_path), 7, main, keep=3, parts=[checkpoint.part_name(r, 3) for r in (1, 2)])
    writers[1].finish()
    whole = checkpoint.load_whole(checkpoint.path_for(str(tmp_path), 7))
    assert "parts" not in whole and whole["step"] == 7 and whole["optimizer"]["param_groups"] == [{"lr": 0.1}]
    for key in ("a", "a_again", "b"):
        assert torch.equal(whole["model"][key], state["model"][key]), key
    assert torch.equal(whole["optimizer"]["state"][1]["m"], shared[3])
    assert whole["model"]["norm"]._metadata == model._metadata


def test_a_killed_save_leaves_no_temporary_file(tmp_path):
    """A save killed mid-write leaves .ckpt-step….pt.PID.partial; the next save removes it."""
    stale = tmp_path / f".{checkpoint.path_for(str(tmp_path), 5).name}.4242{wholefiles.PARTIAL}"
    stale.write_bytes(b"half a checkpoint")
    checkpoint.save(str(tmp_path), 6, {"step": 6}, keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-step000000006.pt"]


GOLDEN_CHECKPOINTS = REPO / "tests" / "golden" / "checkpoints"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sharded", "zero"])
def test_checkpoints_written_by_an_earlier_hvdkit_load_whole_and_export(kind, tmp_path):
    """A checkpoint of each format written at e52fb9d (tests/golden/checkpoints/README.md): a
    sharded save's parts and ZeRO's shards join into the same state, bit for bit, as the plain
    checkpoint of the same two steps, and each exports to plain torch files."""
    from hvdkit.rehearse import verdict

    plain_path, path = (checkpoint.existing(str(GOLDEN_CHECKPOINTS / name))[-1] for name in ("plain", kind))
    plain, state = verdict.plain(plain_path), verdict.plain(path)
    assert plain["step"] == 2 and list(plain["model"]) == ["1.weight", "1.bias", "3.weight", "3.bias", "5.weight",
                                                            "5.bias"]
    assert verdict.difference(plain, state) is None
    for source, out in ((plain_path, tmp_path / "plain"), (path, tmp_path / kind)):
        proc = run([sys.executable, "-m", "hvdkit", "checkpoint", "export", str(source), str(out)])
        assert proc.returncode == 0, proc.stderr[-2000:]
    for name in ("model.pt", "optimizer.pt"):
        assert verdict.difference(torch.load(tmp_path / "plain" / name), torch.load(tmp_path / kind / name)) is None
