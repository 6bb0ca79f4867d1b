"""`run`, `plan` and `tune` share one definition of the run options: their flags are generated from the
config's field declarations (commands/options.py), each command naming only its own options and which
run options it takes."""

from __future__ import annotations

import typer.main

from distrain.cli import app
from distrain.commands import plan, tune
from distrain.commands.options import run_options, shown_default
from distrain.config import COMMON_FIELDS, RunConfig
from distrain.fields import SECTIONS


def options_of(command: str) -> dict[str, object]:
    """The command's click options by their first flag (`--tau`)."""
    click_command = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    return {p.opts[0]: p for p in click_command.params if p.param_type_name == "option"}


def test_run_takes_every_field_of_the_config_with_its_help_panel_and_default():
    flags = options_of("run")
    for name in RunConfig.field_names():
        info = RunConfig.field_info(name)
        option = flags[info.flag]
        assert option.rich_help_panel == info.section
        assert option.help.startswith(info.help)
        shown = shown_default(info)
        assert (f"[default: {shown}]" in option.help) if shown else "[default:" not in option.help
    assert set(flags) - {RunConfig.field_info(n).flag for n in RunConfig.field_names()} == {"--config", "--resume"}


def test_plan_takes_the_run_options_of_every_section_but_the_strategys_and_the_traffic_ones():
    flags = options_of("plan")
    for name in RunConfig.field_names():
        info = RunConfig.field_info(name)
        wanted = (info.section != "strategy" or name in plan.PLAN_TRAFFIC_FLAGS) and name not in plan.PLAN_FLAGS
        if wanted:
            assert flags[info.flag].help.startswith(info.help), name
        elif name not in plan.PLAN_FLAGS:  # --workers, --config: plan's own flags of the same name
            assert info.flag not in flags, name
    assert flags["--workers"].rich_help_panel == "plan"  # plan's own: counts to compare


def test_tune_takes_the_shared_run_options_in_its_order_and_its_sweep_flags():
    flags = options_of("tune")
    for name in tune.SHARED_RUN_OPTIONS:
        info = COMMON_FIELDS[name]
        assert flags[info.flag].help.startswith(info.help), name
    assert flags["--lr"].rich_help_panel == "sweep" and not flags["--lr"].help.startswith(COMMON_FIELDS["lr"].help)
    names = [p.name for p in run_options(only=("seed", "epochs", "task_args"))]
    assert names == ["seed", "epochs", "task_arg"]  # in the order given; --task-arg's parameter


def test_a_section_chooses_the_options_and_without_drops_them():
    resources = {p.name for p in run_options(sections=("resources",))}
    # A parameter is named after its flag (--worker-group: worker_group, handed on as worker_groups).
    named = {i.flag.removeprefix("--").replace("-", "_") for i in COMMON_FIELDS.values() if i.section == "resources"}
    assert resources == named
    assert "workers" not in {p.name for p in run_options(sections=SECTIONS, without={"workers"})}
    assert {p.name for p in run_options(sections=(), also=("compress",))} == {"compress"}


def test_every_run_option_is_optional_so_a_config_file_or_the_default_applies():
    assert all(p.default is None for p in run_options())
