"""Data set registry: each loader returns a `LoadedDataset` with a fixed train/test split.

Images are kept in their stored dtype (uint8 for MNIST/CIFAR) and turned into normalised float
tensors one batch at a time, so a worker holding CIFAR-10 costs ~150 MB, not ~600 MB.
Nothing is ever downloaded: mnist and cifar10 are read by torchvision from `--data-dir`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from distrain.errors import ConfigError
from distrain.name_registry import Registry

T = TypeVar("T")

TEST_FRACTION = 0.2  # held-out share of the bundled digits and synthetic sets
SPLIT_SEED = 1234  # fixed, independent of --seed: every run evaluates on the same held-out set


@dataclass(frozen=True)
class DatasetInfo:
    name: str
    channels: int
    height: int
    width: int
    num_classes: int


@dataclass
class LoadedDataset:
    info: DatasetInfo
    train_x: torch.Tensor  # (N, C, H, W), stored dtype
    train_y: torch.Tensor  # (N,), int64
    test_x: torch.Tensor
    test_y: torch.Tensor
    mean: float
    std: float

    @property
    def train_size(self) -> int:
        return int(self.train_y.shape[0])

    @property
    def test_size(self) -> int:
        return int(self.test_y.shape[0])

    def _prepare(self, x: torch.Tensor) -> torch.Tensor:
        return (x.to(torch.float32) - self.mean) / self.std

    def train_batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.from_numpy(np.asarray(indices, dtype=np.int64))
        return self._prepare(self.train_x[idx]), self.train_y[idx]

    def test_batches(
        self, batch_size: int, shard: int = 0, num_shards: int = 1
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The `shard`-th of `num_shards` contiguous parts of the test set, in batches."""
        n = self.test_size
        lo, hi = n * shard // num_shards, n * (shard + 1) // num_shards
        return [
            (
                self._prepare(self.test_x[i : min(i + batch_size, hi)]),
                self.test_y[i : min(i + batch_size, hi)],
            )
            for i in range(lo, hi, batch_size)
        ]


@dataclass(frozen=True)
class DatasetSpec:
    load: Callable[[str], LoadedDataset]
    # Raises ConfigError when the files are missing; cheap, so the CLI can check before starting Ray.
    check: Callable[[str], None]
    train_size: int  # known up front, so a global batch larger than the data set is refused early
    info: DatasetInfo  # known up front, so models can be sized without loading any data
    reads_files: bool = True  # False: generated or bundled, so --data-dir would be ignored (and is refused)
    memory_bytes: int = 0  # train + test set as a worker holds it (images in their stored dtype, int64 labels)


DATASETS: Registry[DatasetSpec] = Registry("dataset")


def load_dataset(name: str, data_dir: str = "") -> LoadedDataset:
    return DATASETS.get(name).load(data_dir)


def check_dataset(name: str, data_dir: str = "", global_batch: int = 1, train_size: int | None = None) -> None:
    """Cheap checks before anything starts: the files are there and one global batch fits (`train_size`:
    the training samples left once validation is held out; default, all of them)."""
    spec = DATASETS.get(name)
    spec.check(data_dir)
    train_size = spec.train_size if train_size is None else train_size
    if global_batch > train_size:
        raise ConfigError(
            f"the global batch ({global_batch}) exceeds the {train_size} training samples of {name}; "
            "lower --batch-size or --workers"
        )


def _split_sizes(n: int) -> tuple[int, int]:
    n_test = int(round(n * TEST_FRACTION))
    return n - n_test, n_test


def _split(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    order = np.random.default_rng(SPLIT_SEED).permutation(len(y))
    _, n_test = _split_sizes(len(y))
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def _from_numpy(info: DatasetInfo, x: np.ndarray, y: np.ndarray, mean: float, std: float) -> LoadedDataset:
    trx, tr_y, tex, te_y = _split(x, y)
    return LoadedDataset(
        info,
        torch.from_numpy(np.ascontiguousarray(trx)),
        torch.from_numpy(tr_y.astype(np.int64)),
        torch.from_numpy(np.ascontiguousarray(tex)),
        torch.from_numpy(te_y.astype(np.int64)),
        mean,
        std,
    )


def _no_files_needed(data_dir: str) -> None:
    return None


# ---------------------------------------------------------------- digits (bundled with scikit-learn)
DIGITS = DatasetInfo("digits", 1, 8, 8, 10)


def _digits_table() -> np.ndarray:
    """scikit-learn's digits as its (1797, 65) table: 64 pixels then the label per row.

    Read straight from the CSV scikit-learn ships, found without importing scikit-learn: that import
    costs every worker process about 1.2 CPU-seconds, more than the rest of its start-up bar torch
    (the test suite starts hundreds of them). `load_digits` reads the same file; it is the fallback
    if a scikit-learn release moves it."""
    import gzip
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    shipped = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if shipped is not None and shipped.is_file():
        with gzip.open(shipped, "rt") as f:
            return np.loadtxt(f, delimiter=",")
    from sklearn.datasets import load_digits

    digits = load_digits()
    return np.column_stack([digits.data, digits.target])


def _load_digits(data_dir: str) -> LoadedDataset:
    table = _digits_table()
    x = table[:, :-1].astype(np.float32).reshape(-1, 1, 8, 8)  # (1797, 1, 8, 8), values 0..16
    y = table[:, -1].astype(np.int64)
    return _from_numpy(DIGITS, x, y, mean=4.88, std=6.02)


DATASETS.register("digits", "scikit-learn's 8x8 handwritten digits, 1797 images, bundled")(
    DatasetSpec(_load_digits, _no_files_needed, _split_sizes(1797)[0], DIGITS, False, 1797 * (64 * 4 + 8))
)


# ---------------------------------------------------------------- synthetic (deterministic blobs)
SYNTHETIC_SAMPLES = 4000
SYNTHETIC = DatasetInfo("synthetic", 1, 8, 8, 10)


def _load_synthetic(data_dir: str) -> LoadedDataset:
    rng = np.random.default_rng(7)
    classes, n = 10, SYNTHETIC_SAMPLES
    centers = rng.normal(0.0, 1.0, size=(classes, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, classes, size=n)
    x = centers[y] + rng.normal(0.0, 0.8, size=(n, 1, 8, 8)).astype(np.float32)
    return _from_numpy(SYNTHETIC, x.astype(np.float32), y, 0.0, 1.0)


DATASETS.register("synthetic", "10 Gaussian classes of 8x8 images, generated (no files)")(
    DatasetSpec(
        _load_synthetic,
        _no_files_needed,
        _split_sizes(SYNTHETIC_SAMPLES)[0],
        SYNTHETIC,
        reads_files=False,
        memory_bytes=SYNTHETIC_SAMPLES * (64 * 4 + 8),
    )
)


# ---------------------------------------------------------------- torchvision readers (local files only)
MNIST_INFO = DatasetInfo("mnist", 1, 28, 28, 10)
CIFAR10_INFO = DatasetInfo("cifar10", 3, 32, 32, 10)
MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
CIFAR10_FILES = (
    "data_batch_1",
    "data_batch_2",
    "data_batch_3",
    "data_batch_4",
    "data_batch_5",
    "test_batch",
    "batches.meta",  # torchvision's CIFAR10 reads the class names from it
)


def _need_dir(name: str, data_dir: str) -> Path:
    if not data_dir:
        raise ConfigError(f"--dataset {name} reads local files: pass --data-dir DIR (nothing is downloaded)")
    return Path(data_dir)


def _read(name: str, folder: Path, read: Callable[[], T]) -> T:
    """Run a torchvision reader; a corrupt or truncated file is a user error, not a traceback."""
    try:
        return read()
    except (RuntimeError, ValueError, TypeError, AssertionError, EOFError, OSError) as e:
        detail = str(e).strip() or type(e).__name__
        raise ConfigError(
            f"cannot read the {name} files under {folder} ({detail}); replace them with intact copies"
        ) from None


def _check_mnist(data_dir: str) -> None:
    raw = _need_dir("mnist", data_dir) / "MNIST" / "raw"
    missing = [f for f in MNIST_FILES if not (raw / f).is_file()]
    # torchvision reads only the uncompressed files (it unpacks the .gz files only when downloading)
    gzipped = [f for f in missing if (raw / f"{f}.gz").is_file()]
    if gzipped:
        names = " ".join(f"{f}.gz" for f in gzipped)
        raise ConfigError(f"MNIST files under {raw} are still compressed: run `gunzip {names}` there")
    if missing:
        raise ConfigError(f"MNIST files missing under {raw}: {', '.join(missing)}; put torchvision's MNIST/raw there")
    # Headers and sizes, before any worker starts: a truncated, foreign or mismatched file would
    # otherwise be found by every worker at once, inside its actor.
    for split in ("train", "t10k"):
        images = _idx_count(raw / f"{split}-images-idx3-ubyte", IDX_IMAGES_MAGIC, (28, 28))
        labels = _idx_count(raw / f"{split}-labels-idx1-ubyte", IDX_LABELS_MAGIC, ())
        if images != labels:
            raise ConfigError(
                f"MNIST {split} files under {raw} disagree: {images} images but {labels} labels; "
                "replace them with a matching pair"
            )
        _check_labels(raw / f"{split}-labels-idx1-ubyte", MNIST_INFO.num_classes)


IDX_IMAGES_MAGIC = 0x00000803  # IDX: unsigned bytes, 3 dimensions (count, rows, cols)
IDX_LABELS_MAGIC = 0x00000801  # IDX: unsigned bytes, 1 dimension (count)


def _idx_count(path: Path, magic: int, item_shape: tuple[int, ...]) -> int:
    """The item count of an IDX file of unsigned bytes, checked against its magic, shape and size."""
    ndim = 1 + len(item_shape)
    header_size = 4 * (1 + ndim)
    with path.open("rb") as f:
        header = f.read(header_size)
    if len(header) < header_size or int.from_bytes(header[:4], "big") != magic:
        raise ConfigError(
            f"{path} is not an MNIST {'image' if item_shape else 'label'} file "
            f"(IDX magic {magic:#010x} expected); replace it with an intact copy"
        )
    dims = [int.from_bytes(header[4 * i : 4 * i + 4], "big") for i in range(1, ndim + 1)]
    if tuple(dims[1:]) != item_shape:
        shape = "x".join(map(str, dims[1:]))
        raise ConfigError(f"{path} holds {shape} images, not 28x28; replace it with torchvision's MNIST file")
    expected = header_size + dims[0] * math.prod(item_shape)
    size = path.stat().st_size
    if size != expected:
        what = "truncated" if size < expected else "longer than its header says"
        raise ConfigError(
            f"{path} is {what} ({size:,} bytes; its header promises {dims[0]:,} items, {expected:,} bytes); "
            "replace it with an intact copy"
        )
    return dims[0]


def _check_labels(path: Path, num_classes: int) -> None:
    labels = np.frombuffer(path.read_bytes(), dtype=np.uint8, offset=8)
    if labels.size and int(labels.max()) >= num_classes:
        raise ConfigError(
            f"{path} holds label {int(labels.max())}, outside 0..{num_classes - 1}; replace it with an intact copy"
        )


def _same_count(name: str, folder: Path, images: int, labels: int) -> None:
    """Refuse images and labels of different lengths (training on the shorter prefix would be silent)."""
    if images != labels:
        raise ConfigError(f"{name} files under {folder} disagree: {images} images but {labels} labels; replace them")


def _load_mnist(data_dir: str) -> LoadedDataset:
    from torchvision.datasets import MNIST

    _check_mnist(data_dir)
    raw = Path(data_dir) / "MNIST" / "raw"
    train = _read("MNIST", raw, lambda: MNIST(data_dir, train=True, download=False))
    test = _read("MNIST", raw, lambda: MNIST(data_dir, train=False, download=False))
    for ds in (train, test):
        _same_count("MNIST", raw, len(ds.data), len(ds.targets))
    return LoadedDataset(
        MNIST_INFO,
        train.data[:, None].contiguous(),
        train.targets.to(torch.int64),
        test.data[:, None].contiguous(),
        test.targets.to(torch.int64),
        mean=0.1307 * 255,
        std=0.3081 * 255,
    )


DATASETS.register("mnist", "MNIST 28x28, read by torchvision from --data-dir/MNIST/raw")(
    DatasetSpec(_load_mnist, _check_mnist, 60_000, MNIST_INFO, memory_bytes=70_000 * (784 + 8))
)


def _check_cifar10(data_dir: str) -> None:
    folder = _need_dir("cifar10", data_dir) / "cifar-10-batches-py"
    missing = [f for f in CIFAR10_FILES if not (folder / f).is_file()]
    if missing:
        raise ConfigError(
            f"CIFAR-10 files missing under {folder}: {', '.join(missing)}; unpack cifar-10-python.tar.gz there"
        )
    # torchvision accepts only the published files (their MD5s); checking here (~0.5 s for 180 MB)
    # finds a truncated or corrupted batch before any worker starts, instead of inside every one.
    from torchvision.datasets import CIFAR10
    from torchvision.datasets.utils import check_integrity

    known = [*CIFAR10.train_list, *CIFAR10.test_list, [CIFAR10.meta["filename"], CIFAR10.meta["md5"]]]
    corrupt = [name for name, md5 in known if not check_integrity(str(folder / name), md5)]
    if corrupt:
        raise ConfigError(
            f"CIFAR-10 files under {folder} are corrupt or truncated (checksum mismatch): {', '.join(corrupt)}; "
            "unpack cifar-10-python.tar.gz there again"
        )


def _load_cifar10(data_dir: str) -> LoadedDataset:
    from torchvision.datasets import CIFAR10

    _check_cifar10(data_dir)
    folder = Path(data_dir) / "cifar-10-batches-py"
    train = _read("CIFAR-10", folder, lambda: CIFAR10(data_dir, train=True, download=False))
    test = _read("CIFAR-10", folder, lambda: CIFAR10(data_dir, train=False, download=False))

    def images(ds: CIFAR10) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(ds.data.transpose(0, 3, 1, 2)))  # NHWC -> NCHW uint8

    for ds in (train, test):
        _same_count("CIFAR-10", folder, len(ds.data), len(ds.targets))

    return LoadedDataset(
        CIFAR10_INFO,
        images(train),
        torch.tensor(train.targets, dtype=torch.int64),
        images(test),
        torch.tensor(test.targets, dtype=torch.int64),
        mean=0.4734 * 255,
        std=0.2516 * 255,
    )


DATASETS.register("cifar10", "CIFAR-10 32x32 RGB, read by torchvision from --data-dir/cifar-10-batches-py")(
    DatasetSpec(_load_cifar10, _check_cifar10, 50_000, CIFAR10_INFO, memory_bytes=60_000 * (3072 + 8))
)
