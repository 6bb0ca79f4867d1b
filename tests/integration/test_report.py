"""`distrain report` on real runs (BSP all-reduce, SSP on the parameter server, asynchronous with a
worker killed, a BSP -> AdaComm schedule), and on bad input."""

from __future__ import annotations

import errno
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from distrain.cli import app
from distrain.config import RunConfig
from distrain.orchestrator.run import run_training
from distrain.reporting import report as report_module
from distrain.reporting.plots import (
    plot_accuracy,
    plot_bytes,
    plot_loss,
    plot_loss_vs_bytes,
    plot_loss_vs_passes,
    plot_tau,
    plot_throughput,
    plot_time_split,
)
from distrain.reporting.report import COLUMNS, load_runs, plot_runs
from distrain.units import size_text
from tests.unit.test_report_checks import runner

PLOTS = (
    "accuracy_vs_time.png", "accuracy_vs_progress.png", "loss_vs_time.png", "loss_vs_bytes.png",
    "bytes_vs_time.png", "throughput_vs_time.png", "time_split.png", "step_time_per_worker.png",
    "staleness_hist.png",
)  # fmt: skip
TIME_PLOTS = (plot_accuracy, plot_loss, plot_throughput, plot_tau, plot_bytes)


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


def results_table(text: str) -> list[str]:
    """The lines of report.md's results table (the first table; a settings table may follow)."""
    start = text.index("| run | strategy | workers |")
    return text[start:].split("\n\n")[0].splitlines()


def test_report_md_has_the_same_table(report, two_runs):
    _, out = report
    text = (out / "report.md").read_text()
    lines = results_table(text)
    assert len(lines) == 2 + 2  # header, alignment, one row per run
    assert lines[0] == "| " + " | ".join(COLUMNS) + " |"
    bsp, ssp = (line.split(" | ") for line in lines[2:])
    assert bsp[0] == "| bsp-allreduce" and bsp[1] == "bsp" and bsp[2] == "2"
    assert ssp[0] == "| ssp-s1" and ssp[1] == "ssp s=1 (ps) staleness-lr"
    first = json.loads((two_runs[0] / "summary.json").read_text())
    # validation and test apart: the last evaluation's accuracy on each
    assert (bsp[3], bsp[4]) == (f"{first['final_val_accuracy']:.4f}", f"{first['final_test_accuracy']:.4f}")
    assert bsp[7] == "-" and ssp[7] != "-"  # staleness p95 only under the parameter server
    sent = first["bytes_per_step"]
    assert bsp[8] == size_text(sent) and bsp[8].endswith(" MB")  # in units, as the run's summary (was 1,210,448)
    peak = first["peak_memory_bytes"]
    assert bsp[9] == size_text(peak) and bsp[9].endswith((" MB", " GB"))  # the largest worker's peak memory
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


def test_traffic_plots_end_at_each_run_s_bytes_per_worker(two_runs):
    """loss_vs_bytes and bytes_vs_time: a run's line ends at the bytes its workers sent, summed from
    metrics.parquet and divided by the workers; the x axis of the first, the y axis of the second."""
    runs = plot_runs(load_runs(two_runs))
    for plot, axis in ((plot_loss_vs_bytes, 0), (plot_bytes, 1)):
        fig = plot(runs)
        (ax,) = fig.axes
        lines = {line.get_color(): line for line in ax.get_lines() if len(line.get_xdata()) > 2}
        for run in runs:
            steps = run.metrics[run.metrics["kind"] == "step"]
            sent_mb = steps["bytes_sent"].sum() / steps["worker"].nunique() / 1e6
            data = np.asarray(lines[run.color].get_data()[axis], dtype=float)
            assert data[-1] == pytest.approx(sent_mb) and sent_mb > 0, plot.__name__
            assert (np.diff(data) >= 0).all()  # traffic only grows (on either axis)
        assert len(lines) == 2


def test_tau_plot_appears_only_when_some_run_changed_tau(two_runs):
    runs = load_runs(two_runs)
    assert plot_tau(plot_runs(runs)) is None
    steps = runs[0].metrics["kind"] == "step"
    runs[0].metrics["tau"] = pd.Series(4.0, index=runs[0].metrics.index).where(steps)
    assert plot_tau(plot_runs(runs)) is None  # a τ that never changed is in the legend, not a flat plot
    runs[0].metrics.loc[steps & (runs[0].metrics["step"] >= 10), "tau"] = 2.0
    assert plot_tau(plot_runs(runs)) is not None


def test_loss_vs_passes_appears_beside_sgd_runs_when_some_run_is_full_batch(two_runs):
    """Sandblaster's rows count their own data passes (one row per iteration); an SGD run's step k of
    an epoch of S steps stands at (k + 1) / S passes, so its line ends at its epoch count."""
    runs = load_runs(two_runs)
    assert plot_loss_vs_passes(plot_runs(runs)) is None  # no full-batch run: nothing new to show
    m = runs[0].metrics
    steps = m["kind"] == "step"
    m["data_passes"] = (2.0 * (m["step"] + 1)).where(steps)  # as if two passes an iteration (L-BFGS, t = 1)
    # Under SSP each worker counts its own steps, so wall-time order need not be step order (CI saw it
    # interleave); reversing the clock makes that certain here: the line must still only move right.
    runs[1].metrics["wall_time"] = -runs[1].metrics["wall_time"]
    plotted = plot_runs(runs)
    (ax,) = plot_loss_vs_passes(plotted).axes
    lines = {line.get_color(): np.asarray(line.get_xdata(), dtype=float) for line in ax.get_lines()}
    full, sgd = lines[plotted[0].color], lines[plotted[1].color]
    assert list(full) == [2.0 * (k + 1) for k in sorted(m[steps]["step"].unique())]  # one point per iteration
    assert sgd[-1] == pytest.approx(runs[1].summary["epochs_completed"]) and (np.diff(sgd) >= 0).all()


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


@pytest.fixture(scope="module")
def event_runs(tmp_path_factory, ray_cluster) -> list[Path]:
    """AdaComm losing a worker (a failure, τ changing) and a BSP -> local SGD schedule (a switch)."""
    root = tmp_path_factory.mktemp("events")
    small = dict(model="mlp", epochs=2, segment_steps=5)
    chaos = run_training(
        RunConfig(
            strategy="local-sgd", adaptive_tau=True, checkpoint_steps=10, chaos=("kill-worker@25:1",),
            run_dir=str(root / "adacomm-chaos"), **small,
        )
    )  # fmt: skip
    sched = run_training(RunConfig(schedule="bsp:1,local-sgd", run_dir=str(root / "schedule"), **small))
    return [chaos.run_dir, sched.run_dir]


def drawn_lines(fig):
    """(axes, x, y) of every line a figure draws, markers and vertical rules included."""
    for ax in fig.axes:
        for line in ax.get_lines():
            yield ax, np.asarray(line.get_xdata(), dtype=float), np.asarray(line.get_ydata(), dtype=float)


def test_time_plots_draw_every_line_forwards_in_time(two_runs, event_runs):
    runs = plot_runs(load_runs([*two_runs, *event_runs]))
    drawn = 0
    for plot in TIME_PLOTS:
        fig = plot(runs)
        assert fig is not None, plot.__name__
        for _, x, y in drawn_lines(fig):
            x = x[~np.isnan(y)] if len(y) == len(x) else x
            assert (np.diff(x) >= 0).all(), (plot.__name__, x)
            drawn += len(x) > 2
    assert drawn >= 4 * 3  # a real line per run in the loss, throughput and accuracy plots at least


def test_failures_and_switches_are_placed_marked_and_break_the_lines(event_runs):
    chaos, sched = plot_runs(load_runs(event_runs))
    (failure,) = chaos.failures
    (event,) = chaos.summary["failure_events"]
    assert failure.wall_time == event["wall_time"] - chaos.origin  # on the plots' clock: from the first step
    assert failure.text == "worker 1 lost, restarted from step 20"
    steps = chaos.metrics[chaos.metrics["kind"] == "step"]
    assert failure.resumed_at == steps[steps["wall_time"] > failure.wall_time]["wall_time"].min()
    (switch,) = sched.switches
    assert switch.step == sched.summary["phases"][1]["start_step"] == 20  # one epoch: the training set less validation
    assert switch.strategy == "local-sgd tau=8"
    for plot in (plot_loss, plot_accuracy, plot_throughput, plot_tau):
        fig = plot([chaos, sched])
        (ax,) = fig.axes
        notes = [t.get_text() for t in ax.texts]
        assert "adacomm-chaos: worker 1 lost, restarted from step 20" in notes, notes
        assert "schedule: to local-sgd tau=8" in notes, notes
        rules = {(x[0], line.get_linestyle()) for line in ax.get_lines() for x in [line.get_xdata()]
                 if len(x) == 2 and x[0] == x[1]}  # fmt: skip
        assert (failure.wall_time, "--") in rules and (switch.wall_time, ":") in rules, plot.__name__
        labels = fig.legends[0].get_texts()
        assert {"failure (shaded until training resumed)", "strategy switch"} <= {t.get_text() for t in labels}
        own_events = {chaos.color: failure.wall_time, sched.color: switch.wall_time - 1e-9}
        crossings_checked = 0
        for line in ax.get_lines():  # no run's line is drawn across its own failure or switch
            x = np.asarray(line.get_xdata(), dtype=float)
            if len(x) > 2 and line.get_color() in own_events:
                t = own_events[line.get_color()]  # the runs share one time axis: only a run's own event breaks it
                assert (x <= t).all() or (x > t).all(), (plot.__name__, t)
                crossings_checked += 1
        # accuracy has a point per epoch (too few to cross anything); τ is drawn for the local-SGD runs only
        assert crossings_checked >= {plot_loss: 2, plot_throughput: 2, plot_tau: 1}.get(plot, 0), plot.__name__


def test_legends_carry_strategy_and_key_settings(two_runs, event_runs):
    fig = plot_loss(plot_runs(load_runs([*two_runs, *event_runs])))
    legend = [t.get_text().replace("\n  ", " ") for t in fig.legends[0].get_texts()]  # unwrapped
    assert legend[:4] == [
        "bsp-allreduce: bsp; segment-steps 20; model cnn",  # settings in config.yaml's order: by section
        "ssp-s1: ssp s=1 (ps) staleness-lr; segment-steps 20; model cnn",
        "adacomm-chaos: local-sgd tau=8 adaptive (10%, max 16); segment-steps 5; model mlp; checkpoint-steps 10; "
        "chaos kill-worker@25:1",
        "schedule: schedule bsp:1 -> local-sgd tau=8; segment-steps 5; model mlp",
    ], legend


def test_time_split_has_a_bar_per_run_and_strategy(two_runs, event_runs):
    fig = plot_time_split(plot_runs(load_runs([*two_runs, *event_runs])))
    ax = fig.axes[0]
    names = [t.get_text() for t in ax.get_yticklabels()]
    assert names == [
        "bsp-allreduce\nbsp", "ssp-s1\nssp s=1 (ps) staleness-lr",
        "adacomm-chaos\nlocal-sgd tau=8 adaptive (10%, max 16)", "schedule\nbsp", "schedule\nlocal-sgd tau=8",
    ]  # fmt: skip
    widths = {}
    for bar in ax.patches:  # stacked: compute, communication, wait per row
        widths.setdefault(round(bar.get_y(), 3), []).append(bar.get_width())
    assert len(widths) == 5 and all(len(w) == 3 and w[0] > 0 and min(w) >= 0 for w in widths.values())


def test_report_md_names_setup_settings_and_events(two_runs, event_runs, report, tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, ["report", *map(str, [*two_runs, *event_runs]), "--out", str(out)])
    assert result.exit_code == 0, result.output
    text = (out / "report.md").read_text()
    assert "model: differs (see below), data set `digits`, target `val_accuracy>=0.95`" in text
    settings = text[text.index("## Settings that differ between runs") :].split("\n\n")[1].splitlines()
    assert settings[0] == "| run | strategy | segment_steps | model | checkpoint_steps | chaos |"
    assert settings[4] == "| adacomm-chaos | local-sgd tau=8 adaptive (10%, max 16) | 5 | mlp | 10 | kill-worker@25:1 |"
    assert "- `adacomm-chaos`: at " in text and "worker 1 lost, restarted from step 20; training resumed at" in text
    assert "- `schedule`: switched to local-sgd tau=8 at step 20" in text
    assert "mean of the last" in text  # the smoothing window is stated
    assert (out / "tau_over_time.png").is_file() and "](tau_over_time.png)" in text  # AdaComm changed τ
    two, two_out = report  # the module's report of the two runs alone: the same command, made once
    text = (two_out / "report.md").read_text()
    assert "Trained: model `cnn`, data set `digits`, target `val_accuracy>=0.95`." in text
    assert "None besides the strategy settings" in text and two.exit_code == 0


def test_the_same_run_twice_is_one_row_and_a_note(two_runs, tmp_path):
    base = two_runs[0]
    spelled_otherwise = base.parent / ".." / base.parent.name / base.name
    result = runner.invoke(app, ["report", str(base), str(spelled_otherwise), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert len([line for line in result.stdout.splitlines() if line.startswith("│")]) == 1
    assert f"note: {str(spelled_otherwise)!r} is the same run directory as {str(base)!r}" in result.stderr
    assert len(results_table((tmp_path / "out" / "report.md").read_text())) == 3


def test_out_under_a_regular_file_is_one_line_and_writes_nothing(two_runs, tmp_path):
    (tmp_path / "file.txt").write_text("x")
    before = sorted(tmp_path.rglob("*"))
    result = runner.invoke(app, ["report", *map(str, two_runs), "--out", str(tmp_path / "file.txt" / "out")])
    assert_one_line_error(result, "cannot write the report", "file.txt/out", "Not a directory")
    assert sorted(tmp_path.rglob("*")) == before and (tmp_path / "file.txt").read_text() == "x"


def test_a_write_that_fails_midway_leaves_nothing(two_runs, tmp_path, monkeypatch):
    """A read-only file system (or a full disk) seen after some files were written: those files and the
    directories this report made are removed (tested by failing the third write with EROFS)."""
    real = report_module.atomic_write
    calls = []

    def flaky(path, write):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(errno.EROFS, "Read-only file system")
        real(path, write)

    monkeypatch.setattr(report_module, "atomic_write", flaky)
    monkeypatch.chdir(tmp_path)
    for args in (["--out", str(tmp_path / "new" / "deeper")], []):  # given, and the default report-<stamp>/
        calls.clear()
        result = runner.invoke(app, ["report", *map(str, two_runs), *args])
        assert_one_line_error(result, "cannot write the report", "Read-only file system")
        assert len(calls) == 3 and list(tmp_path.iterdir()) == [], args




