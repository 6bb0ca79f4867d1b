"""`distrain run --strategy auto`: the plan's recommendation, made concrete before the run starts.

The planner calibrates on this cluster (a short calibration: planning/calibrate.py) and
recommends a strategy, a transport and its settings (τ, H, s) for the run's worker count. A run that names
a layout (--fsdp, --tensor-parallel), or whose model does not fit one worker's --worker-memory, gets BSP or
DiLoCo across cut replicas (the two built there) at that layout or at one that fits (--fsdp D, and the
--tensor-parallel of a layout that needs it, then among the choice's settings). The run is
then an ordinary run of that strategy: config.yaml records the concrete strategy (so `--config` repeats
it without planning again) with the choice and its reason as a comment on top; summary.json's
`strategy_auto` and the run's prediction.json hold the reason and the predicted step, which
`distrain report` sets against the measured one. A resumed run reads the concrete strategy back.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The record of the choice is the run's (the orchestrator writes it, the report reads it); re-exported here
# because a choice and its record are one subject to callers of this module.
from distrain.orchestrator.auto_choice import (  # noqa: F401
    AUTO,
    CHOICE_FILE,
    recorded_choice,
    recorded_strategy,
    summary_entry,
    write_choice,
    yaml_header,
)

CALIBRATION_STEPS = 24  # a run pays for its plan: short (steps cost ms; each tiny run's start-up costs seconds)
CALIBRATION_REPEATS = 1  # and once: `distrain plan` repeats each tiny run (medians) when the choice matters more


def requested(config_values: dict[str, Any], config_file: str | None) -> bool:
    """Whether the run's flags (or, without a --strategy flag, its YAML) ask for --strategy auto."""
    from distrain.config import RunConfig

    asked = config_values.get("strategy") or (RunConfig.load_yaml(config_file).get("strategy") if config_file else None)
    return asked == AUTO


def make_concrete(
    config_values: dict[str, Any],
    config_file: str | None,
    say: Callable[[str], None] = lambda _: None,
    task_object: Any = None,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """What `distrain run` and `distrain.fit` both do before a run resolves its config: with strategy
    auto, calibrate and choose; returns (the flags with the concrete strategy in place of auto, the record
    of the choice for run_training's `auto=`); otherwise (the flags as given, None)."""
    if not requested(config_values, config_file):
        return config_values, None
    say("--strategy auto: calibrating on this cluster to choose a strategy...")
    concrete, record = choose(config_values, config_file, task_object=task_object)
    say(f"--strategy auto chose {record['strategy']} ({record['transport']}): {record['reason']}")
    return dict(config_values) | concrete, record


def resumed_values(run_dir: str | Path, config_values: dict[str, Any]) -> dict[str, Any]:
    """A resume's flags with `strategy auto` read as the concrete strategy the run chose when it started
    (the resume then compares that one with config.yaml's)."""
    if config_values.get("strategy") != AUTO:
        return config_values
    return dict(config_values, strategy=recorded_strategy(Path(run_dir)) or AUTO)


def choose(
    config_values: dict[str, Any], config_file: str | None, task_object: Any = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(overrides that make the run concrete, the record of the choice). `config_values` are the run's
    flags; the strategy they or the YAML name is "auto". `task_object`: a task fit() ships by value,
    which the calibration's tiny runs train too."""
    from distrain.config import RunConfig
    from distrain.orchestrator import memory
    from distrain.planning.calibrate import calibrate
    from distrain.planning.layout_figures import planned_layouts
    from distrain.planning.layout_model import recommend_among
    from distrain.planning.planner import recommend

    probe = RunConfig.resolve(config_file, dict(config_values, strategy="bsp", transport="", schedule=""))
    if task_object is not None:
        from distrain.orchestrator.tasks import attach_task_object

        attach_task_object(probe, task_object)
    layouts, why = planned_layouts(probe)
    with tempfile.TemporaryDirectory(prefix="distrain-auto-") as tmp:
        cut = layouts[0] if layouts else None  # its collectives measured too
        cal = calibrate(probe, Path(tmp), steps=CALIBRATION_STEPS, repeats=CALIBRATION_REPEATS, layout=cut)
    if layouts:  # a cut replica's strategies only, at the run's layout or one that fits
        rec = recommend_among(cal, probe.workers, layouts, why)
    else:
        rec = recommend(cal, probe.workers, None, memory.local_available() if not probe.address else None)
    overrides = {"strategy": rec.strategy, "transport": rec.transport, **rec.settings}
    record = {
        "requested": AUTO,
        "strategy": rec.strategy,
        "transport": rec.transport,
        "settings": rec.settings,
        "reason": rec.reason,
        "workers": probe.workers,
        "layout": rec.prediction.layout,
        "predicted": rec.prediction.row(),
        "calibration": cal.to_dict(),
    }
    return overrides, record
