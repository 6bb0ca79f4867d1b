"""Checkpoints: model + optimizer state + counters + config, written atomically with torch.save."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from distrain.errors import DistrainError
from distrain.orchestrator.files import atomic_write

FORMAT = "distrain-checkpoint"
VERSION = 1


def checkpoint_name(epoch: int | None) -> str:
    return "final.pt" if epoch is None else f"epoch-{epoch:04d}.pt"


def save_checkpoint(
    directory: Path,
    name: str,
    state: dict[str, Any],
    *,
    config: dict[str, Any],
    epoch: int,
    global_step: int,
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
        **state,  # "model", "optimizer"
    }
    path = directory / name
    atomic_write(path, lambda tmp: torch.save(payload, tmp))
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
    found = sum(t.numel() for t in payload["model"].values() if t.is_floating_point())
    vectors = payload["optimizer"].get("vectors", {})
    if any(v.numel() != num_params for v in vectors.values()) or found < num_params:
        raise DistrainError(f"checkpoint {str(path)!r} does not fit this model's {num_params} parameters")
    return payload
