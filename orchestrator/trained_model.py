"""The model back: a run's task model with the weights of one of its checkpoints (`distrain.load_model`,
`FitResult.model()`), as Lightning's `load_from_checkpoint` gives a user their module.

The checkpoint records the run's config, so the task is built exactly as the workers built it (its import
path and arguments; a task object handed to `fit` from the run directory's task.pkl) and its model with
the run's seed; then the checkpoint's parameters and buffers are loaded. A pipeline's checkpoint holds
the whole model's state dict (the stages' slices are joined before it is written), so the model comes
back whole. Built-in models load their data set's shape (digits: in memory; MNIST or CIFAR from the
run's --data-dir).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from distrain.errors import ConfigError

FINAL = "final.pt"


def checkpoint_of(path: str | Path) -> tuple[Path, Path]:
    """(checkpoint file, run directory) for `path`: a run directory (its final checkpoint, else its latest:
    a stopped, failed or interrupted run) or a checkpoint file inside one."""
    from distrain.orchestrator.checkpoint import latest_checkpoint

    where = Path(path).expanduser()
    if where.is_dir():
        checkpoints = where / "checkpoints"
        final = checkpoints / FINAL
        found = final if final.is_file() else latest_checkpoint(checkpoints) if checkpoints.is_dir() else None
        if found is None:
            raise ConfigError(
                f"{str(where)!r} holds no checkpoint; pass a run directory written by `distrain run` or "
                "distrain.fit that got to its first checkpoint, or a checkpoint file"
            )
        return found, where
    if where.is_file():
        return where, where.parent.parent  # run_dir/checkpoints/<name>.pt
    raise ConfigError(f"{str(where)!r} is neither a run directory nor a checkpoint file")


def load_model(path: str | Path) -> Any:
    """The task's model (a torch `nn.Module`) with the weights of the checkpoint `path` names (see
    `checkpoint_of`), on the CPU and in eval mode."""
    from distrain.config import RunConfig
    from distrain.orchestrator.checkpoint import load_checkpoint, whole_checkpoint
    from distrain.orchestrator.storage import localize
    from distrain.orchestrator.tasks import build_task, load_task_object
    from distrain.trainers.models import seeded

    checkpoint, run_dir = checkpoint_of(localize(path, "load_model"))  # a --storage URI: its local copy
    payload = whole_checkpoint(load_checkpoint(checkpoint), checkpoint)
    config = RunConfig.from_mapping(payload["config"])
    load_task_object(config, run_dir, "load_model")  # a task object handed to distrain.fit: the very one, from task.pkl
    model = seeded(build_task(config).build_model, config.seed)
    model.load_state_dict(payload["model"])
    return model.to("cpu").eval()
