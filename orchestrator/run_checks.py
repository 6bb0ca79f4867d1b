"""What `distrain run` checks about a config before it starts anything, beyond RunConfig's own
validation: the data set is there and one global batch fits it, the model can be split across the
parameter-server shards, an --init-from checkpoint fits the model, the --tensorboard directory can be
written. No Ray, no cluster, nothing written, so `distrain tune` makes the same checks for every trial
before Ray starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from distrain.config import RunConfig
from distrain.config.layout_section import tp_degree
from distrain.errors import ConfigError
from distrain.orchestrator.files import check_creatable_dir
from distrain.strategies.pipeline import check_pipeline_task
from distrain.trainers.datasets import DATASETS, check_dataset
from distrain.trainers.models import parameter_sizes
from distrain.trainers.splits import SPLITS, train_part_size


def check_runnable(config: RunConfig, start_ray: Callable[[], None] | None = None) -> int:
    """Raises ConfigError for a config that `run_training` would refuse; returns the model's size.

    A user's task is built once here (orchestrator/tasks.py): its data sets, its model, its loss on
    one batch; the built-in task is checked from its registries without loading any data. A task's
    Ray Dataset is counted on the Ray `start_ray` starts (orchestrator/streaming.py)."""
    if config.tensorboard:  # filled only once the run has started: a path it cannot write is refused now
        check_creatable_dir(config.tensorboard, "--tensorboard")
    if config.task:
        from distrain.orchestrator.tasks import check_task
        from distrain.trainers.own_optimizer import check_own_optimizer

        task, num_samples, sizes = check_task(config, config.samples_per_step, start_ray)
        check_own_optimizer(task, config, task.build_model())
    else:
        from distrain.orchestrator.tasks import check_checkpoint_best, check_target

        num_samples = train_part_size(DATASETS.get(config.dataset).train_size, config.val_fraction)
        check_dataset(config.dataset, config.data_dir, config.samples_per_step, num_samples)
        # what ClassificationTask.evaluate_batch reports, on each split
        reported = {f"{split}_{name}" for split in SPLITS for name in ("loss", "accuracy")}
        check_target(config, reported, val_is_test=config.val_fraction == 0)
        check_checkpoint_best(config, reported, val_is_test=config.val_fraction == 0)
        sizes = parameter_sizes(config.model, DATASETS.get(config.dataset).info)
    num_params = sum(sizes)
    if config.pipelined:
        check_pipeline(config)
    if tp_degree(config) > 1:
        check_tensor_parallel(config)
    for strategy in config.strategy_classes:
        strategy.check_model(config, sizes)
        strategy.check_data(config, num_samples)
    if config.transport == "ps" and config.ps_shards and config.ps_shards > num_params:
        raise ConfigError(f"--ps-shards {config.ps_shards} exceeds the model's {num_params} parameters")
    return num_params


def check_pipeline(config: RunConfig) -> None:
    """A pipeline's checks of the run's task (strategies/pipeline.py, which owns them)."""
    from distrain.orchestrator.tasks import build_task

    check_pipeline_task(build_task(config), config)


def check_tensor_parallel(config: RunConfig) -> None:
    """--tensor-parallel T: the task's plan splits its model T ways (trainers/tensor_parallel.py); a hybrid
    plan (each of the T workers on its own samples) is the built-in models' only so far: the global
    batch is config arithmetic, which knows them by name (trainers/builtin_names.py)."""
    from distrain.orchestrator.tasks import build_task
    from distrain.trainers.tensor_parallel import check_plan, plan_of, takes_own_samples

    task, tp = build_task(config), tp_degree(config)
    who = f"--task {config.task}" if config.task else f"--model {config.model}"
    plan = plan_of(task, tp, who)
    check_plan(task.build_model(), plan, tp, who)
    if takes_own_samples(plan) and config.task:
        raise ConfigError(
            f"--tensor-parallel {tp}: {who}'s plan takes its input sharded on the batch (a hybrid, each worker on "
            "its own samples), which only the built-in --model cnn does so far; make that layer's input whole"
        )


def check_init_from(config: RunConfig, num_params: int) -> dict[str, Any] | None:
    """The --init-from checkpoint (when there is one), checked against the model."""
    from distrain.orchestrator.checkpoint import load_checkpoint_for, whole_checkpoint  # torch.load
    from distrain.orchestrator.storage import localize
    from distrain.trainers.optim_state import FlatOptimizerState, state_fits

    path = localize(config.init_from, "--init-from") if config.init_from else None  # a URI: its local copy
    checkpoint = load_checkpoint_for(path, config.model, num_params) if path else None
    if checkpoint is not None:
        checkpoint = whole_checkpoint(checkpoint, path)  # a sharded run's, put together: any layout
        recorded = (checkpoint.get("config") or {}).get("optimizer")
        flat = FlatOptimizerState.from_dict(checkpoint["optimizer"])
        args = (config.optimizer, config.momentum, config.weight_decay, config.optimizer_args)
        if own_optimizer(config):  # the task's own optimizer: its state is the task's to match
            return checkpoint
        if recorded not in (None, config.optimizer) or not state_fits(*args, flat):
            # Another optimizer's state (or one missing an entry this one steps with): start it afresh.
            checkpoint = checkpoint | {"optimizer": FlatOptimizerState().to_dict()}
    return checkpoint


def own_optimizer(config: RunConfig) -> bool:
    """Whether the run's task brings its own optimizer (`Task.configure_optimizers`)."""
    if not config.task:
        return False
    from distrain.orchestrator.tasks import build_task
    from distrain.trainers.own_optimizer import defines_own

    return defines_own(build_task(config))
