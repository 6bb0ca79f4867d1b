"""The file-backed data sets, read by torchvision from real on-disk formats written here (no mocks)."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from distrain.errors import ConfigError
from distrain.trainers.datasets import (
    CIFAR10_FILES,
    MNIST_FILES,
    DatasetInfo,
    check_dataset,
    load_dataset,
)

N_TRAIN, N_TEST = 64, 16


def write_idx_images(path: Path, images: np.ndarray) -> None:
    n, rows, cols = images.shape
    path.write_bytes(struct.pack(">iiii", 2051, n, rows, cols) + images.astype(np.uint8).tobytes())


def write_idx_labels(path: Path, labels: np.ndarray) -> None:
    path.write_bytes(struct.pack(">ii", 2049, len(labels)) + labels.astype(np.uint8).tobytes())


@pytest.fixture
def mnist_dir(tmp_path):
    """A tiny MNIST in the real IDX format under tmp_path/MNIST/raw; returns (root, arrays)."""
    rng = np.random.default_rng(0)
    arrays = {
        "train_x": rng.integers(0, 256, size=(N_TRAIN, 28, 28), dtype=np.uint8),
        "train_y": rng.integers(0, 10, size=N_TRAIN, dtype=np.uint8),
        "test_x": rng.integers(0, 256, size=(N_TEST, 28, 28), dtype=np.uint8),
        "test_y": rng.integers(0, 10, size=N_TEST, dtype=np.uint8),
    }
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    write_idx_images(raw / "train-images-idx3-ubyte", arrays["train_x"])
    write_idx_labels(raw / "train-labels-idx1-ubyte", arrays["train_y"])
    write_idx_images(raw / "t10k-images-idx3-ubyte", arrays["test_x"])
    write_idx_labels(raw / "t10k-labels-idx1-ubyte", arrays["test_y"])
    return tmp_path, arrays


def test_idx_header_is_big_endian(mnist_dir):
    root, _ = mnist_dir
    head = (root / "MNIST" / "raw" / "train-images-idx3-ubyte").read_bytes()[:16]
    assert head == bytes.fromhex("00000803") + bytes.fromhex("00000040") + bytes.fromhex("0000001c") * 2


def test_mnist_is_read_from_idx_files(mnist_dir):
    root, arrays = mnist_dir
    check_dataset("mnist", str(root))
    data = load_dataset("mnist", str(root))
    assert data.info == DatasetInfo("mnist", 1, 28, 28, 10)
    assert (data.train_size, data.test_size) == (N_TRAIN, N_TEST)
    assert data.train_x.shape == (N_TRAIN, 1, 28, 28) and data.train_x.dtype == torch.uint8
    assert data.test_x.shape == (N_TEST, 1, 28, 28) and data.test_x.dtype == torch.uint8
    assert data.train_y.dtype == data.test_y.dtype == torch.int64
    np.testing.assert_array_equal(data.train_x[:, 0].numpy(), arrays["train_x"])
    np.testing.assert_array_equal(data.train_y.numpy(), arrays["train_y"])
    np.testing.assert_array_equal(data.test_x[:, 0].numpy(), arrays["test_x"])
    np.testing.assert_array_equal(data.test_y.numpy(), arrays["test_y"])
    # batches come out normalised float, in the order asked for
    x, y = data.train_batch(np.array([5, 0, 63]))
    assert x.dtype == torch.float32 and x.shape == (3, 1, 28, 28)
    expected = (torch.from_numpy(arrays["train_x"][[5, 0, 63]]).float() - data.mean) / data.std
    torch.testing.assert_close(x[:, 0], expected)
    np.testing.assert_array_equal(y.numpy(), arrays["train_y"][[5, 0, 63]])
    assert sum(len(b[1]) for b in data.test_batches(5)) == N_TEST


@pytest.mark.parametrize("missing", MNIST_FILES)
def test_mnist_missing_file_is_named(mnist_dir, missing):
    root, _ = mnist_dir
    (root / "MNIST" / "raw" / missing).unlink()
    for call in (check_dataset, load_dataset):
        with pytest.raises(ConfigError, match=f"MNIST files missing under .*: {missing};"):
            call("mnist", str(root))


def test_mnist_in_an_empty_directory_names_every_file(tmp_path):
    with pytest.raises(ConfigError) as info:
        check_dataset("mnist", str(tmp_path))
    for name in MNIST_FILES:
        assert name in str(info.value)
    assert str(tmp_path / "MNIST" / "raw") in str(info.value)


def test_mnist_without_data_dir_says_how_to_fix_it():
    for call in (check_dataset, load_dataset):
        with pytest.raises(ConfigError, match="pass --data-dir DIR"):
            call("mnist", "")


def test_mnist_gzipped_only_is_a_config_error(mnist_dir):
    """torchvision reads only the uncompressed files; .gz alone must not pass the check."""
    root, _ = mnist_dir
    raw = root / "MNIST" / "raw"
    for name in MNIST_FILES:
        with gzip.open(raw / f"{name}.gz", "wb") as f:
            f.write((raw / name).read_bytes())
        (raw / name).unlink()
    for call in (check_dataset, load_dataset):
        with pytest.raises(ConfigError, match="gunzip"):
            call("mnist", str(root))


def test_mnist_corrupt_file_is_a_config_error(mnist_dir):
    root, _ = mnist_dir
    (root / "MNIST" / "raw" / "train-images-idx3-ubyte").write_bytes(b"not an idx file at all")
    for call in (check_dataset, load_dataset):  # the check finds it: before any worker starts
        with pytest.raises(ConfigError, match=r"MNIST.raw.train-images-idx3-ubyte is not an MNIST image.*intact copy"):
            call("mnist", str(root))


# ---------------------------------------------------------------- CIFAR-10
def test_cifar10_missing_directory(tmp_path):
    for call in (check_dataset, load_dataset):
        with pytest.raises(ConfigError, match="CIFAR-10 files missing under .*cifar-10-batches-py") as info:
            call("cifar10", str(tmp_path / "nowhere"))
        for name in CIFAR10_FILES:
            assert name in str(info.value)
    assert not (tmp_path / "nowhere").exists()


def test_cifar10_without_data_dir():
    with pytest.raises(ConfigError, match="--dataset cifar10 reads local files: pass --data-dir"):
        check_dataset("cifar10", "")


def test_cifar10_needs_batches_meta(tmp_path):
    """torchvision's CIFAR10 also reads batches.meta (the class names)."""
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in CIFAR10_FILES:
        if name != "batches.meta":
            (folder / name).write_bytes(b"x")
    with pytest.raises(ConfigError, match="batches.meta"):
        check_dataset("cifar10", str(tmp_path))


def test_cifar10_corrupt_files_are_a_config_error(tmp_path):
    """Files of the right names but the wrong content fail torchvision's checksum: found by the check
    (before any worker starts), naming every bad file, and by the loader too."""
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in CIFAR10_FILES:
        (folder / name).write_bytes(b"truncated download")
    for call in (check_dataset, load_dataset):
        with pytest.raises(ConfigError, match="cifar-10-batches-py.*corrupt or truncated") as info:
            call("cifar10", str(tmp_path))
        for name in CIFAR10_FILES:
            assert name in str(info.value)


# ---------------------------------------------------------------- broken MNIST files, found before any worker
def test_mnist_truncated_file_is_found_by_the_check(mnist_dir):
    root, _ = mnist_dir
    path = root / "MNIST" / "raw" / "train-images-idx3-ubyte"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    for call in (check_dataset, load_dataset):
        with pytest.raises(ConfigError, match=r"train-images-idx3-ubyte is truncated \(.*64 items"):
            call("mnist", str(root))


def test_mnist_wrong_magic_is_found_by_the_check(mnist_dir):
    root, _ = mnist_dir
    raw = root / "MNIST" / "raw"
    # a label file where the images should be: a real IDX file, but the wrong one
    (raw / "t10k-images-idx3-ubyte").write_bytes((raw / "t10k-labels-idx1-ubyte").read_bytes())
    with pytest.raises(ConfigError, match="t10k-images-idx3-ubyte is not an MNIST image file"):
        check_dataset("mnist", str(root))
    (raw / "t10k-images-idx3-ubyte").write_bytes(b"\x00\x00")  # shorter than any header
    with pytest.raises(ConfigError, match="t10k-images-idx3-ubyte is not an MNIST image file"):
        check_dataset("mnist", str(root))


def test_mnist_images_of_another_size_are_refused(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    write_idx_images(raw / "train-images-idx3-ubyte", np.zeros((4, 32, 32), np.uint8))
    write_idx_labels(raw / "train-labels-idx1-ubyte", np.zeros(4, np.uint8))
    write_idx_images(raw / "t10k-images-idx3-ubyte", np.zeros((2, 28, 28), np.uint8))
    write_idx_labels(raw / "t10k-labels-idx1-ubyte", np.zeros(2, np.uint8))
    with pytest.raises(ConfigError, match="holds 32x32 images, not 28x28"):
        check_dataset("mnist", str(tmp_path))


def test_mnist_extra_bytes_are_refused(mnist_dir):
    root, _ = mnist_dir
    path = root / "MNIST" / "raw" / "train-labels-idx1-ubyte"
    path.write_bytes(path.read_bytes() + b"\x01\x02")
    with pytest.raises(ConfigError, match="train-labels-idx1-ubyte is longer than its header says"):
        check_dataset("mnist", str(root))


@pytest.mark.parametrize("split", ["train", "t10k"])
def test_mnist_label_count_must_match_image_count(mnist_dir, split):
    """1,000 labels for 4,000 images used to train silently on the first 1,000 (torchvision reads both)."""
    root, arrays = mnist_dir
    raw = root / "MNIST" / "raw"
    n = N_TRAIN if split == "train" else N_TEST
    write_idx_labels(raw / f"{split}-labels-idx1-ubyte", np.zeros(n // 4, np.uint8))
    for call in (check_dataset, load_dataset):
        with pytest.raises(ConfigError, match=f"MNIST {split} files under .* disagree: {n} images but {n // 4} labels"):
            call("mnist", str(root))


def test_mnist_loader_refuses_mismatched_counts_on_its_own(mnist_dir, monkeypatch):
    """A worker re-checks what it loaded (files can differ between the driver's node and a worker's)."""
    import distrain.trainers.datasets as datasets

    root, _ = mnist_dir
    write_idx_labels(root / "MNIST" / "raw" / "train-labels-idx1-ubyte", np.zeros(16, np.uint8))
    monkeypatch.setattr(datasets, "_check_mnist", lambda data_dir: None)  # as if the driver saw other files
    with pytest.raises(ConfigError, match="disagree: 64 images but 16 labels"):
        load_dataset("mnist", str(root))


def test_mnist_label_out_of_range_is_refused(mnist_dir):
    root, arrays = mnist_dir
    labels = arrays["test_y"].copy()
    labels[3] = 200
    write_idx_labels(root / "MNIST" / "raw" / "t10k-labels-idx1-ubyte", labels)
    with pytest.raises(ConfigError, match="t10k-labels-idx1-ubyte holds label 200, outside 0..9"):
        check_dataset("mnist", str(root))
