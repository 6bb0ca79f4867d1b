"""One front door: `distrain run` and `distrain.fit` build the run's spec through the same API functions
(`api.prepare`, `api.prepare_resume`) and run it with the same one (`api.train`). No Ray: `train` is
stood in for, and the spec each door handed it compared."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import distrain
from distrain import api
from distrain.cli import app
from distrain.config import RunConfig

runner = CliRunner()


class Handed(Exception):
    """Raised by the stand-in for `api.train`, carrying what it was handed."""

    def __init__(self, prepared: api.PreparedRun) -> None:
        super().__init__("handed")
        self.prepared = prepared


@pytest.fixture
def handed(monkeypatch):
    def train(prepared, on_event=None, *, callbacks=None, keep_ray=False):
        raise Handed(prepared)

    monkeypatch.setattr(api, "train", train)


def through_the_cli(args: list[str]) -> api.PreparedRun:
    result = runner.invoke(app, ["run", *args])
    assert isinstance(result.exception, Handed), result.output
    return result.exception.prepared


def through_fit(**options) -> api.PreparedRun:
    with pytest.raises(Handed) as caught:
        distrain.fit(progress=False, **options)
    return caught.value.prepared


def test_the_cli_and_fit_hand_train_the_same_spec(handed, tmp_path):
    run_dir = str(tmp_path / "r")
    cli = through_the_cli(
        ["--model", "mlp", "--workers", "3", "--strategy", "local-sgd", "--tau", "4", "--epochs", "2",
         "--optimizer-arg", "nesterov=true", "--run-dir", run_dir]
    )  # fmt: skip
    options = dict(model="mlp", workers=3, strategy="local-sgd", tau=4, epochs=2, run_dir=run_dir)
    notebook = through_fit(optimizer_args={"nesterov": True}, **options)
    assert cli.config == notebook.config
    assert cli.config.options_of("local-sgd").tau == 4 and cli.config.section("resources").workers == 3
    assert (cli.auto, cli.resume) == (notebook.auto, notebook.resume) == (None, False)


def test_a_config_file_goes_through_the_same_door(handed, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(RunConfig(model="mlp", epochs=1, lr=0.02).to_yaml())
    cli = through_the_cli(["--config", str(config), "--seed", "5"])
    notebook = through_fit(config=config, seed=5)
    assert cli.config == notebook.config and cli.config.lr == 0.02 and cli.config.seed == 5


def test_a_repeated_config_gets_a_fresh_run_directory_from_either_door(handed, tmp_path):
    """A finished run's config.yaml names its directory; repeating it must not reuse that directory."""
    done = tmp_path / "done"
    done.mkdir()
    (done / "summary.json").write_text("{}")
    config = tmp_path / "c.yaml"
    config.write_text(RunConfig(model="mlp", epochs=1, run_dir=str(done)).to_yaml())
    said = []
    prepared = api.prepare(str(config), {}, say=said.append)
    assert prepared.config.run_dir == ""
    assert said == [f"{done} already holds a run; the repeat gets a new run directory"]
    result = runner.invoke(app, ["run", "--config", str(config)])
    assert isinstance(result.exception, Handed) and result.exception.prepared.config.run_dir == ""
    assert "already holds a run" in result.stdout
    assert through_fit(config=config).config.run_dir == ""


def test_resume_goes_through_prepare_resume(handed, monkeypatch, tmp_path):
    seen = []

    def prepare_resume(run_dir, overrides):
        seen.append((str(run_dir), {k: v for k, v in overrides.items() if v is not None}))
        return api.PreparedRun(RunConfig(model="mlp"), resume=True)

    monkeypatch.setattr(api, "prepare_resume", prepare_resume)
    cli = through_the_cli(["--resume", str(tmp_path), "--epochs", "5"])
    notebook = through_fit(resume=tmp_path, epochs=5)
    assert cli.resume and notebook.resume
    assert seen == [(str(tmp_path), {"epochs": 5})] * 2
