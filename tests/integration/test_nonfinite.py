"""--on-nonfinite (issue 13): a run whose loss or gradient goes NaN/inf stops (status "diverged", CLI exit
code 3, no NaN checkpoint) or skips those updates (counted), on every strategy; never "completed" on NaN.

`--lr 1e30` on mlp/digits overflows within two steps on every strategy.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from distrain.cli import app
from distrain.config import RunConfig
from distrain.errors import ConfigError
from distrain.orchestrator.checkpoint import load_checkpoint, whole_checkpoint
from distrain.orchestrator.run import run_training

pytestmark = pytest.mark.usefixtures("ray_cluster")

TINY = dict(model="mlp", epochs=1, max_steps=12, workers=2, batch_size=16, segment_steps=4, seed=1)
STRATEGIES = {
    "bsp": dict(strategy="bsp"),
    "bsp-ps": dict(strategy="bsp", transport="ps", ps_shards=2),
    "ssp": dict(strategy="ssp", staleness=1),
    "async": dict(strategy="async"),
    "local-sgd": dict(strategy="local-sgd", tau=2),
    "backup-tasks": dict(strategy="bsp", transport="ps", backup_tasks=True),
    "fsdp": dict(strategy="bsp", fsdp=2),  # 2 replicas x 2 shards: each worker checks its own shard
}


def assert_no_nonfinite_checkpoint(run_dir) -> None:
    for path in (run_dir / "checkpoints").glob("*.pt") if (run_dir / "checkpoints").is_dir() else []:
        model = whole_checkpoint(load_checkpoint(path), path)["model"]  # a sharded run's: read whole
        assert all(torch.isfinite(v).all() for v in model.values() if v.is_floating_point()), path


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_diverging_run_stops_as_diverged_and_writes_no_nan_checkpoint(tmp_path, name):
    run_dir = tmp_path / "run"
    config = RunConfig(lr=1e30, run_dir=str(run_dir), checkpoint_steps=1, **TINY, **STRATEGIES[name])
    result = run_training(config)
    summary = result.summary
    assert summary["status"] == "diverged", summary
    assert summary["diverged"]["reason"] == "nonfinite"
    assert summary["diverged"]["step"] < TINY["max_steps"] and summary["diverged"]["what"]
    assert summary["nonfinite_steps"] >= 1
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "diverged"
    assert not (run_dir / "checkpoints" / "final.pt").exists()
    assert_no_nonfinite_checkpoint(run_dir)
    rows = pd.read_parquet(run_dir / "metrics.parquet")
    assert rows["nonfinite"].eq(True).any()


def test_skip_mode_skips_and_counts_the_steps_and_a_run_that_skips_most_ends_diverged(tmp_path):
    """BSP over the PS: a skipped worker still takes part in its round; the round applies the mean of
    the finite gradients (none: no update). With every step non-finite after the blow-up, the run
    skips them all, goes to its end, and ends diverged (issue 26: it was "completed"): more than 10% of
    its steps skipped, or parameters no longer finite; its final parameters are never written."""
    run_dir = tmp_path / "run"
    config = RunConfig(lr=1e30, run_dir=str(run_dir), on_nonfinite="skip", transport="ps", **TINY)
    summary = run_training(config).summary
    assert summary["nonfinite_steps"] >= 1 and summary["status"] == "diverged"
    if summary["diverged"]["reason"] == "skipped_share":  # the parameters stayed finite
        assert summary["diverged"]["skipped"] == summary["nonfinite_steps"] > 0.1 * summary["diverged"]["updates"]
    else:
        assert summary["diverged"]["what"] == "parameters"
    assert not (run_dir / "checkpoints" / "final.pt").exists()
    assert_no_nonfinite_checkpoint(run_dir)


@pytest.mark.parametrize(("layout", "workers"), [({}, 2), ({"fsdp": 2}, 4)])
def test_skip_mode_under_bsp_keeps_the_replicas_equal_and_finite(tmp_path, layout, workers):
    """lr 1e30 with plain SGD: the first update makes θ huge but finite, every later gradient is NaN and
    skipped by both replicas together (decided on the all-reduced gradient): the run completes. Sharded
    (2 replicas x 2 shards): all four workers decide alike, on the sum over their shards."""
    run_dir = tmp_path / "run"
    config = RunConfig(lr=1e30, momentum=0.0, run_dir=str(run_dir), on_nonfinite="skip", **TINY, **layout)
    summary = run_training(config).summary
    rows = pd.read_parquet(run_dir / "metrics.parquet")
    steps = rows[rows["kind"] == "step"]
    skipped = steps[steps["nonfinite"].eq(True)]
    assert summary["nonfinite_steps"] == skipped["step"].nunique() >= 1
    # both workers decided the same for every step
    assert (skipped.groupby("step")["worker"].nunique() == workers).all()
    assert summary["status"] in ("completed", "diverged")
    assert_no_nonfinite_checkpoint(run_dir)


def test_the_cli_prints_one_line_and_exits_3(tmp_path):
    run_dir = tmp_path / "run"
    args = ["run", "--model", "mlp", "--epochs", "1", "--max-steps", "8", "--lr", "1e30", "--run-dir", str(run_dir)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 3, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "training diverged at step" in errors[0] and "--on-nonfinite skip" in errors[0]
    assert "diverged" in result.stdout  # the summary's status row
    assert not (run_dir / "checkpoints" / "final.pt").exists()


def test_on_nonfinite_takes_stop_or_skip():
    assert RunConfig().on_nonfinite == "stop"
    with pytest.raises(ConfigError, match="unknown --on-nonfinite 'ignore'; choose one of: stop, skip"):
        RunConfig(on_nonfinite="ignore")
