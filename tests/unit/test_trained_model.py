"""The model back (orchestrator/trained_model.py), without Ray: a checkpoint written as a run writes it,
loaded into the task's model; which checkpoint a run directory gives; one-line errors."""

from __future__ import annotations

import pytest
import torch

import distrain
from distrain.config import RunConfig
from distrain.orchestrator.checkpoint import save_checkpoint
from distrain.orchestrator.tasks import build_task
from distrain.orchestrator.trained_model import checkpoint_of
from distrain.trainers.models import seeded


def write_checkpoint(run_dir, name: str, shift: float) -> dict[str, torch.Tensor]:
    """A checkpoint of the mlp on digits whose weights are the run-seed's initial ones plus `shift`."""
    config = RunConfig.from_mapping({"model": "mlp", "seed": 3, "run_dir": str(run_dir)})
    model = seeded(build_task(config).build_model, config.seed)
    weights = {k: v + shift for k, v in model.state_dict().items()}
    save_checkpoint(
        run_dir / "checkpoints",
        name,
        {"model": weights, "optimizer": {}},
        config=config.to_dict(),
        epoch=1,
        global_step=8,
    )
    return weights


def assert_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert state.keys() == weights.keys()
    for key, value in weights.items():
        assert torch.equal(state[key], value), key


def test_a_run_directory_gives_its_final_checkpoint_and_else_its_latest(tmp_path):
    step = write_checkpoint(tmp_path, "step-00000008.pt", 0.5)
    model = distrain.load_model(tmp_path)  # no final.pt (a stopped or failed run): the latest
    assert_weights(model, step)
    assert not model.training and all(p.device.type == "cpu" for p in model.parameters())
    final = write_checkpoint(tmp_path, "final.pt", 1.0)
    write_checkpoint(tmp_path, "step-00000016.pt", 2.0)  # latest.json now names this one; final.pt still wins
    assert_weights(distrain.load_model(tmp_path), final)
    assert_weights(distrain.load_model(tmp_path / "checkpoints" / "step-00000008.pt"), step)  # a file: that one


def test_a_path_without_a_checkpoint_is_one_line(tmp_path):
    with pytest.raises(distrain.ConfigError, match="holds no checkpoint"):
        checkpoint_of(tmp_path)
    with pytest.raises(distrain.ConfigError, match="neither a run directory nor a checkpoint file"):
        checkpoint_of(tmp_path / "missing")
