"""The real torchvision loaders on small files written in their on-disk formats."""

import pickle
import struct

import numpy as np
import pytest
import torch
from PIL import Image

from hvdkit import data
from hvdkit.config import TrainConfig
from hvdkit.data import DataError
from hvdkit.rank.start import loaders


def write_idx(path, array):
    """MNIST's IDX format: magic (0, 0, dtype 0x08 = ubyte, ndim), big-endian dims, raw bytes."""
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def make_mnist(root, n_train=20, n_test=10):
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        write_idx(raw / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)))
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", np.arange(n) % 10)
    return raw


def make_cifar10(root, per_batch=4):
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
                 "labels": list(range(per_batch))}
        (folder / name).write_bytes(pickle.dumps(batch))
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": [f"c{i}" for i in range(10)]}))
    return folder


def make_imagefolder(root, train_per_class=3, val_per_class=(4, 3)):
    for split, counts in (("train", (train_per_class, train_per_class)), ("val", val_per_class)):
        for cls, count in zip(("cat", "dog"), counts, strict=True):
            folder = root / split / cls
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = np.full((20, 24, 3), 40 * i % 120 + (0 if cls == "cat" else 120), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")
    return root


def test_mnist_from_idx_files(tmp_path):
    make_mnist(tmp_path)
    built = data.build(TrainConfig(dataset="mnist", data_dir=str(tmp_path)))
    assert (len(built.train), len(built.test), built.in_channels, built.num_classes) == (20, 10, 1, 10)
    image, label = built.test[3]
    assert image.shape == (1, 28, 28) and label == 3


def test_cifar10_from_pickled_batches(tmp_path):
    make_cifar10(tmp_path)
    built = data.build(TrainConfig(dataset="cifar10", data_dir=str(tmp_path)))
    assert (len(built.train), len(built.test)) == (20, 4)
    image, label = built.test[2]
    assert image.shape == (3, 32, 32) and label == 2
    assert built.train.classes[0] == "c0"


def test_imagefolder_from_png_files(tmp_path):
    make_imagefolder(tmp_path)
    built = data.build(TrainConfig(dataset="imagefolder", data_dir=str(tmp_path), image_size=16))
    assert (len(built.train), len(built.test), built.num_classes) == (6, 7, 2)
    assert built.test[0][0].shape == (3, 16, 16)


def test_digits_are_embedded_and_fixed():
    a, b = data.build(TrainConfig()), data.build(TrainConfig())
    assert (len(a.train), len(a.test)) == (1437, 360)
    assert torch.equal(a.test.tensors[1], b.test.tensors[1])
    assert a.train.tensors[0].shape[1:] == (1, 8, 8)


def test_digits_read_from_the_file_are_scikit_learns_load_digits():
    """Ranks read scikit-learn's data file straight, to skip importing sklearn.datasets."""
    from sklearn.datasets import load_digits

    raw, table = load_digits(), data.digits_table()
    assert table.shape == (1797, 65)
    assert np.array_equal(table[:, :64], raw.data) and np.array_equal(table[:, 64], raw.target)


@pytest.mark.parametrize("dataset, breakage, message", [
    ("mnist", "missing", "data: MNIST not found under"),
    ("mnist", "truncated", "data: MNIST under"),
    ("cifar10", "missing", "data: CIFAR-10 not found under"),
    ("cifar10", "garbage", "data: CIFAR-10 under"),
    ("imagefolder", "no-val", "data: imagefolder needs"),
    ("imagefolder", "not-an-image", "data: ImageFolder under"),
])
def test_broken_datasets_are_one_clear_line(tmp_path, dataset, breakage, message):
    if dataset == "mnist" and breakage == "truncated":
        raw = make_mnist(tmp_path)
        path = raw / "train-images-idx3-ubyte"
        path.write_bytes(path.read_bytes()[:100])
    elif dataset == "cifar10" and breakage == "garbage":
        (make_cifar10(tmp_path) / "data_batch_3").write_bytes(b"not a pickle")
    elif breakage == "no-val":
        make_imagefolder(tmp_path)
        for f in (tmp_path / "val").rglob("*.png"):
            f.unlink()
        for d in sorted((tmp_path / "val").rglob("*"), reverse=True):
            d.rmdir()
        (tmp_path / "val").rmdir()
    elif breakage == "not-an-image":
        make_imagefolder(tmp_path)
        (tmp_path / "train" / "cat" / "0.png").write_bytes(b"\x89PNG broken")
    with pytest.raises(DataError) as info:
        data.build(TrainConfig(dataset=dataset, data_dir=str(tmp_path), image_size=16))
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_missing_data_dir(tmp_path):
    with pytest.raises(DataError, match="data_dir .* is not a directory"):
        data.build(TrainConfig(dataset="mnist", data_dir=str(tmp_path / "nope")))


def test_shard_sampler_covers_every_sample_once():
    shards = [list(loaders.ShardSampler(7, rank, 3)) for rank in range(3)]
    assert sorted(i for shard in shards for i in shard) == list(range(7))
    assert [len(s) for s in shards] == [3, 2, 2]
    size = [3]  # an elastic run's world size, read at each pass
    sampler = loaders.ShardSampler(7, lambda: 1, lambda: size[0])
    assert list(sampler) == [1, 4]
    size[0] = 2
    assert list(sampler) == [1, 3, 5] and len(sampler) == 3


def _mark_worker(worker_id):
    """A user's worker_init_fn: runs in the worker, after hvdkit's."""
    import signal

    torch.utils.data.get_worker_info().dataset.seen.append(
        (worker_id, signal.getsignal(signal.SIGTERM) == signal.SIG_IGN))


class _Seen(torch.utils.data.Dataset):
    def __init__(self):
        self.seen = []

    def __len__(self):
        return 2

    def __getitem__(self, index):
        return torch.tensor(self.seen[0][1] if self.seen else False)


def test_loader_workers_ignore_stop_signals_and_run_your_worker_init_fn():
    """Workers must outlive a Ctrl-C or Slurm SIGTERM sent to the whole process group (the rank
    stops them); a worker_init_fn given to the loader still runs, after that."""
    options = loaders.loader_options(TrainConfig(num_workers=1), 0, False, worker_init_fn=_mark_worker)
    loader = torch.utils.data.DataLoader(_Seen(), batch_size=2, **options)
    assert next(iter(loader)).tolist() == [True, True]
