"""Each section's checks of its own values (ranges, choices, syntax), registered with `config_check` in
the order of the sections (the strategy section's, across sections, are with it: `strategy_section.py`),
and last the optimizer's constructor (torch). Messages name the flag and the fix. No Ray."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from distrain.config.checks import config_check
from distrain.config.parsing import parse_chaos, parse_monitor, parse_stragglers, parse_target
from distrain.config.sections import (
    BUILTIN_TASK_FIELDS,
    COMMON_FIELDS,
    LOGGER_NAMES,
    LR_DECAYS,
    LR_SCALING_RULES,
    ON_NONFINITE,
    OPTIMIZER_NAMES,
    PLACEMENTS,
    PRECISIONS,
    REFUSED_OPTIMIZER_NAMES,
)
from distrain.errors import ConfigError

if TYPE_CHECKING:
    from distrain.config.run_config import RunConfig


def at_least(config: RunConfig, names: tuple[str, ...], low: int) -> None:
    for name in names:
        if getattr(config, name) < low:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(config, name)}")


def positive_numbers(config: RunConfig, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(config, name)
        if not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive number, got {value}")


def non_negative_numbers(config: RunConfig, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(config, name)
        if value is None:  # momentum of an optimizer without one
            continue
        if not (value >= 0 and math.isfinite(value)):
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {value}")


def one_of(config: RunConfig, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(config, name)
    if value not in choices:
        raise ConfigError(f"unknown --{name.replace('_', '-')} {value!r}; choose one of: {', '.join(choices)}")


@config_check
def check_data(config: RunConfig) -> None:
    from distrain.trainers.builtin_names import DATASET_READS_FILES, check_dataset, check_model

    check_model(config.model)
    check_dataset(config.dataset)
    at_least(config, ("epochs",), 1)
    at_least(config, ("max_steps",), 0)
    if config.data_dir and not DATASET_READS_FILES[config.dataset]:
        # Like a strategy's options, --data-dir is refused where nothing reads it.
        users = [n for n, reads in DATASET_READS_FILES.items() if reads]
        raise ConfigError(
            f"--data-dir is not used by --dataset {config.dataset} (it reads no files); drop it "
            f"(it applies to: {', '.join(users)})"
        )
    if not 0 <= config.seed < 2**64:  # numpy's default_rng refuses negative seeds, torch's > 64 bits
        raise ConfigError(f"--seed must be in [0, 2**64), got {config.seed}")


@config_check
def check_resources(config: RunConfig) -> None:
    from distrain.units import parse_bytes

    at_least(config, ("workers", "segment_steps"), 1)
    positive_numbers(config, ("cpus_per_worker", "cpus_per_shard"))
    non_negative_numbers(config, ("gpus_per_worker",))
    one_of(config, "placement", PLACEMENTS)
    if config.worker_memory:
        try:
            if parse_bytes(config.worker_memory) <= 0:
                raise ValueError
        except ValueError:
            raise ConfigError(
                f"--worker-memory takes a size such as 3GiB or 512MiB, got {config.worker_memory!r}"
            ) from None


@config_check
def check_optimization(config: RunConfig) -> None:
    at_least(config, ("batch_size", "base_batch_size", "accumulate_steps"), 1)
    positive_numbers(config, ("lr",))
    one_of(config, "precision", PRECISIONS)
    non_negative_numbers(config, ("momentum", "weight_decay", "warmup_epochs", "clip_grad_norm"))
    if config.momentum is not None and config.momentum >= 1:
        raise ConfigError(f"--momentum must be < 1, got {config.momentum}")
    if config.warmup_epochs > config.epochs:
        raise ConfigError(f"--warmup-epochs ({config.warmup_epochs}) exceeds --epochs ({config.epochs}); lower it")
    one_of(config, "lr_scaling", LR_SCALING_RULES)
    check_lr_decay(config)
    if config.optimizer.lower() not in OPTIMIZER_NAMES + REFUSED_OPTIMIZER_NAMES:  # torch need not load for this
        raise ConfigError(f"unknown --optimizer {config.optimizer!r}; choose one of: {', '.join(OPTIMIZER_NAMES)}")


def check_lr_decay(config: RunConfig) -> None:
    one_of(config, "lr_decay", LR_DECAYS)
    owners = {"lr_min": "cosine", "lr_decay_epochs": "step", "lr_decay_gamma": "step"}
    for name, decay in owners.items():
        if getattr(config, name) is not None and config.lr_decay != decay:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} applies to --lr-decay {decay}; add that or drop {flag}")
    if config.lr_decay == "cosine":
        from distrain.trainers.schedule import scaled_lr

        peak = scaled_lr(config.lr, config.global_batch_size, config.base_batch_size, config.lr_scaling)
        if config.lr_min is not None and not (0 <= config.lr_min < peak):
            raise ConfigError(f"--lr-min must be >= 0 and below the peak rate {peak:g}, got {config.lr_min}")
    if config.lr_decay == "step":
        if config.lr_decay_epochs is None:
            raise ConfigError("--lr-decay step needs --lr-decay-epochs E: the rate drops every E epochs")
        if not (config.lr_decay_epochs > 0 and math.isfinite(config.lr_decay_epochs)):
            raise ConfigError(f"--lr-decay-epochs must be a positive number, got {config.lr_decay_epochs}")
        if config.lr_decay_gamma is not None and not 0 < config.lr_decay_gamma <= 1:
            raise ConfigError(f"--lr-decay-gamma must be in (0, 1], got {config.lr_decay_gamma}")


@config_check
def check_checkpointing(config: RunConfig) -> None:
    at_least(config, ("checkpoint_every", "checkpoint_steps"), 0)
    if config.checkpoint_best:
        parse_monitor(config.checkpoint_best)
    if config.init_from and "://" not in config.init_from and not Path(config.init_from).is_file():  # or a URI
        raise ConfigError(f"--init-from {config.init_from!r} is not a file; pass a checkpoint (.pt) path")


@config_check
def check_faults(config: RunConfig) -> None:
    positive_numbers(config, ("collective_timeout_s", "hang_timeout_s"))
    if config.max_failures < -1:
        raise ConfigError(f"--max-failures must be >= 0, or -1 for no limit; got {config.max_failures}")
    parse_chaos(config.chaos, config.num_worker_actors, config.ps_shards)
    one_of(config, "on_nonfinite", ON_NONFINITE)


@config_check
def check_stragglers(config: RunConfig) -> None:
    parse_stragglers(config.straggler, config.num_worker_actors)
    if not (config.straggler_threshold > 1 and math.isfinite(config.straggler_threshold)):
        raise ConfigError(f"--straggler-threshold must be a number > 1, got {config.straggler_threshold}")


@config_check
def check_output(config: RunConfig) -> None:
    at_least(config, ("eval_every",), 0)
    if not 0 < config.target_accuracy <= 1:
        raise ConfigError(f"--target-accuracy must be in (0, 1], got {config.target_accuracy}")
    if config.target:
        parse_target(config.target)
    if not (0 <= config.val_fraction < 1):
        raise ConfigError(f"--val-fraction must be in [0, 1), got {config.val_fraction}")
    unknown = [name for name in config.logger_names if name not in LOGGER_NAMES]
    if unknown:
        raise ConfigError(f"--loggers: unknown logger {unknown[0]!r}; choose from {', '.join(LOGGER_NAMES)}")
    if config.mlflow_uri and "mlflow" not in config.logger_names:
        raise ConfigError("--mlflow-uri is for --loggers mlflow; add mlflow to --loggers or drop --mlflow-uri")


@config_check
def check_task(config: RunConfig) -> None:
    """The built-in task's own flags do not apply to another task (here: those set to another value
    than their default; `RunConfig.refuse_builtin_options` also refuses those given at their default)."""
    if not config.task:
        if config.task_args:
            raise ConfigError("--task-arg applies to a --task of your own; the built-in task takes --model etc.")
        return
    for name in BUILTIN_TASK_FIELDS:
        if getattr(config, name) != COMMON_FIELDS[name].default:
            raise builtin_option_error(config, name)


def builtin_option_error(config: RunConfig, name: str, where: str = "") -> ConfigError:
    what = f"{name} (in {where})" if where else "--" + name.replace("_", "-")
    return ConfigError(
        f"{what} applies to the built-in classification task, not --task {config.task}; "
        "pass your task's settings with --task-arg key=value"
        + (" and its target with --target" if name == "target_accuracy" else "")
    )


@config_check(stage="last")
def check_optimizer_arguments(config: RunConfig) -> None:
    """Last: the optimizer's own constructor checks its arguments, which needs torch (every other flag
    error is found without it, in well under a second)."""
    from distrain.trainers.optim_state import check_optimizer

    check_optimizer(config.optimizer, config.optimizer_args, config.momentum, config.weight_decay)
