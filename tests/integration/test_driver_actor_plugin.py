"""A plugin strategy brings its own driver-side actor (`Strategy.driver_actors` returning a `DriverActor`
spec): the driver starts it, built from the phase, hands it to every worker by name, and asks it for the
run's figures at the end; no distrain file knows about it."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from tests.unit.test_strategy_plugin import invoke

PLUGIN = '''
from typing import Any

import ray

from distrain import ActorSetup, CommStats, DriverActor, Strategy


class Tally:
    """Counts the steps each worker reports (the driver hosts it; every worker calls it each step)."""

    def __init__(self, start_step: int, workers: int) -> None:
        self.start_step, self.workers = start_step, workers
        self.steps: dict[int, list[int]] = {}

    def add(self, rank: int, step: int) -> None:
        self.steps.setdefault(rank, []).append(step)

    def figures(self) -> dict[str, Any]:
        return {"start_step": self.start_step, "workers": self.workers, "steps": self.steps}


def tally_args(setup: ActorSetup) -> dict[str, Any]:
    return {"start_step": setup.start_step, "workers": setup.workers}


class Tallied(Strategy):
    """Local steps, no communication; every step is reported to the driver's tally."""

    name = "tallied"
    metric_columns = {"tallied_step": "int64"}

    @classmethod
    def driver_actors(cls, config: Any) -> tuple[DriverActor, ...]:
        return (DriverActor("tally", Tally, args=tally_args, max_concurrency=1),)

    def setup(self, trainer: Any) -> None:
        self.tally = self.ctx.driver_actors["tally"]
        self.steps = 0

    def step(self, trainer: Any, lr: float) -> CommStats:
        trainer.apply_update(lr)
        self.steps += 1
        # Waited for: the driver reads the tally when the run ends, and a call still on its way from a
        # worker could land after that read (CI saw a worker's steps missing from the figures).
        ray.get(self.tally.add.remote(self.ctx.rank, self.steps))
        return CommStats(extra={"tallied_step": self.steps})

    @classmethod
    def actor_figures(cls, config: Any, actors: dict[str, Any]) -> dict[str, Any]:
        return {"tally": ray.get(actors["tally"].figures.remote())}
'''


@pytest.mark.usefixtures("ray_cluster")
def test_a_plugin_s_own_driver_actor_is_started_handed_to_the_workers_and_read_back(tmp_path):
    path = tmp_path / "tallied.py"
    path.write_text(PLUGIN)
    run_dir = tmp_path / "run"
    flags = ["--model", "mlp", "--workers", "2", "--max-steps", "6", "--segment-steps", "3", "--eval-every", "0"]
    result = invoke(["run", "--strategy", f"{path}:Tallied", *flags, "--run-dir", str(run_dir)])
    assert result.exit_code == 0, result.output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    tally = summary["tally"]
    assert tally["start_step"] == 0 and tally["workers"] == 2  # built from the phase's setup
    steps = pd.read_parquet(run_dir / "metrics.parquet").query("kind == 'step'")
    for rank in (0, 1):  # what each worker sent is what its rows say it did, in order
        mine = steps[steps["worker"] == rank]["tallied_step"].tolist()
        assert mine == list(range(1, 7))
        assert tally["steps"][str(rank)] == mine
