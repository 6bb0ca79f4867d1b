"""A strategy written outside distrain (examples/strategies/easgd.py, copied to a temporary directory):
`--strategy path.py:EASGD` trains with its own flags, its own metric columns and summary figures, and
its own checkpointed state, which `--resume` restores; no distrain file knows about it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from distrain import cli
from distrain.config import RunConfig
from distrain.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "strategies" / "easgd.py"
runner = CliRunner()


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    path = tmp_path_factory.mktemp("mine") / "easgd.py"
    shutil.copy(EXAMPLE, path)
    return f"{path}:EASGD"


def invoke(args: list[str]):
    cli.prepare_commands(args)  # what `distrain` itself does before parsing
    try:
        return runner.invoke(cli.app, args, env={"COLUMNS": "200"})
    finally:
        cli.prepare_commands([])


def test_the_plugin_s_options_are_flags_in_help_and_checked(plugin):
    result = invoke(["run", "--strategy", plugin, "--help"])
    assert result.exit_code == 0, result.output
    assert "--elasticity" in result.output and "--easgd-period" in result.output
    assert "--elasticity" not in invoke(["run", "--help"]).output  # only when that strategy is named
    bad = invoke(["run", "--strategy", plugin, "--elasticity", "0.6", "--workers", "2"])
    assert bad.exit_code == 2 and "--elasticity x --workers must be in (0, 1)" in bad.output
    wrong = invoke(["run", "--strategy", "bsp", "--elasticity", "0.1"])
    assert wrong.exit_code == 2 and "No such option: --elasticity" in wrong.output


def test_the_plugin_s_options_nest_in_config_yaml_and_load_back(plugin, tmp_path):
    cfg = RunConfig(strategy=plugin, elasticity=0.2, easgd_period=3)
    assert cfg.options_of("easgd").elasticity == 0.2
    with pytest.raises(AttributeError, match=r"options_of\('easgd'\)\.elasticity"):
        cfg.elasticity  # noqa: B018 - a plugin's option is its own too
    assert cfg.strategy_name == "easgd"  # what names a default run directory (runs/<time>-easgd), not the path
    path = tmp_path / "config.yaml"
    path.write_text(cfg.to_yaml())
    assert RunConfig.resolve(str(path), {}) == cfg
    with pytest.raises(ConfigError, match=r"--elasticity is not used by --strategy bsp; .*applies to: easgd"):
        RunConfig(strategy="bsp", elasticity=0.2)
    not_a_strategy = tmp_path / "nope.py"
    not_a_strategy.write_text("class EASGD:\n    pass\n")
    with pytest.raises(ConfigError, match="not a subclass of distrain.strategies.Strategy"):
        RunConfig(strategy=f"{not_a_strategy}:EASGD")




def test_tune_sweeps_a_plugin_s_option_for_the_trials_that_run_it(plugin, tmp_path, monkeypatch):
    from distrain.tuning.sweep_spec import VARIANTS, Choice, SweepSpec, parse_param, plugin_strategies

    monkeypatch.chdir(Path(plugin.rpartition(":")[0]).parent)
    strategies = plugin_strategies(Choice(("easgd.py:EASGD", "bsp")))  # relative: made absolute for the trials
    assert strategies.values == (plugin, "bsp")
    spec = SweepSpec(
        base=RunConfig(model="mlp", epochs=1).to_dict(),
        dimensions={"strategy": strategies, "elasticity": parse_param("elasticity=0.1,0.2")[1]},
    )
    spec.validate()  # builds (and so checks) every trial's config
    variants = spec.axes()[VARIANTS].values
    assert {"strategy": plugin, "elasticity": 0.2} in variants and {"strategy": "bsp"} in variants
