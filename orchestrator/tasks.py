"""Which task a run trains, built where it is needed, and checked in the driver before anything starts.

The built-in classification task takes `--model`, `--dataset` and `--data-dir`; any other task is a
user's `distrain.Task` subclass named by an import path (`--task`) and built with `--task-arg`s.
Workers build the task themselves (the import path travels in the config, not the object), so the
driver never holds the training data. `check_task` runs the user's code once in the driver, on one
small batch, so that a broken path, an empty data set, a loss that is not a finite scalar or metrics
not of the contract's form is one line before Ray starts rather than a failure in every worker.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distrain.config import RunConfig, Target, parse_target
from distrain.errors import ConfigError
from distrain.orchestrator import streaming
from distrain.orchestrator.files import atomic_write
from distrain.plugins import is_lone_module, load_object
from distrain.trainers.splits import SPLITS, task_splits
from distrain.trainers.task import ClassificationTask, Task, loss_only


def task_class(path: str) -> type[Task]:
    obj = load_object(path, "--task")
    if not (isinstance(obj, type) and issubclass(obj, Task)):
        what = type(obj).__name__ if not isinstance(obj, type) else f"class {obj.__name__}"
        raise ConfigError(f"--task {path!r} names a {what}, not a subclass of distrain.Task")
    return obj


def describe_task_args(path: str) -> str:
    """ "--task my.py:Name takes: n (default 2048), noise (default 0.1)": what `--help` lists under
    --task-arg for a task named on the command line (its constructor's keyword arguments)."""
    import inspect

    cls = task_class(path)
    params = [p for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"]
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    listed = ", ".join(p.name + ("" if p.default is p.empty else f" (default {p.default!r})") for p in named)
    return f"{cls.__name__} takes: {listed or 'no arguments'}."


OBJECT_PREFIX = "object:"  # config.task of a task object handed to fit() that cannot be rebuilt from a path
TASK_FILE = "task.pkl"  # such an object, kept in its run directory for --resume


def attach_task_object(config: RunConfig, task: Task) -> None:
    """Ship `task` (an object that its import path and constructor arguments cannot rebuild, e.g. its
    class defined in a notebook) with the config: Ray sends the config to every worker, and the
    attribute with it, as `ShippedTask`'s bytes. It is not a config field: config.yaml records
    `object:ClassName`, and `save_task_object` keeps the same bytes in the run directory."""
    config.__dict__["_task_object"] = ShippedTask(task)


class ShippedTask:
    """A task object travelling with the config. Pickled (by Ray, to the workers) it becomes `task_bytes`,
    which unpickle to the task itself; the driver unwraps it in `build_task`."""

    def __init__(self, task: Task):
        self.task = task
        self._bytes: bytes | None = None

    def pickled(self) -> bytes:
        if self._bytes is None:
            self._bytes = task_bytes(self.task)
        return self._bytes

    def __reduce__(self) -> tuple[Any, ...]:
        import pickle

        return (pickle.loads, (self.pickled(),))


def task_bytes(task: Task) -> bytes:
    """`task` by cloudpickle, self-contained where it can be: a class in a notebook's `__main__` travels by
    value anyway, and one from a lone .py file (`from my_task import Regression`) is made to, so that
    neither a worker nor a later `--resume` needs that file on its import path."""
    import inspect

    import cloudpickle

    module = inspect.getmodule(type(task))
    if module is None or not is_lone_module(module):
        return cloudpickle.dumps(task)
    cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(task)
    finally:
        cloudpickle.unregister_pickle_by_value(module)


def save_task_object(config: RunConfig, run_dir: Path) -> None:
    """Keep a shipped task object in `run_dir/task.pkl`, so that `--resume` trains the very same object,
    not a default-constructed one."""
    shipped = config.__dict__.get("_task_object")
    if shipped is None:
        return
    data = shipped.pickled() if isinstance(shipped, ShippedTask) else task_bytes(shipped)  # a config unpickled
    atomic_write(run_dir / TASK_FILE, lambda tmp: Path(tmp).write_bytes(data))


def load_task_object(config: RunConfig, run_dir: Path, doing: str = "--resume") -> None:
    """`--resume` (or `doing`: what the errors name) of a run whose task was a shipped object: attach the
    object its task.pkl holds."""
    if not config.task.startswith(OBJECT_PREFIX):
        return
    import pickle

    name, path = config.task.removeprefix(OBJECT_PREFIX), run_dir / TASK_FILE
    if not path.is_file():
        raise ConfigError(
            f"{doing} {str(run_dir)!r}: the run's task was a {name} object handed to distrain.fit and {TASK_FILE}, "
            "which holds it, is missing; start a new run with --init-from its checkpoint"
        )
    try:
        task = pickle.loads(path.read_bytes())
    except Exception as e:  # e.g. a module the object's class lives in is not importable here
        raise ConfigError(
            f"{doing} {str(run_dir)!r}: cannot load the run's {name} task from {TASK_FILE} ({type(e).__name__}: {e}); "
            "resume where the run was started, with the modules it imported"
        ) from None
    attach_task_object(config, task)


def build_task(config: RunConfig) -> Task:
    """The run's task object (in a worker, or in the driver's check)."""
    shipped = config.__dict__.get("_task_object")
    if shipped is not None:  # the driver's ShippedTask; in a worker, already the task it unpickled to
        return shipped.task if isinstance(shipped, ShippedTask) else shipped
    if not config.task:
        return ClassificationTask(config.model, config.dataset, config.data_dir, config.target_accuracy)
    if config.task.startswith(OBJECT_PREFIX):
        raise ConfigError(
            f"this config's task was a {config.task.removeprefix(OBJECT_PREFIX)} object handed to distrain.fit, "
            f"which config.yaml cannot rebuild (--resume of its run loads it from {TASK_FILE}); pass the task to "
            "distrain.fit again, or move the class to a file and pass --task file.py:Name"
        )
    cls = task_class(config.task)
    try:
        return cls(**config.task_args)
    except TypeError as e:
        raise ConfigError(f"--task {config.task}: {cls.__name__}({_args(config.task_args)}) failed: {e}") from None


def run_target(config: RunConfig, task: Task | None = None) -> Target | None:
    """The run's quality target: --target, else the task's default (classification: --target-accuracy)."""
    given = config.target_spec
    if given is not None:
        return given
    default = (task or build_task(config)).default_target
    return parse_target(default) if default else None


def train_size(config: RunConfig) -> int:
    """Samples in the task's training set, less its validation split (the task is built; its data sets are
    made). A streamed set's were counted once, by the task's check (orchestrator/streaming.py)."""
    streamed = streaming.prepared(config)
    if streamed is not None:
        return streamed.rows
    train = task_splits(build_task(config), config.val_fraction).train
    if streaming.is_dataset(train):
        raise ConfigError(f"--task {config.task}: its training set is a Ray Dataset, counted only by `distrain run`")
    return len(train)


def check_task(
    config: RunConfig, batch_size: int, start_ray: Callable[[], None] | None = None
) -> tuple[Task, int, list[int]]:
    """Build a user task once in the driver: its data sets are not empty, its model builds, its loss is
    a scalar on a batch of `batch_size`. Returns (task, training samples, values of each trainable tensor).
    A training set that is a Ray Dataset is counted here, on the Ray `start_ray` starts if none is up yet
    (orchestrator/streaming.py)."""
    import torch

    task = build_task(config)
    name = config.task
    streaming.forget()
    returned = _call(name, "datasets", lambda: streaming.datasets_lazily(task, start_ray))
    splits = task_splits(task, config.val_fraction, returned)
    train, val, test = splits.train, splits.val, splits.test
    streamed = streaming.is_dataset(train)
    if any(streaming.is_dataset(ds) for ds in (val, test)) and not streamed:
        raise ConfigError(
            f"--task {name}: the test set is a Ray Dataset but the training set is not; stream both or neither"
        )
    if streamed:
        streaming.check_streamable(config)
        streaming.by_value(task)
    for which, ds in (("training", train), ("validation", val), ("test", test)):
        if streaming.is_dataset(ds):
            # (a streamed test set is first read by the check of its metrics, below)
            n = streaming.prepare(config, ds, start_ray) if ds is train else 1
        else:
            try:
                n = len(ds)
            except TypeError:
                raise ConfigError(f"--task {name}: the {which} set has no len(); pass a map-style Dataset") from None
        if n == 0:
            raise ConfigError(f"--task {name}: the {which} set is empty")
    num_train = streaming.prepared(config).rows if streamed else len(train)  # type: ignore[union-attr]
    if batch_size > num_train:
        raise ConfigError(
            f"the global batch ({batch_size}) exceeds the {num_train} training samples of --task {name}; "
            "lower --batch-size or --workers"
        )
    model = _call(name, "build_model", task.build_model)
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"--task {name}: build_model() returned {type(model).__name__}, not a torch.nn.Module")
    sizes = [p.numel() for p in model.parameters() if p.requires_grad]
    if sum(sizes) == 0:
        raise ConfigError(f"--task {name}: the model has no trainable parameters")
    if not streamed:  # a streamed set's first batch would cost an execution of its own: read by the workers
        _check_first_loss(name, task, model, train, min(batch_size, num_train))
    reported = _reported_metrics(name, task, model, test)
    check_target(config, reported, task, splits.val_is_test)
    check_checkpoint_best(config, reported, splits.val_is_test)
    return task, num_train, sizes


def _check_first_loss(name: str, task: Task, model: Any, train: Any, first: int) -> None:
    """The task's loss on the first `first` training samples is a finite scalar that depends on the model."""
    import torch

    batch = _call(name, "collate (reading a batch)", lambda: _first_batch(task, train, first))
    loss = loss_only(_call(name, "loss", lambda: task.loss(model, batch)))  # (loss, logs): the loss checked
    if not (torch.is_tensor(loss) and loss.dim() == 0):
        got = f"a tensor of shape {tuple(loss.shape)}" if torch.is_tensor(loss) else type(loss).__name__
        raise ConfigError(f"--task {name}: loss() must return a scalar tensor (mean over the batch), got {got}")
    if not loss.requires_grad:
        raise ConfigError(f"--task {name}: loss() returned a tensor that does not depend on the model's parameters")
    if not bool(torch.isfinite(loss.detach())):
        # Training would diverge at its first step; better said now, before Ray starts, than as a run
        # that stops at step 0 with nothing to resume.
        raise ConfigError(
            f"--task {name}: loss() is {float(loss.detach())} at the initial parameters, on the first batch (training "
            f"samples 0..{first - 1}); check the data (NaN or inf values) and the model (e.g. a log or a division "
            "by zero)"
        )


def _first_batch(task: Task, data: Any, n: int) -> Any:
    """The first `n` samples of `data` as the workers read them: by index, or streamed (Ray Data)."""
    from distrain.trainers.task import BatchReader

    if streaming.is_dataset(data):
        return task.collate_columns(data.take_batch(n, batch_format="numpy"))
    return BatchReader(data, task.collate, prefetch=False).read(list(range(n)))


def _reported_metrics(name: str, task: Task, model: Any, test: Any) -> set[str]:
    """The metric columns an evaluation of `task` writes (val_loss, val_<metric>, derived figures, and their
    test_ twins), from its evaluation of a few test samples (the model in eval mode, as the workers evaluate)."""
    import torch

    from distrain.trainers.task import reduce_metrics

    batch = _call(name, "collate (reading a test batch)", lambda: _first_batch(task, test, min(8, _size(test))))
    model.eval()
    with torch.no_grad():
        parts = _call(name, "metrics", lambda: task.evaluate_batch(model, batch))
        means = _call(name, "derived_metrics", lambda: reduce_metrics(task, [parts]))
    return {f"{split}_{k}" for k in means for split in SPLITS}


def check_checkpoint_best(config: RunConfig, reported: set[str], val_is_test: bool = False) -> None:
    """--checkpoint-best names a metric every evaluation reports (as a target must)."""
    if not config.checkpoint_best:
        return
    from distrain.config import parse_monitor

    monitor = parse_monitor(config.checkpoint_best)
    if monitor.metric not in reported:
        raise ConfigError(
            f"--checkpoint-best {config.checkpoint_best} names {monitor.metric}, which the task does not report; "
            f"it reports {', '.join(sorted(reported))}"
        )
    if monitor.metric.startswith("test_") and not (val_is_test or config.test_every_epoch):
        raise ConfigError(
            f"--checkpoint-best {config.checkpoint_best} selects on the test set, which is scored only at the end "
            f"of the run; name {monitor.metric.replace('test_', 'val_', 1)}, or add --test-every-epoch"
        )


def check_target(config: RunConfig, reported: set[str], task: Task | None = None, val_is_test: bool = False) -> None:
    """A target on a metric the task never reports would silently never be reached (and leave Tune's
    schedulers without their metric): one line naming the metrics it does report. So would a target
    outside its metric's range (`Task.metric_ranges`; the built-in task's when `task` is None), and one on
    the test set where the test set is scored only at the end (`val_is_test`: the task has no validation
    split of its own, so every evaluation scores the test set)."""
    target = run_target(config, task)
    if target is None:
        return
    source = "--target" if config.target_spec is not None else "the task's default_target"
    if target.metric not in reported:
        raise ConfigError(
            f"{source} {target} names {target.metric}, which the task does not report; "
            f"it reports {', '.join(sorted(reported))}"
        )
    # A target outside the values its metric can take would run to the end without ever being reached.
    ranges = task.metric_ranges if task is not None else ClassificationTask.metric_ranges
    low, high = ranges.get(target.metric.split("_", 1)[1], (-math.inf, math.inf))
    if (target.op == ">=" and target.value > high) or (target.op == "<=" and target.value < low):
        interval = f"{'[' if math.isfinite(low) else '('}{low:g}, {high:g}{']' if math.isfinite(high) else ')'}"
        raise ConfigError(
            f"{source} {target} can never be reached: {target.metric} lies in {interval}; "
            "choose a value in that range"
        )
    if target.metric.startswith("test_") and not (val_is_test or config.test_every_epoch):
        raise ConfigError(
            f"{source} {target} selects on the test set, which is scored only at the end of the run; name the "
            f"validation metric ({target.metric.replace('test_', 'val_', 1)}), or add --test-every-epoch"
        )


def _size(data: Any) -> int:
    """Samples in a map-style set; a streamed one's first 8 are enough to check its metrics on."""
    return 8 if streaming.is_dataset(data) else len(data)


def _call(name: str, what: str, fn: Any) -> Any:
    """Run a piece of the user's task; its own exceptions keep their traceback (it is their bug), with
    a note saying which hook raised."""
    try:
        return fn()
    except ConfigError:
        raise
    except Exception as e:
        e.add_note(f"(raised by {what}() of --task {name}, checked before the run starts)")
        raise


def _args(args: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in args.items())
