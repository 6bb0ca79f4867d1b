"""A task whose data is streamed by Ray Data (docs/raydata.md): the bundled digits written to Parquet by
`write_digits` (an `id`, a `label` and 64 pixel columns a row), read with `ray.data.read_parquet` (its read
tasks run on the CPUs the workers leave free); `collate_columns` makes each streamed batch of columns a
feature matrix and the labels.

`seen_dir`: each worker appends the ids of every training batch it reads to a file there, so a test can
check that an epoch read every row exactly once. `stream_test`: the test set is a Ray Dataset too (else
a map-style torch Dataset read from the same Parquet file).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

import distrain

PIXELS = [f"p{i}" for i in range(64)]


def write_digits(folder: Path, train_rows: int) -> None:
    """`folder`/train.parquet (the first `train_rows` training digits) and test.parquet (all test digits)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from distrain.trainers.datasets import load_dataset

    data = load_dataset("digits")
    parts = (("train", data.train_x[:train_rows], data.train_y[:train_rows]), ("test", data.test_x, data.test_y))
    for name, x, y in parts:
        flat = x.reshape(len(y), 64).numpy()
        columns = {"id": np.arange(len(y)), "label": y.numpy()} | {p: flat[:, i] for i, p in enumerate(PIXELS)}
        # Several row groups and files' worth of blocks: the split has more than one block to deal out.
        pq.write_table(pa.table(columns), folder / f"{name}.parquet", row_group_size=128)


def features(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Columns to a (B, 64) float matrix, scaled as the built-in digits are, and the labels."""
    x = (np.stack([batch[p] for p in PIXELS], axis=1).astype(np.float32) - 4.88) / 6.02
    return {"x": x, "y": batch["label"].astype(np.int64)}


class DigitsStream(distrain.Task):
    default_target = "test_accuracy>=0.5"

    def __init__(self, data_dir: str = "", seen_dir: str = "", stream_test: bool = False):
        self.data_dir = data_dir
        self.seen_dir = seen_dir
        self.stream_test = stream_test

    def datasets(self):
        import ray.data

        # Read as stored (no map stage): the run's count of its rows can use the Parquet metadata.
        train = ray.data.read_parquet(f"{self.data_dir}/train.parquet")
        if self.stream_test:
            return train, ray.data.read_parquet(f"{self.data_dir}/test.parquet").select_columns(["label", *PIXELS])
        import pandas as pd

        frame = features({k: v.to_numpy() for k, v in pd.read_parquet(f"{self.data_dir}/test.parquet").items()})
        return train, torch.utils.data.TensorDataset(torch.from_numpy(frame["x"]), torch.from_numpy(frame["y"]))

    def build_model(self):
        return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    def collate_columns(self, columns):
        """The streamed rows to tensors (each worker's batch; the driver's check of a test batch)."""
        if self.seen_dir and "id" in columns and _in_worker():
            with open(Path(self.seen_dir) / f"{os.getpid()}.txt", "a") as f:
                f.write("".join(f"{i}\n" for i in columns["id"]))
        batch = features(columns)
        return torch.from_numpy(batch["x"]), torch.from_numpy(batch["y"])

    def criterion(self, output, batch):
        return nn.functional.cross_entropy(output, batch[1])

    def metrics(self, model, batch):
        return {"accuracy": float((model(batch[0]).argmax(1) == batch[1]).float().mean())}


def _in_worker() -> bool:
    """In a worker actor (not the driver checking the task's first batch)."""
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
