"""`distrain plan`: calibrate (or read a calibration back), predict every strategy at every worker count,
recommend one, and write it all down.

Files in the plan directory: plan.json (calibration, hardware, layouts, recommendations, straggler costs),
predictions.parquet (one row per strategy, transport, layout, worker count and machine: "here" or the
what-if hardware), plan.png, and calibration/ (the tiny runs' own directories).

Layouts (layout_figures.planned_layouts): the run's --fsdp / --tensor-parallel, or those that fit when one
worker cannot hold the model under --worker-memory; their BSP and DiLoCo rows join the plain ones, and the
recommendation is then made among them (layout_model.recommend_among).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from distrain.config import RunConfig
from distrain.errors import ConfigError
from distrain.orchestrator import memory
from distrain.orchestrator.files import atomic_write_text, fresh_dir
from distrain.planning import planner
from distrain.planning.layout_model import Layout, layout_table, recommend_among
from distrain.planning.planner import Calibration, Hardware, Prediction, Recommendation

PLAN_FILE = "plan.json"


@dataclass
class PlanResult:
    out: Path
    calibration: Calibration
    here: list[Prediction]
    whatif: list[Prediction]
    hardware: Hardware | None
    recommendations: dict[int, Recommendation]
    stragglers: dict[int, dict[str, float]]
    layouts: list[Layout] = field(default_factory=list)  # cut-replica layouts predicted beside plain workers
    layout_reason: str = ""  # why: the run's flags, or one worker over --worker-memory


def choose_out_dir(requested: Path | None) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return fresh_dir(requested, lambda n: Path(f"plan-{stamp}" + (f"-{n}" if n > 1 else "")), "--out")


def load_calibration(path: Path) -> Calibration:
    """A calibration saved by an earlier plan (its plan.json, or the directory holding it)."""
    file = path / PLAN_FILE if path.is_dir() else path
    try:
        return Calibration.from_dict(json.loads(file.read_text())["calibration"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--calibration {str(path)!r} is not a plan written by `distrain plan` ({e})") from None


def make_plan(
    config: RunConfig,
    worker_counts: list[int],
    out: Path,
    hardware: Hardware | None = None,
    calibration: Calibration | None = None,
    steps: int = 40,
    repeats: int = 3,
) -> PlanResult:
    from distrain.planning.layout_figures import planned_layouts

    layouts, why = planned_layouts(config)  # first: a layout the run would refuse is refused before anything
    out.mkdir(parents=True, exist_ok=True)
    if calibration is None:
        from distrain.planning.calibrate import calibrate

        calibration = calibrate(config, out, steps=steps, repeats=repeats, layout=layouts[0] if layouts else None)
    else:  # this machine's figures as measured then; the traffic of this plan's --compress and emulated link
        from dataclasses import replace

        from distrain.planning.calibrate import traffic_figures

        calibration = replace(calibration, **traffic_figures(config, calibration.num_params))
    available = memory.local_available() if not config.address else None
    here = planner.plan_table(calibration, worker_counts) + layout_table(calibration, worker_counts, layouts)
    whatif = []
    if hardware:
        whatif = planner.plan_table(calibration, worker_counts, hardware)
        whatif += layout_table(calibration, worker_counts, layouts, hardware)
    if layouts:
        recs = {n: recommend_among(calibration, n, layouts, why, hardware) for n in worker_counts}
    else:
        recs = {n: planner.recommend(calibration, n, hardware, None if hardware else available) for n in worker_counts}
    stragglers = {n: planner.straggler_costs(calibration, n) for n in worker_counts}
    result = PlanResult(out, calibration, here, whatif, hardware, recs, stragglers, layouts, why)
    write_plan(result, config)
    return result


def predictions_frame(result: PlanResult) -> pd.DataFrame:
    rows = [p.row() | {"machine": "here"} for p in result.here]
    if result.hardware:
        rows += [p.row() | {"machine": result.hardware.name} for p in result.whatif]
    return pd.DataFrame(rows)


def write_plan(result: PlanResult, config: RunConfig) -> None:
    frame = predictions_frame(result)
    frame.to_parquet(result.out / "predictions.parquet", index=False)
    record = {
        "config": config.to_dict(),
        "calibration": result.calibration.to_dict(),
        "hardware": asdict(result.hardware) if result.hardware else None,
        "recommendations": {
            str(n): {"strategy": r.strategy, "transport": r.transport, "settings": r.settings, "reason": r.reason}
            for n, r in result.recommendations.items()
        },
        "stragglers": {str(n): v for n, v in result.stragglers.items()},
        "layouts": [asdict(layout) for layout in result.layouts],
        "layout_reason": result.layout_reason,
    }
    atomic_write_text(result.out / PLAN_FILE, json.dumps(record, indent=2, default=str) + "\n")
    write_png(frame, result.out / "plan.png")


def write_png(frame: pd.DataFrame, path: Path) -> None:
    """Samples/s and bytes per worker per step against N, one line per strategy, transport and layout."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    machines = list(dict.fromkeys(frame["machine"]))
    fig = Figure(figsize=(11, 4 * len(machines)))
    FigureCanvasAgg(fig)
    for i, machine in enumerate(machines):
        rows = frame[frame["machine"] == machine]
        speed, traffic = fig.add_subplot(len(machines), 2, 2 * i + 1), fig.add_subplot(len(machines), 2, 2 * i + 2)
        for (strategy, transport, d, t), g in rows.groupby(
            ["strategy", "transport", "fsdp", "tensor_parallel"], sort=False
        ):
            cut = "".join(f" {flag}{n}" for flag, n in (("D", d), ("T", t)) if n > 1)
            label = f"{strategy} ({transport}{cut})"
            speed.plot(g["workers"], g["samples_per_s"], marker="o", label=label)
            traffic.plot(g["workers"], g["bytes_per_worker"], marker="o", label=label)
        for ax, what in ((speed, "predicted samples/s"), (traffic, "bytes per worker per step")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("workers")
            ax.set_ylabel(what)
            ax.set_title(f"{what} ({machine})")
            ax.grid(alpha=0.3)
        speed.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def predictions_of(run_dir: Path) -> dict[str, Any] | None:
    """The prediction a run carries (written by `--strategy auto`), or None."""
    file = run_dir / "prediction.json"
    return json.loads(file.read_text()) if file.is_file() else None
