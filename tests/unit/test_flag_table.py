"""README.md's table of `distrain run` flags is generated from the command (flag_table.py): every flag
is in it, with the words of its --help, and the README's copy is exactly what the generator writes.
No Ray, no torch."""

from __future__ import annotations

from distrain import flag_table
from distrain.flag_table import BEGIN, END, readme_block, run_options


def test_the_readme_table_is_the_generated_one():
    block = readme_block(flag_table.README.read_text())
    assert block == flag_table.flag_table(), "README.md's flag table is stale: run `python -m distrain.flag_table`"


def test_every_run_flag_is_in_the_readme_table():
    block = readme_block(flag_table.README.read_text())
    lines = [line for line in block.splitlines() if line.startswith("| `")]
    rows = {line.split(" | ")[0].strip("| `").split(" ")[0]: line for line in lines}  # first flag -> its row
    options = run_options()
    assert len(options) > 60
    for option in options:
        assert option.opts[0] in rows, option.opts[0]
        for negation in option.secondary_opts:  # on/off flags: both forms named
            assert negation in rows[option.opts[0]], negation
    for flag in ("--task", "--task-arg", "--target", "--placement", "--pipeline-stages", "--microbatches",
                 "--pipeline-schedule", "--config", "--resume"):  # fmt: skip
        assert flag in rows, flag


def test_write_readme_replaces_only_the_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nbefore\n\n{BEGIN}\n| stale |\n{END}\n\nafter\n")
    assert flag_table.write_readme(readme)
    text = readme.read_text()
    assert text.startswith("# title\n\nbefore\n\n") and text.endswith("\n\nafter\n")
    assert readme_block(text) == flag_table.flag_table() and "| stale |" not in text
    assert not flag_table.write_readme(readme)  # up to date: untouched


def test_placeholders_become_code_so_markdown_keeps_them():
    assert flag_table._code_spans("events under DIR/<run id>/.") == "events under `DIR/<run id>/`."
    assert flag_table._code_spans("METRIC<=VALUE (e.g. test_loss<=0.5)") == "METRIC<=VALUE (e.g. test_loss<=0.5)"
