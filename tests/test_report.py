"""`distrain report` on two real runs (BSP all-reduce, SSP on the parameter server), and on bad input."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from distrain.cli import app
from distrain.config import RunConfig
from distrain.orchestrator.report import COLUMNS, load_runs, plot_tau
from distrain.orchestrator.run import run_training

runner = CliRunner()
PLOTS = ("accuracy_vs_time.png", "loss_vs_time.png", "step_time_per_worker.png", "staleness_hist.png")


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, ray_cluster) -> list[Path]:
    root = tmp_path_factory.mktemp("runs")
    bsp = run_training(RunConfig(strategy="bsp", epochs=2, run_dir=str(root / "bsp-allreduce")))
    ssp = run_training(RunConfig(strategy="ssp", staleness=1, epochs=2, run_dir=str(root / "ssp-s1")))
    return [bsp.run_dir, ssp.run_dir]


@pytest.fixture(scope="module")
def report(two_runs, tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "out"
    result = runner.invoke(app, ["report", *map(str, two_runs), "--out", str(out)])
    return result, out


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (which must come first)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    length, chunk = struct.unpack(">I4s", data[8:16])
    assert chunk == b"IHDR" and length == 13, path
    return struct.unpack(">II", data[16:24])


def test_report_prints_one_table_row_per_run(report, two_runs):
    result, out = report
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    rows = [line for line in result.stdout.splitlines() if line.startswith("│")]
    assert len(rows) == 2
    assert "bsp-allreduce" in rows[0] and "ssp-s1" in rows[1]
    assert "ssp s=1 (ps)" in rows[1]
    for name in COLUMNS:
        assert name in result.stdout, name
    assert f"report in {out}/" in result.stdout


def test_report_md_has_the_same_table(report, two_runs):
    _, out = report
    text = (out / "report.md").read_text()
    lines = [line for line in text.splitlines() if line.startswith("|")]
    assert len(lines) == 2 + 2  # header, alignment, one row per run
    assert lines[0] == "| " + " | ".join(COLUMNS) + " |"
    bsp, ssp = (line.split(" | ") for line in lines[2:])
    assert bsp[0] == "| bsp-allreduce" and bsp[1] == "bsp" and bsp[2] == "2"
    assert ssp[0] == "| ssp-s1" and ssp[1] == "ssp s=1 (ps)"
    assert bsp[6] == "-" and ssp[6] != "-"  # staleness p95 only under the parameter server
    assert bsp[-1] == ssp[-1] == "0 |"  # no failures recorded
    for name in PLOTS:
        assert f"]({name})" in text


def test_plots_are_800x500_pngs_with_content(report):
    _, out = report
    assert sorted(p.name for p in out.iterdir()) == sorted(PLOTS + ("report.md",))
    for name in PLOTS:
        assert png_size(out / name) == (800, 500), name
        assert (out / name).stat().st_size > 5_000, name  # a flat image compresses to well under 5 KB
    assert not (out / "tau_over_time.png").exists()  # no run has a tau column


def test_tau_plot_appears_when_a_run_records_tau(two_runs):
    runs = load_runs(two_runs)
    assert plot_tau(runs) is None
    steps = runs[0].metrics["kind"] == "step"
    runs[0].metrics["tau"] = pd.Series(4.0, index=runs[0].metrics.index).where(steps)
    assert plot_tau(runs) is not None


def test_default_out_dir_is_new_and_in_the_cwd(two_runs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["report", *map(str, two_runs)])
    assert result.exit_code == 0, result.output
    (made,) = tmp_path.iterdir()
    assert made.name.startswith("report-") and (made / "report.md").is_file()
    assert f"report in {made.name}/" in result.stdout


def assert_one_line_error(result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "error:" in lines[0], result.output
    assert result.stdout == ""
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_bad_inputs_write_nothing(two_runs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    not_a_run = tmp_path / "notes"
    not_a_run.mkdir()
    (not_a_run / "metrics.parquet").write_bytes(b"not parquet")
    (tmp_path / "file.txt").write_text("x")
    for name, broken_file in (("bad-metrics", "metrics.parquet"), ("bad-summary", "summary.json")):
        shutil.copytree(two_runs[0], tmp_path / name)
        (tmp_path / name / broken_file).write_text("[1, 2")
    cases = [
        ([str(tmp_path / "missing")], ["not found", "missing"]),
        ([str(not_a_run)], ["not a distrain run directory", "notes", "summary.json"]),
        ([str(tmp_path / "file.txt")], ["is not a directory"]),
        ([str(two_runs[0]), str(not_a_run)], ["notes"]),  # a good run does not hide a bad one
        ([str(tmp_path / "bad-metrics")], ["metrics.parquet", "not a readable metrics file"]),
        ([str(tmp_path / "bad-summary")], ["summary.json", "not a readable run summary"]),
    ]
    before = sorted(p.name for p in tmp_path.iterdir())
    for args, fragments in cases:
        for extra in ([], ["--out", "out"]):
            result = runner.invoke(app, ["report", *args, *extra])
            assert_one_line_error(result, *fragments)
            assert sorted(p.name for p in tmp_path.iterdir()) == before, args


def test_non_empty_out_dir_is_refused(two_runs, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.md").write_text("precious")
    result = runner.invoke(app, ["report", *map(str, two_runs), "--out", str(out)])
    assert_one_line_error(result, "--out", "not empty")
    assert [p.name for p in out.iterdir()] == ["report.md"] and (out / "report.md").read_text() == "precious"
