"""`distrain --help` and friends: a panel per section, every default, whole names at 80 columns, -h,
--version."""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from distrain import cli
from distrain.cli import app
from distrain.config import RunConfig
from distrain.fields import SECTIONS

runner = CliRunner()


def help_text(*args: str) -> str:
    result = runner.invoke(app, [*args, "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
    assert result.exit_code == 0, result.output
    return result.output


def flat(text: str) -> str:
    """The help with its box drawing removed and whitespace collapsed, so wrapped phrases read whole."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


def option_names(command: str) -> list[str]:
    click_command = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    return [opt for p in click_command.params for opt in p.opts if opt.startswith("-")]


@pytest.mark.parametrize("command", ["run", "tune", "plan"])
def test_help_fits_80_columns_with_every_option_name_whole(command):
    text = help_text(command)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text  # rich's mark for a cut-off cell
    for name in option_names(command):
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), f"{name} missing or cut in {command} --help"


def test_run_help_has_a_panel_per_section_in_order():
    text = help_text("run")
    titles = re.findall(r"╭─ (\w+) ─", text)
    assert titles == ["Options", *SECTIONS]
    panel = {}  # option -> the panel it is listed in
    current = None
    for line in text.splitlines():
        if m := re.match(r"╭─ (\w+) ─", line):
            current = m.group(1)
        elif m := re.match(r"│ (--[\w-]+)", line):
            panel[m.group(1)] = current
    for f in all_fields():  # --task-arg, --optimizer-arg: one value per use
        assert panel[f.flag] == f.section, f.name
    assert panel["--resume"] == "checkpointing" and panel["--config"] == "Options"


def all_fields():
    return [RunConfig.field_info(name) for name in RunConfig.field_names()]


def test_every_config_field_has_a_section():
    for f in all_fields():
        assert f.section in SECTIONS, f"{f.name}: give it one of the sections {SECTIONS}"


def test_run_help_shows_every_default():
    text = flat(help_text("run"))
    defaults = RunConfig()
    for f in all_fields():
        if f.default is None:
            continue  # resolved per strategy: checked below
        shown = cli._shown_default(f.name)
        assert f"[default: {shown}]" in text, f.name
    for expected in ("[default: 2]", "[default: bsp]", "[default: 0.05]", "[default: off]", "[default: 20]"):
        assert expected in text
    assert str(defaults.workers) == "2" and defaults.lr == 0.05  # the shown values are the dataclass's
    # Fields resolved later state their effective default and where it applies.
    for phrase in (
        "default 1 (async, ssp, bsp --transport ps)",
        "default 2 (ssp)",
        "default 8 (local-sgd)",
        "default 10% (local-sgd --adaptive-tau)",
        "default 2 x --tau (local-sgd --adaptive-tau)",
        "default 2 x --workers (bsp --transport ps --backup-tasks)",
    ):
        assert phrase in text, phrase


def test_strategy_options_name_the_strategies_that_read_them():
    from distrain.config import option_fields
    from distrain.fields import fields_of
    from distrain.strategies import STRATEGIES

    for strategy in STRATEGIES.names():
        for info in fields_of(STRATEGIES.get(strategy).Options):
            assert strategy in option_fields()[info.name].help, (
                f"--{info.name} help should say it applies to {strategy}"
            )


def test_version_and_short_help(monkeypatch, capsys):
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"distrain {importlib.metadata.version('distrain')}"
    for args in ([], ["run"], ["tune"], ["report"], ["strategies"]):
        short = runner.invoke(app, [*args, "-h"], env={"COLUMNS": "80"})
        assert short.exit_code == 0, short.output
        assert short.output == runner.invoke(app, [*args, "--help"], env={"COLUMNS": "80"}).output
    monkeypatch.setattr(sys, "argv", ["distrain", "--version"])  # the console script's own path
    assert cli.main() == 0
    assert capsys.readouterr().out.startswith("distrain ")


def test_bool_flags_keep_their_no_form():
    """The help lists --no-... forms once, in a sentence, but they still parse."""
    assert "--no-staleness-lr" in help_text("run")
    cfg = RunConfig.resolve(None, {"strategy": "ssp", "staleness_lr": False})
    assert cfg.options_of("ssp").staleness_lr is False
    result = runner.invoke(app, ["run", "--no-backup-tasks", "--workers", "0"])
    assert "No such option" not in result.output and result.exit_code == 2


def test_run_help_for_a_task_lists_its_constructor_arguments():
    example = Path(__file__).resolve().parents[2] / "examples" / "diabetes_regression.py"
    args = ["run", "--task", f"{example}:Diabetes", "--help"]
    cli.prepare_commands(args)
    try:
        text = flat(runner.invoke(app, args, env={"COLUMNS": "200"}).output)
    finally:
        cli.prepare_commands([])
    assert "Diabetes takes: hidden (default 32), seed (default 0)" in text
    assert "Diabetes takes" not in flat(help_text("run"))


def test_model_and_dataset_help_list_the_catalog():
    """--help names every built-in model and data set (trainers/builtin_names.py), `--model linear` included."""
    from distrain.trainers.builtin_names import DATASET_READS_FILES, MODEL_NAMES

    text = flat(help_text("run"))
    model = re.search(r"--model <str> (.*?)\[default", text).group(1)
    dataset = re.search(r"--dataset <str> (.*?)\[default", text).group(1)
    assert all(name in model for name in MODEL_NAMES), model
    assert all(name in dataset for name in DATASET_READS_FILES), dataset
