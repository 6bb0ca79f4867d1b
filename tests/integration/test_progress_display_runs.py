"""The progress display: the summary's steady-state samples/s (one definition, computed from rows as
they arrive), and one line per epoch when the output is not a terminal (also with --eval-every 0)."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from distrain import cli
from distrain.cli import app
from tests.unit.test_progress_display import runner

# ---------------------------------------------------------------- the display when not on a terminal


@pytest.fixture
def piped(monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr(cli, "out", Console(file=buf, force_terminal=False, width=200))
    return buf








def test_piped_run_prints_epoch_lines_with_the_summarys_samples_per_s(ray_cluster, tmp_path):
    """A real tiny run through the CLI (not a terminal here), --eval-every 0: a line per epoch, and the
    last line's samples/s is the summary's figure."""
    import json

    run_dir = tmp_path / "run"
    args = ["run", "--model", "mlp", "--epochs", "3", "--eval-every", "0", "--segment-steps", "5"]
    result = runner.invoke(app, [*args, "--run-dir", str(run_dir)])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("epoch ")]
    assert [line.split("  ")[0] for line in lines] == ["epoch 1/3", "epoch 2/3", "epoch 3/3"]
    pattern = (
        r"epoch \d/3  step \d+/\d+  loss [\d.]+(  val acc [\d.]+(  test acc [\d.]+)?)?"
        r"  ([\d,]+) samples/s  elapsed \d:\d\d:\d\d"
        r"(  eta \d:\d\d:\d\d)?"
    )
    matches = [re.fullmatch(pattern, line) for line in lines]
    assert all(matches), lines
    assert [m.group(1) is not None for m in matches] == [False, False, True]  # only the last epoch is evaluated
    summary = json.loads((run_dir / "summary.json").read_text())
    shown = float(matches[-1].group(3).replace(",", ""))
    assert shown == pytest.approx(summary["steady_state_samples_per_s"], abs=1)


























