"""The memory estimate (orchestrator/memory.py): its parts, the refusal, and start-up progress."""

from __future__ import annotations

from distrain.config import RunConfig


def test_start_up_progress_is_reported_before_the_run_starts(ray_cluster, tmp_path):
    from distrain.orchestrator.run import Preparing, RunStarted, WorkersStarting, run_training

    events = []
    cfg = RunConfig(model="mlp", workers=3, epochs=1, max_steps=2, run_dir=str(tmp_path / "r"))
    run_training(cfg, events.append)
    starting = [e for e in events if isinstance(e, WorkersStarting)]
    assert starting[0] == WorkersStarting(0, 3) and starting[-1] == WorkersStarting(3, 3)
    assert [e.started for e in starting] == sorted(e.started for e in starting)
    before = events[: next(i for i, e in enumerate(events) if isinstance(e, RunStarted))]
    assert [e for e in before if isinstance(e, WorkersStarting)] == starting  # all of it before the run starts
    stages = [e for e in before if isinstance(e, Preparing)]  # and what comes before the workers start
    assert [e.stage for e in stages] == [
        "checking the task, its data and the run directory",
        "joining the Ray already running in this process",
        "placing 3 workers",
    ]
    assert [e.run_dir for e in stages] == [None, tmp_path / "r", tmp_path / "r"]  # once claimed
