"""Fault tolerance on a real local Ray: real kills (ray.kill ends the actor's process), real recovery.

The uninterrupted run is the oracle: BSP (all-reduce or parameter server) that survives a failure
must end with exactly its parameters, because the data order and every BSP rule are deterministic.
"""

from __future__ import annotations

import json
import random
import time

import pandas as pd
import pytest

from distrain.config import RunConfig
from distrain.errors import DistrainError
from distrain.orchestrator.checkpoint import latest_checkpoint, load_checkpoint
from distrain.orchestrator.run import run_training
from tests.helpers import final_params

pytestmark = pytest.mark.usefixtures("ray_cluster")

SMALL = dict(epochs=2, max_steps=30, workers=2, segment_steps=4, checkpoint_steps=6, seed=3)


def steps_of(run_dir) -> pd.DataFrame:
    df = pd.read_parquet(run_dir / "metrics.parquet")
    return df[df["kind"] == "step"]


def assert_every_row_once(run_dir, steps: int, workers: int) -> None:
    rows = steps_of(run_dir)
    per_unit = rows.groupby(["step", "worker"]).size()
    assert (per_unit == 1).all() and len(per_unit) == steps * workers, per_unit[per_unit != 1]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    base = tmp_path_factory.mktemp("uninterrupted")
    return {
        "collective": final_params(run_training(RunConfig(run_dir=str(base / "ar"), **SMALL)).run_dir),
        "ps": final_params(
            run_training(RunConfig(run_dir=str(base / "ps"), transport="ps", ps_shards=2, **SMALL)).run_dir
        ),
    }


def test_bsp_allreduce_worker_killed_mid_epoch_ends_equal_to_the_uninterrupted_run(tmp_path, uninterrupted):
    run = run_training(RunConfig(run_dir=str(tmp_path / "r"), chaos=["kill-worker@15:1"], **SMALL))
    assert run.summary["status"] == "completed"
    assert run.summary["failures"] == 1
    event = run.summary["failure_events"][0]
    assert event["kind"] == "worker" and event["at_step"] >= 15 and event["restored_step"] == 12
    assert run.summary["updates_lost"] == event["at_step"] - 12 and run.summary["time_lost_s"] > 0
    assert json.loads((run.run_dir / "summary.json").read_text())["failures"] == 1
    assert final_params(run.run_dir).equal(uninterrupted["collective"])
    assert_every_row_once(run.run_dir, 30, 2)


def test_bsp_over_ps_shard_killed_ends_equal_to_the_uninterrupted_run(tmp_path, uninterrupted):
    run = run_training(
        RunConfig(run_dir=str(tmp_path / "r"), transport="ps", ps_shards=2, chaos=["kill-ps@9:1"], **SMALL)
    )
    assert run.summary["failures"] == 1 and run.summary["failure_events"][0]["kind"] in ("shard", "worker")
    assert final_params(run.run_dir).equal(uninterrupted["ps"])
    rows = steps_of(run.run_dir).sort_values("step")
    assert_every_row_once(run.run_dir, 30, 2)
    assert (rows["applied_version"] == rows["step"]).all()  # round t applied as version t, once


def test_a_hung_worker_is_treated_as_dead(tmp_path, uninterrupted):
    cfg = RunConfig(run_dir=str(tmp_path / "r"), chaos=["hang-worker@8:0"], hang_timeout_s=3.0, **SMALL)
    run = run_training(cfg)
    assert run.summary["failures"] == 1 and run.summary["failure_events"][0]["kind"] == "hang"
    assert final_params(run.run_dir).equal(uninterrupted["collective"])


@pytest.mark.parametrize("strategy", ["async", "ssp"])
def test_async_and_ssp_survive_a_killed_worker_and_reach_accuracy(tmp_path, strategy):
    cfg = RunConfig(
        strategy=strategy, workers=3, epochs=5, checkpoint_steps=10, chaos=["kill-worker@25:1"],
        hang_timeout_s=30.0, run_dir=str(tmp_path / strategy),
    )  # fmt: skip
    run = run_training(cfg)  # a clock waiting forever on the dead worker would end in a hang failure
    assert run.summary["status"] == "completed" and run.summary["failures"] == 1
    assert run.summary["failure_events"][0]["kind"] in ("worker", "shard")
    assert run.summary["final_test_accuracy"] >= 0.93
    rows = steps_of(run.run_dir)
    assert len(rows.groupby(["step", "slice"]).size()) == run.summary["steps_completed"] * 3


def test_past_max_failures_the_run_stops_with_its_last_checkpoint_intact(tmp_path):
    cfg = RunConfig(run_dir=str(tmp_path / "r"), max_failures=1, chaos=["kill-worker@8:0", "kill-worker@20:1"], **SMALL)
    with pytest.raises(DistrainError, match=r"--max-failures 1 reached.*last good checkpoint.*--resume"):
        run_training(cfg)
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["failures"] == 2
    latest = latest_checkpoint(tmp_path / "r" / "checkpoints")
    assert latest is not None and load_checkpoint(latest)["global_step"] in (12, 18)


def _alive_actors() -> int:
    """Actors alive in the session's Ray, from the GCS table (ray.util.state needs the dashboard, which
    distrain's local Ray leaves out)."""
    from ray._private.state import actors

    return sum(1 for a in actors().values() if a["State"] != "DEAD")


def test_three_phase_chaos_accounts_for_all_work_and_leaks_nothing(tmp_path):
    """Warm-up, a stretch with no failures, then repeated random kills of workers and shards."""
    from ray.util.placement_group import placement_group_table

    rng = random.Random(7)
    # Steps 0-3: warm-up, 4-7: no failures, then a kill every 4-6 steps (a segment moves the step
    # count by at most 3, so no two kills land in one attempt).
    kills = [8 + 5 * i + rng.randrange(2) for i in range(3)]
    chaos = [f"kill-worker@{kills[0]}:{rng.randrange(2)}", f"kill-ps@{kills[1]}:1", f"kill-worker@{kills[2]}:0"]
    actors_before = _alive_actors()
    cfg = RunConfig(
        run_dir=str(tmp_path / "r"), transport="ps", ps_shards=2, workers=2, epochs=1, segment_steps=3,
        checkpoint_steps=5, chaos=chaos, max_failures=-1, seed=11,
    )  # fmt: skip
    run = run_training(cfg)
    total = run.summary["steps_completed"]
    assert run.summary["status"] == "completed" and total == 22
    assert run.summary["failures"] == 3
    assert all(e["at_step"] >= 8 for e in run.summary["failure_events"])  # warm-up and quiet phase untouched
    assert_every_row_once(run.run_dir, total, 2)
    rows = steps_of(run.run_dir).sort_values(["worker", "step"])
    for _, r in rows.groupby("worker"):
        assert r["applied_version"].is_monotonic_increasing and r["clock"].is_monotonic_increasing
    deadline = time.monotonic() + 10  # ray.kill is asynchronous: give the last kills a moment
    while _alive_actors() > actors_before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _alive_actors() <= actors_before
    assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values())


def test_driver_sigkilled_mid_run_then_resume_ends_equal_to_the_uninterrupted_run(tmp_path, uninterrupted):
    """`distrain run` in its own process, SIGKILLed once a checkpoint exists; `--resume` finishes it."""
    import os
    import signal
    import subprocess
    import sys

    from typer.testing import CliRunner

    from distrain.cli import app

    run_dir = tmp_path / "killed"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "distrain.cli", "run", f"--run-dir={run_dir}", *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True,
    )  # fmt: skip
    pointer = run_dir / "checkpoints" / "latest.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if pointer.exists() and json.loads(pointer.read_text())["global_step"] >= 12:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and the local Ray it started, as a crash would
    proc.wait()
    assert not (run_dir / "checkpoints" / "final.pt").exists()
    killed_at = json.loads(pointer.read_text())["global_step"]
    assert 12 <= killed_at < 30

    result = CliRunner().invoke(app, ["run", "--resume", str(run_dir)])
    assert result.exit_code == 0, result.output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps_completed"] == 30
    assert final_params(run_dir).equal(uninterrupted["collective"])
    assert_every_row_once(run_dir, 30, 2)  # rows before the checkpoint came back from it, the rest were redone
