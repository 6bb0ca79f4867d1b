"""A task's own optimizer and rate scheduler (`Task.configure_optimizers`), built where the step runs.

A task that defines `configure_optimizers(params)` returns a torch optimizer over `params`, or a pair
(optimizer, torch `lr_scheduler`). distrain then steps that optimizer at its own rates: the rate of each
parameter group as the task set it, moved by its scheduler once per update (`scheduler.step()` after
`optimizer.step()`); --lr, --lr-scaling, --warmup-epochs, --lr-decay and the --optimizer flags do not
apply. Where `params` come from depends on who holds the parameters:
- a replica holding whole tensors (collective strategies, local SGD, DiLoCo's inner optimizer, a
  pipeline's stage) passes its trainable tensors, in `model.parameters()` order;
- a sharded replica (--fsdp, --tensor-parallel) passes its DTensor shards;
- a parameter-server shard passes one flat 1-D slice cutting across tensors, and so do replicas of a task
  that declares `elementwise_optimizer = True` (one flat tensor: the state then has the same flat form
  under every transport, as distrain's own optimizers'). Only a task that declares it runs over the PS.
"""

from __future__ import annotations

from typing import Any

import torch

from distrain.errors import ConfigError
from distrain.trainers.task import Task

SCHEDULER = torch.optim.lr_scheduler.LRScheduler


def defines_own(task: Task) -> bool:
    """Whether the task overrides `Task.configure_optimizers`."""
    return type(task).configure_optimizers is not Task.configure_optimizers


def build_own(task: Task, params: list[torch.nn.Parameter]) -> tuple[torch.optim.Optimizer, Any] | None:
    """(optimizer, scheduler or None) from the task's hook over `params`; None: distrain's --optimizer.
    A result of another kind is refused in one line (ConfigError)."""
    result = task.configure_optimizers(params)
    if result is None:
        return None
    optimizer, scheduler = result if isinstance(result, tuple | list) and len(result) == 2 else (result, None)
    name = type(task).__name__
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"{name}.configure_optimizers must return a torch.optim.Optimizer or (optimizer, lr_scheduler), "
            f"got {type(result).__name__}"
        )
    if scheduler is not None and not (isinstance(scheduler, SCHEDULER) and scheduler.optimizer is optimizer):
        raise ConfigError(
            f"{name}.configure_optimizers: the second value must be a torch.optim.lr_scheduler over the "
            f"optimizer it returns, got {type(scheduler).__name__}"
        )
    return optimizer, scheduler


def restore_scheduler(scheduler: Any, state: dict[str, Any]) -> None:
    """Put a checkpointed scheduler back where it was: its counters (`last_epoch`: the updates it has
    stepped) and the rates it had set on the optimizer's groups. distrain's flat optimizer state carries
    no param_groups, and a chainable scheduler (StepLR, ExponentialLR, ...) computes its next rate from
    the group's current one: without the rates, a resumed StepLR would start again from the first."""
    scheduler.load_state_dict(state)
    for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr


def check_own_optimizer(task: Task, config: Any, model: torch.nn.Module) -> None:
    """Refuse (one line) a task's own optimizer where it cannot run: Sandblaster (its own full-batch
    method), and the parameter-server transport unless the task declares it element-wise; build it once
    on the model so a broken hook fails before anything starts."""
    if not defines_own(task):
        return
    name = type(task).__name__
    if any(cls.full_batch for cls in config.strategy_classes):
        raise ConfigError(
            f"--strategy sandblaster runs its own full-batch method; {name}.configure_optimizers does not apply "
            "there: drop the hook or choose another strategy"
        )
    if config.transport == "ps" and not task.elementwise_optimizer:
        raise ConfigError(
            f"--transport ps steps flat slices that cut across tensors, so {name}.configure_optimizers must "
            "return an element-wise optimizer and say so (elementwise_optimizer = True); else use the collective"
        )
    params = [p for p in model.parameters() if p.requires_grad]
    build_own(
        task,
        [torch.nn.Parameter(torch.cat([p.detach().reshape(-1) for p in params]))]
        if task.elementwise_optimizer
        else params,
    )
