"""What is trained: a `Task` is a model, its data, its loss and its metrics.

This is the contract users implement (exported as `distrain.Task`); distrain's own image
classification is one task like any other (`ClassificationTask`). A worker builds its task's model
and datasets in its own process, reads the samples its work plan names by index, and calls the task's
`loss` for the step; the driver only ever sees reduced numbers.

    class MyTask(distrain.Task):
        def build_model(self): ...              # torch.nn.Module
        def datasets(self): ...                 # (train, val, test) or (train, test): map-style torch
                                                # Datasets, or Ray Data Datasets (docs/raydata.md)
        def loss(self, model, batch): ...       # scalar tensor, mean over the batch
        def metrics(self, model, batch): ...    # optional: {"name": value}

How metrics reduce (over batches and over the workers that each score a share of the evaluated set):
a value that is a float is the batch's *mean*, weighted by the batch's sample count; a value that is a
`(sum, count)` pair is added up as it is (for per-token figures, say). The test loss reduces the first
way. `derived_metrics` then turns the reduced means into figures that are not means themselves
(perplexity = exp(mean NLL)). Every metric reaches the metrics file as `val_<name>` (each evaluation, on
the validation split) and `test_<name>` (the test set: at the end, or each evaluation with
--test-every-epoch); trainers/splits.py says where the validation split comes from.

Optional hooks, used by strategies that need them: `forward` + `criterion` (a pipeline runs the
criterion on its last stage; `loss` defaults to `criterion(forward(model, batch), batch)`),
`split_points` (module names where a model may be cut into stages), `param_groups` (e.g. no weight
decay on biases), `deterministic_loss` (the loss in eval mode, for full-batch methods),
`configure_optimizers` (the task's own optimizer and rate scheduler) and `micro_batches` (how
--accumulate-steps cuts a batch).
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from distrain.errors import ConfigError
from distrain.trainers.task_call import recording_init

MetricValue = float | tuple[float, float]


class Task:
    """Subclass and override `build_model`, `datasets` and `loss` (or `criterion`)."""

    #: The default `--target` of this task, e.g. "val_accuracy>=0.95" or "val_loss<=1.2"; None: no target.
    default_target: str | None = None

    #: With `datasets()` returning (train, test): hold --val-fraction of the training set out as the
    #: validation split (trainers/splits.py). False: such a task validates on its test set.
    carve_validation: bool = False

    #: The values each metric can take (names without `val_`/`test_`, the loss included), e.g.
    #: {"loss": (0.0, math.inf), "accuracy": (0.0, 1.0)}: a --target outside them is refused before the run
    #: starts, as one that can never be reached. A metric not listed may take any value.
    metric_ranges: dict[str, tuple[float, float]] = {}

    #: Whether `configure_optimizers` returns an element-wise optimizer: each parameter value's update
    #: reads only its own gradient and state (SGD, Adam, ...), so it may be built over flat slices that cut
    #: across tensors, as parameter-server shards hold them. Only then may the task run over --transport ps.
    elementwise_optimizer: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Each subclass's constructor records its call, so that a run given an object records how to build
        # it again (trainers/task_call.py): config.yaml's `task` + `task_args`, what workers and --resume use.
        super().__init_subclass__(**kwargs)
        if cls.__init__ is not object.__init__:
            cls.__init__ = recording_init(cls.__init__)  # type: ignore[method-assign]

    def build_model(self) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} must define build_model(self) -> torch.nn.Module")

    def datasets(self) -> tuple[Dataset, ...]:
        raise NotImplementedError(f"{type(self).__name__} must define datasets(self) -> (train, val, test)")

    # ------------------------------------------------------------------ the loss
    def forward(self, model: nn.Module, batch: Any) -> Any:
        """The model's output for `batch` (default: `model(batch[0])`)."""
        return model(batch[0])

    def criterion(self, output: Any, batch: Any) -> torch.Tensor:
        """The loss of `output` against `batch` (a scalar, mean over the batch)."""
        raise NotImplementedError(f"{type(self).__name__} must define loss(self, model, batch) or criterion()")

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Scalar, mean over the batch; what is differentiated each step. May return `(loss, {"name":
        value})` to log scalars of its own each step (metrics columns `train_<name>`, every logger)."""
        return self.criterion(self.forward(model, batch), batch)

    def metrics(self, model: nn.Module, batch: Any) -> dict[str, MetricValue]:
        """Figures of one test batch: a float is the batch mean, a pair is (sum, count)."""
        return {}

    def derived_metrics(self, means: dict[str, float]) -> dict[str, float]:
        """Figures computed from the reduced means (keys without the `val_`/`test_` prefix), e.g. perplexity."""
        return {}

    # ------------------------------------------------------------------ optional hooks
    def describe(self) -> dict[str, Any]:
        """Facts about this task worth keeping with the run (summary.json's `task_info`)."""
        return {}

    def split_points(self) -> list[str]:
        """Names of submodules before which the model may be cut into pipeline stages."""
        return []

    def param_groups(self, model: nn.Module) -> list[dict[str, Any]] | None:
        """Optimizer parameter groups (torch.optim's format); None: one group of every parameter."""
        return None

    def configure_optimizers(self, params: list[nn.Parameter]) -> Any:
        """The task's own optimizer over `params`, or (optimizer, torch lr_scheduler) stepped once per
        update; None (the default): distrain's --optimizer at --lr's schedule (docs/optimization.md)."""
        return None

    def micro_batches(self, batch: Any, k: int) -> list[Any]:
        """`batch` cut into `k` micro-batches for --accumulate-steps (each weighted by its sample count):
        by default every tensor whose first dimension is the batch's size, in tuples, lists and dicts."""
        from distrain.trainers.accumulation import split_batch

        return split_batch(batch, k, self.batch_size(batch))

    def tensor_parallel_plan(self, tp: int) -> dict[str, Any] | None:
        """How `--tensor-parallel tp` splits the model: submodule name -> "colwise" or "rowwise" (an
        nn.Linear's outputs or inputs cut tp ways, Megatron style), or a torch `ParallelStyle`; modules
        not named stay whole. None: the model cannot be split (tp > 1 is refused); raise ValueError
        to refuse this tp, saying why (attention heads that do not divide, say)."""
        return None

    def deterministic_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The loss with the model in eval mode (no dropout, batch-norm running statistics)."""
        was_training = model.training
        model.eval()
        try:
            return loss_only(self.loss(model, batch))
        finally:
            model.train(was_training)

    # ------------------------------------------------------------------ batches
    def collate(self, samples: list[Any]) -> Any:
        """Samples (as the dataset returns them) into one batch; torch's default_collate by default."""
        return default_collate(samples)

    def collate_columns(self, columns: dict[str, np.ndarray]) -> Any:
        """A streamed batch (a Ray Data `Dataset`'s: column name -> numpy array, docs/raydata.md) into
        the batch `loss` takes; by default a dict of tensors, one per column."""
        # (copied: Ray Data's arrays may be read-only views of its blocks, which torch warns about)
        return {name: torch.tensor(column) for name, column in columns.items()}

    def batch_size(self, batch: Any) -> int:
        """Samples in `batch`: the length of its first tensor."""
        first = _first_tensor(batch)
        if first is None:
            raise TypeError("a batch must hold at least one tensor; override Task.batch_size")
        return int(first.shape[0])

    # ------------------------------------------------------------------ evaluation
    def evaluate_batch(self, model: nn.Module, batch: Any) -> dict[str, tuple[float, float]]:
        """(sum, count) of the loss and of every metric over one batch (model already in eval mode)."""
        n = self.batch_size(batch)
        sums = {"loss": (float(loss_only(self.loss(model, batch))) * n, float(n))}
        figures = self.metrics(model, batch)
        _check_figures(self, "metrics", figures, "{name: number (the batch mean) or (sum, count) pair}")
        for name, value in figures.items():
            sums[name] = _as_sum(self, name, value, n)
        return sums


def loss_only(returned: Any) -> Any:
    """The loss of what `Task.loss` returned, without the scalars a task may log beside it."""
    return returned[0] if type(returned) is tuple and len(returned) == 2 else returned


class ClassificationTask(Task):
    """The built-in task: a registered model on a registered image data set, cross-entropy + accuracy."""

    metric_ranges = {"loss": (0.0, math.inf), "accuracy": (0.0, 1.0)}  # cross-entropy, a share of samples
    carve_validation = True  # validation: --val-fraction of the training set (the test set stays apart)

    def __init__(self, model: str = "cnn", dataset: str = "digits", data_dir: str = "", target_accuracy: float = 0.95):
        self.model = model
        self.dataset = dataset
        self.data_dir = data_dir
        self.default_target = f"val_accuracy>={target_accuracy:g}"

    def build_model(self) -> nn.Module:
        from distrain.trainers.datasets import DATASETS
        from distrain.trainers.models import MODELS

        return MODELS.get(self.model)(DATASETS.get(self.dataset).info)

    def tensor_parallel_plan(self, tp: int) -> dict[str, Any] | None:
        from distrain.trainers.tensor_parallel import BUILTIN_PLANS

        return BUILTIN_PLANS.get(self.model)

    def datasets(self) -> tuple[Dataset, Dataset]:
        from distrain.trainers.datasets import load_dataset

        data = load_dataset(self.dataset, self.data_dir)
        return (
            ImageTensorDataset(data.train_x, data.train_y, data.mean, data.std),
            ImageTensorDataset(data.test_x, data.test_y, data.mean, data.std),
        )

    def criterion(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return nn.functional.cross_entropy(output, batch[1])

    def evaluate_batch(self, model: nn.Module, batch: Any) -> dict[str, tuple[float, float]]:
        logits = model(batch[0])  # one forward for both figures
        n = float(batch[1].numel())
        loss_sum = float(nn.functional.cross_entropy(logits, batch[1], reduction="sum"))
        correct = float((logits.argmax(dim=1) == batch[1]).sum())
        return {"loss": (loss_sum, n), "accuracy": (correct, n)}

    def metrics(self, model: nn.Module, batch: Any) -> dict[str, MetricValue]:
        logits = model(batch[0])
        return {"accuracy": (float((logits.argmax(dim=1) == batch[1]).sum()), float(batch[1].numel()))}


class ImageTensorDataset(Dataset):
    """Images kept in their stored dtype (uint8 for MNIST/CIFAR), normalised one batch at a time."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, mean: float, std: float) -> None:
        self.x, self.y, self.mean, self.std = x, y, mean, std

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.x[i].to(torch.float32) - self.mean) / self.std, self.y[i]

    def get_batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole batch in one indexing operation (the fast path `BatchReader` prefers)."""
        idx = torch.from_numpy(np.asarray(indices, dtype=np.int64))
        return (self.x[idx].to(torch.float32) - self.mean) / self.std, self.y[idx]


# ---------------------------------------------------------------------- reading batches by index
class BatchReader:
    """Reads the samples at given indices of a dataset as one batch, optionally one batch ahead.

    Fastest first: a dataset's own `get_batch(indices)` (one indexing operation), then the batched
    `__getitems__` protocol torch's DataLoader uses, then one `__getitem__` per sample; the last two
    are collated by the task. `prefetch(indices)` starts reading the next batch on a background thread
    so that it overlaps the current step's compute (torch releases the GIL in its kernels). With `pin`
    (a CUDA worker: `pins_memory`), that thread also copies the batch's tensors into pinned (page-locked)
    host memory, so the step's `to_device(..., non_blocking=True)` is a real asynchronous DMA copy; a batch
    read on the training thread itself is not pinned (pinning there is one more copy on the step's path,
    no faster than the pageable copy it would replace).

    A batch that costs less than `CHEAP_READ_S` of CPU to read (the last read's, timed on the thread that
    read it) is read on the training thread instead, unpinned batches only: the thread's work would not
    overlap anything worth its hand-overs (the GIL between each of its torch calls and the training
    thread's, a wake-up per batch), and where the workers fill the cores it runs on a core another worker
    was using (benchmarks/RESULTS.md, issue 32). A read that grows dearer is prefetched again.
    """

    CHEAP_READ_S = 0.5e-3

    def __init__(
        self, dataset: Dataset, collate: Callable[[list[Any]], Any], prefetch: bool = True, pin: bool = False
    ) -> None:
        self.dataset = dataset
        self.collate = collate
        self.pin = pin
        self._reader = _Reader() if prefetch else None
        self._ahead: tuple[bytes, _Reading] | None = None
        self.read_cpu_s = math.inf  # CPU seconds the last batch took to read (unknown: prefetch)

    def read(self, indices: np.ndarray | Sequence[int]) -> Any:
        key = np.asarray(indices, dtype=np.int64).tobytes()
        if self._ahead is not None:
            ahead_key, reading = self._ahead
            self._ahead = None
            if ahead_key == key:
                return reading.result()
        return self._timed_read(indices)

    def prefetch(self, indices: np.ndarray | Sequence[int]) -> None:
        if self._reader is None or (not self.pin and self.read_cpu_s < self.CHEAP_READ_S):
            return
        key = np.asarray(indices, dtype=np.int64).tobytes()
        self._ahead = (key, self._reader.submit(self._read_pinned if self.pin else self._timed_read, indices))

    def _timed_read(self, indices: np.ndarray | Sequence[int]) -> Any:
        t0 = time.thread_time()
        batch = self._read(indices)
        self.read_cpu_s = time.thread_time() - t0
        return batch

    def _read_pinned(self, indices: np.ndarray | Sequence[int]) -> Any:
        return pinned(self._timed_read(indices))

    def _read(self, indices: np.ndarray | Sequence[int]) -> Any:
        get_batch = getattr(self.dataset, "get_batch", None)
        if get_batch is not None:
            return get_batch(np.asarray(indices, dtype=np.int64))
        idx = [int(i) for i in indices]
        get_items = getattr(self.dataset, "__getitems__", None)
        samples = get_items(idx) if get_items is not None else [self.dataset[i] for i in idx]
        return self.collate(samples)

    def close(self) -> None:
        self._ahead = None
        if self._reader is not None:
            self._reader.close()


class _Reading:
    """One batch being read by a `_Reader` thread; `result()` waits for it (and raises what it raised)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def result(self) -> Any:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.value


class _Reader:
    """One daemon thread that reads the batches handed to it, in order. Not a ThreadPoolExecutor: its
    weakref and atexit hooks print "Exception ignored" tracebacks when Ray's SIGTERM handler ends a worker
    process; and not a thread per batch: starting one costs a GIL hand-over per step (measured: ~0.9 ms
    a step slower on 2 cores, benchmarks/RESULTS.md)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[Any], Any], Any, _Reading]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[Any], Any], arg: Any) -> _Reading:
        reading = _Reading()
        self._jobs.put((fn, arg, reading))
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="distrain-prefetch", daemon=True)
            self._thread.start()
        return reading

    def close(self) -> None:
        """End the thread once it has read what it was given (a warm worker outlives its readers)."""
        if self._thread is not None:
            self._jobs.put(None)  # type: ignore[arg-type]
            self._thread = None

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, arg, reading = job
            try:
                reading.value = fn(arg)
            except BaseException as exc:  # handed to the training thread, which raises it in result()
                reading.error = exc
            finally:
                reading.done.set()


def pins_memory(device: str | torch.device) -> bool:
    """Whether a worker on `device` stages host data in pinned memory: only on a CUDA device torch can
    use (`pin_memory` raises where there is no CUDA)."""
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def pinned(batch: Any) -> Any:
    """`batch` with every CPU tensor in it copied into pinned memory (tuples, lists and dicts are walked)."""
    if torch.is_tensor(batch):
        return batch.pin_memory() if batch.device.type == "cpu" else batch
    if isinstance(batch, tuple | list):
        return type(batch)(pinned(b) for b in batch)
    if isinstance(batch, dict):
        return {k: pinned(v) for k, v in batch.items()}
    return batch


class DeviceCopy:
    """Moves a step's batch to the worker's device (`to_device`) and times it: the `h2d_s` of its row.

    On the CPU the move is (nearly) free and timed with the wall clock. On CUDA the copy is
    asynchronous (`non_blocking=True`, from pinned memory when the batch was prefetched), so the wall
    clock would time only its launch; a pair of `torch.cuda.Event`s around it on the current stream
    times the copy itself, with no synchronisation on the step's path. `seconds()` waits for the end
    event, which the step has passed by the time its row is written (the loss read back synchronises);
    the copy stays inside `compute_s` too, which times the whole unit on the host.
    """

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._seconds = 0.0
        self._events: tuple[Any, Any] | None = None

    def move(self, batch: Any) -> Any:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            batch = to_device(batch, self.device)
            end.record()
            self._events = (start, end)
            return batch
        t0 = time.perf_counter()
        batch = to_device(batch, self.device)
        self._seconds, self._events = time.perf_counter() - t0, None
        return batch

    def seconds(self) -> float:
        """The last move's time, in seconds."""
        if self._events is not None:
            start, end = self._events
            end.synchronize()
            self._seconds, self._events = start.elapsed_time(end) / 1000, None
        return self._seconds


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` with every tensor in it moved to `device` (tuples, lists and dicts are walked)."""
    if torch.is_tensor(batch):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def reduce_metrics(task: Task, parts: list[dict[str, tuple[float, float]]]) -> dict[str, float]:
    """Add up the (sum, count) pairs of every worker's share; means first, then the task's derived
    figures. Keys are metric names without the `val_`/`test_` prefix ("loss", "accuracy", ...)."""
    sums: dict[str, list[float]] = {}
    for part in parts:
        for name, (s, c) in part.items():
            acc = sums.setdefault(name, [0.0, 0.0])
            acc[0] += s
            acc[1] += c
    means = {name: (s / c if c else math.nan) for name, (s, c) in sums.items()}
    derived = task.derived_metrics(dict(means))
    _check_figures(task, "derived_metrics", derived, "{name: number}")
    try:
        return means | {k: float(v) for k, v in derived.items()}
    except (TypeError, ValueError):
        bad = next(k for k, v in derived.items() if not _is_number(v))
        raise TaskContractError(task, "derived_metrics", f"{_shown(derived[bad])} for {bad!r}", "a number") from None


class TaskContractError(ConfigError):
    """A task's hook returned what the `Task` contract does not allow: bad input (the user's task), so one
    line naming the task, the hook, what it returned and what it must return, not a traceback through
    distrain's own code."""

    def __init__(self, task: Task, hook: str, got: str, expected: str) -> None:
        super().__init__(f"task {type(task).__name__}: {hook}() returned {got}; it must return {expected}")


def _check_figures(task: Task, hook: str, figures: Any, expected: str) -> None:
    """`figures` (what `hook` returned) is a dict keyed by metric names."""
    if not isinstance(figures, dict):
        raise TaskContractError(task, hook, _shown(figures), f"a dict {expected}")
    for name in figures:
        if not isinstance(name, str) or not name:
            raise TaskContractError(task, hook, f"a dict with the key {name!r}", "metric names (str) as its keys")


def _shown(value: Any) -> str:
    """`value` in a message: its type and a short repr."""
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def _as_sum(task: Task, name: str, value: Any, n: int) -> tuple[float, float]:
    if isinstance(value, tuple | list) and len(value) == 2 and all(map(_is_number, value)):
        return float(value[0]), float(value[1])
    if torch.is_tensor(value) and value.numel() == 1:
        value = value.item()
    if isinstance(value, tuple | list | dict | str | bytes) or not _is_number(value):
        expected = "a number (the batch mean) or a (sum, count) pair for each metric"
        raise TaskContractError(task, "metrics", f"{_shown(value)} for {name!r}", expected)
    return float(value) * n, float(n)


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if torch.is_tensor(batch):
        return batch
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, tuple | list) else ()
    for item in items:
        found = _first_tensor(item)
        if found is not None:
            return found
    return None
