"""The documentation's CLI reference (docs/reference/cli.md) is generated from the commands (flag_table.py):
every command and every flag is in it, with the words of its --help, and the committed page is exactly
what the generator writes. No Ray, no torch."""

from __future__ import annotations

import re

from distrain import flag_table
from distrain.flag_table import commands, options, run_options


def first_flag(row: str) -> str:
    """A table row's first flag: `--seed`, or <code>--workers N&#124;MIN..MAX</code> (a pipe in it)."""
    cell = row.split(" | ")[0].removeprefix("| ").removeprefix("<code>").strip("`")
    return cell.split(" ")[0]


def page_rows() -> dict[str, dict[str, str]]:
    """The committed page's table rows, per command section: first flag -> its row."""
    sections = re.split(r"^## `distrain (\S+)`$", flag_table.PAGE.read_text(), flags=re.M)
    rows: dict[str, dict[str, str]] = {}
    for name, body in zip(sections[1::2], sections[2::2], strict=True):
        lines = [line for line in body.splitlines() if line.startswith(("| `", "| <code>"))]
        rows[name] = {first_flag(line): line for line in lines}
    return rows


def test_the_committed_page_is_the_generated_one():
    assert flag_table.PAGE.read_text() == flag_table.page(), "docs/reference/cli.md is stale: run `make docs`"


def test_every_command_and_every_flag_is_on_the_page():
    rows = page_rows()
    assert list(rows) == list(commands()) and {"run", "tune", "plan", "report", "strategies"} <= set(rows)
    assert len(run_options()) > 60
    for name, command in commands().items():
        for option in options(command):
            assert option.opts[0] in rows[name], (name, option.opts[0])
            for negation in option.secondary_opts:  # on/off flags: both forms named
                assert negation in rows[name][option.opts[0]], (name, negation)
    for flag in ("--task", "--task-arg", "--target", "--placement", "--pipeline-stages", "--microbatches",
                 "--pipeline-schedule", "--config", "--resume"):  # fmt: skip
        assert flag in rows["run"], flag
    for name, flag in (("tune", "--batch-sizes"), ("tune", "--scheduler"), ("plan", "--preset"), ("report", "--out")):
        assert flag in rows[name], (name, flag)
    assert "| `RUN_DIRS...` |" in flag_table.PAGE.read_text()  # report's argument
    assert "<code>--workers N&#124;MIN..MAX</code>" in rows["run"]["--workers"]  # a pipe the table keeps


def test_write_page_writes_the_generated_page_and_leaves_an_up_to_date_one(tmp_path):
    page = tmp_path / "reference" / "cli.md"
    assert flag_table.write_page(page)
    assert page.read_text() == flag_table.page()
    assert not flag_table.write_page(page)  # up to date: untouched
    page.write_text(page.read_text().replace("| `--seed` |", "| `--sead` |"))
    assert flag_table.write_page(page) and "--sead" not in page.read_text()


def test_placeholders_become_code_so_markdown_keeps_them():
    assert flag_table._code_spans("events under DIR/<run id>/.") == "events under `DIR/<run id>/`."
    assert flag_table._code_spans("METRIC<=VALUE (e.g. test_loss<=0.5)") == "METRIC<=VALUE (e.g. test_loss<=0.5)"
