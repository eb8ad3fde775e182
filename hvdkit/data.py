"""Datasets by name (each rank's samplers and loader settings are in hvdkit.rank.start.loaders).

Nothing here downloads: clusters' compute nodes rarely reach the internet, and a job that
fetches data on every rank at once is a job that fails at scale. The default dataset, the
UCI handwritten digits (1,797 8x8 images), ships inside scikit-learn, so the main job runs
on a fresh machine.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import pickle
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from hvdkit import nested
from hvdkit.config import ConfigError, TrainConfig

DIGITS_TEST_SIZE = 360  # a fixed 20% of the 1,797 digits, the same on every rank and run
SYNTHETIC_CLASSES = 10


class DataError(ConfigError):
    """A missing or malformed dataset; the message says where and what was expected."""


# Loader workers are started by a fork server where there is one: forking a process that
# holds MPI/InfiniBand state is unsafe.
WORKER_START_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else None


class UnreadableSample(RuntimeError):
    """A sample whose file cannot be read or decoded; the message names the file and index."""


class Readable(Dataset):
    """An image folder whose unreadable samples are named in one line, or skipped.

    A corrupt file hours into an epoch otherwise ends the run with a DataLoader traceback
    whose last line alone names it. With ``skip``, the next readable sample takes its place
    (the batch keeps its size and the ranks their lockstep) and ``skipped`` counts it, in
    memory shared with the loader's worker processes."""

    def __init__(self, dataset, skip: bool) -> None:
        self.dataset, self.skip = dataset, skip
        self.skipped = multiprocessing.get_context(WORKER_START_METHOD).Value("i", 0)  # the workers' context

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        for offset in range(len(self.dataset)):
            candidate = (index + offset) % len(self.dataset)
            try:
                return self.dataset[candidate]
            except Exception as exc:  # PIL, OSError, a transform: whatever reading the file raised
                problem = (f"sample {candidate} ({self.dataset.samples[candidate][0]}) cannot be read: "
                           f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                if not self.skip:
                    raise UnreadableSample(f"data: {problem}; fix or remove the file, or pass --skip-bad-samples") \
                        from None
                with self.skipped.get_lock():
                    self.skipped.value += 1
                print(f"hvdkit: warning: data: {problem}; skipped", file=sys.stderr, flush=True)
        raise UnreadableSample(f"data: no sample of {len(self.dataset)} can be read")


def one_line(exc: UnreadableSample) -> str:
    """The message of an UnreadableSample, also when a DataLoader worker re-raised it with the
    worker's traceback in front."""
    text = str(exc)
    return text.strip().splitlines()[-1].split("UnreadableSample: ", 1)[-1] if "Traceback" in text else text


@dataclass
class Datasets:
    train: Dataset
    test: Dataset
    in_channels: int
    image_size: int
    num_classes: int  # for text: the vocabulary (256 bytes)
    tokens_per_sample: int = 0  # text only: a sample predicts this many next tokens


def digits_table():
    """The digits as scikit-learn ships them: a row per image, 64 pixels (0-16) then the label.
    Read from its data file, as load_digits() reads it, without importing sklearn.datasets,
    which costs every rank about a second of CPU at start (scipy and more); through
    load_digits() where the file is not where scikit-learn keeps it."""
    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz" if spec else None
    if path and path.is_file():
        return np.loadtxt(path, delimiter=",")
    from sklearn.datasets import load_digits

    raw = load_digits()
    return np.column_stack([raw.data, raw.target])


def digits(cfg: TrainConfig) -> Datasets:
    table = torch.from_numpy(digits_table())
    images = table[:, :64].float().reshape(-1, 1, 8, 8) / 16.0
    labels = table[:, 64].long()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    test, train = order[:DIGITS_TEST_SIZE], order[DIGITS_TEST_SIZE:]
    mean, std = images[train].mean(), images[train].std()
    images = (images - mean) / std
    return Datasets(TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test]),
                    in_channels=1, image_size=8, num_classes=10)


def _require_dir(cfg: TrainConfig, what: str, expected: str) -> Path:
    if not cfg.data_dir:
        raise DataError(f"data: --data-dir is required for {what} (expected {expected} under it)")
    root = Path(cfg.data_dir)
    if not root.is_dir():
        raise DataError(f"data: data_dir {cfg.data_dir!r} is not a directory")
    return root


def _load(what: str, root: Path, expected: str, make: Callable[[], Dataset]) -> Dataset:
    """Run a torchvision constructor, turning its errors into one line that says what to fix."""
    try:
        return make()
    except RuntimeError as exc:
        if "not found" in str(exc):
            raise DataError(f"data: {what} not found under {root}: expected {expected} "
                            f"(hvdkit never downloads; copy the dataset there)") from None
        raise DataError(f"data: {what} under {root} is malformed: {exc}") from None
    except (OSError, ValueError, EOFError, KeyError, IndexError, AssertionError, pickle.UnpicklingError) as exc:
        raise DataError(f"data: {what} under {root} is malformed: {type(exc).__name__}: {exc}") from None


def mnist(cfg: TrainConfig) -> Datasets:
    from torchvision import datasets, transforms

    expected = "MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte"
    root = _require_dir(cfg, "mnist", expected)
    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    train, test = (_load("MNIST", root, expected,
                         lambda t=t: datasets.MNIST(root, train=t, download=False, transform=tf))
                   for t in (True, False))
    return Datasets(train, test, in_channels=1, image_size=28, num_classes=10)


def cifar10(cfg: TrainConfig) -> Datasets:
    from torchvision import datasets, transforms

    class CIFAR10(datasets.CIFAR10):
        """torchvision's CIFAR10, checking that its files exist rather than their md5 sums.

        The sums are those of the archive hvdkit would have downloaded; it never downloads,
        and copies on clusters are often re-packed or cut to subsets. The files must still
        unpickle in CIFAR-10's format, or loading fails.
        """

        train_list = [[name, None] for name, _ in datasets.CIFAR10.train_list]
        test_list = [[name, None] for name, _ in datasets.CIFAR10.test_list]
        meta = {**datasets.CIFAR10.meta, "md5": None}

    expected = "cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}"
    root = _require_dir(cfg, "cifar10", expected)
    norm = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    train_tf = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), norm])
    test_tf = transforms.Compose([transforms.ToTensor(), norm])
    train = _load("CIFAR-10", root, expected, lambda: CIFAR10(root, train=True, download=False, transform=train_tf))
    test = _load("CIFAR-10", root, expected, lambda: CIFAR10(root, train=False, download=False, transform=test_tf))
    return Datasets(train, test, in_channels=3, image_size=32, num_classes=10)


def imagefolder(cfg: TrainConfig) -> Datasets:
    from torchvision import datasets, transforms

    expected = "train/<class>/<image> and val/<class>/<image>"
    root = _require_dir(cfg, "imagefolder", expected)
    val_dir = next((root / name for name in ("val", "test") if (root / name).is_dir()), root / "val")
    norm = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    size = cfg.image_size
    train_tf = transforms.Compose([transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), norm])
    test_tf = transforms.Compose([transforms.Resize(size), transforms.CenterCrop(size), transforms.ToTensor(), norm])
    splits = []
    for folder, tf in ((root / "train", train_tf), (val_dir, test_tf)):
        if not folder.is_dir():
            raise DataError(f"data: imagefolder needs {folder}/ (expected {expected} under {root})")
        dataset = _load("ImageFolder", folder, "<class>/<image> folders",
                        lambda f=folder, t=tf: datasets.ImageFolder(f, transform=t))
        _load("ImageFolder", folder, "readable images", lambda d=dataset: d[0])  # fail now, not mid-epoch
        splits.append(dataset)
    if splits[0].classes != splits[1].classes:
        raise DataError(f"data: {root}/train and {val_dir} have different classes "
                        f"({len(splits[0].classes)} vs {len(splits[1].classes)})")
    return Datasets(Readable(splits[0], cfg.skip_bad_samples), Readable(splits[1], cfg.skip_bad_samples),
                    in_channels=3, image_size=size, num_classes=len(splits[0].classes))


class SyntheticImages(Dataset):
    """Random images made on demand from the index: no memory for big inputs, same on every rank."""

    def __init__(self, length: int, image_size: int, seed: int) -> None:
        self.length, self.image_size, self.seed = length, image_size, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        image = torch.randn(3, self.image_size, self.image_size, generator=gen)
        return image, int(torch.randint(SYNTHETIC_CLASSES, (1,), generator=gen))


def synthetic(cfg: TrainConfig) -> Datasets:
    return Datasets(SyntheticImages(2048, cfg.image_size, seed=1), SyntheticImages(512, cfg.image_size, seed=2),
                    in_channels=3, image_size=cfg.image_size, num_classes=SYNTHETIC_CLASSES)


# Python's own standard library: present wherever Python is, so the language model needs
# no download. About 2.6 MB of these files on CPython 3.11; modules missing from another
# version are skipped.
TEXT_MODULES = ("argparse", "ast", "asyncio.base_events", "asyncio.tasks", "calendar", "collections", "configparser",
                "dataclasses", "datetime", "decimal", "difflib", "email.message", "enum", "fractions", "ftplib",
                "functools", "http.client", "imaplib", "inspect", "ipaddress", "logging", "mailbox", "os", "pathlib",
                "pdb", "pickle", "pydoc", "random", "shutil", "smtplib", "statistics", "string", "subprocess",
                "tarfile", "tempfile", "textwrap", "threading", "tokenize", "traceback", "typing", "unittest.case",
                "urllib.parse", "urllib.request", "uuid", "zipfile")
TEXT_TEST_FRACTION = 0.05
VOCAB = 256  # bytes


class TextChunks(Dataset):
    """Non-overlapping ``seq_len``-byte windows of a byte string: (input bytes, the next byte
    after each)."""

    def __init__(self, corpus: torch.Tensor, seq_len: int) -> None:
        self.corpus, self.seq_len = corpus, seq_len

    def __len__(self) -> int:
        return (len(self.corpus) - 1) // self.seq_len

    def __getitem__(self, index: int):
        start = index * self.seq_len
        window = self.corpus[start:start + self.seq_len + 1]
        return window[:-1], window[1:]


def _stdlib_corpus() -> bytes:
    import importlib.util

    parts = []
    for name in TEXT_MODULES:
        spec = importlib.util.find_spec(name)
        origin = getattr(spec, "origin", None) if spec else None
        if origin and origin.endswith(".py"):
            parts.append(Path(origin).read_bytes())
    return b"\n".join(parts)


def text(cfg: TrainConfig) -> Datasets:
    """Bytes of ``--data-dir`` (a .txt file, or the .txt files of a folder in name order), else
    the embedded corpus; the last 5% is the test set."""
    if cfg.data_dir:
        root = Path(cfg.data_dir)
        files = sorted(root.glob("*.txt")) if root.is_dir() else [root]
        if not files or not all(f.is_file() for f in files):
            raise DataError(f"data: text needs --data-dir to be a .txt file or a folder of them (got {root})")
        corpus = b"\n".join(f.read_bytes() for f in files)
    else:
        corpus = _stdlib_corpus()
    split = int(len(corpus) * (1 - TEXT_TEST_FRACTION))
    tokens = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
    train, test = TextChunks(tokens[:split], cfg.seq_len), TextChunks(tokens[split:], cfg.seq_len)
    if len(test) == 0:
        raise DataError(f"data: the text has {len(corpus)} bytes, too few for a test set of {cfg.seq_len}-byte "
                        f"sequences")
    return Datasets(train, test, in_channels=0, image_size=0, num_classes=VOCAB, tokens_per_sample=cfg.seq_len)


DATASETS: dict[str, Callable[[TrainConfig], Datasets]] = {
    "digits": digits, "text": text, "mnist": mnist, "cifar10": cifar10, "imagefolder": imagefolder,
    "synthetic": synthetic,
}


def build(cfg: TrainConfig) -> Datasets:
    if cfg.dataset not in DATASETS:
        raise DataError(f"data: unknown dataset {cfg.dataset!r}; choose one of: {', '.join(DATASETS)}")
    return DATASETS[cfg.dataset](cfg)


def batch_len(batch: Any) -> int:
    """Samples in a batch: the leading size of its first tensor that has one."""
    for _, leaf in nested.leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim():
            return len(leaf)
    raise TypeError("batch: holds no tensor")
