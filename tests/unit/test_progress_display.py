"""The progress display: the summary's steady-state samples/s (one definition, computed from rows as
they arrive), and one line per epoch when the output is not a terminal (also with --eval-every 0)."""

from __future__ import annotations

import io
import random
from pathlib import Path

import pandas as pd
import pytest
from rich.console import Console
from typer.testing import CliRunner

from distrain.cli import RunDisplay, app
from distrain.commands import console as cli_console
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
    monkeypatch.setattr(cli_console, "out", Console(file=buf, force_terminal=False, width=200))
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
        "epoch 1/3  step 22/66  loss 0.5000  1,234 samples/s  elapsed 0:00:25  eta 0:00:44",  # a step a second
        "epoch 2/3  step 44/66  loss 0.5000  1,234 samples/s  elapsed 0:00:47  eta 0:00:22",
        "epoch 3/3  step 66/66  loss 0.5000  val acc 0.9200  1,234 samples/s  elapsed 0:01:09",
    ]


def test_piped_display_keeps_epoch_order_when_an_evaluation_comes_late(piped):
    cfg = RunConfig(epochs=4, eval_every=2)
    display = RunDisplay(cfg)
    display.live = False
    drive(display, spe=10, epochs=4, evaluated={1, 3}, late_eval=True)
    lines = [line for line in piped.getvalue().splitlines() if line.startswith("epoch")]
    assert [line.split("  ")[0] for line in lines] == ["epoch 1/4", "epoch 2/4", "epoch 3/4", "epoch 4/4"]
    assert ["val acc" in line for line in lines] == [False, True, False, True]




# ---------------------------------------------------------------- what the display says while nothing else does
class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _events():
    from distrain.orchestrator import run

    return run


def terminal(width: int = 160) -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=True, width=width, color_system=None), buf


def test_a_terminal_says_at_once_what_the_run_is_doing_while_it_prepares():
    """Before the first worker starts (seconds: torch and Ray load, Ray starts, workers are placed),
    one line names the stage; it goes once training starts (nothing left above the run's lines)."""
    run = _events()
    console, buf = terminal()
    clock = Clock()
    with RunDisplay(RunConfig(run_dir="runs/x"), console, clock=clock, every_s=0) as display:
        assert "preparing run runs/x: loading Ray and torch  0:00:00" in buf.getvalue()  # at once
        display.on_event(run.Preparing("starting a local Ray", Path("runs/x")))
        clock.now += 7
        display.preparing.refresh()
        assert "preparing run runs/x: starting a local Ray  0:00:07" in buf.getvalue()
        display.on_event(run.WorkersStarting(1, 2))
        display.preparing.refresh()
        assert "preparing run runs/x: starting workers 1/2" in buf.getvalue()
        display.on_event(run.RunStarted(Path("runs/x"), 66, 22, 1000, 1, elapsed_s=2.0))
        assert display.preparing is None  # the line went (transient), the run's own lines follow


def test_the_line_comes_before_the_settings_are_checked_and_says_which_stage_is_on():
    """`distrain run` starts the display before RunConfig.resolve, which loads torch (seconds)."""
    run = _events()
    console, buf = terminal()
    display = RunDisplay(console=console, clock=Clock(), every_s=0)
    with display:
        assert "preparing the run: checking the settings" in buf.getvalue()
        display.configured(RunConfig())  # no --run-dir: named once claimed
        display.preparing.refresh()
        assert "preparing the run: loading Ray and torch" in buf.getvalue()
        display.on_event(run.Preparing("placing 2 workers", Path("runs/20261127-bsp")))
        display.preparing.refresh()
        assert "preparing run runs/20261127-bsp: placing 2 workers" in buf.getvalue()


def test_piped_output_says_something_at_least_every_n_seconds(piped):
    """Not a terminal (a log, `ray job submit`): a `still ...` line after every_s seconds of silence,
    while the run prepares and within an epoch; never while lines come often enough."""
    run = _events()
    clock = Clock(0.0)
    display = RunDisplay(RunConfig(epochs=3, run_dir="runs/x"), clock=clock, every_s=30)
    display.live = False

    def said() -> list[str]:
        return [line for line in piped.getvalue().splitlines() if line.startswith("still")]

    clock.now = 29
    display.tick()
    assert said() == []
    clock.now = 31
    display.tick()
    display.on_event(run.Preparing("starting a local Ray", Path("runs/x")))
    clock.now = 45
    display.tick()  # 14 s since the last line
    clock.now = 62
    display.tick()
    assert said() == [
        "still preparing run runs/x: loading Ray and torch (0:00:31 so far)",
        "still preparing run runs/x: starting a local Ray (0:01:02 so far)",
    ]
    display.on_event(run.RunStarted(Path("runs/x"), 66, 22, 1000, 1, elapsed_s=2.0))  # a line: silence starts over
    for steps in (0, 10, 20):  # a step every second of run time, events every 10 steps
        clock.now = 62 + steps
        display.on_event(run.Progress(0, 3, steps, 66, 0.5, 1234.0, None, elapsed_s=2.0 + steps))
    clock.now = 92 + 5  # 35 s since the run dir line, 15 s since the last event (in a long segment, say)
    display.tick()
    assert said()[2:] == [
        "still training: epoch 1/3  step 20/66  loss 0.5000  1,234 samples/s  elapsed 0:00:37  eta 0:00:31"
    ]  # elapsed: 22 s at the last event, 15 s since; left: 46 steps at 1 step/s, 15 s of them gone
    display.tick()
    assert len(said()) == 3  # just said


def test_a_zero_interval_turns_the_piped_heartbeat_off(piped):
    clock = Clock(0.0)
    display = RunDisplay(RunConfig(), clock=clock, every_s=0)
    display.live = False
    clock.now = 3600
    display.tick()
    assert piped.getvalue() == ""


def test_the_heartbeat_thread_prints_without_events(piped):
    """The lines come from a thread of their own: nothing has to happen in the run for them."""
    import time

    with RunDisplay(every_s=0.05, run_dir="runs/x") as display:
        assert not display.live and display.heartbeat.thread.is_alive()
        deadline = time.monotonic() + 10
        while "still preparing" not in piped.getvalue() and time.monotonic() < deadline:
            time.sleep(0.05)
    assert "still preparing run runs/x: checking the settings" in piped.getvalue()
    assert not display.heartbeat.thread.is_alive()


def test_the_interval_comes_from_the_environment():
    from distrain.errors import ConfigError
    from distrain.run_progress import DEFAULT_HEARTBEAT_S, HEARTBEAT_ENV, heartbeat_seconds

    assert heartbeat_seconds({}) == DEFAULT_HEARTBEAT_S == 30
    assert heartbeat_seconds({HEARTBEAT_ENV: "5"}) == 5 and heartbeat_seconds({HEARTBEAT_ENV: "0"}) == 0
    for bad in ("soon", "-1", "inf"):
        with pytest.raises(ConfigError, match=HEARTBEAT_ENV):
            heartbeat_seconds({HEARTBEAT_ENV: bad})


def test_a_bad_interval_is_one_line_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["run", "--model", "mlp"], env={"DISTRAIN_PROGRESS_EVERY_S": "soon"})
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        "error: DISTRAIN_PROGRESS_EVERY_S='soon': expected seconds, e.g. 30 (0 turns these lines off)"
    ]
    assert list(tmp_path.iterdir()) == []


def test_the_terminal_keeps_a_line_per_epoch_and_shows_the_run_time_and_time_left():
    """The live bar used to overwrite each epoch and count elapsed time from its own start (0:00:00
    while the piped lines said 0:00:25); now the epoch lines stay above it, and both count from the
    run's start, with the time left at the rate so far."""
    console, buf = terminal()
    clock = Clock()
    display = RunDisplay(RunConfig(epochs=3, eval_every=0), console, clock=clock, every_s=0)
    with display:
        drive(display, spe=22, epochs=3, evaluated={2})
        clock.now += 4  # 4 s after the last event
        shown = display.progress.columns[-1].render(display.progress.tasks[0]).plain
    out = buf.getvalue()
    for line in (
        "epoch 1/3  step 22/66  loss 0.5000  1,234 samples/s  elapsed 0:00:25  eta 0:00:44",
        "epoch 2/3  step 44/66  loss 0.5000  1,234 samples/s  elapsed 0:00:47  eta 0:00:22",
        "epoch 3/3  step 66/66  loss 0.5000  val acc 0.9200  1,234 samples/s  elapsed 0:01:09",
    ):
        assert line in out
    assert shown == "elapsed 0:01:13  eta 0:00:00"  # the run's 69 s at the last event, and 4 s since


def test_the_bar_counts_from_the_runs_start_before_any_step():
    run = _events()
    console, _ = terminal()
    clock = Clock()
    display = RunDisplay(RunConfig(epochs=3), console, clock=clock, every_s=0)
    with display:
        display.on_event(run.RunStarted(Path("r"), 66, 22, 1000, 1, elapsed_s=20.0))  # workers took 20 s to start
        clock.now += 5
        shown = display.progress.columns[-1].render(display.progress.tasks[0]).plain
    assert shown == "elapsed 0:00:25"  # no rate yet: no time left


def test_distrain_run_shows_the_line_before_checking_the_settings(monkeypatch):
    """RunConfig.resolve loads torch (seconds): the line is on the screen before it starts, and a
    refusal still ends the command the usual way (one line, exit 2)."""
    console, buf = terminal()
    monkeypatch.setattr(cli_console, "out", console)
    on_screen = []
    resolve = RunConfig.resolve

    def watched(*args, **kwargs):
        on_screen.append(buf.getvalue())
        return resolve(*args, **kwargs)

    monkeypatch.setattr(RunConfig, "resolve", staticmethod(watched))
    result = runner.invoke(app, ["run", "--workers", "0", "--run-dir", "runs/x"])
    assert result.exit_code == 2 and "--workers must be >= 1" in result.stderr
    assert "preparing run runs/x: checking the settings" in on_screen[0]
