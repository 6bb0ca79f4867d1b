"""`distrain plan` and `distrain run --strategy auto`: bad input, the plan's files from a saved calibration,
the record of an automatic choice; and one real plan on digits with a tiny calibration (integration)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from distrain.cli import app
from distrain.config import RunConfig
from distrain.planning import auto_strategy, planner
from tests.unit.test_cli_errors import no_ray  # noqa: F401 - the fixture: fail if Ray would start
from tests.unit.test_plan_cli import runner


@pytest.mark.integration
def test_plan_end_to_end_on_digits_with_a_tiny_calibration(tmp_path, ray_cluster):
    out = tmp_path / "plan"
    result = runner.invoke(
        app,
        [
            "plan",
            "--model",
            "mlp",
            "--workers",
            "1,2",
            "--calibration-steps",
            "8",
            "--calibration-repeats",
            "1",
            "--fsdp",  # and BSP / DiLoCo across 2-way sharded replicas: a fifth tiny run measures them
            "2",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    cal = planner.Calibration.from_dict(json.loads((out / "plan.json").read_text())["calibration"])
    assert cal.num_params == 64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10  # mlp on digits
    assert cal.compute_s > 0 and cal.effective_cores > 0 and cal.allreduce_bandwidth > 0 and cal.ps_call_s > 0
    assert cal.flops_per_sample and cal.flops_per_sample > 2 * 3 * cal.num_params * 0.9  # fwd + bwd ~ 6 flops/param
    for name in ("bsp-1-r0", "local-2-r0", "bsp-2-r0", "async-1-r0", "cut-1-r0"):  # ordinary runs, kept
        assert (out / "calibration" / name / "metrics.parquet").is_file()
    assert RunConfig.load_yaml(out / "calibration" / "cut-1-r0" / "config.yaml")["fsdp"] == 2
    assert cal.layout_scale is not None and cal.layout_scale >= 0 and cal.measured["cut_1"]["fsdp"] == 2
    frame = pd.read_parquet(out / "predictions.parquet")
    assert set(frame[frame.fsdp == 2]["strategy"]) == {"bsp", "diloco"} and "2 replicas x 2 shards" in result.output
    assert "recommended at N=2" in result.output


@pytest.mark.integration
def test_fit_strategy_auto_calibrates_chooses_and_records_like_the_cli(tmp_path, ray_cluster):
    """distrain.fit(strategy="auto") goes through auto_strategy.make_concrete, as `distrain run` does: a
    real (short) calibration, a concrete strategy run, and the choice recorded in all three places."""
    import distrain
    from distrain.reporting.prediction import prediction_rows
    from distrain.reporting.report import Run

    result = distrain.fit(strategy="auto", model="mlp", workers=2, max_steps=16, eval_every=0,
                          checkpoint_every=0, run_dir=str(tmp_path / "run"), progress=False)  # fmt: skip
    summary, run_dir = result.summary, result.run_dir
    chosen = summary["strategy_auto"]
    assert chosen["requested"] == "auto" and chosen["reason"] and chosen["predicted_step_s"] > 0
    assert chosen["strategy"] in {s for s, _ in planner.CANDIDATES} and summary["strategy"] == chosen["strategy"]
    header = (run_dir / "config.yaml").read_text().splitlines()[:2]
    assert header[0].startswith(f"# --strategy auto chose {chosen['strategy']} ({chosen['transport']})")
    assert header[1] == f"# because {chosen['reason']}"
    recorded = RunConfig.load_yaml(run_dir / "config.yaml")
    assert recorded["strategy"] == chosen["strategy"] != "auto"  # --config repeats the concrete choice
    assert auto_strategy.recorded_strategy(run_dir) == chosen["strategy"]
    choice = auto_strategy.recorded_choice(run_dir)
    assert choice["workers"] == 2 and choice["calibration"]["num_params"] == 85_002  # mlp on digits
    metrics = pd.read_parquet(run_dir / "metrics.parquet")
    [row] = prediction_rows([Run(run_dir, "auto", {}, summary, metrics)])  # `distrain report` reads it back
    assert row[1] == chosen["strategy"] and row[2] == f"{choice['predicted']['step_s'] * 1e3:.2f}"


