"""The record of a `--strategy auto` choice in a run directory: config.yaml's comment on top, summary.json's
`strategy_auto`, and prediction.json (the choice, its reason and the predicted step, which `distrain report`
sets against the measured one). Making the choice is planning/auto_strategy.py's; the run only records
it, so the orchestrator never imports the planning package (which starts runs through it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from distrain.orchestrator.files import atomic_write_text

AUTO = "auto"
CHOICE_FILE = "prediction.json"


def yaml_header(auto: dict[str, Any] | None) -> str:
    if not auto:
        return ""
    settings = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in auto["settings"].items())
    return (
        f"# --strategy auto chose {auto['strategy']} ({auto['transport']}) {settings}".rstrip()
        + f"\n# because {auto['reason']}\n"
    )


def summary_entry(auto: dict[str, Any]) -> dict[str, Any]:
    keys = ("requested", "strategy", "transport", "settings", "reason")
    return {k: auto.get(k) for k in keys} | {"predicted_step_s": auto["predicted"]["step_s"]}


def write_choice(run_dir: Path, auto: dict[str, Any]) -> None:
    atomic_write_text(run_dir / CHOICE_FILE, json.dumps(auto, indent=2, default=str) + "\n")


def recorded_choice(run_dir: Path) -> dict[str, Any] | None:
    file = run_dir / CHOICE_FILE
    return json.loads(file.read_text()) if file.is_file() else None


def recorded_strategy(run_dir: Path) -> str | None:
    """The concrete strategy a run was started with (what `--resume ... --strategy auto` means)."""
    from distrain.config import RunConfig

    file = run_dir / "config.yaml"
    return RunConfig.load_yaml(file).get("strategy") if file.is_file() else None
