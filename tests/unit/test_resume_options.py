"""--resume compares a checkpoint's recorded strategy options with the run's (issue 27: options are read
through their strategy's Options, not as config attributes): an edited option is refused, and the flat
files of older versions, which recorded every strategy's options, still resume."""

from __future__ import annotations

import pytest

from distrain.config import RunConfig
from distrain.errors import ConfigError
from distrain.orchestrator import resume


def _resume_with(monkeypatch, tmp_path, config: RunConfig, recorded: dict) -> None:
    checkpoint = tmp_path / "checkpoints" / "step-00000001.pt"
    monkeypatch.setattr(resume, "latest_checkpoint", lambda directory: checkpoint)
    payload = {"global_step": 1, "config": recorded}
    monkeypatch.setattr(resume, "load_checkpoint_for", lambda path, model, num_params: payload)
    assert resume.resume_checkpoint(config, 0) == (checkpoint, payload)


def test_an_edited_strategy_option_is_refused_naming_both_values(monkeypatch, tmp_path):
    config = RunConfig(strategy="local-sgd", tau=4, run_dir=str(tmp_path))
    _resume_with(monkeypatch, tmp_path, config, config.to_dict())  # unchanged: resumes
    with pytest.raises(ConfigError, match=r"--resume cannot change --tau \(the run's checkpoint has 8, .* now has 4\)"):
        _resume_with(monkeypatch, tmp_path, config, config.to_dict() | {"tau": 8})


def test_options_of_strategies_the_run_does_not_use_recorded_by_older_versions_are_left_alone(monkeypatch, tmp_path):
    config = RunConfig(strategy="bsp", run_dir=str(tmp_path))
    older = config.to_dict() | {"tau": 1, "staleness": None, "sync_every": 8, "adaptive_tau": False}
    _resume_with(monkeypatch, tmp_path, config, older)


def test_a_strategy_option_given_with_resume_is_compared_with_the_recorded_run(tmp_path):
    from distrain.orchestrator.checkpoint import LATEST

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / LATEST).write_text("{}")
    (run_dir / "config.yaml").write_text(RunConfig(strategy="local-sgd", tau=8, run_dir=str(run_dir)).to_yaml())
    with pytest.raises(ConfigError, match=r"--resume cannot change --tau \(the run has 8, got 4\)"):
        resume.resume_config(run_dir, {"tau": 4})
    with pytest.raises(ConfigError, match=r"--resume cannot change --staleness \(the run has None, got 3\)"):
        resume.resume_config(run_dir, {"staleness": 3})  # ssp's, unset in a local-sgd run
