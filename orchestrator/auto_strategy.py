"""`distrain run --strategy auto`: the plan's recommendation, made concrete before the run starts.

The planner calibrates on this cluster (a short calibration: orchestrator/plan_calibrate.py) and
recommends a strategy, a transport and its settings (τ, H, s) for the run's worker count. The run is
then an ordinary run of that strategy: config.yaml records the concrete strategy (so `--config` repeats
it without planning again) with the choice and its reason as a comment on top; summary.json's
`strategy_auto` and the run's prediction.json hold the reason and the predicted step, which
`distrain report` sets against the measured one. A resumed run reads the concrete strategy back.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from distrain.orchestrator.files import atomic_write_text

AUTO = "auto"
CHOICE_FILE = "prediction.json"
CALIBRATION_STEPS = 12  # a run pays for its plan: short, the planner's minimum that gives a steady state
CALIBRATION_REPEATS = 1  # and once: `distrain plan` repeats each tiny run (medians) when the choice matters more


def choose(config_values: dict[str, Any], config_file: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(overrides that make the run concrete, the record of the choice). `config_values` are the run's
    flags; the strategy they or the YAML name is "auto"."""
    from distrain.config import RunConfig
    from distrain.orchestrator import memory
    from distrain.orchestrator.plan_calibrate import calibrate
    from distrain.orchestrator.planner import recommend

    probe = RunConfig.resolve(config_file, dict(config_values, strategy="bsp", transport="", schedule=""))
    with tempfile.TemporaryDirectory(prefix="distrain-auto-") as tmp:
        cal = calibrate(probe, Path(tmp), steps=CALIBRATION_STEPS, repeats=CALIBRATION_REPEATS)
    available = memory.local_available() if not probe.address else None
    rec = recommend(cal, probe.workers, None, available)
    overrides = {"strategy": rec.strategy, "transport": rec.transport, **rec.settings}
    record = {
        "requested": AUTO,
        "strategy": rec.strategy,
        "transport": rec.transport,
        "settings": rec.settings,
        "reason": rec.reason,
        "workers": probe.workers,
        "predicted": rec.prediction.row(),
        "calibration": cal.to_dict(),
    }
    return overrides, record


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
