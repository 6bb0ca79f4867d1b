"""distrain.Callback: hooks into a run, a stop request that ends it cleanly, the TensorBoard writer (its
event files read back). A Tune sweep of a user task ranked by the task's own target metric (Tune's
reporter is a callback) is in tests/integration/test_user_task_acceptance.py."""

from __future__ import annotations

import json

import pandas as pd
import pytest

import distrain
from tests.tensorboard_events import read_scalars


# ---------------------------------------------------------------- real runs
def test_a_callback_stops_the_run_and_tensorboard_has_its_figures(tmp_path, ray_cluster):
    """Stop after the first evaluation: the run ends "stopped" at a step every worker reached, with its
    final checkpoint and summary; the hooks came in order; the event files hold what the run recorded."""

    class StopAfterFirst(distrain.Callback):
        def __init__(self):
            self.calls = []

        def on_run_start(self, info):
            self.calls.append(("start", info.total_steps))

        def on_rows(self, rows):
            assert set(rows) >= {"step", "loss", "lr", "samples", "worker"}

        def on_epoch_end(self, epoch, metrics):
            self.calls.append(("epoch", epoch, metrics["val_loss"], metrics["steps_done"]))
            return True

        def on_checkpoint(self, path, step):
            self.calls.append(("checkpoint", path.name, step))

        def on_run_end(self, summary):
            self.calls.append(("end", summary["status"]))

    cb = StopAfterFirst()
    result = distrain.fit(
        model="mlp", epochs=3, workers=2, segment_steps=4, run_dir=str(tmp_path / "run"),
        tensorboard=str(tmp_path / "tb"), callbacks=[cb], progress=False,
    )  # fmt: skip
    kinds = [c[0] for c in cb.calls]
    assert kinds[0] == "start" and kinds[-1] == "end" and cb.calls[-1] == ("end", "stopped")
    total = cb.calls[0][1]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert result.status == summary["status"] == "stopped"
    steps = summary["steps_completed"]
    assert 0 < steps < total  # stopped early, after the segments under way
    assert ("checkpoint", "final.pt", steps) in cb.calls and (tmp_path / "run" / "checkpoints" / "final.pt").is_file()
    evals = [c for c in cb.calls if c[0] == "epoch"]
    assert evals[-1][3] == steps  # the last (partial) epoch was evaluated at the stop
    metrics = pd.read_parquet(tmp_path / "run" / "metrics.parquet")
    assert metrics[metrics["kind"] == "step"]["step"].max() + 1 == steps

    scalars = read_scalars(tmp_path / "tb" / "run")
    train_loss = dict(scalars["train/loss"])
    assert sorted(train_loss) == list(range(1, steps + 1))  # one point per global step
    per_step = metrics[metrics["kind"] == "step"].groupby("step")["loss"].mean()
    assert train_loss[steps] == pytest.approx(per_step.iloc[-1], rel=1e-5)
    assert {s for s, _ in scalars["train/lr"]} == set(train_loss)
    assert scalars["train/samples_per_s"] and all(v > 0 for _, v in scalars["train/samples_per_s"])
    val_loss = scalars["val/loss"]
    assert [s for s, _ in val_loss] == [c[3] for c in evals]
    assert val_loss[-1][1] == pytest.approx(summary["final_val_loss"], rel=1e-5)
    # the test set: scored once, at the stop (the last evaluation's row has it, whenever it was queued)
    assert [s for s, _ in scalars["test/loss"]] == [steps]
    assert scalars["test/accuracy"][-1][1] == pytest.approx(summary["final_test_accuracy"], rel=1e-5)
    last = metrics[metrics["kind"] == "eval"].sort_values("wall_time").iloc[-1]
    assert last["test_loss"] == pytest.approx(summary["final_test_loss"]) and last["step"] == steps


def test_a_raising_callback_fails_the_run_with_its_traceback(tmp_path, ray_cluster):
    class Broken(distrain.Callback):
        def __init__(self):
            self.ended = None

        def on_epoch_end(self, epoch, metrics):
            raise ValueError("bug in the user's callback")

        def on_run_end(self, summary):
            self.ended = summary["status"]

    cb = Broken()
    with pytest.raises(ValueError, match="bug in the user's callback") as info:
        distrain.fit(model="mlp", epochs=1, max_steps=6, run_dir=str(tmp_path / "run"), callbacks=[cb], progress=False)
    assert any("Broken.on_epoch_end" in note for note in info.value.__notes__)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"
    assert cb.ended == "failed"  # on_run_end still ran (to close its files)


