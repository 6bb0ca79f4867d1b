"""Pipeline stages sharded by FSDP2 end to end (`--pipeline-stages S --fsdp D`, strategies/sharded_pipeline.py)
on real Ray actors over real gloo groups: S = 2 x D = 2 equals one process at the same global batch
after 20 steps of momentum SGD, each of the four workers holds a quarter of the parameters, gradients and
optimizer state, and its sharded checkpoint is the whole model's."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from distrain.config import RunConfig
from distrain.orchestrator.run import run_training
from tests.helpers import final_params

pytestmark = pytest.mark.usefixtures("ray_cluster")
HERE = Path(__file__).resolve().parents[1]  # tests/
WIDTH, BLOCKS = 32, 4
# Four equal Linear(32, 32) blocks: two stages of two blocks each, every tensor's rows cut evenly in two.
TASK = dict(task=f"{HERE / 'pipeline_task.py'}:WideMLP", task_args={"width": WIDTH, "blocks": BLOCKS, "samples": 704})
BASE = TASK | dict(
    optimizer="sgd", momentum=0.9, lr=0.05, lr_scaling="none", epochs=1, max_steps=20, seed=3, segment_steps=10,
    eval_every=0,
)  # fmt: skip
PARAMS = BLOCKS * (WIDTH * WIDTH + WIDTH)
TOL = 1e-5


def cfg(tmp_path, name: str, **kw) -> RunConfig:
    return RunConfig(**(BASE | {"run_dir": str(tmp_path / name)} | kw))


def steps_of(run_dir) -> pd.DataFrame:
    df = pd.read_parquet(Path(run_dir) / "metrics.parquet")
    return df[df["kind"] == "step"].sort_values(["step", "worker"])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stages_of_two_shards_equal_one_process_and_hold_a_quarter_each(tmp_path, schedule):
    one = run_training(cfg(tmp_path, "one", workers=1, batch_size=32))
    run = run_training(
        cfg(tmp_path, schedule, workers=1, fsdp=2, batch_size=16, pipeline_stages=2, microbatches=2,
            pipeline_schedule=schedule)
    )  # fmt: skip
    assert run.summary["status"] == "completed"
    assert run.summary["global_batch_size"] == 32
    assert (final_params(run.run_dir) - final_params(one.run_dir)).abs().max().item() <= TOL
    rows = steps_of(run.run_dir)
    # rank = (replica x S + stage) x D + shard: workers 0, 1 are stage 0's shards, 2, 3 stage 1's.
    firsts = rows.groupby("worker")[["stage", "shard", "replica"]].first()
    assert firsts["stage"].tolist() == [0, 0, 1, 1] and firsts["shard"].tolist() == [0, 1, 0, 1]
    assert (rows.groupby("step").size() == 4).all() and rows["samples"].sum() == 20 * 32
    # Each shard's two stages report its pipeline's loss; the two pipelines' losses average to one
    # process's loss on all 32 samples.
    last = rows[rows["stage"] == 1].groupby("step")["loss"].mean().to_numpy()
    assert abs(last - steps_of(one.run_dir)["loss"].to_numpy()).max() <= TOL
    # A quarter of the parameters each (FSDP2 cuts every 32-row tensor in two), with their gradients and
    # momentum buffers alike; together the whole model.
    held = rows.groupby("worker")[["mem_param_bytes", "mem_grad_bytes", "mem_optim_bytes"]].max()
    assert (held["mem_param_bytes"] == PARAMS * 4 // 4).all()
    assert (held["mem_grad_bytes"] == held["mem_param_bytes"]).all()
    assert (held["mem_optim_bytes"] == held["mem_param_bytes"]).all()
