"""Validation and test apart, end to end on Ray (docs/validation.md): `distrain run` of the built-in task
with --checkpoint-best, read back by `distrain report` and `distrain.load_model`; `distrain.fit` of a
task that brings its own validation split, whose figures the model back reproduces on each split."""

from __future__ import annotations

import json
import textwrap

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

import distrain
from distrain.cli import app

pytestmark = pytest.mark.usefixtures("ray_cluster")

THREE_SPLITS = textwrap.dedent(
    """
    import torch
    from torch.utils.data import TensorDataset

    import distrain


    class ThreeSplits(distrain.Task):
        default_target = "val_loss<=0.05"

        def build_model(self):
            return torch.nn.Linear(4, 1)

        def datasets(self):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(160, 4, generator=g)
            y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.05 * torch.randn(160, generator=g)
            y[96:128] += 1.0  # the validation split is its own: shifted, so no other split scores like it
            parts = [TensorDataset(x[a:b], y[a:b]) for a, b in ((0, 96), (96, 128), (128, 160))]
            return tuple(parts)

        def loss(self, model, batch):
            x, y = batch
            return ((model(x).squeeze(-1) - y) ** 2).mean()
    """
)


def test_cli_run_validates_each_epoch_tests_at_the_end_keeps_the_best_and_reports_both(tmp_path):
    run_dir = tmp_path / "run"
    runner = CliRunner()
    result = runner.invoke(app, [
        "run", "--model", "mlp", "--epochs", "2", "--workers", "2", "--segment-steps", "10",
        "--checkpoint-best", "val_loss", "--run-dir", str(run_dir),
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "val acc" in result.output and "test acc" in result.output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["target"] == "val_accuracy>=0.95"
    evals = pd.read_parquet(run_dir / "metrics.parquet").query("kind == 'eval'").sort_values("epoch")
    assert evals["val_accuracy"].notna().all() and evals["test_accuracy"].notna().tolist() == [False, True]
    assert summary["final_val_accuracy"] == pytest.approx(evals["val_accuracy"].iloc[-1])
    assert summary["final_test_accuracy"] == pytest.approx(evals["test_accuracy"].iloc[-1])
    assert summary["final_val_accuracy"] != summary["final_test_accuracy"]  # two sets, not one reported twice

    # the best evaluation's checkpoint, and its model back, scoring the validation split as that evaluation did
    best = summary["best_checkpoint"]
    assert best["metric"] == "val_loss" and best["value"] == pytest.approx(evals["val_loss"].min())
    from distrain.config import RunConfig
    from distrain.orchestrator.tasks import build_task
    from distrain.trainers.splits import task_splits

    model = distrain.load_model(run_dir / best["path"])
    assert not model.training
    val = task_splits(build_task(RunConfig()), RunConfig().val_fraction).val
    x, y = val.get_batch(range(len(val)))
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(model(x), y).item()
    assert loss == pytest.approx(best["value"], rel=1e-5)

    report = runner.invoke(app, ["report", str(run_dir), "--out", str(tmp_path / "report")])
    assert report.exit_code == 0, report.output
    text = (tmp_path / "report" / "report.md").read_text()
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("| run |"))
    header, row = lines[at], lines[at + 2]  # the header, its rule, the run's row
    cells = dict(zip([c.strip() for c in header.split("|")], [c.strip() for c in row.split("|")], strict=True))
    assert cells["val accuracy"] == f"{summary['final_val_accuracy']:.4f}"
    assert cells["test accuracy"] == f"{summary['final_test_accuracy']:.4f}"


def test_fit_uses_a_task_s_own_validation_split_as_is(tmp_path):
    path = tmp_path / "three.py"
    path.write_text(THREE_SPLITS)
    result = distrain.fit(
        f"{path}:ThreeSplits", workers=2, epochs=2, batch_size=16, lr=0.1, checkpoint_best="min:val_loss",
        run_dir=str(tmp_path / "run"), progress=False,
    )  # fmt: skip
    assert result.status == "completed" and set(result.metrics) == {"val_loss", "test_loss"}
    module = {}
    exec(compile(THREE_SPLITS, str(path), "exec"), module)  # the task's data, as the workers built it
    _, val, test = module["ThreeSplits"]().datasets()
    model = result.model()  # the final weights: the last evaluation's
    with torch.no_grad():
        for name, split in (("val_loss", val), ("test_loss", test)):
            x, y = split.tensors
            assert ((model(x).squeeze(-1) - y) ** 2).mean().item() == pytest.approx(result.metrics[name], rel=1e-5)
    assert result.best_checkpoint is not None and result.best_checkpoint.name == "best.pt"
