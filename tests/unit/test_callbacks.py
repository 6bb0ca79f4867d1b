"""distrain.Callback: hooks into a run, a stop request that ends it cleanly, the TensorBoard writer (its
event files read back). A Tune sweep of a user task ranked by the task's own target metric (Tune's
reporter is a callback) is in tests/integration/test_user_task_acceptance.py."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

import distrain
from distrain.orchestrator.callbacks import Callbacks
from distrain.orchestrator.work import WorkPlan
from distrain.tuning.sweep_spec import sort_by_objective


# ---------------------------------------------------------------- no Ray
def test_stop_request_by_return_value_or_attribute():
    class Returns(distrain.Callback):
        def on_rows(self, rows):
            return rows["step"][-1] >= 3

    class Flag(distrain.Callback):
        def on_checkpoint(self, path, step):
            self.should_stop = True

    hooks = Callbacks([Returns()])
    hooks.call("on_rows", {"step": [1, 2]})
    assert not hooks.stop_requested
    hooks.call("on_rows", {"step": [3]})
    assert hooks.stop_requested
    flag = Callbacks([Flag()])
    flag.call("on_rows", {"step": [0]})
    assert not flag.poll()
    flag.call("on_checkpoint", Path("x.pt"), 4)
    assert flag.poll()


def test_a_raising_callback_is_named_and_not_a_distrain_object_is_refused():
    class Broken(distrain.Callback):
        def on_epoch_end(self, epoch, metrics):
            raise ZeroDivisionError("their bug")

    with pytest.raises(ZeroDivisionError) as info:
        Callbacks([Broken()]).call("on_epoch_end", 0, {})
    assert any("Broken.on_epoch_end" in note for note in info.value.__notes__)
    with pytest.raises(distrain.ConfigError):
        Callbacks([object()])  # type: ignore[list-item]


def test_work_plan_stop_lets_every_worker_reach_the_furthest_step():
    static = WorkPlan(total_steps=100, steps_per_epoch=30, workers=2, segment_steps=5, shared=False)
    static.next_segment(0), static.next_segment(0), static.next_segment(1)  # worker 0 to step 10, worker 1 to 5
    assert static.stop() == 10 and static.total_steps == 10
    assert static.next_segment(1) == [(0, s, 1) for s in range(5, 10)]  # worker 1 catches up
    assert static.next_segment(0) == [] and static.next_segment(1) == []
    shared = WorkPlan(total_steps=100, steps_per_epoch=30, workers=2, segment_steps=3, shared=True)
    shared.next_segment(0)  # units 0..2: steps 0 and half of step 1
    assert shared.stop() == 2 and shared.next_segment(1) == [(0, 1, 1)]  # step 1 is completed


def test_objective_follows_the_target_direction():
    table = pd.DataFrame(
        {
            "status": ["completed"] * 3,
            "time_to_target_s": [float("nan")] * 3,
            "final_metric": [0.3, 0.1, 0.2],
        }
    )
    assert sort_by_objective(table, "final_metric", higher_is_better=False)["final_metric"].tolist() == [0.1, 0.2, 0.3]
    assert sort_by_objective(table, "final_accuracy", higher_is_better=True)["final_metric"].tolist() == [0.3, 0.2, 0.1]








def test_the_run_s_last_line_names_its_tensorboard_events(tmp_path, capsys):
    """With --tensorboard DIR the summary ends with where the events are and the command that shows them."""
    from distrain.cli import print_summary
    from distrain.config import RunConfig

    summary = {
        "run_id": "r", "strategy": "bsp", "workers": 2, "model": "mlp", "dataset": "digits", "epochs_completed": 1,
        "steps_completed": 22, "final_test_accuracy": 0.9, "target_accuracy": 0.95, "time_to_target_s": None,
        "wall_time_s": 3.0, "steady_state_samples_per_s": 1000.0, "bytes_per_step": 10, "mean_compute_s": 0.001,
        "mean_comm_s": 0.001,
    }  # fmt: skip
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(RunConfig(tensorboard=str(tmp_path / "tb")).to_yaml())
    print_summary(summary, run_dir)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"TensorBoard events in {tmp_path / 'tb' / 'r'}/; view with: tensorboard --logdir "
                           f"{tmp_path / 'tb'}")  # fmt: skip
    (run_dir / "config.yaml").write_text(RunConfig(loggers="csv,tensorboard").to_yaml())  # in the run directory
    print_summary(summary, run_dir)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"TensorBoard events in {run_dir / 'tensorboard'}/; view with: tensorboard --logdir "
                           f"{tmp_path / 'runs'}")  # fmt: skip
    (run_dir / "config.yaml").write_text(RunConfig().to_yaml())  # without --tensorboard: no such line
    print_summary(summary, run_dir)
    assert "TensorBoard" not in capsys.readouterr().out
