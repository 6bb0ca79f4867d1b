"""A task's three splits: what it trains on, what runs select on (validation), what is reported apart (test).

`Task.datasets()` returns (train, val, test), and the validation split is used as it is; or (train, test).
A task that returns two and sets `carve_validation` (the built-in tasks do) has a seeded share of its
training set held out as validation (`--val-fraction`, the same samples on every run and every worker,
whatever --seed); with --val-fraction 0, or for a task that returns two without `carve_validation`,
there is no validation split of its own: validation is the test set (`Splits.val_is_test`), and what
selects on validation (targets, --checkpoint-best, Tune) then selects on test, as the run's note says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from distrain.errors import ConfigError

SPLIT_SEED = 4321  # fixed, independent of --seed: every run validates on the same held-out samples
SPLITS = ("val", "test")  # what an evaluation scores, as the prefixes of its metric columns


def val_size(n: int, fraction: float) -> int:
    """Samples of a training set of `n` that --val-fraction `fraction` holds out (at least one when > 0)."""
    if fraction <= 0 or n < 2:
        return 0
    return min(n - 1, max(1, int(round(n * fraction))))


def train_part_size(n: int, fraction: float) -> int:
    """Training samples left of `n` once validation is held out."""
    return n - val_size(n, fraction)


class IndexedSubset(Dataset):
    """Samples `indices` of `dataset`, keeping its fast batch read (`get_batch`) where it has one."""

    def __init__(self, dataset: Any, indices: np.ndarray) -> None:
        self.dataset = dataset
        self.indices = np.asarray(indices, dtype=np.int64)
        if hasattr(dataset, "get_batch"):
            self.get_batch = lambda idx: dataset.get_batch(self.indices[np.asarray(idx, dtype=np.int64)])

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> Any:
        return self.dataset[int(self.indices[i])]


def carve_validation(train: Any, fraction: float, seed: int = SPLIT_SEED) -> tuple[Any, Any]:
    """(training part, validation part) of `train`: a seeded random `fraction` of it held out. The training
    part keeps the samples' original order, so that every step's batch is the one it would be (same
    positions) on the rest of the data."""
    n = len(train)
    held = val_size(n, fraction)
    order = np.random.default_rng(seed).permutation(n)
    val_idx = np.sort(order[:held])
    keep = np.ones(n, dtype=bool)
    keep[val_idx] = False
    return IndexedSubset(train, np.flatnonzero(keep)), IndexedSubset(train, val_idx)


@dataclass
class Splits:
    train: Any
    val: Any  # the test set itself when the task has no validation split (`val_is_test`)
    test: Any
    val_is_test: bool


def task_splits(task: Any, val_fraction: float, returned: Any = None) -> Splits:
    """The splits of `task` (its `datasets()` result, or `returned` when already called)."""
    name = type(task).__name__
    got = task.datasets() if returned is None else returned
    if not (isinstance(got, tuple | list) and len(got) in (2, 3)):
        what = f"a {type(got).__name__}" + (f" of {len(got)}" if isinstance(got, tuple | list) else "")
        raise ConfigError(
            f"task {name}: datasets() returned {what}; it must return (train, val, test) or (train, test)"
        )
    if len(got) == 3:
        return Splits(got[0], got[1], got[2], False)
    train, test = got
    # A streamed training set (a Ray Dataset: no indexing) is not carved: it validates on its test set.
    carvable = getattr(task, "carve_validation", False) and hasattr(train, "__getitem__")
    if carvable and val_size(len(train), val_fraction) > 0:
        train, val = carve_validation(train, val_fraction)
        return Splits(train, val, test, False)
    return Splits(train, test, test, True)


def selection_note(task: Any, val_fraction: float) -> str:
    """The note for a run whose validation is its test set: what it selects on, and how to change that."""
    if getattr(task, "carve_validation", False):
        how = "--val-fraction > 0 holds a share of the training set out"
    else:
        how = "return (train, val, test) from datasets(), or set carve_validation = True to use --val-fraction"
    name = type(task).__name__
    return f"task {name} has no validation split: targets and sweeps select on the test set ({how})"


def evaluation_figures(task: Any, parts: list[dict[str, dict[str, tuple[float, float]]]]) -> dict[str, float]:
    """The workers' shares of one evaluation ({split: (sum, count) per metric} each) reduced to its
    figures by column: val_loss, val_accuracy, ..., and test_* where every share scored the test set
    (a share queued before a callback's stop made its epoch the last may lack it)."""
    from distrain.trainers.task import reduce_metrics

    figures: dict[str, float] = {}
    for split in SPLITS:
        shares = [part[split] for part in parts if split in part]
        if shares and len(shares) == len(parts):
            figures |= {f"{split}_{name}": value for name, value in reduce_metrics(task, shares).items()}
    return figures
