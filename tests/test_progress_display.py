"""The progress display: the summary's steady-state samples/s (one definition, computed from rows as
they arrive), and one line per epoch when the output is not a terminal (also with --eval-every 0)."""

from __future__ import annotations

import io
import random
import re
from pathlib import Path

import pandas as pd
import pytest
from rich.console import Console
from typer.testing import CliRunner

from distrain import cli
from distrain.cli import RunDisplay, app
from distrain.config import RunConfig

runner = CliRunner()


def reference_samples_per_s(steps: pd.DataFrame, evals: pd.DataFrame) -> float | None:
    """summary.py's steady-state figure as it was written before the display shared it (the reference)."""
    if "dropped" in steps:
        steps = steps[steps["dropped"].ne(True)]
    if steps.empty:
        return None
    per_step = steps.groupby("step").agg(samples=("samples", "sum"), end=("wall_time", "max")).sort_index()
    if len(per_step) < 2:
        return None
    skip = max(1, int(len(per_step) * 0.1))
    skip = min(skip, len(per_step) - 1)
    t_start = per_step["end"].iloc[skip - 1]
    t_end = per_step["end"].iloc[-1]
    window = per_step.iloc[skip:]
    paused = 0.0
    if not evals.empty:
        inside = evals[(evals["wall_time"] > t_start) & (evals["wall_time"] <= t_end)]
        paused = float(inside["eval_s"].sum())
    elapsed = t_end - t_start - paused
    return float(window["samples"].sum() / elapsed) if elapsed > 0 else None


def synthetic_run(seed: int, workers: int = 3, steps: int = 60, with_dropped: bool = False):
    """Step rows of a run with uneven workers and evaluation pauses, as segments per worker."""
    rng = random.Random(seed)
    rows, evals, t = [], [], 0.0
    for step in range(steps):
        t += rng.uniform(0.01, 0.05)
        for w in range(workers):
            dropped = with_dropped and rng.random() < 0.2
            rows.append(
                {"step": step, "worker": w, "samples": 32, "wall_time": t + rng.uniform(0, 0.02), "dropped": dropped}
            )
        if step % 20 == 19:
            pause = rng.uniform(0.1, 0.3)
            evals.append({"wall_time": t + 0.03 + pause, "eval_s": pause})
            t += pause
    return pd.DataFrame(rows), pd.DataFrame(evals)


@pytest.mark.parametrize("seed", range(5))
def test_live_figure_is_the_summarys_figure_on_every_prefix(seed):
    from distrain.orchestrator.summary import steady_state_samples_per_s
    from distrain.orchestrator.throughput import SteadyState

    steps, evals = synthetic_run(seed, with_dropped=seed % 2 == 1)
    # Rows arrive a segment at a time per worker, workers out of step with each other.
    segments = [g for _, g in steps.groupby([steps["worker"], steps["step"] // 7])]
    random.Random(seed).shuffle(segments)
    meter, seen = SteadyState(), []
    for seg in segments:
        meter.add_steps(
            seg["step"].tolist(), seg["samples"].tolist(), seg["wall_time"].tolist(), seg["dropped"].tolist()
        )
        seen.append(seg)
        so_far = pd.concat(seen)
        reference = reference_samples_per_s(so_far, evals.iloc[0:0])
        if reference is None:
            assert meter.samples_per_s() is None
        else:
            assert meter.samples_per_s() == pytest.approx(reference, rel=1e-9)
    for _, e in evals.iterrows():
        meter.add_eval(e["wall_time"], e["eval_s"])
    reference = reference_samples_per_s(steps, evals)
    assert reference is not None and reference > 0
    assert meter.samples_per_s() == pytest.approx(reference, rel=1e-9)
    assert steady_state_samples_per_s(steps, evals) == pytest.approx(reference, rel=1e-9)


def test_figure_by_hand():
    """2 workers x 32 samples, steps ending 0.1 s apart, a 0.5 s evaluation after step 9."""
    from distrain.orchestrator.throughput import SteadyState

    meter = SteadyState()
    ends = [0.1 * (k + 1) + (0.5 if k >= 10 else 0.0) for k in range(20)]
    for w in (1, 0):
        meter.add_steps(list(range(20)), [32] * 20, [e - 0.01 * w for e in ends])
    meter.add_eval(1.0 + 0.5, 0.5)
    # warm-up: 2 steps; the window runs from step 1's end (0.2) to step 19's (2.5), less the pause.
    assert meter.samples_per_s() == pytest.approx(18 * 64 / (2.5 - 0.2 - 0.5))


# ---------------------------------------------------------------- the display when not on a terminal


@pytest.fixture
def piped(monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr(cli, "out", Console(file=buf, force_terminal=False, width=200))
    return buf


def drive(display: RunDisplay, spe: int, epochs: int, evaluated: set[int], late_eval: bool = False) -> None:
    """Feed the display the events of a 2-worker run with 10-step segments (as orchestrator/run.py emits)."""
    from distrain.orchestrator.run import Progress, RunStarted

    total = spe * epochs
    display.on_event(RunStarted(Path("r"), total, spe, 1000, 1))
    done, waiting = 0, []

    def ev(epoch: int, steps_done: int, acc: float | None = None, evaluated: bool = False) -> Progress:
        return Progress(
            epoch, epochs, steps_done, total, 0.5, 1234.0, acc, evaluated, 0.1 if evaluated else None, 3.0 + steps_done
        )

    while done < total:
        epoch = done // spe
        seg_end = min(done + 10, (epoch + 1) * spe)
        display.on_event(ev(epoch, done))  # worker 0's segment: the step is not done until worker 1's is in
        done = seg_end
        display.on_event(ev(epoch, done))
        if done == (epoch + 1) * spe and epoch in evaluated:
            waiting.append(ev(epoch, done, 0.9 + epoch / 100, True))
        if waiting and (not late_eval or done > waiting[0].steps_done + spe or done == total):
            display.on_event(waiting.pop(0))
    for e in waiting:
        display.on_event(e)


def test_piped_display_prints_one_line_per_epoch_without_evaluations(piped):
    cfg = RunConfig(epochs=3, eval_every=0)
    display = RunDisplay(cfg)
    display.live = False
    drive(display, spe=22, epochs=3, evaluated={2})
    lines = [line for line in piped.getvalue().splitlines() if line.startswith("epoch")]
    assert lines == [
        "epoch 1/3  step 22/66  loss 0.5000  1,234 samples/s  elapsed 0:00:25",
        "epoch 2/3  step 44/66  loss 0.5000  1,234 samples/s  elapsed 0:00:47",
        "epoch 3/3  step 66/66  loss 0.5000  test acc 0.9200  1,234 samples/s  elapsed 0:01:09",
    ]


def test_piped_display_keeps_epoch_order_when_an_evaluation_comes_late(piped):
    cfg = RunConfig(epochs=4, eval_every=2)
    display = RunDisplay(cfg)
    display.live = False
    drive(display, spe=10, epochs=4, evaluated={1, 3}, late_eval=True)
    lines = [line for line in piped.getvalue().splitlines() if line.startswith("epoch")]
    assert [line.split("  ")[0] for line in lines] == ["epoch 1/4", "epoch 2/4", "epoch 3/4", "epoch 4/4"]
    assert ["test acc" in line for line in lines] == [False, True, False, True]


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
    pattern = r"epoch \d/3  step \d+/\d+  loss [\d.]+(  test acc [\d.]+)?  ([\d,]+) samples/s  elapsed \d:\d\d:\d\d"
    matches = [re.fullmatch(pattern, line) for line in lines]
    assert all(matches), lines
    assert [m.group(1) is not None for m in matches] == [False, False, True]  # only the last epoch is evaluated
    summary = json.loads((run_dir / "summary.json").read_text())
    shown = float(matches[-1].group(2).replace(",", ""))
    assert shown == pytest.approx(summary["steady_state_samples_per_s"], abs=1)
