"""`distrain run --resume runs/X`: continue a run whose driver stopped (killed, crashed, Ctrl-C).

The run's own config.yaml is the configuration; flags may change only what does not change the
training math (how long, how often to evaluate or checkpoint, timeouts, fault handling, resources).
The run continues from its newest complete checkpoint (`checkpoints/latest.json`), with the metrics
rows and failures recorded up to it. Every refusal is one line naming the fix, and writes nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from distrain.config import RunConfig
from distrain.errors import ConfigError, DistrainError
from distrain.orchestrator.checkpoint import latest_checkpoint, load_checkpoint_for

# Flags a resumed run may change: none of them changes what one step computes.
RESUMABLE = frozenset(
    {
        "epochs",
        "max_steps",
        "eval_every",
        "checkpoint_every",
        "checkpoint_steps",
        "max_failures",
        "hang_timeout_s",
        "collective_timeout_s",
        "chaos",
        "target_accuracy",
        "segment_steps",
        "address",
        "placement",
        "cpus_per_worker",
        "cpus_per_shard",
        "gpus_per_worker",
        "straggler",
        "data_dir",
        "on_nonfinite",
    }
)
# A checkpoint from another run must agree on these to be continued here.
IDENTITY = ("strategy", "transport", "model", "dataset", "workers", "batch_size", "seed", "optimizer")


def resume_config(run_dir: str | Path, overrides: dict[str, Any]) -> RunConfig:
    """The configuration of the run in `run_dir`, with the (resumable) flags in `overrides` applied."""
    path = Path(run_dir)
    if not path.is_dir():
        raise ConfigError(f"--resume {str(path)!r} is not a directory; pass a run directory such as runs/<id>")
    recorded_file = path / "config.yaml"
    if not recorded_file.is_file() or not (path / "checkpoints").is_dir():
        raise ConfigError(
            f"--resume {str(path)!r} is not a distrain run (no config.yaml and checkpoints/); "
            "pass a directory written by `distrain run`"
        )
    recorded = RunConfig.resolve(str(recorded_file), {})
    given = {k: v for k, v in overrides.items() if v is not None}
    if given.get("run_dir") not in (None, "", str(path), recorded.run_dir):
        raise ConfigError("--resume continues the run in its own directory; drop --run-dir")
    given.pop("run_dir", None)
    if given.get("init_from"):
        raise ConfigError("--resume continues from the run's own checkpoint; drop --init-from")
    for name, value in given.items():
        if name not in RESUMABLE and value != getattr(recorded, name):
            flag = "--" + name.replace("_", "-")
            raise ConfigError(
                f"--resume cannot change {flag} (the run has {getattr(recorded, name)!r}, got {value!r}); drop it, "
                "or start a new run with --init-from its checkpoint"
            )
    values = recorded.to_dict() | {k: v for k, v in given.items() if k in RESUMABLE} | {"run_dir": str(path)}
    return RunConfig.from_mapping(values, str(recorded_file))


def resume_checkpoint(config: RunConfig, num_params: int) -> tuple[Path, dict[str, Any]]:
    """The checkpoint `config`'s run continues from: its newest, checked to belong to this run."""
    directory = Path(config.run_dir) / "checkpoints"
    path = latest_checkpoint(directory)
    if path is None:
        raise DistrainError(
            f"{config.run_dir!r} has no complete checkpoint to resume from; start it again "
            "(use --checkpoint-steps N or --checkpoint-every N so a killed run can be resumed)"
        )
    payload = load_checkpoint_for(path, config.model, num_params)
    recorded = payload.get("config") or {}
    for name in IDENTITY:
        if recorded.get(name) != getattr(config, name):
            raise DistrainError(
                f"checkpoint {str(path)!r} was written by another run ({name} {recorded.get(name)!r}, "
                f"this run has {getattr(config, name)!r}); it cannot be resumed here"
            )
    return path, payload
