"""Checkpoints: model + optimizer state + counters + config, written atomically with torch.save.

A checkpoint also carries what a resumed or recovered run needs to continue as if never stopped:
the parameter-server counters (shard version, worker clocks), the failures seen so far and the run
time elapsed; nothing that grows with the step count. The metrics rows stay in the run's
metrics.parquet, written just before each checkpoint, and a resumed run reads those before the
checkpoint's step back from there (orchestrator/resume.py). The data order needs no state of its
own: it is a pure function of (seed, epoch, step) (trainers/sharding.py), and seed and step are here.
`checkpoints/latest.json` names the newest complete checkpoint; it is replaced (atomically) only
after that checkpoint file is durable, so a crash at any moment leaves it pointing at a whole one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from distrain.errors import DistrainError
from distrain.orchestrator.files import atomic_write, atomic_write_text

FORMAT = "distrain-checkpoint"
# 2: + "channel", each rank's codec state (orchestrator/channel_checkpoint.py). A version-1 checkpoint
# loads as before: without the entry, the residuals start at zero. Readers go by the entries present.
VERSION = 2


LATEST = "latest.json"
CHECKPOINTS = "checkpoints"  # the run directory's folder of them


def checkpoint_name(epoch: int | None) -> str:
    return "final.pt" if epoch is None else f"epoch-{epoch:04d}.pt"


def step_checkpoint_name(global_step: int) -> str:
    return f"step-{global_step:08d}.pt"


def save_checkpoint(
    directory: Path,
    name: str,
    state: dict[str, Any],
    *,
    config: dict[str, Any],
    epoch: int,
    global_step: int,
    extra: dict[str, Any] | None = None,
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "strategy": config["strategy"],
        "model_name": config["model"],
        "config": config,
        "epoch": epoch,  # epochs completed
        "global_step": global_step,  # steps completed
        **(extra or {}),  # "ps", "failures", "elapsed_s" (see orchestrator/recovery.py)
        **state,  # "model", "optimizer", and "channel" under a codec
    }
    path = directory / name
    atomic_write(path, lambda tmp: _save_to(payload, tmp))
    atomic_write_text(directory / LATEST, json.dumps({"name": name, "global_step": global_step}) + "\n")
    return path


def _save_to(payload: dict[str, Any], path: Path) -> None:
    """torch.save through a Python file: a full disk then surfaces as the OSError (ENOSPC) it is,
    in the error's context, where torch.save to a path raises only its own RuntimeError."""
    with open(path, "wb") as f:
        torch.save(payload, f)


def latest_checkpoint(directory: Path) -> Path | None:
    """The newest complete checkpoint in `directory` (by `latest.json`), or None if there is none."""
    pointer = directory / LATEST
    if not pointer.is_file():
        return None
    try:
        name = json.loads(pointer.read_text())["name"]
    except (ValueError, KeyError, TypeError):
        raise DistrainError(f"{str(pointer)!r} is damaged; point it at a checkpoint in that folder") from None
    path = directory / str(name)
    if Path(name).name != name or not path.is_file():
        raise DistrainError(f"{str(pointer)!r} names {name!r}, which is not in {str(directory)!r}")
    return path


def load_checkpoint(path: Path) -> dict[str, Any]:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt, truncated or not a torch file at all
        raise DistrainError(f"cannot read checkpoint {str(path)!r} ({type(e).__name__}); is it complete?") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise DistrainError(f"{str(path)!r} is not a distrain checkpoint")
    return payload


def load_checkpoint_for(path: str | Path, model: str, num_params: int) -> dict[str, Any]:
    """A checkpoint to start `model` from, whatever strategy or transport wrote it."""
    payload = load_checkpoint(Path(path))
    if payload.get("model_name") != model:
        raise DistrainError(
            f"checkpoint {str(path)!r} holds a {payload.get('model_name')!r} model, not {model!r}; "
            f"pass --model {payload.get('model_name')} or another checkpoint"
        )
    directory = sharded_dir(payload, Path(path))
    if directory is not None:  # a sharded run's: its shards' metadata tells the sizes
        from distrain.trainers.sharded_checkpoint import saved_values

        if saved_values(directory) < num_params:
            raise DistrainError(f"checkpoint {str(path)!r} does not fit this model's {num_params} parameters")
        return payload
    found = sum(t.numel() for t in payload["model"].values() if t.is_floating_point())
    vectors = payload["optimizer"].get("vectors", {})
    if any(v.numel() != num_params for v in vectors.values()) or found < num_params:
        raise DistrainError(f"checkpoint {str(path)!r} does not fit this model's {num_params} parameters")
    return payload


def sharded_dir(payload: dict[str, Any], path: Path) -> Path | None:
    """The folder of a sharded run's checkpoint shards (beside its file), or None for a whole checkpoint."""
    ref = payload.get("sharded")
    if ref is None:
        return None
    directory = path.parent / ref["dir"]
    from distrain.trainers.sharded_checkpoint import is_complete

    if not is_complete(directory):
        raise DistrainError(f"checkpoint {str(path)!r} names the shards folder {str(directory)!r}, which is incomplete")
    return directory


def whole_checkpoint(payload: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """`payload` holding the whole model and optimizer state (and a strategy's state) in memory: a sharded
    run's checkpoint read from its shards in this process (DCP puts the pieces together), for what loads
    it whole (a run without sharding, --init-from, the trained model); any other checkpoint as it is."""
    directory = sharded_dir(payload, Path(path))
    if directory is None:
        return payload
    from distrain.trainers.sharded_checkpoint import read_whole

    ref = payload["sharded"]
    whole = read_whole(directory, ref["model_keys"], ref["param_names"], payload.get("strategy_state"))
    scheduler = {"scheduler": ref["scheduler"]} if "scheduler" in ref else {}  # a task's own, as a replica's
    return {k: v for k, v in payload.items() if k != "sharded"} | whole | scheduler
