"""The model back from a real run: `FitResult.model()` scores the test set exactly as the run's final
evaluation did, for a user's task and for a pipeline (whose stages' weights come back as one model)."""

from __future__ import annotations

import pytest
import torch

import distrain
from distrain.config import RunConfig
from distrain.orchestrator.tasks import build_task
from tests.unit.test_tasks import REGRESSION

pytestmark = pytest.mark.usefixtures("ray_cluster")


def held_out(result: distrain.FitResult):
    config = RunConfig.from_mapping(RunConfig.load_yaml(result.run_dir / "config.yaml"))
    return build_task(config).datasets()[1]


def test_the_model_back_scores_the_test_set_as_the_final_evaluation_did(tmp_path):
    task_file = tmp_path / "regression.py"
    task_file.write_text(REGRESSION)
    result = distrain.fit(
        f"{task_file}:Regression", workers=2, epochs=2, batch_size=16, run_dir=str(tmp_path / "run"), progress=False
    )
    model = result.model()
    assert isinstance(model, torch.nn.Module) and not model.training
    x, y = held_out(result).tensors
    with torch.no_grad():
        mse = ((model(x).squeeze(-1) - y) ** 2).mean().item()
        mae = (model(x).squeeze(-1) - y).abs().mean().item()
    assert mse == pytest.approx(result.summary["final_test_loss"], rel=1e-5)
    assert mae == pytest.approx(result.summary["final_test_mae"], rel=1e-5)


def test_a_pipelines_stages_come_back_as_one_model(tmp_path):
    result = distrain.fit(
        model="mlp",
        pipeline_stages=2,
        microbatches=2,
        workers=2,
        epochs=1,
        run_dir=str(tmp_path / "pipe"),
        progress=False,
    )
    model = result.model()
    loader = torch.utils.data.DataLoader(held_out(result), batch_size=512)
    with torch.no_grad():
        correct = sum((model(x).argmax(-1) == y).sum().item() for x, y in loader)
    assert correct / len(loader.dataset) == pytest.approx(result.summary["final_test_accuracy"], abs=1e-9)
