"""`distrain examples`: every example file of the checkout is listed with what it says of itself and the
commands it gives (paths made absolute), `--copy DIR` copies exactly those files, and a DIR that is not new
or empty is one line and exit code 2. (tests/integration/test_wheel.py does the same from a wheel.) No Ray."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from distrain.cli import app
from distrain.commands import examples

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]


def test_every_example_file_is_shipped():
    found = {p.relative_to(ROOT) for p in (ROOT / "examples").rglob("*.py") if "__pycache__" not in p.parts}
    found |= {p.relative_to(ROOT) for p in (ROOT / "notebooks").glob("*.ipynb")}
    assert found and found <= set(examples.bundled(ROOT))
    assert {Path("cluster.yaml"), Path("cluster-local.yaml"), Path("notebooks/README.md")} <= set(examples.bundled())


def test_each_example_describes_itself(tmp_path):
    what, commands = examples.describe(ROOT / "examples" / "char_lm.py")
    assert what.startswith("A character-level transformer")
    assert commands == ["distrain run --task examples/char_lm.py:CharLM --optimizer adam --lr 0.003 --epochs 4"]
    assert examples.describe(ROOT / "notebooks" / "explore_strategies.ipynb")[0].startswith("Exploring distrain")
    config = tmp_path / "c.yaml"
    config.write_text("# first line\n# goes on here.\n#\n# not this\nkey: 1\n")
    assert examples.describe(config) == ("first line goes on here.", [])


def test_the_list_names_every_file_and_its_commands_with_their_own_path():
    result = runner.invoke(app, ["examples"])
    assert result.exit_code == 0, result.output
    for rel in examples.bundled():
        assert f"  {rel}" in result.output, rel
    easgd = ROOT / "examples" / "strategies" / "easgd.py"
    assert f"distrain run --strategy {easgd}:EASGD --elasticity 0.2" in result.output


def test_copy_makes_the_same_files_and_refuses_a_folder_in_use(tmp_path):
    dest = tmp_path / "mine"
    result = runner.invoke(app, ["examples", "--copy", str(dest)])
    assert result.exit_code == 0, result.output
    assert examples.bundled(dest) == examples.bundled()
    for rel in examples.bundled():
        assert (dest / rel).read_bytes() == (ROOT / rel).read_bytes(), rel
    again = runner.invoke(app, ["examples", "--copy", str(dest)])
    assert again.exit_code == 2 and "must be a new or empty directory" in again.output
    assert len(again.output.strip().splitlines()) == 1, again.output
